"""The planning core, tested directly: no processes, no tensors, no files."""

from __future__ import annotations

import pytest
import torch

from zload.checkpoint.index import CheckpointIndex, TensorEntry
from zload.loading.plan import collectives_differing, make_plan
from zload.model.targets import FULL, ORPHAN, PARTITION, Target
from zload.checkpoint.partition import Partition


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_partitions_tile_the_tensor_like_deepspeed(world):
    """Valid ranges of all ranks, in rank order, are exactly 0..numel; sizes are ceil(numel/world)."""
    for numel in range(0, 40):
        covered = []
        for rank in range(world):
            part = Partition(numel, world, rank)
            assert part.size * world - numel < world  # DeepSpeed's padding is less than one per rank
            assert part.size == (numel + world - 1) // world
            covered.extend(range(*part.owned))
        assert covered == list(range(numel))


def test_padding_can_span_several_ranks():
    assert [Partition(1, 3, r).valid for r in range(3)] == [1, 0, 0]
    assert [Partition(5, 4, r).valid for r in range(4)] == [2, 2, 1, 0]
    assert [Partition(5, 4, r).owned for r in range(4)] == [(0, 2), (2, 4), (4, 5), (6, 6)]


def _index(*entries):
    """A one-file index with tensors laid out back to back after a 100-byte header."""
    tensors, offset = {}, 100
    for name, dtype, shape, itemsize in entries:
        numel = 1
        for d in shape:
            numel *= d
        tensors[name] = TensorEntry(name, "f.safetensors", dtype, shape, offset, numel * itemsize)
        offset += numel * itemsize
    return CheckpointIndex("f.safetensors", ("f.safetensors",), tensors)


def _partition(name, shape, world, rank, dtype=torch.float32):
    numel = 1
    for d in shape:
        numel *= d
    return Target((name,), PARTITION, shape, dtype, True, Partition(numel, world, rank))


def test_partition_reads_exactly_the_ranks_byte_range():
    index = _index(("a", "F32", (2, 5), 4), ("w", "BF16", (7,), 2))
    for rank, (first, count) in enumerate([(0, 3), (3, 3), (6, 1)]):
        plan = make_plan(index, [_partition("w", (7,), 3, rank, torch.bfloat16)])
        (item,) = plan.items
        assert (item.offset, item.nbytes, item.numel) == (140 + 2 * first, 2 * count, count)
        assert item.src_dtype is torch.bfloat16 and item.dst_offset == 0
        assert plan.unexpected == ["a"] and plan.problems == [] and plan.conversions == {}


def test_rank_with_only_padding_reads_nothing_but_is_loaded():
    plan = make_plan(_index(("b", "F32", (1,), 4)), [_partition("b", (1,), 3, 2)])
    assert plan.items == [] and plan.loaded == ["b"] and 0 in plan.sources


def test_full_targets_read_whole_tensor_and_record_conversions():
    index = _index(("x", "F16", (3, 3), 2), ("steps", "I64", (4,), 8))
    targets = [Target(("x",), FULL, (3, 3), torch.float32, True),
               Target(("steps",), FULL, (4,), torch.int64, True)]
    plan = make_plan(index, targets)
    assert [(i.offset, i.nbytes) for i in plan.items] == [(100, 18), (118, 32)]
    assert plan.conversions == {"F16->float32": ["x"]}


def test_tied_alias_is_satisfied_by_either_name_and_read_once():
    index = _index(("head.weight", "F32", (4, 2), 4))
    tied = _partition("embed.weight", (4, 2), 2, 1)
    tied = Target(("embed.weight", "head.weight"), PARTITION, tied.shape, torch.float32, True, tied.partition)
    plan = make_plan(index, [tied])
    assert plan.loaded == ["embed.weight"] and plan.unexpected == [] and plan.missing == []
    (item,) = plan.items
    assert (item.offset, item.nbytes) == (100 + 16, 16)


def test_orphan_takes_its_shape_from_the_checkpoint():
    index = _index(("ls.scale_factor", "F32", (6,), 4))
    plan = make_plan(index, [Target(("ls.scale_factor",), ORPHAN, (), torch.bfloat16, True)])
    assert plan.orphans == ["ls.scale_factor"] and plan.items[0].numel == 6


def test_the_collectives_a_plan_makes_and_how_ranks_differ_in_them():
    """An orphan is converted by a broadcast, so its plan names it; a plan without orphans or
    slow-path conversions makes none after the reads. What differs is said rank by rank."""
    index = _index(("a", "F32", (2,), 4), ("ls.scale_factor", "F32", (6,), 4))
    assert make_plan(index, [_partition("a", (2,), 1, 0)], strict=False).collectives == []
    orphan = make_plan(index, [Target(("ls.scale_factor",), ORPHAN, (), torch.bfloat16, True)], strict=False)
    (described,) = orphan.collectives
    assert described == "the orphan 'ls.scale_factor' (bfloat16 [6])"
    other = "the orphan 'x' (float32 [1])"
    assert collectives_differing([[], [described], []]) == \
        f"rank 1's model has {described} that those of ranks 0, 2 lack"
    assert collectives_differing([[described], [described], [other]]) == \
        f"the models of ranks 0, 1 have {described} that rank 2's lacks; rank 2's model has {other} that " \
        "those of ranks 0, 1 lack"
    assert collectives_differing([[described, other], [other, described]]) == \
        f"the ranks' models have {described}, {other}, but in different orders"


def test_missing_is_a_problem_only_when_strict_and_required():
    index = _index(("a", "F32", (2,), 4))
    targets = [_partition("a", (2,), 1, 0), _partition("b", (2,), 1, 0),
               Target(("buf",), FULL, (1,), torch.float32, False)]
    strict = make_plan(index, targets)
    assert strict.missing == ["b"] and "b" in strict.problems[0] and "strict=True" in strict.problems[0]
    assert make_plan(index, targets, strict=False).problems == []


@pytest.mark.parametrize("entry,target,expected", [
    (("w", "F32", (3, 4), 4), _partition("w", (4, 3), 2, 0), "checkpoint shape [3, 4] != model shape [4, 3]"),
    (("w", "I32", (3,), 4), _partition("w", (3,), 2, 0), "checkpoint dtype I32 cannot be cast"),
    (("w", "F32", (3,), 4), _partition("w", (0,), 2, 0), "before deepspeed.initialize"),
])
def test_mismatches_are_problems_naming_file_and_tensor(entry, target, expected):
    plan = make_plan(_index(entry), [target])
    (problem,) = plan.problems
    assert expected in problem and "'w'" in problem and "f.safetensors" in problem
    assert plan.items == [] and plan.loaded == []


def test_target_problem_is_reported_even_when_shapes_match():
    target = Target(("w",), FULL, (2,), torch.float32, True, problem="is on the meta device")
    (problem,) = make_plan(_index(("w", "F32", (2,), 4)), [target]).problems
    assert "meta device" in problem
