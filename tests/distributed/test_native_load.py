"""``load_into`` from DeepSpeed's own checkpoints (``engine.save_checkpoint``) at any world size.

Checkpoints are real: written by ``deepspeed.initialize`` + a training step + ``save_checkpoint``
(tests/support/native_checkpoints.py, the cases of tests/distributed/test_native_checkpoints.py,
built once a session). The reference is DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``;
every tensor of a model loaded at another world size must equal it bit for bit, cast to the model's
dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import zload

from tests.distributed.test_native_checkpoints import CASES
from tests.support.harness import run_world
from tests.support.native_checkpoints import MODELS, zload_reference
from tests.support.zero3 import assert_bit_equal, build_zero, full_state

pytest.importorskip("transformers")


class Loaded(NamedTuple):
    state: dict[str, torch.Tensor]
    report: zload.LoadReport


def _load_body(folder, model: str, tied: bool, dtype) -> Loaded:
    factory_for = MODELS[model][0]
    model = build_zero(factory_for(tied), dtype)
    report = zload.load_into(model, folder)
    return Loaded(full_state(model), report)


def _check(loaded: Loaded, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded.state) == sorted(expected), "the model and DeepSpeed's reference name different tensors"
    for name, tensor in loaded.state.items():
        assert_bit_equal(tensor, expected[name].to(tensor.dtype), name)
    assert not loaded.report.missing and not loaded.report.unexpected


LOAD_WORLDS = {name: options["world"] % 3 + 1 for name, options in CASES.items()}  # never the saved one


@pytest.mark.parametrize("name", CASES)
def test_every_kind_of_checkpoint_loads_at_another_world_size(native_checkpoint, name):
    """ZeRO-1/2/3; bf16, fp16, fp32; several fp32 flat groups; an offloaded optimizer; frozen
    parameters, tied weights, sizes no world divides, buffers: fp32 models at another world size
    hold exactly what DeepSpeed's own reader reconstructs."""
    options = CASES[name]
    case = native_checkpoint(**options)
    for loaded in run_world(LOAD_WORLDS[name], _load_body, case.folder, options.get("model", "llama"),
                            options.get("tied", True), torch.float32):
        _check(loaded, zload_reference(case))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_zero3_checkpoint_loads_at_any_world_size(native_checkpoint, world):
    case = native_checkpoint(**CASES["z3-bf16-w3"])
    for loaded in run_world(world, _load_body, case.folder, "llama", True, torch.float32):
        _check(loaded, zload_reference(case))


def test_bf16_model_gets_the_engines_own_weights(native_checkpoint):
    """A bf16 model loaded from the fp32 masters holds exactly the live engine's 16-bit weights
    (DeepSpeed keeps them as the masters cast), frozen parameters included; loaded from the tag
    folder; each rank reads only its own partitions' bytes."""
    case = native_checkpoint(**CASES["z3-bf16-w3"])
    for loaded in run_world(2, _load_body, case.tag_folder, "llama", True, torch.bfloat16):
        for name, tensor in loaded.state.items():
            assert_bit_equal(tensor, case.module_weights[name], name)
        assert 0 < loaded.report.bytes_read < loaded.report.checkpoint_bytes * 0.6
