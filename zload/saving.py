"""``save``: write a (ZeRO-3) model as Hugging Face-style safetensors, without gathering it.

Every rank computes the same file layout (names, shapes, dtypes, offsets) from metadata it already
has; then each rank writes the elements of its own partitions straight to their offsets in the
shared files. The files are written into a staging folder inside ``path``, read back for their
digests, and put in place by rank 0 only once every rank has finished (``savedir``), so a failed
or killed save leaves the checkpoint in ``path`` as it was, and nothing else there is touched.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import warnings
from dataclasses import dataclass
from functools import partial
from math import prod

import numpy

import torch

from .collector import collector_paused
from .digest import DIGEST_KEY, DIGEST_PLACEHOLDER, block_count, block_digests, data_digest
from .distributed import (
    BATCH_FAILED,
    BATCH_OK,
    agree,
    collective,
    comm_device,
    exchange,
    problems_of,
    rank_and_world,
    stage,
)
from .errors import ZloadError, ZloadWarning
from .execute import DEFAULT_STAGING_BYTES, reader_count
from .index import DTYPES, SINGLE_FILE, CheckpointIndex, TensorEntry
from .integrations.peft import peft_info, peft_role
from .integrations.transformers import transformers_model
from .integrations.transformers_registry import conversion_registry
from .names import match
from .report import SaveReport
from .savedir import LOCK, STAGING_PREFIX, SaveFolder
from .targets import ORPHAN, PARTITION, Target, collect_targets, dtype_name, unwrap

ADAPTER_FILE = "adapter_model.safetensors"
_CODES = {torch_name: code for code, (torch_name, _) in DTYPES.items()}


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the saved checkpoint, built from pieces of model tensors:
    ``(target index, element offset in the target, element offset in this tensor, numel)``."""

    name: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    pieces: tuple[tuple[int, int, int, int], ...]
    # Targets whose reversed transformers conversion is no byte layout: this tensor is written
    # whole by one rank from those targets gathered (the one place ``save`` gathers).
    built_from: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * getattr(torch, self.dtype).itemsize


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
        raise ZloadError(f"max_shard_size={size!r}: expected bytes or a size like '5GB' or '500MiB'")
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
        header[t.name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape),
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
    from transformers.core_model_loading import revert_weight_conversion

    meta = {targets[i].name: torch.empty(targets[i].shape, dtype=getattr(torch, targets[i].dtype),
                                         device="meta") for i in wanted}
    with conversion_registry():
        reverted = revert_weight_conversion(module, meta)
    fake = {}
    for k, (name, t) in enumerate(reverted.items()):
        fake[name] = TensorEntry(name, "", _CODES[dtype_name(t.dtype)], tuple(t.shape),
                                 k, t.numel() * t.element_size())
    matching = match(CheckpointIndex("", ("",), fake), targets, module)
    lost = [targets[i].name for i in wanted if i not in matching.sources]
    if lost or matching.unexpected:
        raise ZloadError(f"transformers' reversed conversion mapping does not round-trip for "
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


def _out_tensors(module, targets: list[Target], dtype: torch.dtype | None) -> tuple[list[OutTensor], str]:
    """The tensors to write, in model order, and the file name for a one-file checkpoint."""
    peft = peft_info(module)
    if peft is not None:  # an adapter alone, in peft's own names and file
        chosen = []
        for i, t in enumerate(targets):
            role, aliases = peft_role(t.name, *peft)
            if role == "adapter":
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
        floating = getattr(torch, targets[i].dtype).is_floating_point  # ints and bools keep theirs
        out_dtype = dtype_name(dtype) if dtype is not None and floating else targets[i].dtype
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
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


def plan_writes(files: list[OutFile], targets: list[Target], rank: int, world: int) -> list[WriteItem]:
    """This rank's writes: the elements of its own partitions, and the whole tensors it is the
    writer of (non-partitioned tensors are spread over the ranks round robin)."""
    items = []
    for f in files:
        for tensor, position in f.tensors:
            size = getattr(torch, tensor.dtype).itemsize
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


def _sources(targets: list[Target], master_weights: bool) -> dict[int, torch.Tensor]:
    """The flat tensor each target's elements are taken from on this rank."""
    sources = {}
    for i, t in enumerate(targets):
        if t.kind == PARTITION:
            source = t.tensor.ds_tensor.data.view(-1)
            if master_weights and t.tensor.requires_grad:
                from deepspeed.utils import safe_get_local_fp32_param

                source = safe_get_local_fp32_param(t.tensor).view(-1)
            sources[i] = source
        elif t.kind != ORPHAN:
            sources[i] = t.tensor.data.view(-1)
    return sources


def _split(item: WriteItem, max_bytes: int) -> list[WriteItem]:
    """``item`` in pieces of at most ``max_bytes`` (at least one element each)."""
    size = getattr(torch, item.dtype).itemsize
    step = max(1, max_bytes // size)
    return [WriteItem(item.file, item.offset + first * size, item.target, item.src_offset + first,
                      min(step, item.numel - first), item.dtype)
            for first in range(0, item.numel, step)]


def _chunks(item: WriteItem, source: torch.Tensor, staging_bytes: int):
    """(byte offset, bytes) of ``item`` in pieces of at most ``staging_bytes``, cast on the way."""
    for part in _split(item, staging_bytes):
        chunk = source[part.src_offset:part.src_offset + part.numel]
        chunk = chunk.detach().to(device="cpu", dtype=getattr(torch, part.dtype)).contiguous()
        yield part.offset, memoryview(chunk.view(torch.uint8).numpy())


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _Files:
    """Open shard files for writing, fsynced when closed."""

    def __init__(self, folder: str):
        self.folder, self.fds = folder, {}

    def fd(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = os.open(os.path.join(self.folder, name), os.O_WRONLY)
        return self.fds[name]

    def close(self, sync: bool) -> None:
        for fd in self.fds.values():
            if sync:
                os.fsync(fd)
            os.close(fd)
        self.fds = {}


def _write_local(items, sources, folder: str, staging_bytes: int) -> int:
    files = _Files(folder)
    written = 0
    try:
        for item in items:
            for offset, data in _chunks(item, sources[item.target], staging_bytes):
                _pwrite_all(files.fd(item.file), data, offset)
                written += len(data)
    finally:
        files.close(sync=True)
    return written


def _stream_to_rank0(items, sources, folder: str, staging_bytes: int,
                     problems: list) -> tuple[int, list]:
    """No shared filesystem: every rank sends its slices to rank 0, one bounded batch at a time,
    ranks in order; rank 0 writes them. Returns (bytes this rank wrote or sent, problems).

    Each batch ends in a status byte. A rank that fails (``problems`` on entry, or while preparing
    or writing) still sends or receives every batch it owes, marked failed or left unwritten, so
    no rank waits for one that gave up; the caller agrees on the problems.
    """
    import torch.distributed as dist

    rank, world = rank_and_world()
    device = comm_device()  # NCCL takes GPU tensors only
    mine = _batch(items, staging_bytes)
    batches = exchange([[(i.file, i.offset, i.nbytes) for i in batch] for batch in mine])
    if rank == 0:
        done = 0
        if not problems:
            done, problems = problems_of("writing", lambda: _write_local(items, sources, folder, staging_bytes))
        files = _Files(folder)
        for sender in range(1, world):
            for batch in batches[sender]:
                incoming = torch.empty(sum(n for _, _, n in batch) + 1, dtype=torch.uint8, device=device)
                with collective():
                    dist.recv(incoming, src=sender)
                if problems:
                    continue  # the save has failed: keep receiving, write no more
                if int(incoming[-1]) != BATCH_OK:
                    problems = [("ZloadError", f"rank {sender} could not send its slices (see its "
                                               "problem)")]
                    continue
                _, problems = problems_of(f"writing the slices rank {sender} sent",
                                          partial(_write_batch, files, batch, incoming[:-1].cpu()))
                done += 0 if problems else len(incoming) - 1
        _, closed = problems_of("closing the files", lambda: files.close(sync=True))
        return done or 0, problems or closed
    sent = 0
    for batch in mine:
        payload = torch.empty(sum(i.nbytes for i in batch) + 1, dtype=torch.uint8)
        if not problems:
            _, problems = problems_of("preparing the slices for rank 0",
                                      partial(_pack, batch, sources, payload))
        payload[-1] = BATCH_FAILED if problems else BATCH_OK
        with collective():
            dist.send(payload.to(device), dst=0)
        sent += len(payload) - 1
    return sent, problems


def _pack(batch: list[WriteItem], sources, payload: torch.Tensor) -> None:
    """``batch``'s bytes, cast, one after another at the start of ``payload``."""
    out, position = payload.numpy(), 0
    for item in batch:
        for _, data in _chunks(item, sources[item.target], 1 << 62):
            out[position:position + len(data)] = numpy.frombuffer(data, dtype=numpy.uint8)
            position += len(data)


def _write_batch(files: _Files, batch, data: torch.Tensor) -> None:
    view, position = memoryview(data.numpy()), 0
    for file, offset, nbytes in batch:
        _pwrite_all(files.fd(file), view[position:position + nbytes], offset)
        position += nbytes


def _batch(items: list[WriteItem], staging_bytes: int) -> list[list[WriteItem]]:
    """Items split and packed into batches of at most ``staging_bytes`` (same on every rank)."""
    batches, batch, size = [], [], 0
    for item in items:
        for part in _split(item, staging_bytes):
            if batch and size + part.nbytes > staging_bytes:
                batches.append(batch)
                batch, size = [], 0
            batch.append(part)
            size += part.nbytes
    if batch:
        batches.append(batch)
    return batches


def _write_converted(module, targets: list[Target], files: list[OutFile], folder: str,
                     shared: bool, master_weights: bool, failed: str) -> tuple[int, list[str]]:
    """Tensors whose transformers conversion is no byte layout: for each group of targets, all
    ranks gather those targets only (their fp32 masters with ``master_weights``), and one rank
    runs transformers' reversed conversion and writes the results. Returns (bytes written here,
    names of the gathered targets)."""
    placed = {t.name: (f.name, t, position) for f in files for t, position in f.tensors if t.built_from}
    groups = list(dict.fromkeys(t.built_from for _, t, _ in placed.values()))
    written, gathered = 0, []
    if not groups:
        return written, gathered
    import deepspeed
    from transformers.core_model_loading import revert_weight_conversion

    rank, world = rank_and_world()
    for k, group in enumerate(groups):
        writer = k % world if shared else 0
        params = [targets[i].tensor for i in group if targets[i].kind == PARTITION]
        problems = []
        with collective(), deepspeed.zero.GatheredParameters(params):
            # every rank: gathering a master is a collective
            full = {targets[i].name: _full_value(targets[i], master_weights) for i in group}
            if rank == writer:
                try:
                    with conversion_registry():
                        converted = revert_weight_conversion(module, full)
                    out = _Files(folder)
                    try:
                        for name, (file, tensor, position) in placed.items():
                            if tensor.built_from == group:
                                data = converted[name].to(getattr(torch, tensor.dtype)).contiguous()
                                _pwrite_all(out.fd(file), memoryview(data.view(torch.uint8).numpy()),
                                            position)
                                written += tensor.nbytes
                    finally:
                        out.close(sync=True)
                except Exception as e:
                    problems.append(("ZloadError", f"converting {[targets[i].name for i in group]} "
                                                   f"for saving failed: {type(e).__name__}: {e}"))
        agree(problems, failed)
        gathered += [targets[i].name for i in group]
    return written, gathered


def _full_value(target: Target, master_weights: bool) -> torch.Tensor:
    """A gathered target's whole tensor: its fp32 master where asked for and kept, else its data."""
    if master_weights and target.kind == PARTITION and target.tensor.requires_grad:
        from deepspeed.utils import safe_get_full_fp32_param

        master = safe_get_full_fp32_param(target.tensor)
        if master is not None:
            return master
    return target.tensor.data


def _sees(lock: str, token: str) -> bool:
    """Whether this rank sees the staging folder rank 0 just made, i.e. shares its filesystem."""
    try:
        with open(lock) as f:
            return f.readline().strip() == token
    except OSError:
        return False


def _create_files(files: list[OutFile], folder: str) -> None:
    for f in files:
        with open(os.path.join(folder, f.name), "wb") as out:
            out.write(f.header)
            out.truncate(f.size)


def _record_digests(files: list[OutFile], folder: str, writers: int, failed: str) -> None:
    """Read the written files back, each of the first ``writers`` ranks a share of their blocks,
    and write each file's data digest into its header (rank 0). Every rank must call it."""
    rank, _ = rank_and_world()
    blocks = [(f, k) for f in files for k in range(block_count(len(f.header), f.size))]
    mine = blocks[rank::writers] if rank < writers else []

    def hash_mine():
        digests = {}
        for f in files:
            wanted = [k for g, k in mine if g is f]
            if wanted:
                with open(os.path.join(folder, f.name), "rb") as src:
                    found = block_digests(src.fileno(), len(f.header), f.size, wanted, reader_count())
                digests.update(((f.name, k), d) for k, d in found.items())
        return digests

    digests, problems = problems_of("reading the written files back for their digests", hash_mine)
    agree(problems, failed)
    gathered = {}
    for part in exchange(digests):
        gathered.update(part)

    def record():
        for f in files:
            count = block_count(len(f.header), f.size)
            digest = data_digest({k: gathered[(f.name, k)] for k in range(count)}, count)
            fd = os.open(os.path.join(folder, f.name), os.O_WRONLY)
            try:
                _pwrite_all(fd, memoryview(digest.encode()), f.digest_at)
                os.fsync(fd)
            finally:
                os.close(fd)

    _, problems = problems_of("recording the digests", lambda: rank == 0 and record())
    agree(problems, failed)


def _stage_configs(module, folder: str) -> list[str]:
    """The configs transformers / peft need to load the folder, written into ``folder``; their names."""
    before = set(os.listdir(folder))
    peft = peft_info(module)
    if peft is not None:
        module.peft_config[peft[0]].save_pretrained(folder)
    elif hasattr(module, "config") and hasattr(module.config, "save_pretrained"):
        module.config.save_pretrained(folder)
        generation = getattr(module, "generation_config", None)
        if generation is not None and getattr(module, "can_generate", lambda: False)():
            generation.save_pretrained(folder)
    written = sorted(set(os.listdir(folder)) - before)
    for name in written:
        with open(os.path.join(folder, name), "rb+") as f:
            os.fsync(f.fileno())
    return written


def _publish(folder: SaveFolder, module, single: str, files: list[OutFile]) -> None:
    """Rank 0: configs staged, the new checkpoint committed, then the leftovers of killed saves
    and this save's staging folder removed."""
    for f in files:
        with open(os.path.join(folder.staging, f.name), "rb+") as out:
            os.fsync(out.fileno())
    configs = _stage_configs(module, folder.staging)
    index = None
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for f in files for t, _ in f.tensors)},
                 "weight_map": {t.name: f.name for f in files for t, _ in f.tensors}}
    folder.commit(single, [f.name for f in files] if index else [], index, configs)
    folder.finish()


@collector_paused()
def save(model, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
         dtype: torch.dtype | None = None, master_weights: bool = False,
         shared_filesystem: bool | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
         buffer_bytes: int | None = None) -> SaveReport:
    """Write ``model`` (an nn.Module, ZeRO-3 or not, or a DeepSpeedEngine) to the folder ``path``.

    Layout as transformers writes it: ``model.safetensors``, or shards of at most
    ``max_shard_size`` with ``model.safetensors.index.json``; names in the form transformers
    expects for a ``PreTrainedModel`` (its config is saved too). A ``PeftModel`` saves its active
    adapter alone, as peft does (``adapter_model.safetensors`` + ``adapter_config.json``).
    Every parameter (trainable or frozen) and persistent buffer is written at full shape, tied
    weights once. No rank gathers anything: each writes its own partitions, in pieces of at most
    ``staging_bytes``. ``dtype`` converts on the way; ``master_weights`` writes a live engine's fp32
    master weights of trainable parameters. ``shared_filesystem=None`` detects whether all ranks
    see the same folder; if not, ranks stream their slices to rank 0. Must be called by every rank.
    Only zload's own files in ``path`` are written or removed (see ``zload.savedir``); a checkpoint
    already there is replaced only once every rank has succeeded, in one rename.
    ``buffer_bytes`` is the former name of ``staging_bytes`` (as ``load_into`` calls it).
    """
    if buffer_bytes is not None:
        warnings.warn("zload.save(buffer_bytes=...) is now staging_bytes=..., as in load_into; "
                      "buffer_bytes will be removed", FutureWarning, stacklevel=3)
        staging_bytes = buffer_bytes
    started = time.perf_counter()
    rank, world = rank_and_world()
    module, engine = unwrap(model)
    final = os.path.abspath(os.fspath(path))
    refused = f"zload: cannot save to {final}; nothing was written"

    def plan_save():
        if master_weights and engine is None:
            raise ZloadError("master_weights=True needs the DeepSpeedEngine, not its module")
        targets = collect_targets(module, live_engine=True)
        problems = [f"'{t.name}': {t.problem}" for t in targets if t.problem and t.kind != PARTITION]
        problems += [f"'{t.name}': a [0]-shaped parameter re-created after zero.Init; load it "
                     "(zload.load_into repairs it) before saving" for t in targets if t.kind == ORPHAN]
        if problems:
            raise ZloadError("; ".join(problems))
        tensors, single = _out_tensors(module, targets, torch.float32 if master_weights and dtype is None
                                       else dtype)
        # peft reads one adapter file only, so an adapter is never sharded
        limit = parse_size(max_shard_size) if single != ADAPTER_FILE else float("inf")
        files = layout(tensors, limit, single)
        return targets, single, files, plan_writes(files, targets, rank, world)

    with stage(f"planning the save to {final}", "Nothing was written."):
        planned, problems = problems_of("planning the save", plan_save)
        agree(problems, refused)
        token = exchange(secrets.token_hex(8) if rank == 0 else None)[0]
    targets, single, files, items = planned
    folder = SaveFolder(final, token) if rank == 0 else None
    staging = os.path.join(final, STAGING_PREFIX + token)
    as_it_was = f"{final} still holds what it held before"
    failed = f"zload: saving to {final} failed; {as_it_was} (rank 0 removes the partial files)"
    try:
        with stage(f"saving to {final}", f"{as_it_was}; the partial files in {staging} are "
                   f"removed by rank 0, or by the next save into {final} if rank 0 is gone."):
            _, problems = problems_of("creating the files",
                                      lambda: rank == 0 and (folder.begin(), _create_files(files, staging)))
            agree(problems, refused)
            shared = all(exchange(_sees(os.path.join(staging, LOCK), token))) \
                if shared_filesystem is None else shared_filesystem

            sources, problems = problems_of("finding the partitions to write",
                                            lambda: _sources(targets, master_weights))
            if not shared:
                written, problems = _stream_to_rank0(items, sources, staging, staging_bytes, problems)
            elif not problems:
                written, problems = problems_of(
                    "writing", lambda: _write_local(items, sources, staging, staging_bytes))
            agree(problems, failed)
            converted_bytes, gathered = _write_converted(module, targets, files, staging, shared,
                                                         master_weights, failed)
            written += converted_bytes
            _record_digests(files, staging, world if shared else 1, failed)
        with stage(f"putting the new files in place in {final}", "Rank 0 does that alone: "
                   f"depending on how far it got, {final} holds the old or the new checkpoint, never "
                   "a mix of both; the next save into it removes what is left over."):
            _, problems = problems_of("publishing",
                                      lambda: rank == 0 and _publish(folder, module, single, files))
            if problems:  # rank 0's: say what the folder holds now
                outcome = folder.abort()
                problems = [(cls, f"{message} ({outcome})") for cls, message in problems]
            agree(problems, f"zload: saving to {final} failed while putting the new files in place")
    except BaseException:
        if rank == 0:
            folder.abort()
        raise
    for note in folder.notes if folder else []:  # point at the caller's save() line
        warnings.warn(note, ZloadWarning, stacklevel=3)
    return SaveReport(final, [f.name for f in files], sum(f.size for f in files), written, gathered,
                      time.perf_counter() - started)
