"""zload.init: build without weight init and without zero.Init's broadcast, then load everything."""

from __future__ import annotations

import json
from typing import NamedTuple
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import (
    DS_CONFIG, Refused, bad_ds_configs, check_against, dtype_config, load_expected, load_recording_warnings,
    refusal,
)


def _count_calls(build):
    """(model, broadcasts and weight-init calls issued while ``build()`` ran)."""
    import deepspeed.comm as ds_comm

    calls = []
    patched = [(ds_comm, "broadcast"), (torch.nn.init, "kaiming_uniform_")]
    originals = [getattr(owner, name) for owner, name in patched]

    def counting(original):
        def call(*args, **kwargs):
            calls.append(original)
            return original(*args, **kwargs)
        return call

    for (owner, name), original in zip(patched, originals):
        setattr(owner, name, counting(original))
    try:
        model = build()
    finally:
        for (owner, name), original in zip(patched, originals):
            setattr(owner, name, original)
    return model, len(calls)


def _build_with_init():
    with zload.init(DS_CONFIG, dtype=torch.bfloat16):
        return models.ParamsOnly()


def _build_with_zero_init():
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG, dtype=torch.bfloat16):
        return models.ParamsOnly()


class InitThenLoad(NamedTuple):
    broadcasts: int  # and weight-init calls, while zload.init built the model
    zero_init_broadcasts: int  # the same, while zero.Init built it
    error: str | None  # what the load raised
    messages: list[str] | None  # the warnings it gave, if it did not raise


def _init_then_load(path, strict):
    model, broadcasts = _count_calls(_build_with_init)
    _, zero_init_broadcasts = _count_calls(_build_with_zero_init)
    assert torch.nn.init.normal_.__name__ == "normal_"  # init functions restored on exit
    assert all(hasattr(p, "ds_id") and p.ds_tensor.dtype == torch.bfloat16 for p in model.parameters())
    try:
        load = load_recording_warnings(model, path, strict=strict)
    except zload.PlanError as e:
        return InitThenLoad(broadcasts, zero_init_broadcasts, str(e), None)
    if not load.report.missing:
        check_against(model, load_expected(path))
    return InitThenLoad(broadcasts, zero_init_broadcasts, None, load.messages)


@pytest.mark.parametrize("world", [2, 3])
def test_init_builds_without_broadcast_and_loads_everything(tmp_path, world):
    state = models.state_with_seed(models.ParamsOnly, seed=61)
    save_file(state, str(tmp_path / "m.safetensors"))
    for rank in run_world(world, _init_then_load, str(tmp_path / "m.safetensors"), True):
        assert rank.broadcasts == 0  # neither zero.Init's broadcasts nor nn.Linear's kaiming init ran
        assert rank.zero_init_broadcasts == len(state) + 1  # one broadcast per parameter, one init
        assert rank.error is None and not any("never loaded" in m for m in rank.messages)


@pytest.mark.parametrize("world", [2, 3])
def test_strict_load_refuses_to_leave_init_parameters_unwritten(tmp_path, world):
    state = models.state_with_seed(models.ParamsOnly, seed=62)
    del state["b"]
    save_file(state, str(tmp_path / "m.safetensors"))
    for strict in run_world(world, _init_then_load, str(tmp_path / "m.safetensors"), True):
        assert "not in the checkpoint" in strict.error and strict.error.rstrip().endswith(": b"), strict.error
    for rank, lenient in enumerate(run_world(world, _init_then_load, str(tmp_path / "m.safetensors"), False)):
        assert lenient.error is None, lenient.error  # the warning every rank would give: rank 0 gives it
        assert any("never loaded" in m and "b" in m for m in lenient.messages) == (rank == 0), lenient.messages


def _peft_base_only(path):
    """A PEFT model built by zload.init: a base checkpoint leaves the LoRA weights unwritten."""
    from peft import LoraConfig, get_peft_model

    with zload.init(DS_CONFIG):
        model = get_peft_model(models.ParamsOnly(), LoraConfig(r=2, target_modules=["a"]))
    try:
        zload.load_into(model, path)
    except zload.PlanError as e:
        return str(e)
    return None


def test_init_parameters_outside_the_checkpoints_scope_still_count(tmp_path):
    pytest.importorskip("peft")
    state = models.state_with_seed(models.ParamsOnly, seed=63)
    save_file(state, str(tmp_path / "m.safetensors"))
    for error in run_world(2, _peft_base_only, str(tmp_path / "m.safetensors")):
        assert error is not None and "zload.init" in error and "lora_A" in error, error


def _build(config, kwargs) -> None:
    with zload.init(config, **kwargs):
        models.ParamsOnly()


def _refusals_of(configs, kwargs) -> list[Refused | None]:
    """What ``zload.init(config, **kwargs)`` building a model raised, for each of ``configs``."""
    return [refusal(lambda: _build(config, kwargs)) for config in configs]


def test_a_bad_config_is_refused_naming_the_key_before_deepspeed_reads_it(tmp_path):
    """Wrong section types, a missing or garbled JSON file, a config of no config's type, weight
    quantization and an "auto" the Trainer does not fill in; each refused with the key and file at
    fault."""
    bad = bad_ds_configs(tmp_path, "config")
    for refusals in run_world(2, _refusals_of, [case.config for case in bad], {}):
        for case, refused in zip(bad, refusals, strict=True):
            assert refused is not None and (refused.kind, refused.path) == (case.kind, case.path), (case, refused)
            assert case.says in refused.message, (case, refused)


def test_quantized_weights_asked_by_argument_are_refused_before_deepspeed_builds_its_quantizer(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dtype_config(torch.bfloat16)))
    for refusals in run_world(2, _refusals_of, [DS_CONFIG, str(path)], {"zero_quantized_nontrainable_weights": True}):
        for refused in refusals:  # the argument at fault, not the file
            assert refused is not None and (refused.kind, refused.path) == ("ArgumentValueError", None), refused
            assert "weight-quantized parameters (zero_quantized_nontrainable_weights=True asks" in refused.message


def _built_from_file(path):
    """The dtypes of a model built by ``zload.init(path)``, and the types of the configs DeepSpeed
    was given."""
    from deepspeed.runtime.config import DeepSpeedConfig

    given = []
    parse = DeepSpeedConfig.__init__

    def recording(self, config, *args, **kwargs):
        given.append(type(config).__name__)
        parse(self, config, *args, **kwargs)

    with mock.patch.object(DeepSpeedConfig, "__init__", recording), zload.init(path):
        model = models.ParamsOnly()
    return {str(p.ds_tensor.dtype) for p in model.parameters()}, given


def test_a_config_file_is_read_once_by_zload(tmp_path):
    """A JSON file's config builds as DeepSpeed reads it ("bfloat16", the older name of "bf16"), and
    DeepSpeed is given the dict zload checked, not the path to read again."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**DS_CONFIG, "bfloat16": {"enabled": True}}))
    assert run_world(2, _built_from_file, str(path)) == [({"torch.bfloat16"}, ["dict"])] * 2
