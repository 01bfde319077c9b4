"""Executor: perform a plan's reads and copies. The only stage that touches files and tensors.

Reads are issued in file order; runs of file-contiguous ranges become one ``os.preadv`` that
scatters the bytes to several buffers at once. A few reader threads take the runs one at a time
(``preadv`` releases the GIL); the calling thread is one of them whenever it would otherwise wait,
and there are no more of them than this rank's share of the CPUs, since reads from the page cache
are memory copies that more threads than cores only slow down. A rank with one reader thread, and
the rank of a world of one where its device reads ahead far enough, has the runs the page cache
lacks brought in ahead of it (``pagecache.ReadAhead``: streamed through the gaps between them in
large requests), up to ``READ_AHEAD_BYTES`` ahead of its reads, so that a cold load keeps the
storage device busy; the runs of a file in a batch whose first, middle and last are cached are
neither brought in nor looked at again. A range whose destination is a CPU tensor of the same dtype
is read straight into the destination; the others land in one of two staging buffers and are copied
(and cast) by ``kernels.scatter_cast``: while one buffer is being copied out, the next batch is
read into the other. For GPU destinations the staging buffers are pinned and each batch goes to the
device on its own CUDA stream, so reads, host-to-device copies and the kernel overlap without a
per-tensor synchronisation.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..checkpoint.dtypes import TORCH_DTYPES
from ..checkpoint.files import FileTable, OpenFile
from ..checkpoint.pagecache import ReadAhead
from ..distributed import local_ranks, rank_and_world, reader_count
from ..errors import CheckpointError
from ..kernels import Dequant, Segment, scatter_cast
from ..progress import Progress
from .plan import ALIGN, ReadItem, StagingLayout, align

DEFAULT_STAGING_BYTES = 64 << 20  # both staging buffers together
_IOV_MAX = 1024  # buffers per preadv call (Linux IOV_MAX)
_RUN_BYTES = 16 << 20  # longer runs are split so that the reader threads can share them
READ_AHEAD_BYTES = 64 << 20  # uncached bytes brought in ahead of the readers (other sizes: benchmarks/README.md)


def gap_ranks() -> int:
    """How many other ranks' ranges a gap between two of this rank's may hold and still be read
    through ahead of it: the node's other ranks when the whole world is on this node (the node
    reads every byte of such a gap anyway), none when other nodes' ranges lie in the gaps."""
    local = local_ranks()
    return local - 1 if rank_and_world()[1] <= local else 0


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous CPU tensor."""
    return memoryview(tensor.detach().view(torch.uint8).numpy()).cast("B")


@dataclass
class _Run:
    """File-contiguous bytes read with one preadv into ``buffers``."""

    opened: OpenFile
    file: str  # its key
    offset: int
    buffers: list = field(default_factory=list)
    nbytes: int = 0


def _read_run(run: _Run) -> int:
    """Read a whole run (retrying short reads); returns its byte count."""
    buffers, offset = run.buffers, run.offset
    while buffers:
        try:
            got = os.preadv(run.opened.fd, buffers, offset)
        except OSError as e:
            raise CheckpointError(f"{run.opened.path}: read failed at byte {offset}: {e.strerror}",
                                  path=run.opened.path) from e
        if got == 0:
            raise CheckpointError(f"{run.opened.path}: unexpected end of file at byte {offset} "
                                  "(was the file changed during the load?)", path=run.opened.path)
        offset += got
        while buffers and got >= len(buffers[0]):
            got -= len(buffers[0])
            buffers = buffers[1:]
        if buffers and got:
            buffers = [buffers[0][got:]] + buffers[1:]
    return run.nbytes


class _RunQueue:
    """A batch's runs, taken one at a time by the reader threads (whichever is free next); those
    not in the page cache are brought in ahead of them, from the moment the batch is queued."""

    def __init__(self, runs: list[_Run], progress: Progress, read_ahead: ReadAhead):
        self.runs = runs
        self.next = 0
        self.lock = threading.Lock()
        self.progress = progress
        self.read_ahead = read_ahead
        self.first = read_ahead.extend([(r.opened.fd, r.offset, r.nbytes) for r in runs])

    def read_until_empty(self) -> int:
        """Read runs until none are left; returns the bytes this thread read."""
        total = 0
        while True:
            with self.lock:
                if self.next == len(self.runs):
                    return total
                taken = self.next
                self.next += 1
            run = self.runs[taken]
            try:
                self.read_ahead.reached(self.first + taken)
                got = _read_run(run)
            except BaseException:
                with self.lock:
                    self.next = len(self.runs)  # the batch has failed: the other threads stop too
                raise
            self.progress.update(got)
            total += got


class _Staging:
    """One staging buffer: host bytes (pinned for a GPU), plus its device copy and the events
    that say when the host buffer may be refilled and when the device copy may be."""

    def __init__(self, capacity: int, device: torch.device):
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.view = byte_view(self.host)
        self.device_copy = torch.empty(capacity, dtype=torch.uint8, device=device) \
            if device.type == "cuda" else None
        self.copied = None  # CUDA event: host -> device copy done
        self.consumed = None  # CUDA event: the kernel reading the device copy done

    def ready_for_reading(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None


class _Reader:
    def __init__(self, files: FileTable, destinations: list, staging_bytes: int, staged_total: int,
                 progress: Progress | None = None, threads: int | None = None,
                 device: torch.device = torch.device("cpu")):
        self.files = files
        self.destinations = destinations
        self.progress = progress or Progress()
        self.capacity = max(ALIGN, min(staging_bytes // 2, staged_total))
        self.device = device
        self.buffers: list[_Staging] = []
        self.current = 0
        self.layout = StagingLayout(self.capacity)
        self.segments: list[Segment] = []
        self.runs: list[_Run] = []
        self.pending = None  # the batch being read: (queue, helpers' futures, staging, segments)
        self.read_files: set[str] = set()
        self.bytes_read = 0
        self.helpers = (reader_count() if threads is None else max(1, threads)) - 1
        # reading ahead for a lone reader, and alongside reader threads in a world of one, whose
        # rank reads every byte (benchmarks/README.md, "How a cold load reads")
        world_of_one = rank_and_world()[1] == 1
        self.read_ahead = ReadAhead(READ_AHEAD_BYTES if not self.helpers or world_of_one else 0, gap_ranks(),
                                    alongside=bool(self.helpers))
        self.pool = ThreadPoolExecutor(self.helpers, thread_name_prefix="zload-read") \
            if self.helpers else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _opened(self, file: str) -> OpenFile:
        self.read_files.add(file)
        return self.files.get(file)

    def queue(self, file: str, offset: int, buffer: memoryview) -> None:
        """Add the read of ``buffer`` from ``file`` at ``offset`` (run by ``drain``)."""
        for first in range(0, len(buffer), _RUN_BYTES):
            piece = buffer[first:first + _RUN_BYTES]
            run = self.runs[-1] if self.runs else None
            if (run is None or run.file != file or run.offset + run.nbytes != offset + first
                    or len(run.buffers) >= _IOV_MAX or run.nbytes >= _RUN_BYTES):
                run = _Run(self._opened(file), file, offset + first)
                self.runs.append(run)
            run.buffers.append(piece)
            run.nbytes += len(piece)

    def _staging(self) -> _Staging:
        while len(self.buffers) <= self.current:
            self.buffers.append(_Staging(self.capacity, self.device))
        return self.buffers[self.current]

    def add(self, item: ReadItem) -> None:
        if item.numel == 0:
            return  # preadv of nothing would look like end of file
        dst = self.destinations[item.target]
        if dst.device.type == "cpu" and dst.dtype == item.src_dtype:
            first = item.dst_offset * dst.element_size()
            self.queue(item.file, item.offset, byte_view(dst)[first:first + item.nbytes])
            return
        for part in self.layout.parts(item):
            start = self.layout.place(part.staged_nbytes)
            if start == 0 and self.segments:
                self.flush()
            staging = self._staging()
            if start == 0:
                staging.ready_for_reading()
            self.queue(part.file, part.offset, staging.view[start:start + part.nbytes])
            dequant = None if part.scale is None else self._queue_scales(part, staging, start)
            self.segments.append(Segment(start, item.src_dtype, part.numel, part.target, part.dst_offset,
                                         dequant))

    def _queue_scales(self, part: ReadItem, staging: _Staging, start: int) -> Dequant:
        """Queue the read of ``part``'s scale rows, staged after it; how the kernel finds them."""
        file, offset, nbytes = part.scale_span
        at = align(start + part.nbytes)
        if nbytes:
            self.queue(file, offset, staging.view[at:at + nbytes])
        scale = part.scale
        dtype = TORCH_DTYPES[scale.entry.dtype]
        return Dequant(at, dtype, nbytes // dtype.itemsize, part.first_element, part.scale_rows[0],
                       scale.rows, scale.columns, scale.kernel_block, scale.grid)

    def flush(self) -> None:
        """Start reading the batch queued so far; copy out the batch read before it."""
        queue = _RunQueue(self.runs, self.progress, self.read_ahead)
        helpers = min(self.helpers, len(self.runs))
        futures = [self.pool.submit(queue.read_until_empty) for _ in range(helpers)]
        batch = (queue, futures, self._staging() if self.segments else None, self.segments)
        self.runs, self.segments = [], []
        self._finish(self.pending)
        self.pending = batch
        self.current = 1 - self.current

    def drain(self) -> None:
        """Finish every read queued so far, then check that no file read changed meanwhile."""
        self.flush()
        self._finish(self.pending)
        self.pending = None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).synchronize()
        self.files.check_unchanged(self.read_files)

    def _finish(self, batch) -> None:
        if batch is None:
            return
        queue, futures, staging, segments = batch
        self.bytes_read += queue.read_until_empty()  # this thread helps rather than waits
        for future in futures:
            self.bytes_read += future.result()
        if not segments:
            return
        if self.stream is None:
            scatter_cast(staging.host, segments, self.destinations)
            return
        used = max(s.staged_end for s in segments)
        if staging.consumed is not None:
            # the kernel that read this device buffer two batches ago; the previous batch's kernel
            # (the other buffer) may still run while this copy does
            self.stream.wait_event(staging.consumed)
        with torch.cuda.stream(self.stream):
            staging.device_copy[:used].copy_(staging.host[:used], non_blocking=True)
            staging.copied = torch.cuda.Event()
            staging.copied.record(self.stream)
        main = torch.cuda.current_stream(self.device)
        main.wait_event(staging.copied)
        scatter_cast(staging.device_copy, segments, self.destinations)
        staging.consumed = torch.cuda.Event()
        staging.consumed.record(main)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.read_ahead.close()


def execute(files: FileTable, items: list[ReadItem], destinations: list[torch.Tensor],
            staging_bytes: int = DEFAULT_STAGING_BYTES, progress: Progress | None = None,
            threads: int | None = None) -> int:
    """Read every item into its flat destination; returns the number of bytes read.

    Files are read through ``files`` (opened when their headers were read), and must not have
    changed by the end. Items are grouped by the device of their destination, each group with its
    own staging. ``threads``: reader threads, the calling one included (default: ``reader_count()``).
    """
    by_device: dict[torch.device, list[ReadItem]] = {}
    for item in items:
        by_device.setdefault(destinations[item.target].device, []).append(item)
    total = 0
    for device, group in by_device.items():
        staged_total = sum(i.staged_nbytes + ALIGN for i in group)  # an upper bound, alignment included
        reader = _Reader(files, destinations, staging_bytes, staged_total, progress, threads, device)
        try:
            for item in sorted(group, key=lambda i: (i.file, i.offset)):
                reader.add(item)
            reader.drain()
        finally:
            reader.close()
        total += reader.bytes_read
    return total


class RangeReader:
    """Reads byte ranges of ``files`` into given buffers, keeping its reader threads from one
    ``read`` to the next (a node-local reader serves many batches). After a failed ``read`` only
    ``close`` is left to call."""

    def __init__(self, files: FileTable):
        self._reader = _Reader(files, [], 0, 0)

    def read(self, ranges) -> int:
        """Read each ``(file, offset, writable memoryview)`` completely; returns bytes read."""
        before = self._reader.bytes_read
        for file, offset, view in ranges:
            if len(view):
                self._reader.queue(file, offset, view)
        self._reader.drain()
        return self._reader.bytes_read - before

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_tensor(files: FileTable, entry) -> torch.Tensor:
    """The whole tensor ``entry`` (an ``index.TensorEntry``), for the conversion slow path."""
    out = torch.empty(entry.nbytes, dtype=torch.uint8)
    view, size = byte_view(out), entry.itemsize
    with RangeReader(files) as reader:
        reader.read([(file, offset, view[skip * size:(skip + count) * size])
                     for file, offset, skip, count in entry.spans(0, entry.numel)])
    return out.view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape)
