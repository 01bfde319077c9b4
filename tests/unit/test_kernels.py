"""scatter_cast backends: the Triton kernel (run on CPU by Triton's interpreter) against the torch
reference, bit for bit, and the dispatch between them.

The kernel is decorated on first use in the mode ``TRITON_INTERPRET`` says then, so setting it
per test (``monkeypatch``) works whether or not something imported triton before; it is not set
for the whole process, where the ranks other tests start would inherit it.
"""

from __future__ import annotations

import logging
import random
import sys

import pytest
import torch

from zload import kernels
from zload.kernels.torch_scatter import scatter_cast_torch
from zload.kernels import Segment, scatter_cast, zero_segment

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy


@pytest.fixture
def interpreted(monkeypatch):
    """Forces the Triton path, interpreted on CPU; the triton_scatter module."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ZLOAD_KERNEL", "triton")
    from zload.kernels import triton_scatter

    assert triton_scatter.interpreting()
    return triton_scatter


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def reference(staging, segments, destinations):
    """The torch path on copies of ``destinations``."""
    out = [d.clone() for d in destinations]
    scatter_cast_torch(staging, segments, out)
    return out


def assert_matches(actual, expected, exact):
    """Same bits where ``exact``; elsewhere (a converted element) same bits unless torch made a
    NaN, which must then be a NaN."""
    same = bits(actual) == bits(expected)
    if actual.dtype in FLOATS + [torch.float64]:
        nan = expected.isnan()
        same |= ~exact & nan & actual.isnan()
    bad = (~same).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {actual.numel()} {actual.dtype} elements differ, "
        f"first at {bad[:5].tolist()}: "
        f"got {[hex(v) for v in bits(actual)[bad[:5]].tolist()]}, "
        f"want {[hex(v) for v in bits(expected)[bad[:5]].tolist()]}")


def random_bits(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``n`` elements of ``dtype`` with random bit patterns (NaNs, infs, subnormals included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def special_f32() -> torch.Tensor:
    patterns = [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FFFFFFF, 0x7FA00000,  # NaNs
        0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,  # subnormal, min/max normal
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF818000,  # bfloat16 ties and near
        0x7F7F8000, 0x7F7F7FFF,  # bfloat16 overflow to inf / not
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000, 0xC77FF000,  # float16 max, overflow
        0x33800000, 0x33000000, 0x33000001, 0x33C00000, 0x387FC000, 0x38800000,  # f16 subnormals
        0x3F801000, 0x3F803000, 0x3F801001, 0xB3000000,  # float16 ties
    ]
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


def sources(dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Every bit pattern of a 16-bit dtype; specials and random patterns of float32."""
    if dtype.itemsize == 2:
        return torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return torch.cat([special_f32(), random_bits(20000, torch.float32, g)])


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_every_dtype_pair_bit_exact(interpreted, src_dtype, dst_dtype):
    """Every float16/bfloat16 value and float32 specials (NaN, inf, -0.0, subnormals, ties,
    float16 and bfloat16 overflow) convert as torch converts them."""
    g = torch.Generator().manual_seed(7)
    src = sources(src_dtype, g)
    staging = torch.cat([torch.zeros(8, dtype=torch.uint8), src.view(torch.uint8)])
    n = src.numel()
    dst = random_bits(n + 9, dst_dtype, g)
    segments = [Segment(8, src_dtype, n, 0, 5)]
    expected = reference(staging, segments, [dst])[0]
    assert interpreted.scatter_cast_triton(staging, segments, [dst]) == []  # the kernel took it all
    assert_matches(dst, expected, exact=torch.full((n + 9,), src_dtype == dst_dtype))
    if src_dtype == dst_dtype:
        assert torch.equal(bits(dst), bits(expected))
    elif dst_dtype != torch.float32:  # a NaN narrowed is c10's scalar NaN, whatever torch gave
        made = bits(dst)[5:5 + n][src.isnan()].long() & 0xFFFF
        sign = (bits(src)[src.isnan()].long() < 0).long() << 15
        want = sign | 0x7E00 if dst_dtype == torch.float16 else torch.full_like(made, 0x7FC0)
        assert made.numel() and torch.equal(made, want)


def random_table(seed: int):
    """Many destinations of mixed dtypes (some slices of one shared buffer, as ZeRO partitions
    are), odd lengths, staging offsets aligned to the source itemsize only, random destination
    offsets, zero segments, and float64 casts the kernel leaves to torch; segments shuffled."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtypes = FLOATS * 4 + [torch.int32, torch.int64, torch.uint8, torch.float64, torch.bool]
    shared = {d: random_bits(1500, d, g) for d in FLOATS}
    destinations, used = [], {d: 0 for d in FLOATS}
    for dtype in dtypes:
        size = rng.randint(40, 300)
        if dtype in FLOATS and rng.random() < 0.5:
            start = used[dtype] + rng.randint(0, 7)
            destinations.append(shared[dtype][start:start + size])
            used[dtype] = start + size
        else:
            destinations.append(random_bits(size, dtype, g))
    pieces, exact = [], [torch.ones(d.numel(), dtype=torch.bool) for d in destinations]
    for index, dst in enumerate(destinations):
        position = rng.randint(0, 3)
        while True:
            numel = rng.choice([1, 2, 3, 5, 7]) if rng.random() < 0.3 else rng.randint(1, 61)
            if position + numel > dst.numel():
                break
            if rng.random() < 0.15:
                pieces.append((None, None, index, position, numel))
            else:
                if dst.dtype in FLOATS:
                    src_dtype = rng.choice(FLOATS + [torch.float64] * (rng.random() < 0.1))
                elif dst.dtype == torch.float64:
                    src_dtype = rng.choice(FLOATS + [torch.float64])
                else:
                    src_dtype = dst.dtype
                if src_dtype != dst.dtype:
                    exact[index][position:position + numel] = False
                pieces.append((src_dtype, random_bits(numel, src_dtype, g), index, position, numel))
            position += numel + rng.choice([0, 0, 1, 4])
    rng.shuffle(pieces)
    staging = torch.randint(0, 256, (sum(8 + p[4] * 8 for p in pieces) + 64,), dtype=torch.uint8,
                            generator=g)
    segments, offset = [], rng.randint(0, 7)
    for src_dtype, values, index, position, numel in pieces:
        if src_dtype is None:
            segments.append(zero_segment(index, position, numel))
            continue
        itemsize = src_dtype.itemsize
        offset = -(-offset // itemsize) * itemsize  # aligned to the itemsize, not to 64
        staging[offset:offset + numel * itemsize] = values.view(torch.uint8)
        segments.append(Segment(offset, src_dtype, numel, index, position))
        offset += numel * itemsize + rng.randint(0, 5)
    return staging, segments, destinations, exact


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_segment_tables(interpreted, seed):
    staging, segments, destinations, exact = random_table(seed)
    assert len(segments) > 50 and any(s.src_dtype is None for s in segments)
    expected = reference(staging, segments, destinations)
    rest = scatter_cast_small_blocks(interpreted, staging, segments, destinations, block=16)
    assert len(rest) < len(segments) / 2  # the kernel took every segment but the float64 casts
    assert all(torch.float64 in (s.src_dtype, destinations[s.dst].dtype) for s in rest)
    for actual, want, mask in zip(destinations, expected, exact):
        assert_matches(actual, want, mask)


def scatter_cast_small_blocks(module, staging, segments, destinations, block):
    """``scatter_cast`` with ``block`` elements per program, so segments span several."""
    rest = module.scatter_cast_triton(staging, segments, destinations, block=block)
    scatter_cast_torch(staging, rest, destinations)
    return rest


class LaunchCounter:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(grid[0])
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_one_launch_for_every_dtype_pair_and_width(interpreted, monkeypatch):
    """Hundreds of segments into many destinations, with all 6 casts and bit copies (zeros
    included) of all 4 widths, take a single launch of one program per block."""
    staging, segments, destinations, _ = random_table(4)
    counter = LaunchCounter(interpreted._kernel())
    monkeypatch.setattr(interpreted, "_kernel", lambda: counter)
    expected = reference(staging, segments, destinations)
    rest = scatter_cast_small_blocks(interpreted, staging, segments, destinations, block=64)
    taken = [s for s in segments if s not in rest]
    casts = {(s.src_dtype, destinations[s.dst].dtype) for s in taken
             if s.src_dtype not in (None, destinations[s.dst].dtype)}
    widths = {destinations[s.dst].element_size() for s in taken
              if s.src_dtype in (None, destinations[s.dst].dtype)}
    assert len(casts) == 6 and len(widths) == 4
    assert counter.launches == [sum(-(-s.numel // 64) for s in taken)]
    assert all(s.src_dtype == torch.float64 or destinations[s.dst].dtype == torch.float64
               for s in rest) and rest
    for actual, want in zip(destinations, expected):
        assert_matches(actual, want, torch.zeros(actual.numel(), dtype=torch.bool))


def test_zero_segments_torch_path(monkeypatch):
    """Zero segments need no staging bytes and no Triton."""
    monkeypatch.setenv("ZLOAD_KERNEL", "torch")
    destinations = [torch.full((10,), 7.0), torch.full((6,), 3, dtype=torch.int64)]
    staging = torch.tensor([1.5, 2.5], dtype=torch.float32).view(torch.uint8)
    scatter_cast(staging, [zero_segment(0, 7, 3), Segment(0, torch.float32, 2, 0, 1),
                           zero_segment(1, 0, 2)], destinations)
    assert destinations[0].tolist() == [7, 1.5, 2.5, 7, 7, 7, 7, 0, 0, 0]
    assert destinations[1].tolist() == [0, 0, 3, 3, 3, 3]


def test_auto_uses_torch_for_cpu_destinations(monkeypatch):
    """auto never imports triton for CPU destinations (zload runs without it)."""
    monkeypatch.delenv("ZLOAD_KERNEL", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" would raise
    monkeypatch.delitem(sys.modules, "zload.kernels.triton_scatter", raising=False)
    dst = [torch.zeros(4, dtype=torch.bfloat16)]
    scatter_cast(torch.tensor([1.0, 2.0]).view(torch.uint8), [Segment(0, torch.float32, 2, 0, 1)],
                 dst)
    assert dst[0].tolist() == [0, 1, 2, 0]


def test_forced_triton_without_triton_raises(monkeypatch):
    monkeypatch.setenv("ZLOAD_KERNEL", "triton")
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "zload.kernels.triton_scatter", raising=False)
    with pytest.raises(ImportError):
        scatter_cast(torch.zeros(8, dtype=torch.uint8), [Segment(0, torch.float32, 2, 0, 0)],
                     [torch.zeros(2)])


def test_bad_backend_name(monkeypatch):
    monkeypatch.setenv("ZLOAD_KERNEL", "cuda")
    with pytest.raises(ValueError, match="ZLOAD_KERNEL"):
        scatter_cast(torch.zeros(8, dtype=torch.uint8), [], [])


def test_auto_falls_back_to_torch_once_triton_fails(monkeypatch, caplog):
    """A Triton that cannot compile or launch is reported once; the copies are then done by
    torch, now and from then on."""
    monkeypatch.delenv("ZLOAD_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "_auto_triton", lambda segments, destinations: True)
    fake = type(sys)("zload.kernels.triton_scatter")

    def broken(*args, **kwargs):
        raise RuntimeError("no CUDA driver")

    fake.scatter_cast_triton = broken
    monkeypatch.setitem(sys.modules, "zload.kernels.triton_scatter", fake)
    monkeypatch.setattr(kernels, "triton_scatter", fake, raising=False)
    dst = [torch.zeros(3, dtype=torch.float16)]
    with caplog.at_level(logging.WARNING, logger="zload"):
        scatter_cast(torch.tensor([1.0, 2.0, 3.0]).view(torch.uint8),
                     [Segment(0, torch.float32, 3, 0, 0)], dst)
    assert dst[0].tolist() == [1, 2, 3]
    assert "no CUDA driver" in caplog.text and kernels._triton_broken


def test_out_of_range_segment_is_refused_before_any_write(interpreted):
    dst = [torch.zeros(4), torch.zeros(4, dtype=torch.float16)]
    staging = torch.ones(4, dtype=torch.float32).view(torch.uint8)
    with pytest.raises(ValueError, match="out of range"):
        scatter_cast(staging, [Segment(0, torch.float32, 2, 0, 0),
                               Segment(0, torch.float32, 3, 1, 2)], dst)
    with pytest.raises(ValueError, match="staging"):
        scatter_cast(staging, [Segment(8, torch.float32, 3, 0, 0)], dst)
    assert not dst[0].any() and not dst[1].any()


def test_misaligned_staging_goes_to_torch(interpreted):
    """A staging buffer or offset not aligned to the source itemsize is left to torch."""
    raw = torch.zeros(64, dtype=torch.uint8)
    raw[6:14] = torch.tensor([1.5, -2.25]).view(torch.uint8)
    staging = raw[2:]  # data_ptr 2 past an aligned one: offset 4 is aligned, element 1 is not
    segment = Segment(4, torch.float32, 2, 0, 0)
    dst = [torch.zeros(2)]
    assert interpreted.scatter_cast_triton(staging, [segment], dst) == [segment]
    assert not dst[0].any()


@pytest.mark.parametrize("capability", [80, 90])
def test_kernel_compiles_for_the_gpu(capability, monkeypatch):
    """The interpreter runs programs the GPU compiler rejects (and the other way round): compile
    the kernel for real, to a cubin, which needs Triton's bundled ptxas but no GPU."""
    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        pytest.skip(f"this Triton has no offline compile API: {e}")
    from zload.kernels import triton_scatter

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's notice
    signature = {"staging_ptr": "*u8", "dst8_ptr": "*u8", "dst16_ptr": "*i16", "dst32_ptr": "*i32",
                 "dst64_ptr": "*i64", "table_ptr": "*i64", "BLOCK": "constexpr", "COLUMNS": "constexpr"}
    source = ASTSource(JITFunction(triton_scatter._scatter_cast_kernel), signature,
                       constexprs={"BLOCK": triton_scatter.BLOCK, "COLUMNS": triton_scatter.COLUMNS})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
    except RuntimeError as e:
        if "ptxas" in str(e).lower() and "not found" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise
    assert compiled.asm["cubin"] and "st.global" in compiled.asm["ptx"]
    # the FP8 product keeps float32 subnormals, as torch's does: no flush-to-zero multiply
    assert "mul.f32" in compiled.asm["ptx"] or "mul.rn.f32" in compiled.asm["ptx"]
    assert "mul.ftz" not in compiled.asm["ptx"] and "mul.rn.ftz" not in compiled.asm["ptx"]
