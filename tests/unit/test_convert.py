"""``zload.convert`` in one process: each element of the output goes to one rank, and a folder that
is no DeepSpeed checkpoint is refused. Real checkpoints converted: tests/distributed/test_convert.py."""

from __future__ import annotations

import pytest
import torch

import zload
from zload.saving.convert import byte_share
from zload.saving.plan import OutTensor, layout


transformers = pytest.importorskip("transformers")


def test_byte_shares_cover_every_element_once():
    """Each element goes to exactly one rank, and the ranks' shares differ by an element at most."""
    shapes = [(torch.float32, (7, 3)), (torch.bfloat16, (5,)), (torch.int64, ()), (torch.float32, (0, 4)),
              (torch.bfloat16, (13,))]
    tensors = [OutTensor(f"t{i}", dtype, shape, ((i, 0, 0, 0),)) for i, (dtype, shape) in enumerate(shapes)]
    files = layout(tensors, 40)
    everything = sorted((i, k) for i, (_, shape) in enumerate(shapes) for k in range(torch.Size(shape).numel()))
    for world in (1, 2, 3, 7, 200):
        shares = [byte_share(files, rank, world) for rank in range(world)]
        assert sorted((i.target, i.src_offset + k) for share in shares for i in share for k in range(i.numel)) \
            == everything
        sizes = [sum(i.nbytes for i in share) for share in shares]
        assert max(sizes) - min(sizes) <= 2 * 8


def test_not_a_deepspeed_checkpoint(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(zload.CheckpointNotFoundError, match="(?s)nothing was written.*holds neither 'latest'"):
        zload.convert(tmp_path / "plain", tmp_path / "out")
    with pytest.raises(zload.ArgumentValueError, match="weights='fp16'"):
        zload.convert(tmp_path / "plain", tmp_path / "out", weights="fp16")
    assert not (tmp_path / "out").exists()
