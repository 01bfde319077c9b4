"""The torch implementation of ``scatter_cast``: one ``copy_`` (or ``zero_``) per segment, any device."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Dequant(NamedTuple):
    """The scales of an FP8 segment, staged beside it: ``count`` scales of ``dtype`` at byte
    ``staging_offset``, flat scale rows ``first_row`` onward (each ``grid[1]`` scales) of a weight
    whose matrices are ``rows`` x ``columns`` in blocks of ``block``. The segment's first element
    is element ``first_element`` of the whole weight. Value = ``fp8.to(float32) * scale``."""

    staging_offset: int
    dtype: torch.dtype
    count: int
    first_element: int
    first_row: int
    rows: int
    columns: int
    block: tuple[int, int]
    grid: tuple[int, int]

    def scales_for(self, staged: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 scale of each of the segment's ``numel`` elements, from the ``staged``
        scales: one scale row per weight row touched, widened to the columns (a row at a time,
        not an index per element, which is several times slower)."""
        staged = staged.to(torch.float32)
        if self.count == 1:
            return staged  # one scale for every element (broadcast)
        first, last = self.first_element // self.columns, (self.first_element + numel - 1) // self.columns
        rows = torch.arange(first, last + 1, device=staged.device)
        scale_rows = (rows // self.rows) * self.grid[0] + (rows % self.rows) // self.block[0] - self.first_row
        per_row = staged.view(-1, self.grid[1])[scale_rows]
        widened = per_row.repeat_interleave(self.block[1], dim=1)[:, :self.columns].reshape(-1)
        start = self.first_element - first * self.columns
        return widened[start:start + numel]


class Segment(NamedTuple):
    """``numel`` elements of ``src_dtype`` at byte ``staging_offset`` of the staging buffer go to
    elements ``[dst_offset, dst_offset + numel)`` of destination ``dst``; with ``src_dtype=None``
    those elements are zeroed instead (partition padding). ``dequant``: the scales of FP8 values."""

    staging_offset: int
    src_dtype: torch.dtype | None
    numel: int
    dst: int
    dst_offset: int
    dequant: Dequant | None = None

    @property
    def staged_end(self) -> int:
        """The staging byte after the last one it reads (its scales included)."""
        if self.src_dtype is None:
            return 0
        end = self.staging_offset + self.numel * self.src_dtype.itemsize
        if self.dequant is not None:
            end = max(end, self.dequant.staging_offset + self.dequant.count * self.dequant.dtype.itemsize)
        return end


def scatter_cast_torch(staging: torch.Tensor, segments, destinations) -> None:
    for seg in segments:
        dst = destinations[seg.dst][seg.dst_offset:seg.dst_offset + seg.numel]
        if seg.src_dtype is None:
            dst.zero_()
            continue
        nbytes = seg.numel * seg.src_dtype.itemsize
        src = staging[seg.staging_offset:seg.staging_offset + nbytes].view(seg.src_dtype)
        if seg.dequant is None:
            dst.copy_(src)
            continue
        d = seg.dequant
        scales = staging[d.staging_offset:d.staging_offset + d.count * d.dtype.itemsize].view(d.dtype)
        dst.copy_(src.to(torch.float32).mul_(d.scales_for(scales, seg.numel)))
