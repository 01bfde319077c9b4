"""zload.save without a process group: ``max_shard_size`` parsed, and ``dtype`` on a plain model.
Saves of live engines and transformers models: tests/distributed/test_save_engine.py."""

from __future__ import annotations

import pytest
import torch

import zload
from zload.saving.plan import parse_size

from tests.support.checkpoints import read_all
from tests.support.zero3 import assert_bit_equal

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------
# F: max_shard_size parsing

def test_parse_max_shard_size():
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("20KB") == 20_000 and parse_size("3KiB") == 3072
    assert parse_size(1000) == 1000
    for bad in ("twenty kilobytes", "", "GB", "5XB", "-5GB", "5 G B"):
        with pytest.raises(zload.ZloadError):
            parse_size(bad)


def test_dtype_leaves_integer_buffers_and_int_sizes_work(tmp_path):
    """In this process (no torch.distributed): ``dtype`` casts floating tensors only; an int
    ``max_shard_size`` is bytes; ``master_weights`` needs an engine."""
    from tests.support import models

    torch.manual_seed(0)
    model = models.Awkward()
    report = zload.save(model, tmp_path / "out", dtype=torch.bfloat16, max_shard_size=1000)
    saved = read_all(tmp_path / "out")
    state = model.state_dict()
    assert sorted(saved) == sorted(state) and len(report.files) > 1
    for name, tensor in state.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert_bit_equal(saved[name], want, name)
    assert saved["steps"].dtype == torch.int64
    with pytest.raises(zload.ZloadError, match="master_weights"):
        zload.save(model, tmp_path / "master", master_weights=True)
    assert not (tmp_path / "master").exists()


def test_a_group_whose_flats_took_different_steps_is_refused(monkeypatch):
    """One step count per group is all the format holds: flats of one group (ZeRO-3 sub-groups)
    that disagree are refused, not saved with ``step: null`` (which a resume reads as no step)."""
    from types import SimpleNamespace

    from zload.errors import UnsupportedModelError
    from zload.integrations.deepspeed import Flat, Slot
    from zload.saving import optimizer

    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]
    flats = [Flat(0, torch.zeros(4), (Slot(p, 0, 4, 0),)) for p in params]
    states = [{"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)}, {"step": 2, "exp_avg": torch.zeros(4)}]
    for name, value in {"optimizer_flats": lambda engine: (flats, None), "flat_states": lambda engine, f: states,
                        "optimized_parameters": lambda engine: [params], "hyperparameters": lambda engine: [{}],
                        "is_zero3": lambda p: False}.items():
        monkeypatch.setattr(optimizer, name, value)
    model = [SimpleNamespace(name=f"w{k}", tensor=p) for k, p in enumerate(params)]
    with pytest.raises(UnsupportedModelError, match=r"group 0 on rank 0 .*different numbers of steps \(2, 3\)"):
        optimizer._plan(SimpleNamespace(), model, "1GB", 0, 1)
