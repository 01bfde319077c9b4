"""What the page cache holds of a checkpoint file, and asking the kernel to fetch what it lacks.

From a cold page cache, one thread reading a rank's ranges in order leaves the storage device
idle between its requests: the kernel fetches little ahead of reads that skip over other ranks'
bytes. ``posix_fadvise(WILLNEED)`` starts the fetch of a span without waiting for it, so spans
hinted ahead of the reader keep several requests in flight. When the pages are already cached the
hints would only cost system calls, so a span is hinted only when ``mincore`` (through ctypes: no
compiled extension) finds the first pages of it missing. Looking at every page instead costs
about 15 us per MB when cached (1.4 ms for a 95 MB file, measured), more than a warm load can
spare; a few pages cost about 3 us. Even that, span by span from a thread of its own, took CPU
from the readers of a warm load (two ranks on two cores, 800 spans each: about 5% of the load),
so the spans of one file in a batch whose first, middle and last are cached are all taken as
cached. Where either call is missing (not Linux, no libc), nothing is hinted and reads work as
before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

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


def prefetch_if_uncached(fd: int, spans: list[tuple[int, int]]) -> None:
    """Hint every ``(offset, length)`` of ``spans`` at once, if they look ``uncached``: for many
    small reads spread over a file, each of which would otherwise wait for the device in turn."""
    if uncached(fd, spans):
        for offset, length in spans:
            prefetch(fd, offset, length)


class ReadAhead:
    """Hints the uncached spans of a reading order to the kernel, up to ``window`` bytes ahead of
    the reader, from a thread of its own: a hint can wait for room in the device's queue, and the
    reader should be copying meanwhile. Spans are ``(fd, offset, length)``, appended in the order
    they are read (``extend``); readers call ``reached(i)`` as they start span ``i``. The spans of
    a file that does not look ``uncached`` when they are appended are never looked at again (a
    warm load starts no thread). ``close`` before the descriptors are closed. A window of 0 hints
    nothing."""

    def __init__(self, window: int):
        self.window = window
        self.spans: list[tuple[int, int, int] | None] = []  # None: taken as cached
        self.starts = [0]  # bytes of the reading order before span i
        self.position = 0  # where the reader is
        self.hinted = 0  # spans[:hinted] have been looked at (or passed by the reader)
        self.closed = False
        self.changed = threading.Condition()
        self.thread: threading.Thread | None = None

    def extend(self, spans) -> int:
        """Append spans to the reading order; returns the index of the first."""
        by_file: dict[int, list[tuple[int, int]]] = {}
        if self.window > 0:
            for fd, offset, length in spans:
                by_file.setdefault(fd, []).append((offset, length))
        cold = {fd for fd, of_file in by_file.items() if uncached(fd, of_file)}
        with self.changed:
            first = len(self.spans)
            for span in spans:
                self.spans.append(span if span[0] in cold else None)
                self.starts.append(self.starts[-1] + span[2])
            self.changed.notify()
        if self.thread is None and cold:  # never without mincore: ``cached`` is None then
            self.thread = threading.Thread(target=self._hint, name="zload-read-ahead", daemon=True)
            self.thread.start()
        return first

    def reached(self, i: int) -> None:
        with self.changed:
            if self.starts[i] > self.position:
                self.position = self.starts[i]
                self.changed.notify()

    def _next(self) -> tuple[int, int, int] | None:
        """The next span to look at, once it is within the window; None when closed."""
        with self.changed:
            while not self.closed:
                if self.hinted < len(self.spans) and (self.spans[self.hinted] is None
                                                      or self.starts[self.hinted] < self.position):
                    self.hinted += 1  # taken as cached, or the reader is past it already
                elif self.hinted < len(self.spans) and self.starts[self.hinted] < self.position + self.window:
                    self.hinted += 1
                    return self.spans[self.hinted - 1]
                else:
                    self.changed.wait()
            return None

    def _hint(self) -> None:
        while (span := self._next()) is not None:
            if cached(*span) is False:
                prefetch(*span)

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify()
        if self.thread is not None:
            self.thread.join()
