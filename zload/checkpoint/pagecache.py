"""What the page cache holds of a checkpoint file, and getting what it lacks from the device in
large requests.

From a cold page cache, one thread reading a rank's ranges in order leaves the storage device
idle between its requests: the kernel fetches little ahead of reads that skip over other ranks'
bytes. ``ReadAhead`` therefore reads ahead of the reader: it streams the file through the page
cache in order, through the gaps that the node's other ranks read anyway, with ``sendfile`` to
``/dev/null`` (no copy) from an open file description of its own, so that the kernel sees one
sequential reader and fetches in fewer, larger requests than a hint for each range gets (counted
in benchmarks/README.md, "How a cold load reads"); the reader copies each range once it has been
pulled. A lone reader's ranges too far apart to stream through are hinted instead
(``posix_fadvise(WILLNEED)``), as are all of them wherever ``sendfile`` or ``/proc/self/fd`` are
missing: hints fetch in single pages, which the device serves in smaller requests. Beside reader
threads of its own (a world of one) nothing is hinted, and the stream runs only where the device
reads ahead far (``read_ahead_bytes``).

Pages that a small read leaves in the cache break the kernel's large requests around them (its
readahead falls back to single pages after it meets a cached one), so what ``sample_digests``
brought in is ``forget``-ed once every rank has sampled.

When the pages are already cached, pulling and hinting would only cost system calls, so the
spans of a file in a batch are brought in only when ``mincore`` (through ctypes: no compiled
extension) finds the first pages of its first, middle or last span missing. Looking at every
page instead costs more than a warm load can spare, and even a few pages, span by span from a
thread of its own, took CPU from the readers of a warm load (benchmarks/README.md, "How a cold
load reads"). Where ``mincore`` is missing (not Linux, no libc),
nothing is pulled or hinted and reads work as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
import warnings

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_SAMPLE_BYTES = 16 * mmap.PAGESIZE  # looked at, at the start of a span


def _libc():
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        map_, mincore, unmap = libc.mmap, libc.mincore, libc.munmap
    except (OSError, AttributeError):
        return None
    map_.restype = ctypes.c_void_p
    map_.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                     ctypes.c_long)
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    unmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return map_, mincore, unmap


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def cached(fd: int, offset: int, length: int) -> bool | None:
    """Whether the first pages of a span of ``fd`` (up to ``_SAMPLE_BYTES``) are all in the page
    cache; None when that cannot be known. Mapping them reads nothing."""
    if _LIBC is None or length <= 0:
        return None
    map_, mincore, unmap = _LIBC
    start = offset - offset % mmap.PAGESIZE
    size = min(offset + length - start, _SAMPLE_BYTES)
    address = map_(None, size, _PROT_READ, _MAP_SHARED, fd, start)
    if address is None or address == _MAP_FAILED:
        return None
    try:
        pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        if mincore(address, size, pages) != 0:
            return None
        return b"\x00" not in pages.raw
    finally:
        unmap(address, size)


def prefetch(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading a span into the page cache; it does not wait for it. A
    refused hint changes nothing but speed."""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def uncached(fd: int, spans: list[tuple[int, int]]) -> bool:
    """Whether the first, middle or last ``(offset, length)`` of ``spans`` (in one file, in reading
    order) lacks pages in the page cache: the cheap evidence that decides for all of them."""
    return bool(spans) and any(cached(fd, *spans[k]) is False for k in {0, len(spans) // 2, len(spans) - 1})


def prefetch_if_uncached(fd: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Hint every ``(offset, length)`` of ``spans`` at once, if they look ``uncached``: for many
    small reads spread over a file, each of which would otherwise wait for the device in turn.
    Returns the spans hinted (all or none: some of them may have been cached already)."""
    if not uncached(fd, spans):
        return []
    for offset, length in spans:
        prefetch(fd, offset, length)
    return spans


def forget(spans: list[tuple[int, int, int]]) -> None:
    """Drop the pages of ``(fd, offset, length)`` spans from the page cache: spans a small read
    brought in, so that they do not break the large requests of a later read around them.
    ``POSIX_FADV_DONTNEED`` drops whole pages only, so each span is widened to its pages."""
    page = mmap.PAGESIZE
    for fd, offset, length in spans:
        if length <= 0:
            continue  # a length of 0 would mean "to the end of the file"
        start = offset - offset % page
        try:
            os.posix_fadvise(fd, start, -(-(offset + length - start) // page) * page,
                             os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


# the device read-ahead at which a stream beside readers pays: measured on one virtual disk that
# reads ahead 8 MiB only (benchmarks/README.md); a fast array reading ahead this much may be
# quicker with its readers alone, not measured
STREAMED_READ_AHEAD_BYTES = 4 << 20


def read_ahead_bytes(fd: int, sysfs: str = "/sys") -> int | None:
    """How far the kernel reads ahead on the device that holds ``fd``'s file: the ``read_ahead_kb``
    of its backing device (a disk, a mapped device, a network file system's mount), or of the disk
    of its partition. None where ``sysfs`` does not say: an overlay, a tmpfs, btrfs or ZFS (their
    devices are anonymous), no sysfs."""
    try:
        device = os.fstat(fd).st_dev
    except OSError:
        return None
    name = f"{os.major(device)}:{os.minor(device)}"
    for path in (os.path.join(sysfs, "class", "bdi", name, "read_ahead_kb"),
                 os.path.join(sysfs, "dev", "block", name, "..", "queue", "read_ahead_kb")):
        try:
            with open(path) as f:
                return int(f.read()) * 1024
        except (OSError, ValueError):
            continue
    return None


PULL_GAP_BYTES = 1 << 20  # a gap this small is streamed through, whoever reads it
_PULL_CHUNK = 16 << 20  # bytes per sendfile call
_LOOK_AHEAD_SPANS = 4  # spans looked at for the next one above a span


def pull(source: int, sink: int, offset: int, length: int) -> None:
    """Read a span of ``source`` into the page cache through ``sendfile`` to ``sink``
    (``/dev/null``): the kernel's own sequential readahead, and no copy."""
    end = offset + length
    while offset < end:
        sent = os.sendfile(sink, source, offset, end - offset)
        if sent <= 0:
            return  # end of file: the reader's own read reports it
        offset += sent


def own_description(fd: int) -> int | None:
    """A second open file description of ``fd``'s file (from ``/proc/self/fd``), so that its
    readahead state is the puller's alone; None where there is none, or it is another file."""
    try:
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        mine, theirs = os.fstat(fd), os.fstat(other)
        if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
            return other
    except OSError:
        pass
    os.close(other)
    return None


_NULL_DEVICE = (1, 3)  # Linux's /dev/null: character device major 1, minor 3


def null_sink() -> int | None:
    """``/dev/null`` opened for writing, if it is the null device; None otherwise: pulls must
    never write anywhere."""
    try:
        sink = os.open(os.devnull, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        found = os.fstat(sink)
        if stat.S_ISCHR(found.st_mode) and (os.major(found.st_rdev), os.minor(found.st_rdev)) == _NULL_DEVICE:
            return sink
    except OSError:
        pass
    os.close(sink)
    return None


class ReadAhead:
    """Brings the uncached spans of a reading order into the page cache, up to ``window`` bytes of
    it ahead of the reader, from a thread of its own. Spans are ``(fd, offset, length)``, appended
    in the order they are read (``extend``); readers call ``reached(i)`` before they read span
    ``i``, which waits until the span has been pulled or hinted. A span is pulled, with the gap
    before it when that is at most ``PULL_GAP_BYTES`` or what ``gap_ranks`` spans as long as its
    neighbours fill (the node's other ranks, when the whole world is on this node: their reads fill
    the gaps); a span with no neighbour that close on either side is hinted. ``alongside``: the
    reader has threads of its own (a world of one, which reads every byte); then nothing is hinted
    (hints split their requests), and a file is streamed only where its device reads ahead at least
    ``STREAMED_READ_AHEAD_BYTES`` (one stream then keeps the device busy; at the 128 KiB that NVMe
    drives read ahead by default, the readers' own requests keep more in flight). The spans of a
    file that does not look ``uncached`` when they are appended are never looked at again (a warm
    load starts no thread). ``close`` before the descriptors are closed. A window of 0 brings
    nothing."""

    def __init__(self, window: int, gap_ranks: int = 0, alongside: bool = False):
        self.window = window
        self.gap_ranks = max(0, gap_ranks)
        self.alongside = alongside
        self.spans: list[tuple[int, int, int] | None] = []  # None: taken as cached
        self.starts = [0]  # bytes of the reading order before span i
        self.position = 0  # where the reader is
        self.done = 0  # spans[:done] have been pulled, hinted or passed over
        self.closed = False
        self.changed = threading.Condition()
        self.thread: threading.Thread | None = None
        self.sink: int | None = None  # /dev/null, once opened
        self.can_pull = True  # False once /dev/null or sendfile turned out unusable
        self.puller: tuple[int, int | None] | None = None  # (fd, its own description or None)
        self.streams: dict[int, tuple[int, int, int]] = {}  # fd -> (start, end, last span's length)

    def extend(self, spans) -> int:
        """Append spans to the reading order; returns the index of the first."""
        by_file: dict[int, list[tuple[int, int]]] = {}
        if self.window > 0:
            for fd, offset, length in spans:
                by_file.setdefault(fd, []).append((offset, length))
        cold = {fd for fd, of_file in by_file.items() if uncached(fd, of_file) and self._streams_well(fd)}
        with self.changed:
            first = len(self.spans)
            for span in spans:
                self.spans.append(span if span[0] in cold else None)
                self.starts.append(self.starts[-1] + span[2])
            self.changed.notify_all()
        if self.thread is None and cold:  # never without mincore: ``cached`` is None then
            thread = threading.Thread(target=self._bring, name="zload-read-ahead", daemon=True)
            thread.start()
            self.thread = thread
        return first

    def reached(self, i: int) -> None:
        with self.changed:
            if self.starts[i] > self.position:
                self.position = self.starts[i]
                self.changed.notify_all()
            while self.done <= i and not self.closed and self.spans[i] is not None:
                self.changed.wait()

    def _next(self) -> tuple[int, tuple[int, int, int]] | None:
        """The next span to bring, once it is within the window; None when closed."""
        with self.changed:
            while not self.closed:
                k = self.done
                if k < len(self.spans) and self.spans[k] is None:
                    self.done += 1
                    self.changed.notify_all()
                elif k < len(self.spans) and self.starts[k] < self.position + self.window:
                    return k, self.spans[k]
                else:
                    self.changed.wait()
            return None

    def _bring(self) -> None:
        try:
            while (step := self._next()) is not None:
                k, span = step
                with self.changed:  # the next span above this one (an FP8 weight's scales lie below it)
                    following = next((s for s in self.spans[k + 1:k + 1 + _LOOK_AHEAD_SPANS]
                                      if s is not None and s[0] == span[0] and s[1] >= span[1] + span[2]), None)
                self._pull_or_hint(span, following)
                with self.changed:
                    self.done = k + 1
                    self.changed.notify_all()
        except Exception as error:  # the reads go on without it, as slowly as without hints
            from ..distributed import rank_and_world  # torch, which this module does not import otherwise

            warnings.warn(f"rank {rank_and_world()[0]}: reading ahead of a cold load stopped ({error!r}); the "
                          "load goes on without it, as fast as the reads alone", RuntimeWarning, stacklevel=1)
        finally:  # a reader never waits for a thread that has stopped
            with self.changed:
                self.closed = True
                self.changed.notify_all()

    def _in_reach(self, end: int, span: tuple[int, int, int], neighbour: int) -> bool:
        """Whether the gap from ``end`` to ``span`` (in the same file) is worth streaming
        through: ``gap_ranks`` spans of the longer of ``span`` and its ``neighbour`` (the other
        span beside the gap) fill it, or it is small."""
        return 0 <= span[1] - end <= max(PULL_GAP_BYTES, self.gap_ranks * max(span[2], neighbour))

    def _streams_well(self, fd: int) -> bool:
        return not self.alongside or (read_ahead_bytes(fd) or 0) >= STREAMED_READ_AHEAD_BYTES

    def _hint(self, fd: int, offset: int, length: int) -> None:
        if not self.alongside:
            prefetch(fd, offset, length)

    def _pull_or_hint(self, span: tuple[int, int, int], following) -> None:
        """Pull the span, from the end of the stream so far in its file when the gap is in reach;
        hint it instead when it stands alone (no neighbour in reach on either side: for spans far
        apart, hints keep many requests in flight where one thread pulling keeps one) or when
        pulls cannot be made. In an order that goes back, a span inside what the stream has
        covered is brought already, and one below it is hinted."""
        fd, offset, length = span
        start, end, before = self.streams.get(fd, (0, -1, 0))
        if start <= offset and offset + length <= end:
            return
        if offset < start:  # below the stream: hinted, and the stream goes on where it was
            self._hint(fd, offset, length)
            return
        continues = start <= offset <= end or (offset > end >= 0 and self._in_reach(end, span, before))
        if not continues and not (following is not None and self._in_reach(offset + length, following, length)):
            self._hint(fd, offset, length)
            return
        source = self._source(fd)
        if source is None:
            self._hint(fd, offset, length)
            return
        try:
            for at in range(end if continues else offset, offset + length, _PULL_CHUNK):
                if self.closed:
                    return
                pull(source, self.sink, at, min(_PULL_CHUNK, offset + length - at))
            self.streams[fd] = (start if continues else offset, offset + length, length)
        except OSError:
            self.can_pull = False  # no sendfile here: hints from now on
            self._close_source()
            self._hint(fd, offset, length)

    def _source(self, fd: int) -> int | None:
        """``fd``'s own description for pulling (the last file's is closed: the reading order
        moves through the files one after another), or None where pulls cannot be made."""
        if self.puller is not None and self.puller[0] == fd:
            return self.puller[1]
        self._close_source()
        if self.can_pull and self.sink is None:
            self.sink = null_sink()
            self.can_pull = self.sink is not None
        if not self.can_pull:
            return None
        self.puller = (fd, own_description(fd))
        return self.puller[1]

    def _close_source(self) -> None:
        puller, self.puller = self.puller, None  # forgotten first: a close that raises is not retried
        if puller is not None and puller[1] is not None:
            os.close(puller[1])

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        if self.thread is not None:
            self.thread.join()
        sink, self.sink = self.sink, None
        try:
            self._close_source()
        finally:
            if sink is not None:
                os.close(sink)
