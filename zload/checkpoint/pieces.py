"""Pieces: which byte runs of checkpoint tensors make up one model tensor (``Source``), the record
name matching produces and the planner turns into reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .index import TensorEntry
from .quantized import Scale


@dataclass(frozen=True)
class Piece:
    """``numel`` elements of ``entry`` from element ``src_offset`` go to element ``dst_offset``,
    dequantised by ``scale`` for an FP8 weight."""

    entry: TensorEntry
    src_offset: int
    dst_offset: int
    numel: int
    scale: Scale | None = None


@dataclass(frozen=True)
class Source:
    """Where one model tensor's values come from."""

    entries: tuple[TensorEntry, ...]  # the checkpoint tensors it is built from
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...] = ()
    # Slow path: given a reader ``entry -> torch.Tensor``, build the whole tensor.
    convert: Callable | None = field(default=None, compare=False)
    scaled: bool = False  # built from FP8 weights that are dequantised by their scales

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


def whole(entry: TensorEntry) -> Source:
    return Source((entry,), entry.shape, (Piece(entry, 0, 0, entry.numel),))
