"""The torch implementation of ``scatter_cast``: one ``copy_`` per segment, any device."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Segment(NamedTuple):
    """``numel`` elements of ``src_dtype`` at byte ``staging_offset`` of the staging buffer go to
    elements ``[dst_offset, dst_offset + numel)`` of destination ``dst``."""

    staging_offset: int
    src_dtype: torch.dtype
    numel: int
    dst: int
    dst_offset: int


def scatter_cast_torch(staging: torch.Tensor, segments, destinations) -> None:
    for seg in segments:
        nbytes = seg.numel * seg.src_dtype.itemsize
        src = staging[seg.staging_offset:seg.staging_offset + nbytes].view(seg.src_dtype)
        destinations[seg.dst][seg.dst_offset:seg.dst_offset + seg.numel].copy_(src)
