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

    def scale_(self, values: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
        """Multiply the segment's float32 ``values`` in place by their scales (``staged``). Whole
        weight rows take their block scales broadcast over each block; the partial rows at either
        end take scales widened element by element (widening all of them took twice as long)."""
        staged = staged.to(torch.float32)
        if self.count == 1:
            return values.mul_(staged)  # one scale for every element
        columns, block_columns = self.columns, self.block[1]
        head = min(values.numel(), -self.first_element % columns)
        rows = (values.numel() - head) // columns
        middle_end = head + rows * columns
        values[:head].mul_(self._widened(staged, self.first_element, head))
        if rows:
            scales = self._row_scales(staged, (self.first_element + head) // columns, rows)
            middle = values[head:middle_end].view(rows, columns)
            whole = columns // block_columns
            middle[:, :whole * block_columns].unflatten(1, (whole, block_columns)).mul_(scales[:, :whole, None])
            middle[:, whole * block_columns:].mul_(scales[:, whole:])
        values[middle_end:].mul_(self._widened(staged, self.first_element + middle_end,
                                               values.numel() - middle_end))
        return values

    def _row_scales(self, staged: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """The scale row of each weight row ``first`` .. ``first + count - 1``: (count, grid[1])."""
        rows = torch.arange(first, first + count, device=staged.device)
        scale_rows = (rows // self.rows) * self.grid[0] + (rows % self.rows) // self.block[0] - self.first_row
        return staged.view(-1, self.grid[1])[scale_rows]

    def _widened(self, staged: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """The scale of each weight element ``first`` .. ``first + count - 1``, one by one."""
        if count == 0:
            return staged[:0]
        low, high = first // self.columns, (first + count - 1) // self.columns
        per_row = self._row_scales(staged, low, high - low + 1)
        widened = per_row.repeat_interleave(self.block[1], dim=1)[:, :self.columns].reshape(-1)
        start = first - low * self.columns
        return widened[start:start + count]


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
        dst.copy_(d.scale_(src.to(torch.float32), scales))
