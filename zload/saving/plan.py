"""The save plan: what ``save`` writes where, computed from metadata every rank already has.

Pure and the same on every rank (as ``plan`` is for loading): the tensors of the checkpoint and
their names, the shard files and their headers, this rank's writes, and how they are cut into
staging batches. No files, no processes; ``writer`` performs it, ``saving.save`` orchestrates.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from math import prod

import torch

from ..checkpoint.digest import DIGEST_KEY, DIGEST_PLACEHOLDER
from ..checkpoint.dtypes import CODES
from ..checkpoint.index import SINGLE_FILE, CheckpointIndex, TensorEntry
from ..errors import ArgumentValueError, PlanError, UnsupportedModelError
from ..integrations.peft import Role, peft_info, peft_role
from ..integrations.transformers import revert_conversion, transformers_model
from ..loading.plan import element_steps
from ..model.names import match
from ..model.targets import ORPHAN, PARTITION, Target
from ..report import shortened

ADAPTER_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the saved checkpoint, built from pieces of model tensors:
    ``(target index, element offset in the target, element offset in this tensor, numel)``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[tuple[int, int, int, int], ...]
    # Targets whose reversed transformers conversion is no byte layout: this tensor is written
    # whole by one rank from those targets gathered (the one place ``save`` gathers).
    built_from: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class OutFile:
    name: str
    header: bytes  # length prefix + JSON, padded to 8 bytes
    tensors: tuple[tuple[OutTensor, int], ...]  # each with its absolute offset in the file
    digest_at: int  # where the data digest goes in the header, once known

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t, _ in self.tensors)


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal, as transformers counts; ``"5GiB"`` is binary)."""
    if isinstance(size, int):
        return size
    match_ = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", size.upper())
    if not match_:
        raise ArgumentValueError(f"max_shard_size={size!r}: expected bytes or a size like '5GB' or '500MiB'")
    number, unit, binary = match_.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit or " "))


def layout(tensors: list[OutTensor], max_shard_bytes: int, single_name: str = SINGLE_FILE) -> list[OutFile]:
    """The shards transformers' ``save_pretrained`` writes for these tensors: huggingface_hub's
    splitter (in order, a shard closed before it would exceed ``max_shard_bytes``, a larger tensor
    alone in its own); one file keeps ``single_name``, several are ``model-0000k-of-0000N.safetensors``."""
    from huggingface_hub import split_state_dict_into_shards_factory  # lazily: zload imports without it

    split = split_state_dict_into_shards_factory(
        {t.name: t for t in tensors}, get_storage_size=lambda t: t.nbytes, max_shard_size=max_shard_bytes,
        filename_pattern=single_name.replace(".safetensors", "{suffix}.safetensors"))
    by_name = {t.name: t for t in tensors}
    return [_file(name, [by_name[key] for key in keys]) for name, keys in split.filename_to_tensors.items()]


def _file(name: str, tensors: list[OutTensor]) -> OutFile:
    """The file's header, with a placeholder for the digest of its data (filled in once written)."""
    header: dict = {"__metadata__": {"format": "pt", DIGEST_KEY: DIGEST_PLACEHOLDER}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to a multiple of 8 bytes
    blob = len(text).to_bytes(8, "little") + text
    placed, position = [], len(blob)
    for t in tensors:
        placed.append((t, position))
        position += t.nbytes
    # __metadata__ comes first, so the first occurrence is the placeholder's
    return OutFile(name, blob, tuple(placed), blob.index(DIGEST_PLACEHOLDER.encode()))


def _as_is(targets: list[Target], i: int, name: str) -> tuple:
    """Target ``i`` saved whole under ``name``: (name, shape, pieces, built_from)."""
    return name, targets[i].shape, ((i, 0, 0, prod(targets[i].shape)),), ()


def _checkpoint_names(module, targets: list[Target], wanted: list[int]) -> dict[int, list]:
    """For a transformers model: target index -> [(checkpoint name, shape, pieces, built_from)] in
    the form transformers writes (its conversion mapping reversed); else the model's own names.

    The reversed mapping is run on meta tensors to learn names and shapes; matching those names
    back (``names.match``) gives which elements of each model tensor each saved tensor holds.
    """
    if transformers_model(module) is None:
        return {i: [_as_is(targets, i, targets[i].name)] for i in wanted}
    meta = {targets[i].name: torch.empty(targets[i].shape, dtype=targets[i].dtype, device="meta") for i in wanted}
    reverted = revert_conversion(module, meta)
    fake = {}
    for k, (name, t) in enumerate(reverted.items()):
        fake[name] = TensorEntry(name, "", CODES[t.dtype], tuple(t.shape),
                                 k, t.numel() * t.element_size())
    matching = match(CheckpointIndex("", ("",), fake), targets, module)
    lost = [targets[i].name for i in wanted if i not in matching.sources]
    if lost or matching.unexpected:
        raise UnsupportedModelError(f"transformers' reversed conversion mapping does not round-trip for "
                                    f"{lost or matching.unexpected}; cannot name them as transformers would")
    out: dict[int, list] = {}
    for i, source in matching.sources.items():
        if source.convert is not None:
            fed = tuple(j for j, other in matching.sources.items() if other.entries == source.entries)
            out[i] = [(entry.name, entry.shape, (), fed) for entry in source.entries]
            continue
        for piece in source.pieces:
            out.setdefault(i, []).append((piece.entry.name, piece.entry.shape,
                                          ((i, piece.dst_offset, piece.src_offset, piece.numel),), ()))
    return out


def out_tensors(module, targets: list[Target], dtype: torch.dtype | None) -> tuple[list[OutTensor], str]:
    """The tensors to write, in model order, and the file name for a one-file checkpoint."""
    peft = peft_info(module)
    if peft is not None:  # an adapter alone, in peft's own names and file
        chosen = []
        for i, t in enumerate(targets):
            role, aliases = peft_role(t.name, *peft)
            if role == Role.ADAPTER:
                chosen.append((i, aliases[0]))
        wanted = [i for i, _ in chosen]
        names = {i: [_as_is(targets, i, name)] for i, name in chosen}
        single = ADAPTER_FILE
    else:
        wanted = [i for i, t in enumerate(targets) if t.required]
        names = _checkpoint_names(module, targets, wanted)
        single = SINGLE_FILE
    merged: dict[str, OutTensor] = {}
    for i in wanted:
        floating = targets[i].dtype.is_floating_point  # ints and bools keep theirs
        out_dtype = dtype if dtype is not None and floating else targets[i].dtype
        for name, shape, pieces, built_from in names.get(i, []):
            if name in merged:  # several model tensors feed one saved tensor
                prior = merged[name]
                merged[name] = OutTensor(name, prior.dtype, prior.shape, prior.pieces + pieces,
                                         prior.built_from)
            else:
                merged[name] = OutTensor(name, out_dtype, tuple(shape), pieces, built_from)
    return list(merged.values()), single


@dataclass(frozen=True)
class WriteItem:
    """Write ``numel`` elements of this rank's source for target ``target`` (from element
    ``src_offset``), cast to ``dtype``, at byte ``offset`` of file ``file``."""

    file: str
    offset: int
    target: int
    src_offset: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def split(self, max_bytes: int) -> list[WriteItem]:
        """This write cut into element-aligned pieces of at most ``max_bytes``."""
        size = self.dtype.itemsize
        return [WriteItem(self.file, self.offset + first * size, self.target, self.src_offset + first,
                          count, self.dtype)
                for first, count in element_steps(self.numel, size, max_bytes)]


def plan_writes(files: list[OutFile], targets: list[Target], rank: int, world: int) -> list[WriteItem]:
    """This rank's writes: the elements of its own partitions, and the whole tensors it is the
    writer of (non-partitioned tensors are spread over the ranks round robin)."""
    items = []
    for f in files:
        for tensor, position in f.tensors:
            size = tensor.dtype.itemsize
            for i, model_offset, out_offset, numel in tensor.pieces:
                target = targets[i]
                if target.kind == PARTITION:
                    low, high = target.partition.owned
                elif i % world == rank:
                    low, high = 0, prod(target.shape)
                else:
                    continue
                first, last = max(low, model_offset), min(high, model_offset + numel)
                if first < last:
                    items.append(WriteItem(f.name, position + (out_offset + first - model_offset) * size,
                                           i, first - low, last - first, tensor.dtype))
    return items


@dataclass(frozen=True)
class Beside:
    """Files saved beside the weights (the optimizer state): named from ``single``, always as
    shards with an index (``metadata`` its metadata), committed with the weights
    (``SaveFolder.commit``)."""

    single: str
    files: list[OutFile]
    metadata: dict


@dataclass(frozen=True)
class SavePlan:
    """Everything ``save`` writes, and this rank's share of it."""

    targets: list[Target]
    files: list[OutFile]
    single: str  # the file name of a one-file checkpoint (model or adapter)
    items: list[WriteItem]  # this rank's writes
    beside: Beside | None = None

    @property
    def written(self) -> list[OutFile]:
        """Every file the save writes: the weights' and those beside them."""
        return self.files + (self.beside.files if self.beside else [])


def make_save_plan(module, targets: list[Target], dtype: torch.dtype | None, max_shard_size: int | str,
                   rank: int, world: int) -> SavePlan:
    """The save plan of ``module``'s ``targets``; raises a ``PlanError`` naming every tensor that
    cannot be saved as it is."""
    problems = [f"'{t.name}': {t.problem}" for t in targets if t.problem and t.kind != PARTITION]
    problems += [f"'{t.name}': a [0]-shaped parameter re-created after zero.Init; load it "
                 "(zload.load_into repairs it) before saving" for t in targets if t.kind == ORPHAN]
    if problems:
        raise PlanError(shortened(problems, 8, "; "))
    tensors, single = out_tensors(module, targets, dtype)
    # peft reads one adapter file only, so an adapter is never sharded
    limit = parse_size(max_shard_size) if single != ADAPTER_FILE else float("inf")
    files = layout(tensors, limit, single)
    return SavePlan(targets, files, single, plan_writes(files, targets, rank, world))
