"""Executor: perform a plan's reads and copies. The only stage that touches files and tensors.

Reads are issued in file order; runs of file-contiguous ranges become one ``os.preadv`` that
scatters the bytes to several buffers at once. A range whose destination is a CPU tensor of the
same dtype is read straight into the destination; the others land in a bounded staging buffer and
are copied (and cast) by ``kernels.scatter_cast`` whenever the buffer fills up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .errors import CheckpointError
from .kernels import Segment, scatter_cast
from .plan import ReadItem, split_item
from .progress import Progress

DEFAULT_STAGING_BYTES = 64 << 20
_ALIGN = 64  # staging placement; keeps every dtype view aligned
_IOV_MAX = 1024  # buffers per preadv call (Linux IOV_MAX)


def align(position: int) -> int:
    """The first staging offset at or after ``position`` where any dtype view is aligned."""
    return -(-position // _ALIGN) * _ALIGN


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous CPU tensor."""
    return memoryview(tensor.detach().view(torch.uint8).numpy()).cast("B")


@dataclass
class _Run:
    """File-contiguous bytes read with one preadv into ``buffers``."""

    fd: int
    file: str
    offset: int
    buffers: list = field(default_factory=list)
    nbytes: int = 0


class _Reader:
    def __init__(self, destinations: list[torch.Tensor], staging_bytes: int, staged_total: int,
                 progress: Progress | None = None):
        self.destinations = destinations
        self.progress = progress or Progress()
        self.capacity = max(_ALIGN, min(staging_bytes, staged_total))
        self.staging = None
        self.position = 0
        self.segments: list[Segment] = []
        self.runs: list[_Run] = []
        self.fds: dict[str, int] = {}
        self.bytes_read = 0

    def _fd(self, file: str) -> int:
        if file not in self.fds:
            try:
                self.fds[file] = os.open(file, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{file}: cannot open: {e.strerror}") from e
        return self.fds[file]

    def _queue(self, file: str, offset: int, buffer: memoryview) -> None:
        run = self.runs[-1] if self.runs else None
        if (run is None or run.file != file or run.offset + run.nbytes != offset
                or len(run.buffers) >= _IOV_MAX):
            run = _Run(self._fd(file), file, offset)
            self.runs.append(run)
        run.buffers.append(buffer)
        run.nbytes += len(buffer)

    def add(self, item: ReadItem) -> None:
        if item.numel == 0:
            return  # preadv of nothing would look like end of file
        dst = self.destinations[item.target]
        src_dtype = getattr(torch, item.src_dtype)
        if dst.device.type == "cpu" and dst.dtype == src_dtype:
            view = _byte_view(dst[item.dst_offset:item.dst_offset + item.numel])
            self._queue(item.file, item.offset, view)
            return
        for part in split_item(item, self.capacity - _ALIGN):
            start = align(self.position)
            if start + part.nbytes > self.capacity:
                self.flush()
                start = 0
            if self.staging is None:
                self.staging = torch.empty(self.capacity, dtype=torch.uint8)
                self._staging_view = _byte_view(self.staging)
            self.position = start + part.nbytes
            self._queue(part.file, part.offset, self._staging_view[start:self.position])
            self.segments.append(Segment(start, src_dtype, part.numel, part.target, part.dst_offset))

    def flush(self) -> None:
        for run in self.runs:
            self._read_run(run)
        self.runs = []
        if self.segments:
            scatter_cast(self.staging, self.segments, self.destinations)
        self.segments, self.position = [], 0

    def _read_run(self, run: _Run) -> None:
        buffers, offset = run.buffers, run.offset
        while buffers:
            try:
                got = os.preadv(run.fd, buffers, offset)
            except OSError as e:
                raise CheckpointError(f"{run.file}: read failed at byte {offset}: {e.strerror}") from e
            if got == 0:
                raise CheckpointError(f"{run.file}: unexpected end of file at byte {offset} "
                                      "(was the file changed during the load?)")
            offset += got
            self.bytes_read += got
            self.progress.update(got)
            while buffers and got >= len(buffers[0]):
                got -= len(buffers[0])
                buffers = buffers[1:]
            if buffers and got:
                buffers = [buffers[0][got:]] + buffers[1:]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def execute(items: list[ReadItem], destinations: list[torch.Tensor],
            staging_bytes: int = DEFAULT_STAGING_BYTES, progress: Progress | None = None) -> int:
    """Read every item into its flat destination; returns the number of bytes read."""
    staged_total = sum(i.nbytes + _ALIGN for i in items)  # an upper bound, alignment included
    reader = _Reader(destinations, staging_bytes, staged_total, progress)
    try:
        for item in sorted(items, key=lambda i: (i.file, i.offset)):
            reader.add(item)
        reader.flush()
    finally:
        reader.close()
    return reader.bytes_read


def read_ranges(ranges) -> int:
    """Read each ``(file, offset, writable memoryview)`` completely; returns bytes read."""
    reader = _Reader([], 0, 0)
    try:
        for file, offset, view in ranges:
            if len(view):
                reader._queue(file, offset, view)
        reader.flush()
    finally:
        reader.close()
    return reader.bytes_read


def read_tensor(entry) -> torch.Tensor:
    """The whole tensor ``entry`` (an ``index.TensorEntry``), for the conversion slow path."""
    from .index import DTYPES

    out = torch.empty(entry.nbytes, dtype=torch.uint8)
    read_ranges([(entry.file, entry.start, _byte_view(out))])
    return out.view(getattr(torch, DTYPES[entry.dtype][0])).reshape(entry.shape)
