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
