"""Reading from a cold page cache: spans the cache lacks are hinted to the kernel ahead of the
reader (zload.pagecache), spans it holds never are, and what is read stays exactly the file's bytes.

Files are evicted with ``posix_fadvise(DONTNEED)`` after an fsync, as the load benchmark's cold
mode does without root; a file system that keeps the pages anyway skips the cold cases.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import save_file

import zload.execute as execute_module
import zload.pagecache as pagecache
from zload import open_checkpoint
from zload.digest import sample_digests, sample_windows
from zload.execute import RangeReader, byte_view

MB = 1 << 20


def evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path) -> None:
    with open(path, "rb") as f:
        while f.read(MB):
            pass


@pytest.fixture
def hints(monkeypatch):
    """Every hint given, as (fd, offset, length), still passed on to the kernel."""
    given, real = [], pagecache.prefetch
    monkeypatch.setattr(pagecache, "prefetch", lambda *span: given.append(span) or real(*span))
    return given


@pytest.fixture
def big_file(tmp_path):
    """A 6 MB checkpoint of one float32 tensor, and its data."""
    path = tmp_path / "big.safetensors"
    data = torch.randn(6 * MB // 4)
    save_file({"x": data}, str(path))
    return path, data


def skip_unless_evictable(path) -> None:
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if pagecache.cached(fd, 0, os.fstat(fd).st_size) is not False:
            pytest.skip("this file system keeps the pages (or mincore is unavailable)")
    finally:
        os.close(fd)


def test_cached_says_whether_a_spans_first_pages_are_resident(big_file):
    path, _ = big_file
    skip_unless_evictable(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pagecache.cached(fd, 3 * MB + 5, 4096) is False
        os.pread(fd, 2 * MB, 3 * MB)
        assert pagecache.cached(fd, 3 * MB + 5, 100_000) is True
        assert pagecache.cached(fd, 0, 4096) is False  # other pages stay as they were
    finally:
        os.close(fd)


def read_in_pieces(path, data, pieces: int = 4) -> list[tuple[int, int]]:
    """Read the tensor in ``pieces`` equal parts (the strided ranges of one rank, say), none
    file-contiguous with the one before, through a RangeReader; check every byte, and return the
    parts' (offset, length) in the file."""
    index = open_checkpoint(path)
    entry = index.tensors["x"]
    out = torch.zeros_like(data)
    view, piece = byte_view(out), entry.nbytes // pieces
    order = list(range(0, pieces, 2)) + list(range(1, pieces, 2))  # no two pieces file-contiguous
    try:
        with RangeReader(index.opened) as reader:
            reader.read([(entry.file, entry.start + q * piece, view[q * piece:(q + 1) * piece])
                         for q in order])
    finally:
        index.close()
    assert torch.equal(out, data)
    return [(entry.start + q * piece, piece) for q in range(pieces)]


@pytest.fixture
def unhurried(monkeypatch):
    """One reader thread that pauses before each run, so that a busy machine cannot let the reader
    pass the hinter."""
    real_read = execute_module._read_run

    def read(run):
        time.sleep(0.05)
        return real_read(run)

    monkeypatch.setattr(execute_module, "_read_run", read)
    monkeypatch.setattr(execute_module, "reader_count", lambda: 1)


def test_a_cold_read_is_hinted_ahead_of_the_reader(big_file, hints, unhurried):
    path, data = big_file
    skip_unless_evictable(path)
    quarters = read_in_pieces(path, data)
    assert sorted((offset, length) for _, offset, length in hints) == quarters


def test_a_warm_file_is_looked_at_in_three_spans_only(big_file, monkeypatch):
    """Looking at every span of a warm load from the hint thread, though cheap, cost about 5% of
    the load (two ranks on two cores): a file whose first, middle and last spans are cached is
    taken as cached whole."""
    path, data = big_file
    warm(path)
    monkeypatch.setattr(execute_module, "reader_count", lambda: 1)  # the one case that hints
    looked, real = [], pagecache.cached
    monkeypatch.setattr(pagecache, "cached", lambda *span: looked.append(span) or real(*span))
    started, real_hint = [], pagecache.ReadAhead._hint
    monkeypatch.setattr(pagecache.ReadAhead, "_hint", lambda self: started.append(1) or real_hint(self))
    read_in_pieces(path, data, pieces=12)
    assert len(looked) == 3
    assert started == []  # no hint thread at all


@pytest.mark.parametrize("readers", [1, 2])
def test_a_warm_read_gives_no_hint(big_file, hints, monkeypatch, readers):
    path, data = big_file
    warm(path)
    monkeypatch.setattr(execute_module, "reader_count", lambda: readers)
    read_in_pieces(path, data)
    assert hints == []


def test_a_rank_with_two_reader_threads_gives_no_hint(big_file, hints, monkeypatch):
    """Its readers keep two requests in flight already; hints beside them made cold loads slower."""
    path, data = big_file
    skip_unless_evictable(path)
    monkeypatch.setattr(execute_module, "reader_count", lambda: 2)
    read_in_pieces(path, data)
    assert hints == []


def test_read_ahead_stays_within_its_window_and_skips_what_the_reader_passed(monkeypatch):
    """Spans of 10 bytes, a window of 25: hints go three spans ahead of the reader, and spans the
    reader has already reached are not hinted any more."""
    given = []
    monkeypatch.setattr(pagecache, "cached", lambda fd, offset, length: False)
    monkeypatch.setattr(pagecache, "prefetch", lambda fd, offset, length: given.append(offset))

    def settled(expected):
        deadline = time.monotonic() + 5
        while given != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # and nothing more follows
        return given == expected

    ahead = pagecache.ReadAhead(25)
    try:
        assert ahead.extend([(7, 10 * k, 10) for k in range(10)]) == 0
        assert settled([0, 10, 20])
        ahead.reached(5)
        assert settled([0, 10, 20, 50, 60, 70])
        assert ahead.extend([(7, 100, 10)]) == 10
        ahead.reached(9)
        assert settled([0, 10, 20, 50, 60, 70, 90, 100])
    finally:
        ahead.close()
    assert not ahead.thread.is_alive()


def test_a_cold_batch_after_warm_ones_is_hinted_from_where_the_reader_is(monkeypatch):
    """Spans of 10 bytes, a window of 25: a batch of a warm file (fd 1) starts no thread, but the
    reader's place in it still counts, so the next batch (cold fd 2) is hinted at once up to the
    window from there."""
    given = []
    monkeypatch.setattr(pagecache, "cached", lambda fd, offset, length: fd != 2)
    monkeypatch.setattr(pagecache, "prefetch", lambda fd, offset, length: given.append((fd, offset)))
    ahead = pagecache.ReadAhead(25)
    try:
        ahead.extend([(1, 10 * k, 10) for k in range(100)])
        ahead.reached(99)
        assert ahead.thread is None
        assert ahead.extend([(2, 10 * k, 10) for k in range(10)]) == 100
        deadline = time.monotonic() + 5
        while len(given) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # and nothing more follows
        assert given == [(2, 0), (2, 10)]
    finally:
        ahead.close()


def test_sample_digests_hint_a_cold_files_windows_all_at_once(big_file, hints):
    path, _ = big_file
    index = open_checkpoint(path)
    try:
        opened = index.opened.get("big.safetensors")
        files = [(opened.fd, opened.data_start, opened.identity.size)]
        warm(path)
        digest = sample_digests(files)
        assert hints == []
        skip_unless_evictable(path)
        assert sample_digests(files) == digest
        windows = sample_windows(opened.data_start, opened.identity.size)
        assert [(offset, length) for _, offset, length in hints] == windows
    finally:
        index.close()


def test_hints_never_block_a_read_when_mincore_is_unavailable(big_file, hints, monkeypatch):
    """Where mincore cannot be called (not Linux), nothing is hinted and reads work as before."""
    path, data = big_file
    monkeypatch.setattr(pagecache, "_LIBC", None)
    evict(path)
    read_in_pieces(path, data)
    assert hints == []


class TwoBigTensors(torch.nn.Module):
    """Large enough (8 MB) that the header and digest reads leave most pages uncached; odd sizes."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(1023, 1025))
        self.b = torch.nn.Parameter(torch.empty(1_000_003))


def _cold_load_with_one_reader(path):
    """A rank of a ZeRO-3 world loading with one reader thread (so it hints), counting its hints."""
    from .zero3 import build_zero, check_against, load_expected

    model = build_zero(TwoBigTensors)
    given, real_prefetch, real_count = [], pagecache.prefetch, execute_module.reader_count
    pagecache.prefetch = lambda *span: given.append(span) or real_prefetch(*span)
    execute_module.reader_count = lambda: 1
    try:
        from zload import load_into

        load_into(model, path)
    finally:
        pagecache.prefetch, execute_module.reader_count = real_prefetch, real_count
    return check_against(model, load_expected(path)), len(given)


@pytest.mark.parametrize("world", [2, 3])
def test_a_cold_zero3_load_is_hinted_and_bit_exact_at_every_rank(tmp_path, world):
    """The whole path in a real DeepSpeed world: every rank of a load from an emptied page cache
    hints what it reads, and the partitions equal the checkpoint's bytes, at a world size that
    divides the tensors and one that does not."""
    from .harness import run_world

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(1023, 1025), "b": torch.randn(1_000_003)}, str(path))
    skip_unless_evictable(path)
    for compared, hinted in run_world(world, _cold_load_with_one_reader, path):
        assert compared == 2 and hinted > 0
