"""The Triton implementation of ``scatter_cast``: one launch per staging batch (per device).

Program ``i`` copies row ``i`` of a block table: int64 rows of ``src_element, dst_element, count,
code`` and six columns for FP8 rows, one row per ``block`` elements of a segment, ``src_element =
-1`` for zeros. The code says what the row does: the destination's element width (1, 2, 4 or 8
bytes) and, for a cast, the source and destination float types (float32, float16, bfloat16). A row
without a cast copies bits (same dtype, any dtype of that width) or, for a zero segment, stores
zeros. An FP8 row (``Dequant``) decodes its e4m3fn or e5m2 bytes to float32 on integer bits (exact),
multiplies each by its block's scale (float32, bf16 or fp16, staged after the values; the row's
geometry columns say which scale an element takes), and converts the float32 product as a cast
from float32: ``(fp8.to(float32) * scale).to(dtype)``, as the torch path does.

Triton pointers are typed, and a row's types are known only at run time: every program issues the
loads and stores of all four widths, each masked off unless it is the row's, and computes every
conversion, keeping the row's with ``tl.where``. Masked-off accesses touch no memory, and the
arithmetic is cheap next to the memory traffic. So any mix of dtypes and destinations is ONE launch.
All the destinations of one width are addressed through ONE typed base pointer, the destination of
that width with the lowest address: a row's ``dst_element`` is ``(dst.data_ptr() -
base.data_ptr()) // itemsize + dst_offset``. That is plain pointer arithmetic on the GPU, and it
holds under ``TRITON_INTERPRET=1`` too as long as the tensors are CPU tensors, whose storages the
interpreter uses in place (the interpreter copies each *argument* of a CUDA tensor to the host, so
it would address other destinations wildly: in interpreter mode only CPU destinations are taken).
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
COLUMNS = 10  # of the block table

_FLOAT_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}  # 0: no cast
_FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _scatter_cast_kernel(staging_ptr, dst8_ptr, dst16_ptr, dst32_ptr, dst64_ptr, table_ptr,
                         BLOCK: tl.constexpr, COLUMNS: tl.constexpr):
    """Program i: row i of ``table`` (src_element or -1, dst_element, count, code, then for an FP8
    row scale_base, first_element, rows, columns, block_rows, block_columns), where code =
    scale float code * 1024 + fp8 code * 256 (1 e4m3fn, 2 e5m2; 0 no scaling) + destination width
    in bytes * 16 + source float code * 4 + destination float code (float codes: 0 none,
    1 float32, 2 float16, 3 bfloat16; an FP8 row's source is float32, its dequantised value).
    ``dstN_ptr`` is the base for destinations of N bits. Everything is inline: helper jit
    functions would be bound to the mode (compiled or interpreted) of their decoration."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * COLUMNS
    src_start = tl.load(row)
    dst_start = tl.load(row + 1)
    count = tl.load(row + 2)
    code = tl.load(row + 3)
    width = (code >> 4) & 15
    src_float = (code >> 2) & 3
    dst_float = code & 3
    fp8 = (code >> 8) & 3
    scale_float = (code >> 10) & 3
    cast = src_float != 0
    src_width = tl.where(fp8 != 0, 1, tl.where(cast, tl.where(src_float == 1, 4, 2), width))
    # Masks are "idx < a per-row limit" (0 where the row does not use that width): the interpreter
    # turns ``&`` of a scalar and a block of booleans into integers, which tl.load refuses.
    idx = tl.arange(0, BLOCK)
    reads = tl.where(src_start >= 0, count, 0)
    x8 = tl.load(staging_ptr + src_start + idx, mask=idx < tl.where(src_width == 1, reads, 0), other=0)
    x16 = tl.load(staging_ptr.to(tl.pointer_type(tl.int16)) + src_start + idx,
                  mask=idx < tl.where(src_width == 2, reads, 0), other=0)
    x32 = tl.load(staging_ptr.to(tl.pointer_type(tl.int32)) + src_start + idx,
                  mask=idx < tl.where(src_width == 4, reads, 0), other=0)
    x64 = tl.load(staging_ptr.to(tl.pointer_type(tl.int64)) + src_start + idx,
                  mask=idx < tl.where(src_width == 8, reads, 0), other=0)
    # a cast goes through float32, exactly
    from_f16 = x16.to(tl.float16, bitcast=True).to(tl.float32).to(tl.uint32, bitcast=True)
    from_bf16 = x16.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    u = tl.where(src_float == 1, x32.to(tl.uint32, bitcast=True),
                 tl.where(src_float == 2, from_f16, from_bf16))
    # FP8 -> float32, exactly: e5m2 is float16's upper byte; e4m3fn (bias 7, no inf, NaN at
    # exponent and mantissa all ones) is its integer mantissa times a power of two
    b = x8.to(tl.uint32)
    sign = (b >> 7) << 31
    from_e5m2 = (b << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    exponent = ((b >> 3) & 15).to(tl.int32)
    mantissa = (b & 7).to(tl.int32)
    power = ((tl.where(exponent == 0, -9, exponent - 10) + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa, mantissa + 8).to(tl.float32) * power
    from_e4m3 = (tl.where((b & 0x7F) == 0x7F, 0x7FC00000, magnitude.to(tl.uint32, bitcast=True)) | sign
                 ).to(tl.float32, bitcast=True)
    # each element's scale: element -> (matrix, row, column) -> its block's scale
    scale_base = tl.load(row + 4)
    element = tl.load(row + 5) + idx
    rows = tl.load(row + 6)
    columns = tl.load(row + 7)
    block_rows = tl.load(row + 8)
    block_columns = tl.load(row + 9)
    matrix_row = element // columns
    scale_row = (matrix_row // rows) * ((rows + block_rows - 1) // block_rows) + (matrix_row % rows) // block_rows
    scale_at = scale_base + scale_row * ((columns + block_columns - 1) // block_columns) \
        + (element % columns) // block_columns
    s32 = tl.load(staging_ptr.to(tl.pointer_type(tl.int32)) + scale_at,
                  mask=idx < tl.where(scale_float == 1, count, 0), other=0)
    s16 = tl.load(staging_ptr.to(tl.pointer_type(tl.int16)) + scale_at,
                  mask=idx < tl.where(scale_float >= 2, count, 0), other=0)
    scale = tl.where(scale_float == 1, s32.to(tl.uint32, bitcast=True),
                     tl.where(scale_float == 2,
                              s16.to(tl.float16, bitcast=True).to(tl.float32).to(tl.uint32, bitcast=True),
                              s16.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)).to(tl.float32, bitcast=True)
    dequantised = tl.where(fp8 == 1, from_e4m3, from_e5m2) * scale
    u = tl.where(fp8 != 0, dequantised.to(tl.uint32, bitcast=True), u)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    # float32 to the 16-bit types, rounding to nearest even
    to_f16 = tl.where(nan, (((u >> 16) & 0x8000) | 0x7E00).to(tl.uint16),
                      u.to(tl.float32, bitcast=True).to(tl.float16).to(tl.uint16, bitcast=True))
    to_bf16 = tl.where(nan, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
    cast16 = tl.where(dst_float == 2, to_f16, to_bf16).to(tl.int16, bitcast=True)
    tl.store(dst8_ptr + dst_start + idx, x8, mask=idx < tl.where(width == 1, count, 0))
    tl.store(dst16_ptr + dst_start + idx, tl.where(cast, cast16, x16),
             mask=idx < tl.where(width == 2, count, 0))
    tl.store(dst32_ptr + dst_start + idx, tl.where(cast, u.to(tl.int32, bitcast=True), x32),
             mask=idx < tl.where(width == 4, count, 0))
    tl.store(dst64_ptr + dst_start + idx, x64, mask=idx < tl.where(width == 8, count, 0))


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


def _row_code(seg, dst: torch.Tensor) -> int | None:
    """The kernel's code for ``seg`` (see ``_scatter_cast_kernel``), or None if it cannot take it."""
    width = dst.element_size()
    if seg.dequant is not None:
        if seg.src_dtype in _FP8_CODES and seg.dequant.dtype in _FLOAT_CODES and dst.dtype in _FLOAT_CODES:
            return (_FLOAT_CODES[seg.dequant.dtype] * 1024 + _FP8_CODES[seg.src_dtype] * 256 + width * 16
                    + _FLOAT_CODES[torch.float32] * 4 + _FLOAT_CODES[dst.dtype])
        return None
    if seg.src_dtype is None or seg.src_dtype == dst.dtype:
        return width * 16 if width in _TORCH_BITS else None
    if seg.src_dtype in _FLOAT_CODES and dst.dtype in _FLOAT_CODES:
        return width * 16 + _FLOAT_CODES[seg.src_dtype] * 4 + _FLOAT_CODES[dst.dtype]
    return None


def scatter_cast_triton(staging: torch.Tensor, segments, destinations, block: int = BLOCK) -> list:
    """Launch the kernel once per device for every segment it can take; return the others (for
    the torch path). ``block`` (a power of two) is the elements per program; tests make it small.
    """
    interpret = interpreting()
    staging_ok = staging.dim() == 1 and staging.dtype == torch.uint8 and staging.is_contiguous()
    rest, by_device = [], {}
    for seg in segments:
        if seg.numel == 0:
            continue
        dst = destinations[seg.dst]
        code = None
        if (_usable(dst, interpret) and dst.dim() == 1 and dst.is_contiguous()
                and dst.data_ptr() % dst.element_size() == 0):
            code = _row_code(seg, dst)
        if code is not None and seg.src_dtype is not None:
            itemsize = seg.src_dtype.itemsize
            scale_size = seg.dequant.dtype.itemsize if seg.dequant else 1
            if (not staging_ok or staging.data_ptr() % max(itemsize, scale_size)
                    or seg.staging_offset % itemsize
                    or (seg.dequant and seg.dequant.staging_offset % scale_size)
                    or (interpret and staging.device.type != "cpu")):
                code = None
        if code is None:
            rest.append(seg)
            continue
        _check_bounds(staging, seg, dst)
        by_device.setdefault(dst.device, []).append((seg, code))
    for device, taken in by_device.items():
        _launch(staging, destinations, device, taken, block)
    return rest


def _check_bounds(staging, seg, dst) -> None:
    """The kernel writes raw memory: refuse what the torch path would refuse (or clamp)."""
    if seg.numel < 0 or seg.dst_offset < 0 or seg.dst_offset + seg.numel > dst.numel():
        raise ValueError(f"segment {seg} out of range of destination {seg.dst} "
                         f"({dst.numel()} elements)")
    if seg.src_dtype is not None:
        starts = [seg.staging_offset] + ([seg.dequant.staging_offset] if seg.dequant else [])
        if min(starts) < 0 or seg.staged_end > staging.numel():
            raise ValueError(f"segment {seg} out of range of the staging buffer "
                             f"({staging.numel()} bytes)")


def _launch(staging, destinations, device, taken, block) -> None:
    """One launch for all ``taken`` (segment, code) pairs of destinations on ``device``."""
    bases = {}  # width -> the destination of that width with the lowest address
    for seg, _ in taken:
        dst = destinations[seg.dst]
        width = dst.element_size()
        if width not in bases or dst.data_ptr() < bases[width].data_ptr():
            bases[width] = dst
    src_elem, dst_elem, numel, codes, scaling = [], [], [], [], []
    used = 0
    for seg, code in taken:
        dst = destinations[seg.dst]
        width = dst.element_size()
        if seg.src_dtype is None:
            src_elem.append(-1)
        else:
            src_elem.append(seg.staging_offset // seg.src_dtype.itemsize)
            used = max(used, seg.staged_end)
        dst_elem.append((dst.data_ptr() - bases[width].data_ptr()) // width + seg.dst_offset)
        numel.append(seg.numel)
        codes.append(code)
        scaling.append(_scaling(seg.dequant))
    table = _block_table(src_elem, dst_elem, numel, codes, scaling, block)
    if device.type == "cuda":  # from pinned memory, so the copy does not block the host
        table = table.pin_memory().to(device, non_blocking=True)
    if staging.device == device:
        staging_dev = staging
    else:
        # one copy of the bytes in use; blocking, so the caller may refill ``staging`` at once
        staging_dev = staging[:used].to(device)
    if staging_dev.numel() == 0:
        staging_dev = torch.empty(8, dtype=torch.uint8, device=device)  # never read
    # typed bases; a width no destination has gets a stand-in its masked stores never touch
    typed = [bases[w].view(bits) if w in bases else torch.empty(1, dtype=bits, device=device)
             for w, bits in _TORCH_BITS.items()]
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        _kernel()[(table.shape[0],)](staging_dev, *typed, table, BLOCK=block, COLUMNS=COLUMNS)


def _scaling(d) -> list[int]:
    """A row's FP8 columns (scale_base, first_element, rows, columns, block_rows, block_columns):
    ``scale_base`` is the staging element (of the scale dtype) of scale row 0, so that scale row
    ``r`` column ``c`` is at ``scale_base + r * grid_columns + c``. Ones where nothing is scaled."""
    if d is None:
        return [0, 0, 1, 1, 1, 1]
    base = d.staging_offset // d.dtype.itemsize - d.first_row * d.grid[1]
    return [base, d.first_element, d.rows, d.columns, *d.block]


def _block_table(src_elem, dst_elem, numel, codes, scaling, block) -> torch.Tensor:
    """Rows (src element or -1, dst element, count, code, FP8 columns) of at most ``block``
    elements each."""
    src = torch.tensor(src_elem, dtype=torch.int64)
    dst = torch.tensor(dst_elem, dtype=torch.int64)
    n = torch.tensor(numel, dtype=torch.int64)
    code = torch.tensor(codes, dtype=torch.int64)
    blocks = (n + block - 1) // block
    seg = torch.repeat_interleave(torch.arange(len(numel)), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    start = (torch.arange(seg.numel()) - first[seg]) * block
    src_rows = torch.where(src[seg] >= 0, src[seg] + start, -1)
    scale = torch.tensor(scaling, dtype=torch.int64).reshape(-1, 6)[seg]
    scale[:, 1] += start  # each row's first element of the weight
    return torch.cat([torch.stack([src_rows, dst[seg] + start, (n[seg] - start).clamp(max=block), code[seg]],
                                  dim=1), scale], dim=1).contiguous()
