"""Plan: join the checkpoint index with the model's targets into byte-range reads.

Pure and deterministic: given the same index and targets every rank computes the same problems
in the same order, which is what lets ranks agree on an error before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from .index import DTYPES, CheckpointIndex, TensorEntry
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
    source: str = ""
    checkpoint_bytes: int = 0
    items: list[ReadItem] = field(default_factory=list)
    sources: dict[int, TensorEntry] = field(default_factory=dict)  # target index -> its tensor
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    conversions: dict[str, list[str]] = field(default_factory=dict)  # "BF16->float32" -> names
    orphans: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def bytes_to_read(self) -> int:
        return sum(item.nbytes for item in self.items)


def _source_for(target: Target, index: CheckpointIndex) -> TensorEntry | None:
    for name in target.names:
        if name in index.tensors:
            return index.tensors[name]
    return None


def _compatibility_problem(target: Target, entry: TensorEntry) -> str | None:
    src = DTYPES[entry.dtype][0]
    if src != target.dtype and not (src in _FLOATING and target.dtype in _FLOATING):
        return f"checkpoint dtype {entry.dtype} cannot be cast to the model's {target.dtype}"
    if target.kind != ORPHAN and entry.shape != target.shape:
        hint = ""
        if prod(target.shape) == 0 and entry.numel > 0:
            hint = (" (a parameter re-created after zero.Init and converted by deepspeed.initialize? "
                    "call zload.load_into before deepspeed.initialize so zload can repair it)")
        return f"checkpoint shape {list(entry.shape)} != model shape {list(target.shape)}{hint}"
    return None


def _reads(target: Target, index: int, entry: TensorEntry) -> ReadItem | None:
    """The single contiguous byte range of ``entry`` this rank needs for ``target``."""
    if target.kind == PARTITION:
        first, count = target.partition.start, target.partition.valid
    else:
        first, count = 0, entry.numel
    if count == 0:
        return None
    size = entry.itemsize
    return ReadItem(entry.file, entry.start + first * size, count * size, DTYPES[entry.dtype][0],
                    index, 0, count)


def make_plan(index: CheckpointIndex, targets: list[Target], *, strict: bool = True) -> LoadPlan:
    """Match every target to a checkpoint tensor and list the reads; never raises for bad input."""
    plan = LoadPlan(targets, index.source, index.total_bytes)
    claimed: set[str] = set()
    for i, target in enumerate(targets):
        claimed.update(target.names)
        entry = _source_for(target, index)
        if entry is None:
            if target.required:
                plan.missing.append(target.name)
            continue
        problem = target.problem or _compatibility_problem(target, entry)
        if problem:
            plan.problems.append(f"'{target.name}' ({entry.file}, tensor '{entry.name}'): {problem}")
            continue
        plan.sources[i] = entry
        plan.loaded.append(target.name)
        if target.kind == ORPHAN:
            plan.orphans.append(target.name)
        if DTYPES[entry.dtype][0] != target.dtype:
            plan.conversions.setdefault(f"{entry.dtype}->{target.dtype}", []).append(target.name)
        item = _reads(target, i, entry)
        if item is not None:
            plan.items.append(item)
    plan.unexpected = sorted(set(index.tensors) - claimed)
    if strict and plan.missing:
        shown = ", ".join(plan.missing[:20]) + (" ..." if len(plan.missing) > 20 else "")
        plan.problems.append(f"{len(plan.missing)} model tensors are not in the checkpoint "
                             f"{index.source} (strict=True): {shown}")
    return plan
