"""ZeRO's partition geometry: which flat elements of a tensor each rank owns, as DeepSpeed cuts a
tensor both in a live model (``ds_tensor``) and in the partitions it saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Partition:
    """The flat element range ``[start, start + size)`` one rank owns of an ``numel``-element tensor.

    Mirrors DeepSpeed's ``_partition_param``: ``size = ceil(numel / world)``; the last ranks may
    own fewer valid elements than ``size``, or none, and the rest of their slice is padding.
    ``size``, ``start`` and ``valid`` are worked out once: a load asks for them several times for
    each of hundreds of parameters.
    """

    numel: int
    world: int
    rank: int
    size: int = field(init=False, repr=False, compare=False)
    start: int = field(init=False, repr=False, compare=False)
    valid: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        size = -(-self.numel // self.world)
        start = self.rank * size
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "valid", max(0, min(size, self.numel - start)))

    @property
    def owned(self) -> tuple[int, int]:
        """``[low, high)``: the elements of the full tensor this rank's partition holds."""
        return self.start, self.start + self.valid
