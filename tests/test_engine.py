"""Loading into a live DeepSpeedEngine (bf16 + optimizer) after it has trained a step."""

from __future__ import annotations

import deepspeed
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import zload

from . import models
from .harness import run_world
from .zero3 import check_against, load_expected


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 33)
        self.norm = nn.LayerNorm(33)  # small: stays gathered (persistent) between steps
        self.down = nn.Linear(33, 5)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


def _config(stage: int, hpz: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=100, zero_hpz_partition_size=hpz)
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "zero_allow_untested_optimizer": True, "zero_optimization": zero}


def _step(engine, x):
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _engine_rank_body(path, stage, hpz):
    config = _config(stage, hpz)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=stage == 3):
        model = MLP()
    model.up.requires_grad_(False)  # frozen: its hpZ secondary copy is never refreshed by the optimizer
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
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


@pytest.mark.parametrize("world,stage,hpz", [(1, 3, 1), (2, 3, 1), (3, 3, 1), (4, 3, 2), (2, 2, 1)])
def test_live_engine_load_survives_a_step(tmp_path, world, stage, hpz):
    """ZeRO-3 (hpZ in the last case), and a ZeRO-2 engine whose bf16 masters need refreshing too."""
    state = models.state_with_seed(MLP, seed=7)
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    assert run_world(world, _engine_rank_body, path, stage, hpz) == list(range(world))
