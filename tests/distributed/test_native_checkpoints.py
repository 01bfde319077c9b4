"""The fixtures of ``native_checkpoints``: DeepSpeed's own offline reader (``zero_to_fp32``) of each
checkpoint gives back, bit for bit, what the live engine held when it wrote it."""

from __future__ import annotations

import pytest
import torch

from tests.support.native_checkpoints import DTYPES, NativeCase, deepspeed_reference
from tests.support.zero3 import assert_bit_equal

pytest.importorskip("transformers")

CASES = {
    "z3-bf16-w2-groups": dict(world=2, stage=3, dtype="bf16", sub_group_size=1000),
    "z3-bf16-w3": dict(world=3, stage=3, dtype="bf16"),
    "z3-bf16-w3-awkward": dict(world=3, stage=3, dtype="bf16", model="awkward"),
    "z3-bf16-w2-offload": dict(world=2, stage=3, dtype="bf16", offload_optimizer=True),
    "z3-fp16-w2": dict(world=2, stage=3, dtype="fp16"),
    "z2-bf16-w2": dict(world=2, stage=2, dtype="bf16"),
    "z2-fp16-w3-untied-all-trainable": dict(world=3, stage=2, dtype="fp16", tied=False, frozen=False),
    "z1-fp32-w1": dict(world=1, stage=1, dtype="fp32"),
    "z1-bf16-w2-awkward": dict(world=2, stage=1, dtype="bf16", model="awkward"),
}


def _what_deepspeed_returns(case: NativeCase) -> dict[str, torch.Tensor]:
    """zero_to_fp32's state dict, from the live engine: the fp32 masters of trainable parameters
    (under tied aliases too), frozen parameters as the module holds them (ZeRO-1 records none:
    DeepSpeed 0.19.8 saves frozen ones only when gradients are partitioned), and buffers with the
    floating ones made fp32."""
    expected = {}
    for name in case.param_names + list(case.tied):
        canonical = case.tied.get(name, name)
        if canonical in case.masters:
            expected[name] = case.masters[canonical]
        elif case.stage >= 2:
            expected[name] = case.module_weights[name]
    for name in case.buffer_names:
        buffer = case.module_weights[name]
        expected[name] = buffer.float() if buffer.is_floating_point() else buffer
    return expected


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_deepspeed_reads_back_the_live_engine(native_checkpoint, options):
    case = native_checkpoint(**options)
    assert case.tag_folder == case.folder / "global_step1"
    assert {case.module_weights[n].dtype for n in case.param_names} == {DTYPES[case.dtype]}
    assert set(case.frozen_names) < set(case.param_names)
    assert bool(case.frozen_names) == options.get("frozen", True)
    assert set(case.masters) == set(case.param_names) - set(case.frozen_names)

    reference, expected = deepspeed_reference(case.folder), _what_deepspeed_returns(case)
    assert sorted(reference) == sorted(expected)
    for name, tensor in reference.items():
        assert_bit_equal(tensor, expected[name], f"{options}: {name}")


def test_sub_group_size_splits_the_fp32_partitions(native_checkpoint):
    case = native_checkpoint(**CASES["z3-bf16-w2-groups"])
    for rank in range(case.world):
        state = torch.load(case.tag_folder / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                           map_location="cpu", weights_only=False)
        assert len(state["optimizer_state_dict"]["fp32_flat_groups"]) >= 2
