"""Unit tests for zload.execute and zload.kernels.scatter_cast on CPU tensors.

Reads are built by hand as ReadItems over real safetensors files; every destination is compared
bit for bit with ``source_slice.to(dst_dtype)`` (so NaN, -0.0 and subnormals count), including
the elements no item writes, which must keep their sentinel bits.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors.torch import save_file

import zload.loading.execute as execute_module
from zload import CheckpointError, open_checkpoint
from zload.loading.execute import DEFAULT_STAGING_BYTES, execute
from zload.checkpoint.files import FileTable, open_regular
from zload.checkpoint.dtypes import TORCH_DTYPES
from zload.kernels import Segment, scatter_cast
from zload.loading.plan import ReadItem, StagingLayout

from tests.support.checkpoints import save_sharded

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DST_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers, so equality is bitwise (NaN == NaN, -0.0 != 0.0)."""
    return t.view(BITS[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, any_nan=None):
    """Bitwise equality; where ``any_nan`` is set, an expected NaN may be any NaN.

    torch itself converts a float16 NaN to float32 with different bits in its vectorised loop
    (payload and sign kept) and its scalar tail (0x7fffffff), so for that one conversion the NaN
    bits depend on where a copy happens to be split and no chunked copy can promise them.
    """
    assert actual.dtype == expected.dtype
    differ = bits(actual) != bits(expected)
    if any_nan is not None:
        loose = any_nan & expected.isnan()
        assert actual[loose].isnan().all()
        differ &= ~loose
    diff = differ.nonzero().flatten().tolist()
    assert not diff, (f"{len(diff)} elements differ, first at {diff[:5]}: "
                      f"{actual[diff[:5]].tolist()} != {expected[diff[:5]].tolist()}")


def special_floats(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values laced with NaN, +-inf, -0.0, subnormals and values that overflow or go
    subnormal when narrowed to float16 / bfloat16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float32) * 10
    specials = [float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                1e-40, -1e-42,  # float32 subnormals
                3e-6, -6e-8, 1e-7,  # float16 subnormal / underflow territory
                1e5, -7e4, 65520.0, 3e38,  # overflow float16 (not bfloat16)
                1.0 + 2**-8, 1.0 + 3 * 2**-9, 0.1]  # bfloat16 rounding ties and inexact
    x = x.to(dtype)
    positions = torch.randperm(n, generator=g)[:len(specials) * 4]
    for i, p in enumerate(positions.tolist()):
        x[p] = specials[i % len(specials)]
    if dtype == torch.float16:
        x[positions[0]] = torch.tensor(2**-24, dtype=torch.float16)  # smallest float16 subnormal
    if dtype == torch.bfloat16:
        x[positions[1]] = torch.tensor(1e-39, dtype=torch.bfloat16)  # a bfloat16 subnormal
    return x


def source_tensors(seed: int, n: int = 1531) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-2**40, 2**40, (n,), generator=g)
    ints[:8] = torch.tensor([0, -1, 2**24 + 1, -(2**24) - 1, 65504, 65520, 2**53 + 1, -7])
    return {
        "f32": special_floats(n, torch.float32, seed),
        "f16": special_floats(n + 2, torch.float16, seed + 1),
        "bf16": special_floats(n + 4, torch.bfloat16, seed + 2),
        "i64": ints,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Two files of random tensors; returns (index, {name: tensor}) merged over both files."""
    folder = tmp_path_factory.mktemp("execute")
    tensors, entries, files = {}, {}, FileTable()
    for seed, prefix in ((0, "a."), (10, "b.")):
        part = {prefix + k: v for k, v in source_tensors(seed).items()}
        path = folder / f"{prefix}safetensors"
        save_file(part, str(path))
        tensors.update(part)
        entries.update(open_checkpoint(path).tensors)
        files.add(open_regular(str(path)), path.name)
    with files:
        yield entries, tensors, files


def item_for(entry, target: int, first: int, count: int, dst_offset: int) -> ReadItem:
    size = entry.itemsize
    return ReadItem(entry.file, entry.start + first * size, count * size, TORCH_DTYPES[entry.dtype],
                    target, dst_offset, count)


def sentinel(length: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaNs included) that a correct copy must either overwrite or keep."""
    ints = BITS[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(ints)
    return torch.randint(info.min, info.max, (length,), generator=g, dtype=ints).view(dtype)


def random_plan(entries, tensors, names, dst_dtypes, seed: int, length: int = 4001):
    """Random non-overlapping sub-ranges of source tensors placed in flat destinations.

    ``names`` lists the tensors each destination may draw from (one list per destination, or
    one list for all). Returns (items, destinations, expected, any_nan): destinations start as
    sentinel bits, ``expected`` is what each must hold afterwards, and ``any_nan`` marks the
    elements converted float16 -> float32 (see ``assert_bits_equal``).
    """
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    if isinstance(names[0], str):
        names = [names] * len(dst_dtypes)
    destinations = [sentinel(length, d, g) for d in dst_dtypes]
    expected = [d.clone() for d in destinations]
    any_nan = [torch.zeros(length, dtype=torch.bool) for _ in destinations]
    items = []
    for target, dst in enumerate(destinations):
        cursor = rng.choice([0, 1, 3])
        while True:
            name = rng.choice(names[target])
            src = tensors[name].reshape(-1)
            count = rng.choice([1, 2, 3, 5, 17, 63, rng.randrange(1, 300) | 1])
            first = rng.randrange(0, src.numel() - count + 1)
            if cursor + count > length:
                break
            items.append(item_for(entries[name], target, first, count, cursor))
            expected[target][cursor:cursor + count] = src[first:first + count].to(dst.dtype)
            any_nan[target][cursor:cursor + count] = (src.dtype, dst.dtype) == (torch.float16,
                                                                                torch.float32)
            cursor += count + rng.choice([0, 0, 1, 2, 7])
    rng.shuffle(items)
    return items, destinations, expected, any_nan


class ScatterSpy:
    """Counts scatter_cast calls (one per staging flush) while delegating to the real kernel."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self.segments = 0
        real = execute_module.scatter_cast

        def spy(staging, segments, destinations):
            self.calls += 1
            self.segments += len(segments)
            real(staging, segments, destinations)

        monkeypatch.setattr(execute_module, "scatter_cast", spy)


STAGING = [1, 64, 100, 256, 4096, DEFAULT_STAGING_BYTES]
A_NAMES = ["a.f32", "a.f16", "a.bf16", "a.i64"]


@pytest.mark.parametrize("staging", STAGING)
@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_dtypes_match_torch_cast(checkpoint, monkeypatch, staging, seed):
    """Random odd ranges of every source dtype into f32/f16/bf16 destinations at odd offsets:
    bit-exact against ``.to()``, untouched elsewhere, whatever the staging size."""
    entries, tensors, files = checkpoint
    items, destinations, expected, any_nan = random_plan(entries, tensors, A_NAMES, DST_DTYPES,
                                                         seed)
    spy = ScatterSpy(monkeypatch)
    got = execute(files, items, destinations, staging_bytes=staging)
    assert got == sum(i.nbytes for i in items)
    for actual, want, loose in zip(destinations, expected, any_nan):
        assert_bits_equal(actual, want, loose)
    staged = [i for i in items if i.src_dtype != destinations[i.target].dtype]
    assert spy.segments >= len(staged) > 0
    if staging <= 100:
        assert spy.calls > len(staged)  # tiny buffer: items are split across many flushes
    if staging == DEFAULT_STAGING_BYTES:
        assert spy.calls < 10


def test_two_files_interleaved(checkpoint, monkeypatch):
    """Items alternating between two files (and between staged and direct reads) land right."""
    entries, tensors, files = checkpoint
    names = A_NAMES + [n.replace("a.", "b.") for n in A_NAMES]
    items, destinations, expected, any_nan = random_plan(entries, tensors, names, DST_DTYPES,
                                                         seed=5)
    assert {i.file for i in items} == {entries["a.f32"].file, entries["b.f32"].file}
    for staging in (100, DEFAULT_STAGING_BYTES):
        dsts = [d.clone() for d in destinations]
        assert execute(files, items, dsts, staging_bytes=staging) == sum(i.nbytes for i in items)
        for actual, want, loose in zip(dsts, expected, any_nan):
            assert_bits_equal(actual, want, loose)


@pytest.mark.parametrize("staging", [64, DEFAULT_STAGING_BYTES])
def test_direct_reads_bypass_staging(checkpoint, monkeypatch, staging):
    """Same dtype into a CPU destination is read straight into it: no scatter_cast at all."""
    entries, tensors, files = checkpoint
    names = [["a.f32", "b.f32"], ["a.f16", "b.f16"], ["a.bf16", "b.bf16"]]
    items, destinations, expected, _ = random_plan(entries, tensors, names, DST_DTYPES, seed=7)
    spy = ScatterSpy(monkeypatch)
    assert execute(files, items, destinations, staging) == sum(i.nbytes for i in items)
    assert spy.calls == 0
    for actual, want in zip(destinations, expected):
        assert_bits_equal(actual, want)


def test_whole_tensors_and_adjacent_ranges(checkpoint):
    """Whole tensors, and one tensor split into file-adjacent pieces (merged into one read),
    reassemble exactly, staged and direct."""
    entries, tensors, files = checkpoint
    src = tensors["a.bf16"]
    n = src.numel()
    cuts = [0, 1, 2, 9, 200, 777, n]
    destinations = [torch.full((n,), -1.0, dtype=d) for d in DST_DTYPES]
    items = [item_for(entries["a.bf16"], t, a, b - a, a)
             for t in range(3) for a, b in zip(cuts, cuts[1:])]
    assert execute(files, items, destinations, staging_bytes=128) == 3 * src.numel() * 2
    for actual in destinations:
        assert_bits_equal(actual, src.to(actual.dtype))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_file_truncated_after_indexing(tmp_path, direct):
    """A file that shrinks between indexing and reading is a CheckpointError naming it,
    not silently short destinations."""
    path = tmp_path / "shrinks.safetensors"
    save_file({"x": torch.randn(1000), "y": torch.randn(1000)}, str(path))
    index = open_checkpoint(path)
    os.truncate(path, path.stat().st_size - 10)
    dst = torch.zeros(2000, dtype=torch.float32 if direct else torch.bfloat16)
    items = [item_for(index.tensors[n], 0, 0, 1000, k * 1000) for k, n in enumerate("xy")]
    with pytest.raises(CheckpointError) as err:
        execute(index.opened, items, [dst], staging_bytes=4096)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("how", ["removed", "renamed_over"])
def test_what_is_read_is_what_was_validated(tmp_path, how):
    """A file removed or replaced by another (a concurrent save renaming its shards into place)
    after its header was read: the bytes still come from the file whose header was validated."""
    path = tmp_path / "x.safetensors"
    data = torch.randn(10)
    save_file({"x": data}, str(path))
    index = open_checkpoint(path)
    if how == "removed":
        path.unlink()
    else:
        save_file({"x": torch.zeros(10)}, str(tmp_path / "other.safetensors"))
        os.replace(tmp_path / "other.safetensors", path)
    out = torch.full((10,), 7.0)
    assert execute(index.opened, [item_for(index.tensors["x"], 0, 0, 10, 0)], [out]) == 40
    assert torch.equal(out, data)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_a_file_changed_in_place_after_indexing_is_refused(tmp_path, direct):
    """Same size, other values, written into the same file: its modification time gives it away."""
    path = tmp_path / "x.safetensors"
    save_file({"x": torch.randn(1000)}, str(path))
    index = open_checkpoint(path)
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(1000)}, str(other))
    with open(path, "r+b") as f:
        f.write(other.read_bytes())
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1))  # whatever the filesystem's granularity
    dst = torch.zeros(1000, dtype=torch.float32 if direct else torch.bfloat16)
    with pytest.raises(CheckpointError, match="changed while it was being read") as err:
        execute(index.opened, [item_for(index.tensors["x"], 0, 0, 1000, 0)], [dst], staging_bytes=4096)
    assert str(path) in str(err.value)


def test_a_failed_read_stops_the_other_reader_threads(tmp_path, monkeypatch):
    """Once one run fails the batch has failed: the other threads take no further runs."""
    import time

    path = tmp_path / "x.safetensors"
    save_file({"x": torch.randn(1000)}, str(path))
    index = open_checkpoint(path)
    entry = index.tensors["x"]
    monkeypatch.setattr(execute_module, "_RUN_BYTES", 64)  # 4000 bytes: 63 runs
    calls = []

    def first_read_fails(run):
        calls.append(run.offset)
        if len(calls) == 1:
            raise CheckpointError("the first read fails")
        time.sleep(0.002)
        return run.nbytes

    monkeypatch.setattr(execute_module, "_read_run", first_read_fails)
    with pytest.raises(CheckpointError, match="the first read fails"):
        execute(index.opened, [item_for(entry, 0, 0, 1000, 0)], [torch.zeros(1000)], threads=2)
    assert len(calls) <= 3


def test_reader_count_is_this_ranks_share_of_the_cpus(monkeypatch):
    """Page-cache reads are memory copies: no more reader threads than a rank's share of the CPUs."""
    from zload.distributed import reader_count

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert reader_count() == 4 and reader_count(8) == 8
    monkeypatch.setenv("LOCAL_SIZE", "8")  # the DeepSpeed launcher's name
    assert reader_count() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's
    assert reader_count() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert reader_count() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert reader_count() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert reader_count() == 1


@pytest.mark.parametrize("threads", [1, 3])
def test_the_calling_thread_reads_instead_of_waiting(tmp_path, monkeypatch, threads):
    """The calling thread takes runs too; with one reader it reads everything and starts no pool."""
    import threading
    import time

    path = tmp_path / "x.safetensors"
    data = torch.randn(1000)
    save_file({"x": data}, str(path))
    index = open_checkpoint(path)
    entry = index.tensors["x"]
    monkeypatch.setattr(execute_module, "_RUN_BYTES", 128)  # 4000 bytes: 32 runs
    readers, real_read = [], execute_module._read_run

    def recorded(run):
        readers.append(threading.current_thread())
        time.sleep(0.002)
        return real_read(run)

    monkeypatch.setattr(execute_module, "_read_run", recorded)
    before = threading.active_count()
    out = torch.zeros(1000)
    assert execute(index.opened, [item_for(entry, 0, 0, 1000, 0)], [out], threads=threads) == 4000
    assert torch.equal(out, data) and len(readers) == 32
    assert threading.main_thread() in readers
    assert (len(set(readers)) == 1) if threads == 1 else (1 < len(set(readers)) <= threads)
    assert threading.active_count() == before  # the helpers are gone


def test_a_range_reader_keeps_its_files_and_threads_across_reads(tmp_path, monkeypatch):
    """A node-local reader serves many batches with one RangeReader: every read returns exactly
    its ranges, no file is opened again, and the helper threads are the same from read to read."""
    import threading
    import time

    path = tmp_path / "x.safetensors"
    data = torch.randn(3000)
    save_file({"x": data}, str(path))
    index = open_checkpoint(path)
    entry = index.tensors["x"]
    monkeypatch.setattr(execute_module, "_RUN_BYTES", 256)  # many runs per read, for the helpers
    monkeypatch.setattr(execute_module, "reader_count", lambda: 3)
    opened, real_open = [], os.open
    monkeypatch.setattr(os, "open", lambda *a: opened.append(a[0]) or real_open(*a))
    readers, real_read = set(), execute_module._read_run

    def recorded(run):
        readers.add(threading.current_thread())
        time.sleep(0.001)  # long enough for the helpers to take runs too
        return real_read(run)

    monkeypatch.setattr(execute_module, "_read_run", recorded)
    out = torch.zeros(3000)
    view = memoryview(out.numpy()).cast("B")
    with execute_module.RangeReader(index.opened) as reader:
        for first in range(0, 3000, 1000):  # three batches, each a third of the tensor
            got = reader.read([(entry.file, entry.start + 4 * first, view[4 * first:4 * (first + 1000)])])
            assert got == 4000 and torch.equal(out[:first + 1000], data[:first + 1000])
            assert not out[first + 1000:].any()
            helpers = {t for t in readers if t is not threading.main_thread()}
        assert len(helpers) <= 2 and len(readers - helpers) <= 1
    assert opened == [] and len(readers) > 1  # read through the descriptor the index opened


def test_scatter_cast_segments():
    """scatter_cast copies each staged segment to its destination slice, cast like ``.to()``,
    and leaves everything else alone."""
    g = torch.Generator().manual_seed(3)
    sources = [special_floats(37, torch.float32, 0), special_floats(21, torch.float16, 1),
               special_floats(50, torch.bfloat16, 2), torch.randint(-2**40, 2**40, (9,),
                                                                    generator=g)]
    staging = torch.full((1024,), 0xAB, dtype=torch.uint8)
    segments, offset = [], 0
    plan = [(0, 2, 3), (1, 0, 0), (2, 1, 11), (3, 0, 100), (0, 0, 40), (2, 2, 77)]  # src, dst, off; no overlap
    destinations = [torch.full((200,), 7.0, dtype=d) for d in DST_DTYPES]
    expected = [d.clone() for d in destinations]
    for src_index, dst, dst_offset in plan:
        src = sources[src_index]
        raw = src.view(torch.uint8)
        staging[offset:offset + raw.numel()] = raw
        segments.append(Segment(offset, src.dtype, src.numel(), dst, dst_offset))
        expected[dst][dst_offset:dst_offset + src.numel()] = src.to(expected[dst].dtype)
        offset += -(-raw.numel() // 64) * 64
    scatter_cast(staging, segments, destinations)
    for actual, want in zip(destinations, expected):
        assert_bits_equal(actual, want)


@pytest.mark.parametrize("capacity", [64, 200, 4096])
def test_staging_layout_packs_aligned_parts_that_cover_each_item(capacity):
    """Every part starts at a 64-byte aligned offset and ends within ``capacity``; parts of a batch
    do not overlap; each item's parts cover exactly its elements and bytes, in order."""
    rng = random.Random(capacity)
    items = [ReadItem("f", rng.randrange(10_000), n * size, dtype, k, rng.randrange(100), n)
             for k, (n, size, dtype) in enumerate(
                 (rng.randrange(1, 300), *rng.choice([(2, torch.bfloat16), (4, torch.float32), (8, torch.int64)]))
                 for _ in range(40))]
    layout = StagingLayout(capacity)
    batches, end = [], 0
    for item in items:
        parts = layout.parts(item)
        assert [p.dst_offset for p in parts] == list(range(item.dst_offset, item.dst_offset + item.numel,
                                                           parts[0].numel))
        assert sum(p.numel for p in parts) == item.numel and sum(p.nbytes for p in parts) == item.nbytes
        assert all(p.offset == item.offset + (p.dst_offset - item.dst_offset) * item.nbytes // item.numel
                   for p in parts)
        for part in parts:
            start = layout.place(part.nbytes)
            if start == 0:
                batches.append(0)
            else:
                assert start >= end  # after the batch's previous part
            assert start % 64 == 0 and start + part.nbytes <= capacity
            end = start + part.nbytes
            batches[-1] += 1
    assert len(batches) > (1 if capacity < 4096 else 0)


def test_plans_name_files_by_key_so_any_copy_of_the_checkpoint_serves_them(tmp_path):
    """A plan names checkpoint files by their key (their name in the checkpoint folder), not by
    where this rank found them; only the reader resolves a key, through the files it opened. So
    the reads planned against one copy run against another copy in another folder (another
    node's), which is what node-local sharing relies on."""
    from zload.loading.plan import make_plan
    from zload.model.targets import FULL, Target

    state = {"x": torch.randn(1000), "y": torch.randn(30)}
    for node in ("node0", "node1"):
        save_sharded(state, tmp_path / node, shards=2)
    planned_on, read_from = open_checkpoint(tmp_path / "node0"), open_checkpoint(tmp_path / "node1")
    outs = [torch.zeros(1000), torch.zeros(30)]
    targets = [Target((name,), FULL, (len(out),), torch.float32, True, tensor=out)
               for name, out in zip(state, outs)]
    items = make_plan(planned_on, targets).items
    assert {i.file for i in items} == set(planned_on.files) == {"model-00001-of-00002.safetensors",
                                                                 "model-00002-of-00002.safetensors"}
    assert execute(read_from.opened, items, outs) == 4 * 1030
    assert torch.equal(outs[0], state["x"]) and torch.equal(outs[1], state["y"])
