"""The torch implementation of ``scatter_cast``: one ``copy_`` (or ``zero_``) per segment, any device."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Segment(NamedTuple):
    """``numel`` elements of ``src_dtype`` at byte ``staging_offset`` of the staging buffer go to
    elements ``[dst_offset, dst_offset + numel)`` of destination ``dst``; with ``src_dtype=None``
    those elements are zeroed instead (partition padding)."""

    staging_offset: int
    src_dtype: torch.dtype | None
    numel: int
    dst: int
    dst_offset: int


def scatter_cast_torch(staging: torch.Tensor, segments, destinations) -> None:
    for seg in segments:
        if seg.src_dtype is None:
            destinations[seg.dst][seg.dst_offset:seg.dst_offset + seg.numel].zero_()
            continue
        nbytes = seg.numel * seg.src_dtype.itemsize
        src = staging[seg.staging_offset:seg.staging_offset + nbytes].view(seg.src_dtype)
        destinations[seg.dst][seg.dst_offset:seg.dst_offset + seg.numel].copy_(src)
