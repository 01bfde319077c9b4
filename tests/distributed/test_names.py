"""Name matching: user key maps, prefix alignment, PEFT names (pure), and their use in a load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import build_zero, check_against


class Wrapped(nn.Module):
    """A model that nests a checkpointed one under a prefix, as a trainer's wrapper does."""

    def __init__(self):
        super().__init__()
        self.model = models.ParamsOnly()
        self.value_head = nn.Linear(3, 1)


def _load_wrapped(path, key_map):
    model = build_zero(Wrapped)
    report = zload.load_into(model, path, strict=False, key_map=key_map)
    expected = {"model." + k.removeprefix("old_"): v for k, v in torch.load(path + ".pt").items()}
    check_against(model, expected, names=list(expected))  # value_head is left out on purpose
    return sorted(report.loaded), report.missing, report.unexpected


@pytest.mark.parametrize("world", [2, 3])
def test_key_map_and_prefix_alignment_in_a_zero3_load(tmp_path, world):
    """Checkpoint names `old_a.weight` etc.: key_map strips `old_`, then `model.` is added."""
    state = models.state_with_seed(models.ParamsOnly, seed=21)
    renamed = {"old_" + k: v for k, v in state.items()}
    path = str(tmp_path / "m.safetensors")
    save_file(renamed, path)
    torch.save(renamed, path + ".pt")
    for loaded, missing, unexpected in run_world(world, _load_wrapped, path, {r"^old_": ""}):
        assert loaded == sorted("model." + k for k in state)
        assert missing == ["value_head.weight", "value_head.bias"] and unexpected == []
