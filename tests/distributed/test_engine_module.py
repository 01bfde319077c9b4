"""The module inside an engine (``engine.module``, a Trainer's ``trainer.model``) after
``deepspeed.initialize``: loading into it keeps the engine's fp32 masters in step, as loading into
the engine does; saving its master weights finds them as saving the engine does."""

from __future__ import annotations

import deepspeed
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zload

from tests.support import models
from tests.support.checkpoints import read_all
from tests.support.harness import run_world
from tests.distributed.test_engine import MLP, _config, _step
from tests.support.zero3 import assert_bit_equal, check_against, load_expected


def _engine(stage: int, offload: bool = False):
    config = _config(stage, hpz=1, offload=offload)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = MLP()
    model.up.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    return engine


def _load_into_module_body(path, stage, offload):
    engine = _engine(stage, offload)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    _step(engine, x)  # a live engine: persistent parameters gathered, fp32 masters in use

    zload.load_into(engine.module, path)
    expected = load_expected(path)
    check_against(engine.module, expected)
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            want = expected[name].to(torch.bfloat16).float()
            assert torch.equal(deepspeed.utils.safe_get_full_fp32_param(p), want), f"{name}: master not refreshed"
    _step(engine, x)  # lr=0: the loaded weights survive the optimizer step
    check_against(engine.module, expected)
    return dist.get_rank()


@pytest.mark.parametrize("stage,offload", [(3, False), (2, False), (1, False), (3, True)])
def test_loading_into_the_module_of_an_engine_refreshes_its_masters(tmp_path, stage, offload):
    """ZeRO-3 (its persistent parameters gathered between steps, its masters offloaded in one
    case) and ZeRO-1/2, whose parameters link each to its own fragment of the masters."""
    path = tmp_path / "model.safetensors"
    save_file(models.state_with_seed(MLP, seed=7), str(path))
    assert run_world(2, _load_into_module_body, path, stage, offload) == [0, 1]


def _masters_unlike_weights(engine, stage) -> dict[str, torch.Tensor]:
    """Set the engine's fp32 masters to values no bf16 weight equals; returns them, whole."""
    masters = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if stage == 3:
            deepspeed.utils.safe_set_local_fp32_param(p, deepspeed.utils.safe_get_local_fp32_param(p) + 1 / 3)
        else:
            deepspeed.utils.safe_set_full_fp32_param(p, deepspeed.utils.safe_get_full_fp32_param(p) + 1 / 3)
        masters[name] = deepspeed.utils.safe_get_full_fp32_param(p)
        assert not torch.equal(masters[name], masters[name].bfloat16().float()), name
    return masters


def _save_module_masters_body(root):
    engine = _engine(3)
    masters = _masters_unlike_weights(engine, 3)
    zload.save(engine.module, f"{root}/module", master_weights=True)
    zload.save(engine, f"{root}/engine", master_weights=True)
    return masters


def test_saving_the_master_weights_of_the_module_of_an_engine(tmp_path):
    """ZeRO-3: the module finds the masters the engine keeps."""
    masters = run_world(2, _save_module_masters_body, str(tmp_path))[0]
    from_module, from_engine = read_all(tmp_path / "module"), read_all(tmp_path / "engine")
    assert sorted(from_module) == sorted(from_engine) == ["down.bias", "down.weight", "norm.bias",
                                                          "norm.weight", "up.bias", "up.weight"]
    for name, tensor in from_engine.items():
        assert_bit_equal(from_module[name], tensor, name)
    for name, master in masters.items():
        assert_bit_equal(from_module[name], master, f"master: {name}")


def _refused_zero2_masters_body(root):
    engine = _engine(2)
    _masters_unlike_weights(engine, 2)
    refused = []
    for model in (engine, engine.module):
        with pytest.raises(zload.ArgumentValueError, match="ZeRO-1/2") as error:
            zload.save(model, f"{root}/out", master_weights=True)
        refused.append(str(error.value))
    return refused


def test_zero2_master_weights_are_refused_not_saved_as_16_bit_weights(tmp_path):
    """ZeRO-1/2 masters are fragments of flat buffers, which save does not write yet: refused the
    same for the engine and its module, rather than the 16-bit weights written as fp32."""
    for engine_refused, module_refused in run_world(2, _refused_zero2_masters_body, str(tmp_path)):
        assert engine_refused == module_refused
    assert not (tmp_path / "out").exists()
