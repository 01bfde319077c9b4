"""Plan: join the model's targets with their checkpoint sources into byte-range reads.

Pure and deterministic: given the same index and targets every rank computes the same problems
in the same order, which is what lets ranks agree on an error before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

from ..checkpoint.dtypes import TORCH_DTYPES
from ..checkpoint.index import CheckpointIndex
from ..checkpoint.pieces import Source
from ..checkpoint.quantized import Scale
from ..model.names import Matching, match
from ..model.targets import ORPHAN, PARTITION, Target, dtype_name
from ..report import brief, ranks_named, shortened

_FLOATING = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
ALIGN = 64  # staging placement; keeps every dtype view aligned


def element_steps(numel: int, itemsize: int, max_bytes: int) -> list[tuple[int, int]]:
    """(first element, count) of consecutive pieces of at most ``max_bytes`` (one element at least)."""
    step = max(1, max_bytes // itemsize)
    return [(first, min(step, numel - first)) for first in range(0, numel, step)]


@dataclass(frozen=True)
class ReadItem:
    """Copy ``numel`` elements stored at ``file[offset:offset + nbytes]`` (dtype ``src_dtype``)
    into element ``dst_offset`` onward of target number ``target``, casting to its dtype."""

    file: str  # the file's key in the checkpoint; only the reader knows where it lies
    offset: int
    nbytes: int
    src_dtype: torch.dtype
    target: int  # index into LoadPlan.targets
    dst_offset: int
    numel: int
    # An FP8 weight's read: its scales, and the index of its first element in the whole weight
    # (which says which scale each element takes).
    scale: Scale | None = None
    first_element: int = 0

    @property
    def scale_rows(self) -> tuple[int, int]:
        """The flat scale rows ``[low, high)`` its elements need (read along with it)."""
        return self.scale.rows_for(self.first_element, self.numel)

    @property
    def scale_span(self) -> tuple[str, int, int]:
        """(file, byte offset, byte count) of its scale rows."""
        entry, (low, high) = self.scale.entry, self.scale_rows
        width = self.scale.grid[1]
        spans = entry.spans(low * width, (high - low) * width)
        return (spans[0][0], spans[0][1], (high - low) * width * entry.itemsize) if spans \
            else (entry.file, entry.start, 0)

    @property
    def staged_nbytes(self) -> int:
        """Staging bytes it takes: its own, then (aligned) its scale rows."""
        return align(self.nbytes) + self.scale_span[2] if self.scale else self.nbytes

    @property
    def least_staged(self) -> int:
        """Staging bytes its smallest piece takes: one element (and its row of scales)."""
        return self._part(0, 1, self.nbytes // self.numel).staged_nbytes

    def _part(self, first: int, count: int, itemsize: int) -> ReadItem:
        return ReadItem(self.file, self.offset + first * itemsize, count * itemsize, self.src_dtype,
                        self.target, self.dst_offset + first, count, self.scale, self.first_element + first)

    def split(self, max_bytes: int) -> list[ReadItem]:
        """This read cut into element-aligned pieces of at most ``max_bytes`` (staged bytes, scale
        rows included; one element at least)."""
        itemsize = self.nbytes // self.numel if self.numel else 1
        if self.scale is None:
            return [self._part(first, count, itemsize)
                    for first, count in element_steps(self.numel, itemsize, max_bytes)]
        parts, first = [], 0
        while first < self.numel:
            low, high = 1, self.numel - first  # the longest piece that fits, by bisection
            while low < high:
                middle = (low + high + 1) // 2
                if self._part(first, middle, itemsize).staged_nbytes <= max_bytes:
                    low = middle
                else:
                    high = middle - 1
            parts.append(self._part(first, low, itemsize))
            first += low
        return parts


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
    optimizer: object = None  # ``optimizer.OptimizerPlan``: a resume's, with optimizer=True

    @property
    def collectives(self) -> list[str]:
        """What in this plan takes part in collectives after the reads, in the order the load
        makes them: each slow-path conversion (its reader rank sends the others their parts) and
        each orphan (made a ZeRO-3 parameter by a broadcast). It must be the same on every rank,
        or one rank would wait in a collective the others never make. A resume's optimizer state
        comes last, described alike on every rank."""
        resumed = [self.optimizer.agreed] if self.optimizer is not None else []
        if not self.slow and not self.orphans:  # nearly every load: nothing to walk
            return resumed
        converted = [(self.targets[i], self.sources[i]) for i in self.slow]
        return [f"the conversion of '{target.name}' (from {', '.join(map(brief, source.names))}; "
                f"{dtype_name(target.dtype)} {list(source.shape)})" for target, source in converted] + \
               [f"the orphan '{target.name}' ({dtype_name(target.dtype)} {list(source.shape)})"
                for i, source in self.sources.items() if (target := self.targets[i]).kind == ORPHAN] + resumed


def collectives_differing(gathered: list[list[str]]) -> str:
    """How the ranks' ``LoadPlan.collectives`` (``gathered``, in rank order) differ: what some
    ranks' models have and the others' lack, or else that they come in different orders."""
    having: dict[str, list[int]] = {}
    for rank, described in enumerate(gathered):
        for item in described:
            having.setdefault(item, []).append(rank)
    lacked: dict[tuple[int, ...], list[str]] = {}
    for item, ranks in having.items():
        if len(ranks) < len(gathered):
            lacked.setdefault(tuple(ranks), []).append(item)
    if not lacked:
        return f"the ranks' models have {shortened(list(having), 3)}, but in different orders"
    parts = []
    for ranks, items in lacked.items():
        others = [r for r in range(len(gathered)) if r not in ranks]
        whose = f"{ranks_named(ranks)}'s model has" if len(ranks) == 1 else f"the models of {ranks_named(ranks)} have"
        lacks = f"{ranks_named(others)}'s lacks" if len(others) == 1 else f"those of {ranks_named(others)} lack"
        parts.append(f"{whose} {shortened(items, 3)} that {lacks}")
    return shortened(parts, 4, "; ")


def align(position: int) -> int:
    """The first staging offset at or after ``position`` where any dtype view is aligned."""
    return -(-position // ALIGN) * ALIGN


class StagingLayout:
    """Where byte ranges go in staging buffers of ``capacity`` bytes: each at the next aligned
    offset, and a new batch (from offset 0) whenever the current one has no room. Readers and the
    ranks they send to compute the same layout from the same items, so they agree on every offset.
    Items are anything with ``nbytes`` and ``split(max_bytes)`` (reads here, writes when saving)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.position = 0

    def parts(self, item):
        """``item`` cut into pieces that each fit a batch."""
        return item.split(self.capacity - ALIGN)

    def place(self, nbytes: int) -> int:
        """The offset of the next ``nbytes`` (a part); 0 starts a new batch."""
        start = align(self.position)
        if start + nbytes > self.capacity:
            start = 0
        self.position = start + nbytes
        return start


def staging_batches(items: list, capacity: int) -> list[list[tuple[int, object]]]:
    """``items`` cut and placed as batches of (staging offset, part), each at most ``capacity`` bytes."""
    layout = StagingLayout(capacity)
    batches: list[list[tuple[int, object]]] = []
    for item in items:
        for part in layout.parts(item):
            start = layout.place(part.nbytes)
            if start == 0:
                batches.append([])
            batches[-1].append((start, part))
    return batches


def staging_problems(plan: LoadPlan, staging_bytes: int) -> list[str]:
    """A problem if one element of an FP8 weight, staged with its row of scales, would not fit in
    a piece of the staging (``execute`` stages batches of half ``staging_bytes``, in pieces of at
    most that less ``ALIGN``): said while planning, not found part-way through the reads."""
    room = max(ALIGN, staging_bytes // 2) - ALIGN
    need: dict[str, int] = {}
    for item in plan.items:
        if item.scale is not None and item.least_staged > room:
            name = plan.targets[item.target].name
            need[name] = max(need.get(name, 0), item.least_staged)
    if not need:
        return []
    most, names = max(need.values()), [f"'{n}'" for n in sorted(need)]
    return [f"staging_bytes={staging_bytes} is too small for the FP8 weights {shortened(names, 5)}: one element "
            f"with its row of scales takes up to {most} staging bytes, and reads are staged in halves of "
            f"staging_bytes less {ALIGN}; pass staging_bytes={2 * (most + ALIGN)} or more"]


def _compatibility_problem(target: Target, source: Source) -> str | None:
    if source.scaled:
        if target.dtype not in _FLOATING - {torch.float64}:
            return f"an FP8 weight dequantises into float32, bfloat16 or float16, not {dtype_name(target.dtype)}"
        if source.convert is not None:
            return ("an FP8 weight converted by transformers beyond stacking and concatenation "
                    "cannot be dequantised by zload; load a dequantised copy")
    for entry in () if source.scaled else source.entries:
        src = TORCH_DTYPES[entry.dtype]
        if src != target.dtype and not (src in _FLOATING and target.dtype in _FLOATING):
            return f"checkpoint dtype {entry.dtype} cannot be cast to the model's {dtype_name(target.dtype)}"
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
        start = piece.src_offset + first - piece.dst_offset
        for file, offset, skip, count in entry.spans(start, last - first):
            items.append(ReadItem(file, offset, count * size, TORCH_DTYPES[entry.dtype], index,
                                  first + skip - low, count, piece.scale, start + skip))
    return items


def _describe(target: Target, source: Source) -> str:
    files = sorted({f for e in source.entries for f in e.files}) or ["(converted)"]
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
    refused: dict[str, list[str]] = {}  # problem -> the tensors that have it
    for i, target in enumerate(targets):
        source = matching.sources.get(i)
        if source is None:
            if target.required and (matching.required is None or i in matching.required):
                plan.missing.append(target.name)
            continue
        problem = target.problem or _compatibility_problem(target, source)
        if problem:
            refused.setdefault(problem, []).append(_describe(target, source))
            continue
        plan.sources[i] = source
        plan.loaded.append(target.name)
        if target.kind == ORPHAN:
            plan.orphans.append(target.name)
        for dtype in sorted({e.dtype for e in source.entries}):
            if TORCH_DTYPES[dtype] != target.dtype:
                plan.conversions.setdefault(f"{dtype}->{dtype_name(target.dtype)}", []).append(target.name)
        if source.convert is not None:
            plan.slow.append(i)
        else:
            plan.items.extend(_reads(target, i, source))
    # one line per problem, however many tensors have it (every persistent parameter gathered)
    plan.problems += [f"{shortened(described, 3)}: {problem}" for problem, described in refused.items()]
    if strict and plan.missing:
        plan.problems.append(f"{len(plan.missing)} model tensors are not in the checkpoint "
                             f"{index.source} (strict=True): {shortened(plan.missing, 20)}")
    return plan
