"""Loading into a live DeepSpeedEngine (bf16 + optimizer) after it has trained a step."""

from __future__ import annotations

import deepspeed
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import check_against, load_expected


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 33)
        self.norm = nn.LayerNorm(33)  # small: stays gathered (persistent) between steps
        self.down = nn.Linear(33, 5)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


def _config(stage: int, hpz: int, offload: bool = False) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=100, zero_hpz_partition_size=hpz)
    if offload:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": zero}


def _step(engine, x):
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _engine_rank_body(path, stage, hpz, offload=False):
    config = _config(stage, hpz, offload)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = MLP()
    model.up.requires_grad_(False)  # frozen: its hpZ secondary copy is never refreshed by the optimizer
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    assert bool(engine.zero_offload_optimizer()) == bool(engine.zero_offload_param()) == offload, (
        engine.zero_offload_optimizer(), engine.zero_offload_param())
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    _step(engine, x)  # a live engine: persistent params gathered, fp32 masters in use

    zload.load_into(engine, path)
    expected = load_expected(path)
    check_against(engine.module, expected)
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        master = deepspeed.utils.safe_get_full_fp32_param(p)
        want = expected[name].to(torch.bfloat16).float()
        assert torch.equal(master, want), f"{name}: fp32 master not refreshed"

    reference = MLP().to(torch.bfloat16)
    reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in expected.items()})
    with torch.no_grad():
        want_out = reference(x)
        got_out = engine(x)
    assert torch.equal(got_out, want_out), "the forward after the load does not use the loaded weights"

    _step(engine, x)  # lr=0: the loaded weights must survive the optimizer step
    check_against(engine.module, expected)
    return dist.get_rank()


@pytest.mark.parametrize("world,stage,hpz,offload", [(1, 3, 1, False), (2, 3, 1, False), (3, 3, 1, False),
                                                    (4, 3, 2, False), (2, 2, 1, False), (3, 3, 1, True)])
def test_live_engine_load_survives_a_step(tmp_path, world, stage, hpz, offload):
    """ZeRO-3 (hpZ in one case), a ZeRO-2 engine whose bf16 masters need refreshing too, and
    ZeRO-3 with its parameters and optimizer offloaded to host memory (the masters live there)."""
    state = models.state_with_seed(MLP, seed=7)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    assert run_world(world, _engine_rank_body, path, stage, hpz, offload) == list(range(world))
