"""The Triton implementation of ``scatter_cast``: a handful of launches per staging batch.

Triton pointers are typed, so the segments of a batch are grouped by what the kernel does to
them, and each group is one launch, whatever its number of segments and destinations:

- a cast group per (source dtype, destination dtype) pair of float32/float16/bfloat16 that
  differ (at most 6);
- a bit-copy group per element width (1, 2, 4 or 8 bytes) for segments whose source dtype is
  the destination's (any dtype of that width, float or int), and for zero segments
  (``src_dtype=None``: zero ``numel`` elements), which load nothing and store zeros (at most 4).

So a batch takes at most 10 launches, per device. Each launch reads a block table (int64 rows of
``src_element, dst_element, count``; one row per ``block`` elements of a segment, ``src_element
= -1`` for zeros) and program ``i`` copies row ``i``: loads ``count`` elements from the staging
buffer (the uint8 pointer cast to the group's element type), converts them and stores them. All
the destinations of a group are addressed through ONE typed base pointer, the group's destination
with the lowest address: a row's ``dst_element`` is ``(dst.data_ptr() - base.data_ptr()) //
itemsize + dst_offset``. That is plain pointer arithmetic on the GPU, and it holds under
``TRITON_INTERPRET=1`` too as long as the tensors are CPU tensors, whose storages the interpreter
uses in place (the interpreter copies each *argument* of a CUDA tensor to the host, so it would
address other destinations wildly: in interpreter mode only CPU destinations are taken).
``tl.int64`` addresses cast to pointers are not used: the interpreter has no int-to-pointer cast.

Conversions are done on integer bits so the interpreter and the GPU give the same bits, and the
bits ``tensor.to(dtype)`` gives, for every non-NaN value (rounding to nearest even, subnormals,
overflow to inf, -0.0): float32 -> bfloat16 is c10's integer rounding; bfloat16 -> float32 is a
shift; float16 <-> float32 use the hardware (numpy in the interpreter) conversion, which rounds to
nearest even; float16 <-> bfloat16 go through float32 (exact) as torch does. A NaN converted to
another dtype becomes c10's scalar NaN (bfloat16 ``0x7FC0``, float16 ``0x7E00`` with the sign);
widened to float32 it keeps what the hardware keeps. torch's own NaN bits depend on the CPU's
vector unit and the device, so only "is NaN" is comparable there. Bit copies keep every bit.

What the kernel cannot take (a float64 cast, a non-contiguous destination, a destination on
another kind of device, a misaligned address) is returned to the caller for the torch path.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TL_BITS = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_TL_FLOAT = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _scatter_cast_kernel(staging_ptr, dst_ptr, table_ptr, SRC: tl.constexpr, DST: tl.constexpr,
                         SRC_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: row i of ``table`` (src_element or -1, dst_element, count). ``SRC == DST``
    copies ``SRC_BITS`` elements; otherwise SRC, DST are float dtypes and ``dst_ptr`` points to
    integers of DST's width. Everything is inline: helper jit functions would be bound to the mode
    (compiled or interpreted) of their decoration."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * 3
    src_start = tl.load(row)
    dst_start = tl.load(row + 1)
    count = tl.load(row + 2)
    idx = tl.arange(0, BLOCK)
    src = staging_ptr.to(tl.pointer_type(SRC_BITS))
    x = tl.load(src + src_start + idx, mask=idx < tl.where(src_start >= 0, count, 0), other=0)
    if SRC == DST:
        y = x
    else:
        # to float32, exactly
        if SRC == tl.float32:
            v = x.to(tl.float32, bitcast=True)
        elif SRC == tl.float16:
            v = x.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            v = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        u = v.to(tl.uint32, bitcast=True)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        # float32 to DST, rounding to nearest even
        if DST == tl.float32:
            y = u.to(tl.int32, bitcast=True)
        elif DST == tl.float16:
            h = v.to(tl.float16).to(tl.uint16, bitcast=True)
            canonical = (((u >> 16) & 0x8000) | 0x7E00).to(tl.uint16)
            y = tl.where(nan, canonical, h).to(tl.int16, bitcast=True)
        else:
            rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            y = tl.where(nan, 0x7FC0, rounded).to(tl.uint16).to(tl.int16, bitcast=True)
    tl.store(dst_ptr + dst_start + idx, y, mask=idx < count)


_KERNELS: dict[bool, object] = {}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read now."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernel():
    """The kernel for the current mode. ``triton.jit`` picks compiled or interpreted when it
    decorates, so decorating on first use per mode lets ``TRITON_INTERPRET`` be set after
    ``import triton`` (tests) without a stale choice."""
    mode = interpreting()
    if mode not in _KERNELS:
        _KERNELS[mode] = triton.jit(_scatter_cast_kernel)
    return _KERNELS[mode]


def _usable(tensor: torch.Tensor, interpret: bool) -> bool:
    if interpret:
        return tensor.device.type == "cpu"
    return tensor.is_cuda


def _group_key(seg, dst: torch.Tensor):
    """(kind, width, src dtype, dst dtype) of the launch that takes ``seg``, or None."""
    width = dst.element_size()
    if seg.src_dtype is None or seg.src_dtype == dst.dtype:
        return ("bits", width) if width in _TORCH_BITS else None
    if seg.src_dtype in _FLOATS and dst.dtype in _FLOATS:
        return ("cast", seg.src_dtype, dst.dtype)
    return None


def scatter_cast_triton(staging: torch.Tensor, segments, destinations, block: int = BLOCK) -> list:
    """Launch the kernel for every segment it can take; return the others (for the torch path).

    ``block`` (a power of two) is the elements per program; tests make it small.
    """
    interpret = interpreting()
    staging_ok = staging.dim() == 1 and staging.dtype == torch.uint8 and staging.is_contiguous()
    rest, groups = [], {}
    for seg in segments:
        if seg.numel == 0:
            continue
        dst = destinations[seg.dst]
        key = None
        if (_usable(dst, interpret) and dst.dim() == 1 and dst.is_contiguous()
                and dst.data_ptr() % dst.element_size() == 0):
            key = _group_key(seg, dst)
        if key is not None and seg.src_dtype is not None:
            itemsize = seg.src_dtype.itemsize
            if (not staging_ok or staging.data_ptr() % itemsize or seg.staging_offset % itemsize
                    or (interpret and staging.device.type != "cpu")):
                key = None
        if key is None:
            rest.append(seg)
            continue
        _check_bounds(staging, seg, dst)
        groups.setdefault((dst.device, key), []).append(seg)
    by_device: dict[torch.device, list] = {}
    for (device, key), segs in groups.items():
        by_device.setdefault(device, []).append((key, segs))
    for device, launches in by_device.items():
        _launch_all(staging, destinations, device, launches, block)
    return rest


def _check_bounds(staging, seg, dst) -> None:
    """The kernel writes raw memory: refuse what the torch path would refuse (or clamp)."""
    if seg.numel < 0 or seg.dst_offset < 0 or seg.dst_offset + seg.numel > dst.numel():
        raise ValueError(f"segment {seg} out of range of destination {seg.dst} "
                         f"({dst.numel()} elements)")
    if seg.src_dtype is not None:
        end = seg.staging_offset + seg.numel * seg.src_dtype.itemsize
        if seg.staging_offset < 0 or end > staging.numel():
            raise ValueError(f"segment {seg} out of range of the staging buffer "
                             f"({staging.numel()} bytes)")


def _launch_all(staging, destinations, device, launches, block) -> None:
    tables, plans = [], []
    used = 0
    for key, segs in launches:
        width = destinations[segs[0].dst].element_size()
        # one typed base per group: the destination with the lowest address
        base_index = min({s.dst for s in segs}, key=lambda i: destinations[i].data_ptr())
        base_ptr = destinations[base_index].data_ptr()
        src_elem, dst_elem, numel = [], [], []
        for s in segs:
            if s.src_dtype is None:
                src_elem.append(-1)
            else:
                src_elem.append(s.staging_offset // s.src_dtype.itemsize)
                used = max(used, s.staging_offset + s.numel * s.src_dtype.itemsize)
            dst_elem.append((destinations[s.dst].data_ptr() - base_ptr) // width + s.dst_offset)
            numel.append(s.numel)
        table = _block_table(src_elem, dst_elem, numel, block)
        tables.append(table)
        plans.append((key, base_index, table.shape[0]))
    table = torch.cat(tables).to(device)
    if staging.device == device:
        staging_dev = staging
    else:
        # one copy of the bytes in use; blocking, so the caller may refill ``staging`` at once
        staging_dev = staging[:used].to(device)
    if staging_dev.numel() == 0:
        staging_dev = torch.zeros(8, dtype=torch.uint8, device=device)
    kernel = _kernel()
    row = 0
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        for key, base_index, rows in plans:
            base = destinations[base_index]
            if key[0] == "bits":
                bits = _TL_BITS[key[1]]
                src_ty, dst_ty, src_bits = bits, bits, bits
                base = base.view(_TORCH_BITS[key[1]])
            else:
                _, src_dtype, dst_dtype = key
                src_ty, dst_ty = _TL_FLOAT[src_dtype], _TL_FLOAT[dst_dtype]
                src_bits = _TL_BITS[src_dtype.itemsize]
                base = base.view(_TORCH_BITS[dst_dtype.itemsize])
            kernel[(rows,)](staging_dev, base, table[row:row + rows], SRC=src_ty, DST=dst_ty,
                            SRC_BITS=src_bits, BLOCK=block)
            row += rows


def _block_table(src_elem, dst_elem, numel, block) -> torch.Tensor:
    """Rows (src element or -1, dst element, count) of at most ``block`` elements each."""
    src = torch.tensor(src_elem, dtype=torch.int64)
    dst = torch.tensor(dst_elem, dtype=torch.int64)
    n = torch.tensor(numel, dtype=torch.int64)
    blocks = (n + block - 1) // block
    seg = torch.repeat_interleave(torch.arange(len(numel)), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    start = (torch.arange(seg.numel()) - first[seg]) * block
    src_rows = torch.where(src[seg] >= 0, src[seg] + start, -1)
    return torch.stack([src_rows, dst[seg] + start, (n[seg] - start).clamp(max=block)], dim=1)
