"""Plan: join the model's targets with their checkpoint sources into byte-range reads.

Pure and deterministic: given the same index and targets every rank computes the same problems
in the same order, which is what lets ranks agree on an error before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from .index import DTYPES, CheckpointIndex
from .names import Matching, Source, match
from .report import shortened
from .targets import ORPHAN, PARTITION, Target

_FLOATING = {"float16", "bfloat16", "float32", "float64"}


@dataclass(frozen=True)
class ReadItem:
    """Copy ``numel`` elements stored at ``file[offset:offset + nbytes]`` (dtype ``src_dtype``)
    into element ``dst_offset`` onward of target number ``target``, casting to its dtype."""

    file: str
    offset: int
    nbytes: int
    src_dtype: str  # torch dtype name
    target: int  # index into LoadPlan.targets
    dst_offset: int
    numel: int


@dataclass
class LoadPlan:
    """What this rank will read and write, and everything that stands in the way."""

    targets: list[Target]
    checkpoint_bytes: int = 0
    items: list[ReadItem] = field(default_factory=list)
    sources: dict[int, Source] = field(default_factory=dict)  # target index -> its source
    slow: list[int] = field(default_factory=list)  # targets built by a conversion on one rank
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    conversions: dict[str, list[str]] = field(default_factory=dict)  # "BF16->float32" -> names
    orphans: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def split_item(item: ReadItem, max_bytes: int) -> list[ReadItem]:
    """``item`` cut into element-aligned pieces of at most ``max_bytes`` (at least one element)."""
    itemsize = item.nbytes // item.numel if item.numel else 1
    step = max(1, max_bytes // itemsize)
    return [ReadItem(item.file, item.offset + first * itemsize, min(step, item.numel - first) * itemsize,
                     item.src_dtype, item.target, item.dst_offset + first, min(step, item.numel - first))
            for first in range(0, item.numel, step)]


def _compatibility_problem(target: Target, source: Source) -> str | None:
    for entry in source.entries:
        src = DTYPES[entry.dtype][0]
        if src != target.dtype and not (src in _FLOATING and target.dtype in _FLOATING):
            return f"checkpoint dtype {entry.dtype} cannot be cast to the model's {target.dtype}"
    if target.kind != ORPHAN and source.shape != target.shape:
        hint = ""
        if prod(target.shape) == 0 and prod(source.shape) > 0:
            hint = (" (a parameter re-created after zero.Init and converted by deepspeed.initialize? "
                    "call zload.load_into before deepspeed.initialize so zload can repair it)")
        return f"checkpoint shape {list(source.shape)} != model shape {list(target.shape)}{hint}"
    return None


def _reads(target: Target, index: int, source: Source) -> list[ReadItem]:
    """The byte ranges of the checkpoint this rank needs for ``target``: for a ZeRO-3 partition
    only the elements it owns, which is one contiguous range of each piece."""
    if target.kind == PARTITION:
        low, high = target.partition.owned
    else:
        low, high = 0, prod(source.shape)
    items = []
    for piece in source.pieces:
        first, last = max(low, piece.dst_offset), min(high, piece.dst_offset + piece.numel)
        if first >= last:
            continue
        entry, size = piece.entry, piece.entry.itemsize
        offset = entry.start + (piece.src_offset + first - piece.dst_offset) * size
        items.append(ReadItem(entry.file, offset, (last - first) * size, DTYPES[entry.dtype][0],
                              index, first - low, last - first))
    return items


def _describe(target: Target, source: Source) -> str:
    files = sorted({e.file for e in source.entries}) or ["(converted)"]
    return f"'{target.name}' ({', '.join(files)}, tensor {', '.join(repr(n) for n in source.names)})"


def make_plan(index: CheckpointIndex, targets: list[Target], *, strict: bool = True,
              matching: Matching | None = None) -> LoadPlan:
    """List every read this rank needs and every problem; never raises for bad input.

    ``matching`` (from ``names.match``) says which checkpoint bytes feed which target; by default
    names are matched as they are.
    """
    matching = matching or match(index, targets)
    plan = LoadPlan(targets, index.total_bytes, unexpected=matching.unexpected,
                    problems=list(matching.problems))
    for i, target in enumerate(targets):
        source = matching.sources.get(i)
        if source is None:
            if target.required and (matching.required is None or i in matching.required):
                plan.missing.append(target.name)
            continue
        problem = target.problem or _compatibility_problem(target, source)
        if problem:
            plan.problems.append(f"{_describe(target, source)}: {problem}")
            continue
        plan.sources[i] = source
        plan.loaded.append(target.name)
        if target.kind == ORPHAN:
            plan.orphans.append(target.name)
        for dtype in sorted({e.dtype for e in source.entries}):
            if DTYPES[dtype][0] != target.dtype:
                plan.conversions.setdefault(f"{dtype}->{target.dtype}", []).append(target.name)
        if source.convert is not None:
            plan.slow.append(i)
        else:
            plan.items.extend(_reads(target, i, source))
    if strict and plan.missing:
        plan.problems.append(f"{len(plan.missing)} model tensors are not in the checkpoint "
                             f"{index.source} (strict=True): {shortened(plan.missing, 20)}")
    return plan
