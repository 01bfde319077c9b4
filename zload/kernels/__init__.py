"""Copy kernels: scatter many staged byte segments into destination tensors, casting dtype.

One entry point, ``scatter_cast``; the backend is chosen from the destinations' device. The
torch implementation is the reference every faster backend must match bit for bit.
"""

from .torch_scatter import Segment, scatter_cast_torch


def scatter_cast(staging, segments, destinations) -> None:
    """Copy each ``Segment`` of the uint8 ``staging`` tensor into ``destinations[seg.dst]``.

    ``destinations`` are flat (1-D) tensors; values are converted as ``tensor.to(dtype)`` does
    (NaN payloads from float16 excepted: torch itself gives them different bits in vectorised
    and scalar loops, so only "is NaN" is preserved for them).
    """
    scatter_cast_torch(staging, segments, destinations)


__all__ = ["Segment", "scatter_cast"]
