"""A cold ZeRO-3 load, its spans pulled into the page cache ahead of the readers, bit exact at every
rank. The page cache itself: tests/unit/test_pagecache.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import zload.loading.execute as execute_module
import zload.checkpoint.pagecache as pagecache
from zload import open_checkpoint
from zload.checkpoint.digest import sample_windows

from tests.unit.test_pagecache import skip_unless_evictable


class TwoBigTensors(torch.nn.Module):
    """Large enough (8 MB) that the header and digest reads leave most pages uncached; odd sizes."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(1023, 1025))
        self.b = torch.nn.Parameter(torch.empty(1_000_003))


def _cold_load_with_one_reader(path):
    """A rank of a ZeRO-3 world loading with one reader thread (so it reads ahead): whether its
    partitions are right, its pulls, and the (offset, length) of what its data sample brought into
    the page cache and forgot."""
    import zload.checkpoint.views as checkpoint_module
    from tests.support.zero3 import build_zero, check_against, load_expected

    model = build_zero(TwoBigTensors)
    pulled, forgotten = [], []
    real_pull, real_forget, real_count = pagecache.pull, checkpoint_module.forget, execute_module.reader_count
    pagecache.pull = lambda *args: pulled.append(args[2:]) or real_pull(*args)
    checkpoint_module.forget = lambda spans: forgotten.extend(span[1:] for span in spans) or real_forget(spans)
    execute_module.reader_count = lambda: 1
    try:
        from zload import load_into

        load_into(model, path)
    finally:
        pagecache.pull, checkpoint_module.forget, execute_module.reader_count = real_pull, real_forget, real_count
    return check_against(model, load_expected(path)), pulled, forgotten


@pytest.mark.parametrize("world", [2, 3])
def test_a_cold_zero3_load_is_pulled_and_bit_exact_at_every_rank(tmp_path, world):
    """The whole path in a real DeepSpeed world: a load from an emptied page cache pulls what it
    reads, the ranks forget the sampled windows they brought in (all of them, between
    them), and the partitions equal the checkpoint's bytes, at a world size that divides the
    tensors and one that does not."""
    from tests.support.harness import run_world

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(1023, 1025), "b": torch.randn(1_000_003)}, str(path))
    skip_unless_evictable(path)
    results = run_world(world, _cold_load_with_one_reader, path)
    index = open_checkpoint(path)
    opened = index.opened.get("model.safetensors")
    windows = sample_windows(opened.data_start, opened.identity.size)
    index.close()
    assert [compared for compared, _, _ in results] == [2] * world
    assert any(pulled for _, pulled, _ in results)  # a rank that came late may find it all cached
    assert {tuple(span) for _, _, forgotten in results for span in forgotten} == set(windows)
