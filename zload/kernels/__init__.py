"""Copy kernels: scatter many staged byte segments into destination tensors, casting dtype.

One entry point, ``scatter_cast``; the backend is chosen from the destinations' device. The
torch implementation is the reference every faster backend must match bit for bit.

Backends (``ZLOAD_KERNEL`` = ``auto``, the default, ``torch`` or ``triton``):

- ``torch`` (``torch_scatter.py``): one ``copy_`` (or ``zero_``) per segment, any device.
- ``triton`` (``triton_scatter.py``): one launch per call and device, whatever the mix of dtype
  pairs, for CUDA destinations (CPU destinations under ``TRITON_INTERPRET=1``). Segments it
  cannot take (float64 casts, non-contiguous or other-device destinations) go to torch.

``auto`` uses Triton when a segment's destination is a CUDA tensor and ``import triton`` works
(tried once, on first need, so zload imports and runs without it), else torch; if the Triton
path fails to compile or launch, it says so once (a ``zload`` log warning) and stays on torch.
``triton`` raises instead of falling back.
"""

from __future__ import annotations

import logging
import os

from ..distributed import Choice
from .torch_scatter import Dequant, Segment, scatter_cast_torch

log = logging.getLogger("zload")


class Backend(Choice):
    """``ZLOAD_KERNEL``: which kernels copy (see the module docstring)."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


_triton_broken: str | None = None  # why auto stopped using Triton, once it has


def zero_segment(dst: int, dst_offset: int, numel: int) -> Segment:
    """A segment that zeroes elements ``[dst_offset, dst_offset + numel)`` of ``dst`` (partition
    padding); it reads no staging bytes."""
    return Segment(0, None, numel, dst, dst_offset)


def backend() -> Backend:
    """``ZLOAD_KERNEL`` as a ``Backend``; another value is an ``ArgumentValueError`` (a ``ValueError``)
    naming those allowed."""
    return Backend.of(os.environ.get("ZLOAD_KERNEL", "").strip().lower() or "auto", "ZLOAD_KERNEL")


def scatter_cast(staging, segments, destinations) -> None:
    """Copy each ``Segment`` of the uint8 ``staging`` tensor into ``destinations[seg.dst]``;
    a segment with ``src_dtype=None`` (``zero_segment``) zeroes its range instead.

    ``destinations`` are flat (1-D) tensors; values are converted as ``tensor.to(dtype)`` does,
    NaN bits excepted where the dtype changes: torch itself gives a converted NaN different bits
    on different vector units and devices (float32 NaN -> bfloat16 is ``0xFFFF`` on AVX-512,
    ``0x7FC0`` in c10's scalar code; float16 NaN payloads differ between its vectorised and
    scalar loops), so only "is NaN" is preserved then. Copies without a dtype change keep every bit.
    A segment with a ``Dequant`` is FP8 scaled on the way: ``(fp8.to(float32) * scale).to(dtype)``.
    """
    choice = backend()
    choice_forced = choice == Backend.TRITON
    if choice == Backend.AUTO:
        choice = Backend.TRITON if _auto_triton(segments, destinations) else Backend.TORCH
    if choice == Backend.TRITON:
        try:
            from .triton_scatter import scatter_cast_triton

            rest = scatter_cast_triton(staging, segments, destinations)
        except ValueError:
            raise  # a segment out of range of its tensors: the caller's bug
        except Exception as e:  # compile or launch failure (no driver, an unsupported GPU)
            if choice_forced:
                raise
            _give_up_triton(e)
            rest = segments  # every segment again: the copies are idempotent
        segments = rest
    scatter_cast_torch(staging, segments, destinations)


def _auto_triton(segments, destinations) -> bool:
    if _triton_broken is not None:
        return False
    if not any(destinations[i].is_cuda for i in {seg.dst for seg in segments}):
        return False
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 (a broken install is as good as none)
        _give_up_triton(e)
        return False
    return True


def retry_triton() -> None:
    """Forget that Triton failed, so that ``auto`` tries it again on next need, as a new process
    would (a process that runs one test after another needs each to start afresh)."""
    global _triton_broken
    _triton_broken = None


def _give_up_triton(error: BaseException) -> None:
    global _triton_broken
    if _triton_broken is None:
        _triton_broken = f"{type(error).__name__}: {error}"
        level = logging.INFO if isinstance(error, ModuleNotFoundError) else logging.WARNING
        log.log(level, "the Triton scatter kernel is unavailable (%s); using torch copies",
                _triton_broken)


__all__ = ["Dequant", "Segment", "scatter_cast", "zero_segment"]
