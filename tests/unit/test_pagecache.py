"""Reading from a cold page cache: spans the cache lacks are pulled into it (or hinted to the
kernel) ahead of the reader (zload.pagecache), spans it holds never are, the pages a data sample
brought in are forgotten again, and what is read stays exactly the file's bytes.

Files are evicted with ``posix_fadvise(DONTNEED)`` after an fsync, as the load benchmark's cold
mode does without root; a file system that keeps the pages anyway skips the cold cases.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch
from safetensors.torch import save_file

import zload.loading.execute as execute_module
import zload.checkpoint.pagecache as pagecache
from zload import open_checkpoint
from zload.checkpoint.digest import sample_digests, sample_windows
from zload.loading.execute import RangeReader, byte_view

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
def pulls(monkeypatch):
    """Every pull made, as (offset, length), still made."""
    made, real = [], pagecache.pull
    monkeypatch.setattr(pagecache, "pull", lambda source, sink, offset, length:
                        made.append((offset, length)) or real(source, sink, offset, length))
    return made


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


def read_in_pieces(path, data, pieces: int = 4, in_order: bool = False) -> list[tuple[int, int]]:
    """Read the tensor in ``pieces`` equal parts (the strided ranges of one rank, say), none
    file-contiguous with the one before unless ``in_order``, through a RangeReader; check every
    byte, and return the parts' (offset, length) in the file."""
    index = open_checkpoint(path)
    entry = index.tensors["x"]
    out = torch.zeros_like(data)
    view, piece = byte_view(out), entry.nbytes // pieces
    order = list(range(pieces)) if in_order else list(range(0, pieces, 2)) + list(range(1, pieces, 2))
    try:
        with RangeReader(index.opened) as reader:
            reader.read([(entry.file, entry.start + q * piece, view[q * piece:(q + 1) * piece])
                         for q in order])
    finally:
        index.close()
    assert torch.equal(out, data)
    return [(entry.start + q * piece, piece) for q in range(pieces)]


@pytest.fixture
def two_ranks_here(monkeypatch):
    """A rank with one reader thread, of two on this node, as under torchrun."""
    monkeypatch.setattr(execute_module, "reader_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")


def test_a_cold_read_is_pulled_through_the_gaps_ahead_of_the_reader(big_file, hints, pulls, two_ranks_here):
    """Quarters read in the order 0, 2, 1, 3 (the gaps the node's other rank reads): the
    read-ahead thread streams the whole stretch through the page cache, the gaps with it, once,
    and hints nothing."""
    path, data = big_file
    skip_unless_evictable(path)
    quarters = read_in_pieces(path, data)
    assert pulls == [quarters[0], (quarters[1][0], 2 * quarters[1][1]), quarters[3]]  # 1 with 2
    assert hints == []


def resident(fd: int, offset: int, length: int) -> bool:
    """Whether every page of the span is in the page cache (``cached`` looks at the first few)."""
    real = pagecache._SAMPLE_BYTES
    pagecache._SAMPLE_BYTES = length + 2 * MB
    try:
        return pagecache.cached(fd, offset, length) is True
    finally:
        pagecache._SAMPLE_BYTES = real


def test_a_reader_reaching_a_span_waits_until_it_and_its_gap_are_cached(big_file):
    """What makes the device see one large sequential read: the reader copies from the page cache
    only after the pull, never asking for the pages itself (its own small requests broke up the
    kernel's large ones)."""
    path, _ = big_file
    skip_unless_evictable(path)
    fd = os.open(path, os.O_RDONLY)
    ahead = pagecache.ReadAhead(64 * MB)
    try:
        ahead.extend([(fd, MB // 2 + k * 3 * MB // 2, MB) for k in range(4)])
        ahead.reached(1)
        assert resident(fd, MB // 2, 2 * MB + MB // 2)  # spans 0 and 1, and the gap between
    finally:
        ahead.close()
        os.close(fd)


def test_a_warm_file_is_looked_at_in_three_spans_only(big_file, monkeypatch):
    """Looking at every span of a warm load from the hint thread, though cheap, cost about 5% of
    the load (two ranks on two cores): a file whose first, middle and last spans are cached is
    taken as cached whole."""
    path, data = big_file
    warm(path)
    monkeypatch.setattr(execute_module, "reader_count", lambda: 1)  # the one case that hints
    looked, real = [], pagecache.cached
    monkeypatch.setattr(pagecache, "cached", lambda *span: looked.append(span) or real(*span))
    started, real_bring = [], pagecache.ReadAhead._bring
    monkeypatch.setattr(pagecache.ReadAhead, "_bring", lambda self: started.append(1) or real_bring(self))
    read_in_pieces(path, data, pieces=12)
    assert len(looked) == 3
    assert started == []  # no hint thread at all


@pytest.mark.parametrize("readers", [1, 2])
def test_a_warm_read_gives_no_hint(big_file, hints, pulls, monkeypatch, readers):
    path, data = big_file
    warm(path)
    monkeypatch.setattr(execute_module, "reader_count", lambda: readers)
    read_in_pieces(path, data)
    assert hints == [] and pulls == []


def test_a_rank_with_two_reader_threads_of_a_larger_world_neither_hints_nor_pulls(big_file, hints, pulls,
                                                                                    monkeypatch):
    """Its readers keep two requests in flight already; hints beside them made cold loads slower."""
    path, data = big_file
    skip_unless_evictable(path)
    monkeypatch.setattr(execute_module, "reader_count", lambda: 2)
    monkeypatch.setattr(execute_module, "rank_and_world", lambda: (0, 2))
    read_in_pieces(path, data)
    assert hints == [] and pulls == []


@pytest.mark.parametrize("read_ahead_kb, streamed", [(8192, True), (128, False), (None, False)])
def test_a_world_of_one_streams_beside_its_reader_threads_where_its_device_reads_ahead_far(
        big_file, hints, pulls, monkeypatch, read_ahead_kb, streamed):
    """Its rank reads every byte of a whole checkpoint: one stream ahead of two reader threads made
    cold loads faster on this project's disk, which reads ahead 8 MiB (benchmarks/README.md, "How a
    cold load reads"); at NVMe's default 128 KiB, or where the device is not known, the readers'
    own requests keep more in flight. Nothing is hinted beside them."""
    path, data = big_file
    skip_unless_evictable(path)
    monkeypatch.setattr(execute_module, "reader_count", lambda: 2)
    monkeypatch.setattr(execute_module, "_RUN_BYTES", MB)  # runs the two threads share
    monkeypatch.setattr(pagecache, "read_ahead_bytes",
                        lambda fd: None if read_ahead_kb is None else read_ahead_kb << 10)
    pieces = read_in_pieces(path, data, in_order=True)
    if streamed:
        assert pulls[0][0] == pieces[0][0] and sum(length for _, length in pulls) == 6 * MB
        assert all(offset + length == following for (offset, length), (following, _) in zip(pulls, pulls[1:]))
        evict(path)
        read_in_pieces(path, data)  # 0, 2, 1, 3: gaps of a quarter, beyond what is streamed through
    else:
        assert pulls == []
    assert hints == []


def test_read_ahead_bytes_is_the_backing_devices_or_its_disks(tmp_path):
    """A file system on a whole device has a backing device of the same number; on a partition,
    the disk holding it says."""
    device = os.stat(tmp_path).st_dev
    name = f"{os.major(device)}:{os.minor(device)}"
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        bdi = tmp_path / "sys1" / "class" / "bdi" / name
        bdi.mkdir(parents=True)
        (bdi / "read_ahead_kb").write_text("8192\n")
        assert pagecache.read_ahead_bytes(fd, str(tmp_path / "sys1")) == 8 << 20
        disk = tmp_path / "sys2" / "devices" / "nvme0n1"
        (disk / "queue").mkdir(parents=True)
        (disk / "queue" / "read_ahead_kb").write_text("128\n")
        (disk / "nvme0n1p1").mkdir()
        (tmp_path / "sys2" / "dev" / "block").mkdir(parents=True)
        (tmp_path / "sys2" / "dev" / "block" / name).symlink_to(disk / "nvme0n1p1")
        assert pagecache.read_ahead_bytes(fd, str(tmp_path / "sys2")) == 128 << 10
        assert pagecache.read_ahead_bytes(fd, str(tmp_path / "nowhere")) is None
    finally:
        os.close(fd)


def test_read_ahead_alongside_readers_leaves_spans_far_apart_to_them(recorded, monkeypatch):
    """A hint would split the readers' own requests; the far span counts as brought, so a reader
    reaching it does not wait."""
    events, fd = recorded
    monkeypatch.setattr(pagecache, "PULL_GAP_BYTES", 100)
    monkeypatch.setattr(pagecache, "read_ahead_bytes", lambda fd: 8 << 20)
    ahead = pagecache.ReadAhead(MB, alongside=True)
    try:
        ahead.extend([(fd, 0, 10), (fd, 10, 10), (fd, 500_000, 10)])
        ahead.reached(2)  # returns: the far span counts as brought
        assert settled(events, [("pull", 0, 10), ("pull", 10, 10)])
    finally:
        ahead.close()


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Pulls and hints as ("pull" | "hint", offset, length), none made, spans taken as uncached;
    and an open 1 MB file to give them."""
    events = []
    monkeypatch.setattr(pagecache, "cached", lambda fd, offset, length: False)
    monkeypatch.setattr(pagecache, "pull", lambda source, sink, offset, length:
                        events.append(("pull", offset, length)))
    monkeypatch.setattr(pagecache, "prefetch", lambda fd, offset, length:
                        events.append(("hint", offset, length)))
    path = tmp_path / "file"
    path.write_bytes(bytes(MB))
    fd = os.open(path, os.O_RDONLY)
    yield events, fd
    os.close(fd)


def settled(events, expected) -> bool:
    deadline = time.monotonic() + 5
    while events != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # and nothing more follows
    return events == expected


def test_read_ahead_stays_within_its_window_and_the_reader_waits_for_it(recorded):
    """Spans of 10 bytes end to end, a window of 25: pulls go three spans ahead of the reader, and
    a reader reaching a span returns once it has been pulled."""
    events, fd = recorded
    ahead = pagecache.ReadAhead(25)
    try:
        assert ahead.extend([(fd, 10 * k, 10) for k in range(10)]) == 0
        assert settled(events, [("pull", 0, 10), ("pull", 10, 10), ("pull", 20, 10)])
        ahead.reached(5)
        assert ("pull", 50, 10) in events
        assert settled(events, [("pull", 10 * k, 10) for k in range(8)])
        assert ahead.extend([(fd, 100, 10)]) == 10
        ahead.reached(9)
        assert settled(events, [("pull", 10 * k, 10) for k in range(11)])
    finally:
        ahead.close()
    assert not ahead.thread.is_alive()


def test_spans_far_apart_are_hinted_and_a_gap_the_nodes_ranks_read_is_pulled(recorded, monkeypatch):
    """Gaps of 990 bytes after spans of 10, beyond the 100 bytes streamed through whoever reads
    them: hinted, each on its own (many requests in flight, where a pull keeps one), as when other
    nodes' ranks read the gaps. With 100 ranks on the node and none elsewhere, whose other 99
    spans of 10 bytes fill such a gap, they are pulled."""
    events, fd = recorded
    monkeypatch.setattr(pagecache, "PULL_GAP_BYTES", 100)
    spans = [(fd, 1000 * k, 10) for k in range(3)]
    for gap_ranks, expected in [(0, [("hint", 1000 * k, 10) for k in range(3)]),
                                (99, [("pull", 0, 10), ("pull", 10, 1000), ("pull", 1010, 1000)])]:
        events.clear()
        ahead = pagecache.ReadAhead(MB, gap_ranks)
        try:
            ahead.extend(spans)
            assert settled(events, expected)
        finally:
            ahead.close()


def test_a_span_in_a_hole_below_the_stream_is_still_brought_in(recorded):
    """An order that goes back (an FP8 weight's scales, stored before the weights): a span inside
    what was streamed is skipped, one below it is hinted, and the stream goes on where it was."""
    events, fd = recorded
    ahead = pagecache.ReadAhead(MB)
    try:
        ahead.extend([(fd, 100, 10), (fd, 110, 10), (fd, 20, 10), (fd, 115, 5), (fd, 120, 10)])
        assert settled(events, [("pull", 100, 10), ("pull", 110, 10), ("hint", 20, 10), ("pull", 120, 10)])
    finally:
        ahead.close()


def test_fp8_weights_are_streamed_past_their_scales(recorded):
    """Each FP8 weight is read with its scales, stored before the weights: the weights still form
    one stream (the next span above a weight is looked for past its scales), the scales are
    hinted."""
    events, fd = recorded
    spans = []
    for k in range(3):
        spans += [(fd, 100_000 + 100 * k, 100), (fd, 10 + 5 * k, 5)]
    ahead = pagecache.ReadAhead(MB)
    try:
        ahead.extend(spans)
        assert settled(events, [event for k in range(3)
                                for event in (("pull", 100_000 + 100 * k, 100), ("hint", 10 + 5 * k, 5))])
    finally:
        ahead.close()


@pytest.mark.parametrize("world, streamed", [(2, 1), (4, 0)])
def test_gaps_are_streamed_through_only_when_the_whole_world_is_on_this_node(monkeypatch, world, streamed):
    """Two ranks on this node: in a world of 2 the gaps are the other rank's; in a world of 4
    they hold another node's ranges too, which this node must not read."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(execute_module, "rank_and_world", lambda: (0, world))
    assert execute_module.gap_ranks() == streamed


def test_a_cold_batch_after_warm_ones_is_pulled_from_where_the_reader_is(recorded, monkeypatch, tmp_path):
    """Spans of 10 bytes, a window of 25: a batch of a warm file starts no thread, but the reader's
    place in it still counts, so the next batch (a cold file) is pulled at once up to the window
    from there."""
    events, cold = recorded
    warm_file = tmp_path / "warm"
    warm_file.write_bytes(bytes(1000))
    warm_fd = os.open(warm_file, os.O_RDONLY)
    monkeypatch.setattr(pagecache, "cached", lambda fd, offset, length: fd != cold)
    ahead = pagecache.ReadAhead(25)
    try:
        ahead.extend([(warm_fd, 10 * k, 10) for k in range(100)])
        ahead.reached(99)
        assert ahead.thread is None
        assert ahead.extend([(cold, 10 * k, 10) for k in range(10)]) == 100
        assert settled(events, [("pull", 0, 10), ("pull", 10, 10)])
    finally:
        ahead.close()
        os.close(warm_fd)


def test_sample_digests_hint_a_cold_files_windows_all_at_once_and_say_so(big_file, hints):
    path, _ = big_file
    index = open_checkpoint(path)
    try:
        opened = index.opened.get("big.safetensors")
        files = [(opened.fd, opened.data_start, opened.identity.size)]
        warm(path)
        digest, brought = sample_digests(files)
        assert hints == [] and brought == []
        skip_unless_evictable(path)
        windows = [(opened.fd, offset, length)
                   for offset, length in sample_windows(opened.data_start, opened.identity.size)]
        assert sample_digests(files) == (digest, windows)
        assert hints == windows
    finally:
        index.close()


def test_forget_drops_the_pages_of_a_window_smaller_than_a_page_and_no_others(big_file):
    """``POSIX_FADV_DONTNEED`` itself drops only whole pages within its span: nothing, for a
    512-byte window. Two windows read from a cold file, as the data sample reads them; one is
    forgotten."""
    path, _ = big_file
    skip_unless_evictable(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for window in (3 * MB - 4096 + 5, 3 * MB + 4096 + 5, 3 * MB + 5):
            reader = os.open(path, os.O_RDONLY)  # no readahead state from the read before
            os.pread(reader, 512, window)
            os.close(reader)
        assert pagecache.cached(fd, 3 * MB + 5, 512) is True
        pagecache.forget([(fd, 3 * MB + 5, 512), (fd, 3 * MB + 4096, 0)])
        assert pagecache.cached(fd, 3 * MB + 5, 512) is False
        assert pagecache.cached(fd, 3 * MB - 4096 + 5, 512) is True  # the pages on either side
        assert pagecache.cached(fd, 3 * MB + 4096 + 5, 512) is True
    finally:
        os.close(fd)


@pytest.mark.parametrize("missing", ["sendfile", "/proc/self/fd"])
def test_without_sendfile_or_proc_the_spans_are_hinted(big_file, hints, monkeypatch, missing, two_ranks_here):
    path, data = big_file
    skip_unless_evictable(path)
    if missing == "sendfile":
        def no_sendfile(*args):
            raise OSError(errno.ENOSYS, "no sendfile")
        monkeypatch.setattr(os, "sendfile", no_sendfile)
    else:
        monkeypatch.setattr(pagecache, "own_description", lambda fd: None)
    quarters = read_in_pieces(path, data)
    assert sorted((offset, length) for _, offset, length in hints) == quarters


def test_a_reader_never_waits_for_a_read_ahead_thread_that_died(big_file, monkeypatch, two_ranks_here):
    path, data = big_file
    skip_unless_evictable(path)

    def broken(*args):
        raise RuntimeError("the read-ahead thread dies")

    monkeypatch.setattr(pagecache, "pull", broken)
    with pytest.warns(RuntimeWarning, match=r"^rank \d+: reading ahead of a cold load stopped"):
        read_in_pieces(path, data)  # returns, with every byte right


@pytest.mark.parametrize("impostor", ["a regular file", "/dev/zero"])
def test_pulls_never_write_to_a_dev_null_that_is_not_the_null_device(big_file, hints, pulls, monkeypatch,
                                                                     tmp_path, two_ranks_here, impostor):
    path, data = big_file
    skip_unless_evictable(path)
    if impostor == "a regular file":
        impostor = tmp_path / "null"
        impostor.write_bytes(b"")
    elif not os.path.exists(impostor):
        pytest.skip(f"no {impostor} here")
    monkeypatch.setattr(os, "devnull", str(impostor))
    quarters = read_in_pieces(path, data)
    assert pulls == []
    if not str(impostor).startswith("/dev/"):
        assert impostor.read_bytes() == b""
    assert sorted((offset, length) for _, offset, length in hints) == quarters


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.parametrize("pulling", [True, False])
def test_read_ahead_closes_what_it_opened_once(big_file, monkeypatch, pulling):
    """Its own descriptions of the files and /dev/null, also when a pull fails; a second close
    closes nothing (the numbers may belong to other files by then)."""
    path, _ = big_file
    skip_unless_evictable(path)
    if not pulling:
        def no_sendfile(*args):
            raise OSError(errno.ENOSYS, "no sendfile")
        monkeypatch.setattr(os, "sendfile", no_sendfile)
    fd = os.open(path, os.O_RDONLY)
    before = open_descriptors()
    ahead = pagecache.ReadAhead(64 * MB, 1)
    ahead.extend([(fd, 0, MB), (fd, MB + 4096, MB)])
    ahead.reached(1)
    ahead.close()
    assert open_descriptors() == before
    other = os.open(path, os.O_RDONLY)  # takes a number the read-ahead had used
    try:
        ahead.close()
        os.fstat(other)
    finally:
        os.close(other)
        os.close(fd)


def test_hints_never_block_a_read_when_mincore_is_unavailable(big_file, hints, pulls, monkeypatch):
    """Where mincore cannot be called (not Linux), nothing is pulled or hinted and reads work as
    before."""
    path, data = big_file
    monkeypatch.setattr(pagecache, "_LIBC", None)
    evict(path)
    read_in_pieces(path, data)
    assert hints == [] and pulls == []
