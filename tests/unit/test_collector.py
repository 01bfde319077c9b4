"""The cyclic garbage collector is paused while a model builds and during a load, and restored after,
whatever happens."""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zload
from zload.collector import collector_paused


@pytest.fixture
def collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_in_the_block_and_restored_after_an_error(collector_enabled):
    with pytest.raises(RuntimeError):
        with collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled(collector_enabled):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_load_into_runs_with_the_collector_paused(tmp_path, collector_enabled):
    model = nn.Linear(3, 2)
    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, tmp_path / "model.safetensors")
    seen = []

    def key_map(name):  # called while planning, inside load_into
        seen.append(gc.isenabled())
        return name

    zload.load_into(model, tmp_path, key_map=key_map)
    assert seen and not any(seen) and gc.isenabled()
    assert torch.equal(model.weight, torch.ones(2, 3))
