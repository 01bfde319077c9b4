"""The geometry of DeepSpeed checkpoints (``native.native_entries``), without processes or files.

Each layout is built here the way DeepSpeed lays its partitions out, on a synthetic disk whose
elements are ids (``(tensor name, element)``, or ``PAD`` for padding): reading a tensor back
through ``TensorEntry.spans`` must give its ids in order, whole and in any sub-range (as plans
read it). Layouts that lie about their sizes are refused with a message naming the tensor.
"""

from __future__ import annotations

import itertools
from math import ceil, prod

import pytest

from zload.checkpoint.index import DTYPES
from zload.checkpoint.native import NativeLayout, Stored, native_entries

PAD = "pad"


class Disk:
    """Synthetic files: for each file key, the id stored at each element's byte offset."""

    def __init__(self):
        self.files: dict[str, dict[int, object]] = {}

    def store(self, file: str, ids: list, dtype: str = "F32", shape=None) -> Stored:
        """``ids`` written after what ``file`` holds, past a gap (so that an offset that is off
        by a little reads nothing or a neighbour, never the right id)."""
        content, size = self.files.setdefault(file, {}), DTYPES[dtype][1]
        start = max(content, default=0) + 3 * size + 5
        content.update({start + k * size: element for k, element in enumerate(ids)})
        return Stored(file, start, len(ids), dtype, tuple(shape) if shape is not None else (len(ids),))

    def read(self, entry, first: int = 0, count: int | None = None) -> list:
        count = entry.numel - first if count is None else count
        out = []
        for file, offset, skip, run in entry.spans(first, count):
            assert skip == len(out), f"{entry.name}: spans out of order or overlapping"
            out += [self.files[file].get(offset + k * entry.itemsize) for k in range(run)]
        return out


def ids(name: str, shape) -> list:
    return [(name, i) for i in range(prod(shape))]


def partition(elements: list, world: int, rank: int) -> list:
    """Rank ``rank``'s ZeRO-3 partition of ``elements``: ceil(n / world) of them, padded."""
    size = ceil(len(elements) / world)
    part = elements[rank * size:(rank + 1) * size]
    return part + [PAD] * (size - len(part))


def zero3(disk: Disk, world: int, groups: list[dict], cuts=(), frozen=None, buffers=None,
          shared=None) -> NativeLayout:
    """A ZeRO-3 save by ``world`` ranks: each rank's flat fp32 buffer (its partition of every
    trainable parameter in order) split into flat groups at element offsets ``cuts``; frozen
    parameters as padded bf16 partitions in each rank's model states; buffers whole in rank 0's."""
    frozen, buffers = frozen or {}, buffers or {}
    flat = []
    for rank in range(world):
        elements = [e for group in groups for name, shape in group.items()
                    for e in partition(ids(name, shape), world, rank)]
        bounds = [0, *cuts, len(elements)]
        flat.append([disk.store(f"optim{rank}", elements[a:b]) for a, b in zip(bounds, bounds[1:])])
    fragments = {name: [disk.store(f"model{rank}", partition(ids(name, shape), world, rank), "BF16")
                        for rank in range(world)] for name, shape in frozen.items()}
    return NativeLayout(3, world, groups, flat, None, dict(frozen), fragments, _buffers(disk, buffers),
                        {}, {}, dict(shared or {}))


def _buffers(disk: Disk, buffers: dict) -> dict[str, Stored]:
    return {name: disk.store("model0", ids(name, shape), dtype, shape) for name, (shape, dtype) in buffers.items()}


def zero12(disk: Disk, world: int, groups: list[dict], paddings: list[list[int]], frozen=None,
           buffers=None) -> NativeLayout:
    """A ZeRO-1/2 save: each group's parameters flattened with an alignment padding after each,
    padded to a multiple of 2 * world, and cut into ``world`` equal partitions (so parameters
    cross rank boundaries); frozen parameters and buffers whole in the one model states file."""
    flat = [[] for _ in range(world)]
    for group, pads in zip(groups, paddings):
        elements = [e for (name, shape), pad in zip(group.items(), pads) for e in ids(name, shape) + [PAD] * pad]
        elements += [PAD] * (-len(elements) % (2 * world))
        size = len(elements) // world
        for rank in range(world):
            flat[rank].append(disk.store(f"optim{rank}", elements[rank * size:(rank + 1) * size]))
    whole = {name: [disk.store("model0", ids(name, shape), "BF16", shape)] for name, shape in (frozen or {}).items()}
    return NativeLayout(2, world, groups, flat, paddings, dict(frozen or {}), whole, _buffers(disk, buffers or {}),
                        {}, {}, {})


def check_reads(disk: Disk, layout: NativeLayout, expected: dict[str, list]) -> None:
    """Every tensor indexed reads back as ``expected``, whole and in sub-ranges; nothing else is
    indexed and nothing is wrong."""
    entries, problems = native_entries(layout)
    assert problems == []
    assert sorted(entries) == sorted(expected)
    for name, entry in entries.items():
        assert disk.read(entry) == expected[name], name
        for first, last in itertools.combinations(range(entry.numel + 1), 2):
            assert disk.read(entry, first, last - first) == expected[name][first:last], (name, first, last)


AWKWARD = {"tiny": (1,), "empty": (0,), "empty_rows": (3, 0), "odd": (5, 7), "cube": (4, 3, 2)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero3_sizes_that_do_not_divide(world):
    disk = Disk()
    layout = zero3(disk, world, [AWKWARD])
    check_reads(disk, layout, {name: ids(name, shape) for name, shape in AWKWARD.items()})


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero3_flat_groups_cut_inside_partitions(world):
    """Several optimizer groups, and flat groups cut so that a parameter's partition (of 'odd' and
    of 'cube') crosses from one flat group into the next; empty flat groups too."""
    groups = [{"tiny": (1,), "odd": (5, 7)}, {"empty": (0,), "cube": (4, 3, 2), "bias": (5,)}]
    tiny, odd, cube = (ceil(n / world) for n in (1, 35, 24))
    cuts = [tiny + odd // 2, tiny + odd + cube // 2, tiny + odd + cube // 2]
    disk = Disk()
    layout = zero3(disk, world, groups, cuts=cuts)
    assert len(layout.flat[0]) > 2
    check_reads(disk, layout, {name: ids(name, shape) for g in groups for name, shape in g.items()})


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero3_frozen_parameters_buffers_and_tied_aliases(world):
    groups = [{"embed": (7, 3), "norm": (3,)}]
    frozen = {"frozen.weight": (5, 2), "frozen.one": (1,)}
    buffers = {"steps": ((5,), "I64"), "scale": ((), "F32")}
    disk = Disk()
    layout = zero3(disk, world, groups, frozen=frozen, buffers=buffers, shared={"head.weight": "embed"})
    expected = {name: ids(name, shape) for name, shape in [*groups[0].items(), *frozen.items()]}
    expected.update({name: ids(name, shape) for name, (shape, _) in buffers.items()})
    expected["head.weight"] = ids("embed", (7, 3))
    check_reads(disk, layout, expected)
    entries, _ = native_entries(layout)
    assert entries["frozen.weight"].dtype == "BF16" and entries["steps"].dtype == "I64"
    assert entries["head.weight"].shape == (7, 3) and entries["scale"].shape == ()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero12_parameters_across_ranks_and_alignment_paddings(world):
    groups = [{"a": (3, 5), "tiny": (1,), "b": (7,)}, {"empty": (0,), "c": (2, 9)}]
    paddings = [[1, 0, 3], [0, 2]]
    disk = Disk()
    layout = zero12(disk, world, groups, paddings, frozen={"frozen": (3, 3)}, buffers={"steps": ((4,), "I64")})
    expected = {name: ids(name, shape) for g in groups for name, shape in g.items()}
    expected.update(frozen=ids("frozen", (3, 3)), steps=ids("steps", (4,)))
    check_reads(disk, layout, expected)


def test_zero12_without_recorded_paddings():
    """Saves before DeepSpeed recorded param_alignment_paddings: parameters packed back to back."""
    groups = [{"a": (3, 5), "b": (7,)}]
    disk = Disk()
    layout = zero12(disk, 3, groups, [[0, 0]])
    layout.paddings = None
    check_reads(disk, layout, {"a": ids("a", (3, 5)), "b": ids("b", (7,))})


# --------------------------------------------------------------------------------------------
# layouts that lie


def problems_of(layout: NativeLayout) -> str:
    entries, problems = native_entries(layout)
    assert problems, "a layout that lies was accepted"
    return "; ".join(problems)


def test_flat_groups_of_different_sizes_on_two_ranks():
    disk = Disk()
    layout = zero3(disk, 2, [AWKWARD])
    other = zero3(disk, 2, [{**AWKWARD, "cube": (4, 3, 3)}])
    layout.flat[1] = other.flat[1]  # rank 1's optimizer states from another save
    message = problems_of(layout)
    assert "differ in size" in message and "optim0" in message and "optim1" in message


@pytest.mark.parametrize("change", ["extra_elements", "missing_elements", "extra_parameter"])
def test_zero3_sizes_that_do_not_add_up(change):
    disk = Disk()
    layout = zero3(disk, 3, [AWKWARD])
    if change == "extra_parameter":
        layout.param_shapes = [{**AWKWARD, "ghost": (2,)}]
    else:
        longer = change == "extra_elements"
        layout.flat = [[disk.store(f"optim{r}", [PAD] * (g.numel + (1 if longer else -1))) for g in groups]
                       for r, groups in enumerate(layout.flat)]
    message = problems_of(layout)
    assert "'cube'" in message or "'ghost'" in message, message


@pytest.mark.parametrize("change", ["last_parameter_past_the_end", "group_too_long"])
def test_zero12_sizes_that_do_not_add_up(change):
    """The last parameter of a group running past the end of its partitions (within the 2 * world
    alignment, which zero_to_fp32's own check allows) must not be read short."""
    disk = Disk()
    groups = [{"a": (3,), "b": (4,)}]
    layout = zero12(disk, 2, groups, [[0, 0]])  # 7 elements padded to 8: 4 a rank
    if change == "last_parameter_past_the_end":
        layout.paddings = [[1, 0]]  # 'b' would end at element 8, past the 8 the ranks hold
        layout.flat = [[disk.store(f"optim{r}", [PAD] * 3)] for r in range(2)]
    else:
        layout.flat = [[disk.store(f"optim{r}", [PAD] * 8)] for r in range(2)]
    message = problems_of(layout)
    assert "'b'" in message, message


@pytest.mark.parametrize("stage", [3, 2])
def test_frozen_partition_of_the_wrong_size(stage):
    disk = Disk()
    build = zero3 if stage == 3 else zero12
    args = () if stage == 3 else ([[0]],)
    layout = build(disk, 2, [{"a": (3,)}], *args, frozen={"frozen": (5,)})
    layout.frozen["frozen"][-1] = disk.store("model1", [PAD] * 2, "BF16")
    assert "'frozen'" in problems_of(layout)


@pytest.mark.parametrize("paddings", [[[0]], [[0, 1, 2], [0]], [[0, 0]]])
def test_wrong_count_of_alignment_paddings(paddings):
    """A padding list per group, one padding per parameter: fewer or more is refused (not an
    IndexError), naming the group's tensors."""
    disk = Disk()
    groups = [{"a": (3,), "b": (4,)}, {"c": (5,)}]
    layout = zero12(disk, 2, groups, [[0, 0], [0]])
    layout.paddings = paddings
    message = problems_of(layout)
    assert "'a'" in message or "'c'" in message, message


def test_groups_and_flat_partitions_in_different_numbers():
    disk = Disk()
    layout = zero12(disk, 2, [{"a": (3,)}, {"b": (4,)}], [[0], [0]])
    layout.param_shapes = layout.param_shapes[:1]
    assert "'a'" in problems_of(layout)


@pytest.mark.parametrize("where", ["two_groups", "frozen", "buffer"])
def test_a_tensor_listed_twice(where):
    """DeepSpeed lists each tensor once; a name listed twice would be read from one place or the
    other depending on the reader's order."""
    disk = Disk()
    groups = [{"a": (3,), "b": (4,)}, {"c": (2,)}]
    if where == "two_groups":
        groups[1]["a"] = (3,)
    layout = zero3(disk, 2, groups, frozen={"a": (3,)} if where == "frozen" else None,
                   buffers={"b": ((4,), "F32")} if where == "buffer" else None)
    message = problems_of(layout)
    assert "'a'" in message or "'b'" in message, message


def test_masters_kept_in_16_bits():
    """DeepSpeed keeps 16-bit masters when told to (bf16_master_weights_and_grads): the entries
    are of the flat groups' dtype, and their byte offsets of its size."""
    disk = Disk()
    layout = zero3(disk, 3, [AWKWARD])
    layout.flat = [[disk.store(s.file + "-bf16", [disk.files[s.file][s.start + 4 * k] for k in range(s.numel)],
                               "BF16") for s in flat] for flat in layout.flat]
    entries, problems = native_entries(layout)
    assert problems == [] and {e.dtype for e in entries.values()} == {"BF16"}
    for name, entry in entries.items():
        assert disk.read(entry) == ids(name, AWKWARD[name]), name


def test_an_empty_tensor_lies_in_a_file_of_the_checkpoint():
    """So that ranks lacking the checkpoint are sent it with that file's tensors."""
    entries, _ = native_entries(zero3(Disk(), 2, [AWKWARD]))
    assert entries["empty"].files == ("optim0",) and entries["empty_rows"].files == ("optim0",)


def test_a_nest_of_shared_lists_prints_briefly():
    """A hostile value in a message: 2**60 items if printed whole."""
    from zload.report import brief

    nest = [1]
    for _ in range(60):
        nest = [nest, nest]
    assert len(brief(nest)) < 300
