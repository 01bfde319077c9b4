"""The cyclic garbage collector is paused while a model builds and during a load, and restored after,
whatever happens."""

from __future__ import annotations

import gc

import torch
from torch import nn

import zload

from tests.support.harness import run_world


def _collector_while_building():
    from tests.support.zero3 import DS_CONFIG

    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            seen.append(gc.isenabled())
            self.weight = nn.Parameter(torch.empty(4, 4))

    gc.enable()
    with zload.init(DS_CONFIG, dtype=torch.bfloat16):
        Probe()
    return seen, gc.isenabled()


def test_init_builds_with_the_collector_paused():
    """A full collection walks every live object; while a large model builds they are many."""
    assert run_world(1, _collector_while_building) == [([False], True)]
