"""The writer: perform a save plan. Every file save touches is opened here.

Each rank writes its parts of the shard files in the staging folder in place (``write_local``), or,
when ranks do not share a filesystem, sends them to rank 0 in staging batches (``stream_to_rank0``);
a conversion writes tensors read from a checkpoint's files (``write_from_files``).
Then the files are read back for their digests (``record_digests``) and rank 0 publishes them with
the configs (``publish``, through ``savedir.SaveFolder``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy
import torch

from ..checkpoint.digest import DIGEST_PLACEHOLDER, block_count, block_digests, data_digest
from ..checkpoint.dtypes import TORCH_DTYPES
from ..checkpoint.files import FileTable
from ..checkpoint.index import TensorEntry
from ..distributed import (
    BATCH_FAILED,
    BATCH_OK,
    Problem,
    agree,
    collective,
    comm_device,
    exchange,
    problems_of,
    rank_and_world,
    reader_count,
)
from ..errors import UnsupportedModelError, WriteError, ZloadError
from ..integrations.deepspeed import flat_partition, full_master, gathered_parameters, local_master
from ..integrations.peft import peft_info
from ..integrations.transformers import revert_conversion
from ..loading.execute import byte_view, execute
from ..loading.plan import ALIGN, ReadItem, align, staging_batches
from ..model.targets import ORPHAN, PARTITION, Target
from ..progress import Progress
from .folder import SaveFolder, writing
from .plan import Beside, OutFile, OutTensor, WriteItem


def partition_sources(targets: list[Target], master_weights: bool) -> dict[int, torch.Tensor]:
    """The flat tensor each target's elements are taken from on this rank."""
    sources = {}
    for i, t in enumerate(targets):
        if t.kind == PARTITION:
            source = flat_partition(t.tensor)
            if master_weights and t.tensor.requires_grad:
                source = local_master(t.tensor).view(-1)
            sources[i] = source
        elif t.kind != ORPHAN:
            sources[i] = t.tensor.data.view(-1)
    return sources


def _chunks(item: WriteItem, source: torch.Tensor, staging_bytes: int):
    """(byte offset, bytes) of ``item`` in pieces of at most ``staging_bytes``, cast on the way."""
    for part in item.split(staging_bytes):
        chunk = source[part.src_offset:part.src_offset + part.numel]
        chunk = chunk.detach().to(device="cpu", dtype=part.dtype).contiguous()
        yield part.offset, memoryview(chunk.view(torch.uint8).numpy())


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _Files:
    """Open shard files for writing, fsynced when closed; an ``OSError`` (a full disk) is a
    ``WriteError`` naming the file."""

    def __init__(self, folder: str):
        self.folder, self.fds = folder, {}

    def write(self, name: str, data: memoryview, offset: int) -> None:
        with writing(os.path.join(self.folder, name)):
            if name not in self.fds:
                self.fds[name] = os.open(os.path.join(self.folder, name), os.O_WRONLY)
            _pwrite_all(self.fds[name], data, offset)

    def close(self, sync: bool) -> None:
        """Close every file, fsynced first with ``sync``; raises the first failure once all are closed."""
        fds, self.fds = self.fds, {}
        failure = None
        for name, fd in fds.items():
            try:
                if sync:
                    with writing(os.path.join(self.folder, name)):
                        os.fsync(fd)
            except WriteError as e:
                failure = failure or e
            finally:
                os.close(fd)
        if failure is not None:
            raise failure


def write_own(items, sources, folder: str, shared: bool, staging_bytes: int, problems: list, failed: str,
              progress: Progress) -> int:
    """Write this rank's ``items`` (taken from ``sources``) into the files in ``folder``: in place
    where every rank sees it (``shared``), else streamed to rank 0; then agree on the problems
    (``problems`` those found before, raising ``failed``). Returns the bytes written or sent."""
    written = 0
    if not shared:
        written, problems = stream_to_rank0(items, sources, folder, staging_bytes, problems, progress)
    elif not problems:
        written, problems = problems_of("writing", lambda: write_local(items, sources, folder, staging_bytes,
                                                                       progress))
    agree(problems, failed)
    return written


def write_local(items, sources, folder: str, staging_bytes: int, progress: Progress) -> int:
    files = _Files(folder)
    written = 0
    try:
        for item in items:
            for offset, data in _chunks(item, sources[item.target], staging_bytes):
                files.write(item.file, data, offset)
                written += len(data)
                progress.update(len(data))
    finally:
        files.close(sync=True)
    return written


def write_from_files(items: list[WriteItem], sources: list[TensorEntry], table: FileTable, folder: str,
                     staging_bytes: int, progress: Progress | None = None) -> int:
    """Write ``items``, each taking its elements from the tensor ``sources[item.target]`` of a
    checkpoint whose files ``table`` holds, cast to the item's dtype. Nothing is held whole: a
    batch at a time, the executor reads (and casts) into one of two output buffers while a thread
    writes the batch before from the other; with the executor's staging for casts, that is
    ``staging_bytes`` in all. Returns the bytes written."""
    capacity = max(2 * ALIGN, align(min(staging_bytes // 4, sum(i.nbytes + ALIGN for i in items))))
    buffers = [torch.empty(capacity, dtype=torch.uint8) for _ in range(2)]
    files, pending, written = _Files(folder), None, 0
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="zload-write") as pool:
            for k, batch in enumerate(staging_batches(items, capacity)):
                reads, destinations = _reads_into(batch, sources, buffers[k % 2])
                execute(table, reads, destinations, staging_bytes // 2, progress)
                if pending is not None:
                    pending.result()  # the write of the batch before: its buffer is the next one
                pending = pool.submit(_write_batch, files, [(at, i.file, i.offset, i.nbytes) for at, i in batch],
                                      buffers[k % 2])
                written += sum(i.nbytes for _, i in batch)
            if pending is not None:
                pending.result()
    finally:
        files.close(sync=True)
    return written


def _reads_into(batch: list[tuple[int, WriteItem]], sources: list[TensorEntry],
                buffer: torch.Tensor) -> tuple[list[ReadItem], list[torch.Tensor]]:
    """The executor's reads that put each part of ``batch`` at its offset in ``buffer``, and their
    destinations: ``buffer`` seen as each dtype written."""
    dtypes = sorted({part.dtype for _, part in batch}, key=str)
    destinations = [buffer.view(dtype) for dtype in dtypes]
    reads = []
    for at, part in batch:
        entry, size = sources[part.target], part.dtype.itemsize
        for file, offset, skip, count in entry.spans(part.src_offset, part.numel):
            reads.append(ReadItem(file, offset, count * entry.itemsize, TORCH_DTYPES[entry.dtype],
                                  dtypes.index(part.dtype), at // size + skip, count))
    return reads, destinations


def stream_to_rank0(items, sources, folder: str, staging_bytes: int, problems: list,
                    progress: Progress) -> tuple[int, list]:
    """No shared filesystem: every rank sends its slices to rank 0, one bounded batch at a time,
    ranks in order; rank 0 writes them. Returns (bytes this rank wrote or sent, problems).

    Each batch ends in a status byte. A rank that fails (``problems`` on entry, or while preparing
    or writing) still sends or receives every batch it owes, marked failed or left unwritten, so
    no rank waits for one that gave up; the caller agrees on the problems.
    """
    import torch.distributed as dist

    rank, world = rank_and_world()
    device = comm_device()  # NCCL takes GPU tensors only
    mine = staging_batches(items, max(2 * ALIGN, staging_bytes))
    described = [[(at, i.file, i.offset, i.nbytes) for at, i in batch] for batch in mine]
    batches = exchange(described)
    if rank == 0:
        done = 0
        if not problems:
            done, problems = problems_of("writing", partial(write_local, items, sources, folder, staging_bytes,
                                                            progress))
        files = _Files(folder)
        for sender in range(1, world):
            for batch in batches[sender]:
                incoming = torch.empty(_payload_bytes(batch), dtype=torch.uint8, device=device)
                with collective():
                    dist.recv(incoming, src=sender)
                if problems:
                    continue  # the save has failed: keep receiving, write no more
                if int(incoming[-1]) != BATCH_OK:
                    problems = [Problem(ZloadError, f"rank {sender} could not send its slices (see its "
                                                    "problem)")]
                    continue
                _, problems = problems_of(f"writing the slices rank {sender} sent",
                                          partial(_write_batch, files, batch, incoming.cpu()))
                if not problems:
                    done += sum(nbytes for *_, nbytes in batch)
                    progress.update(sum(nbytes for *_, nbytes in batch))
        _, closed = problems_of("closing the files", lambda: files.close(sync=True))
        return done or 0, problems or closed
    sent = 0
    for batch, description in zip(mine, described):
        payload = torch.empty(_payload_bytes(description), dtype=torch.uint8)
        if not problems:
            _, problems = problems_of("preparing the slices for rank 0",
                                      partial(_pack, batch, sources, payload))
        payload[-1] = BATCH_FAILED if problems else BATCH_OK
        with collective():
            dist.send(payload.to(device), dst=0)
        sent += sum(i.nbytes for _, i in batch)
    return sent, problems


def _payload_bytes(description) -> int:
    """A batch's message: its staging layout (its last part ends it) and a status byte."""
    at, _, _, nbytes = description[-1]
    return at + nbytes + 1


def _pack(batch: list[tuple[int, WriteItem]], sources, payload: torch.Tensor) -> None:
    """``batch``'s bytes, cast, each part at its staging offset in ``payload``."""
    out = payload.numpy()
    for at, item in batch:
        for _, data in _chunks(item, sources[item.target], item.nbytes):
            out[at:at + len(data)] = numpy.frombuffer(data, dtype=numpy.uint8)


def _write_batch(files: _Files, batch, data: torch.Tensor) -> None:
    view = byte_view(data)
    for at, file, offset, nbytes in batch:
        files.write(file, view[at:at + nbytes], offset)


def _converted(files: list[OutFile]) -> dict[tuple[int, ...], list[tuple[str, OutTensor, int]]]:
    """The tensors whose transformers conversion is no byte layout, as (file, tensor, offset), by
    the group of targets they are built from, in file order; group ``k`` is written by rank
    ``k % world`` (rank 0 where the ranks do not share the folder)."""
    groups: dict[tuple[int, ...], list[tuple[str, OutTensor, int]]] = {}
    for f in files:
        for t, position in f.tensors:
            if t.built_from:
                groups.setdefault(t.built_from, []).append((f.name, t, position))
    return groups


def bytes_written_here(items: list[WriteItem], files: list[OutFile], shared: bool) -> int:
    """The bytes this rank writes into ``files``: its ``items`` and its share of the converted
    tensors, or, where the ranks do not share the folder, all of them on rank 0 and none elsewhere."""
    rank, world = rank_and_world()
    if not shared:
        return sum(t.nbytes for f in files for t, _ in f.tensors) if rank == 0 else 0
    converted = [t.nbytes for k, tensors in enumerate(_converted(files).values()) if k % world == rank
                 for _, t, _ in tensors]
    return sum(i.nbytes for i in items) + sum(converted)


def write_converted(module, targets: list[Target], files: list[OutFile], folder: str, shared: bool,
                    master_weights: bool, failed: str, progress: Progress) -> tuple[int, list[str]]:
    """Tensors whose transformers conversion is no byte layout: for each group of targets, all
    ranks gather those targets only (their fp32 masters with ``master_weights``), and one rank
    runs transformers' reversed conversion and writes the results. Returns (bytes written here,
    names of the gathered targets)."""
    groups = _converted(files)
    written, gathered = 0, []
    if not groups:
        return written, gathered
    rank, world = rank_and_world()
    for k, (group, tensors) in enumerate(groups.items()):
        writer = k % world if shared else 0
        params = [targets[i].tensor for i in group if targets[i].kind == PARTITION]
        problems = []
        with collective(), gathered_parameters(params):
            # every rank: gathering a master is a collective
            full = {targets[i].name: _full_value(targets[i], master_weights) for i in group}
            if rank == writer:
                try:
                    converted = revert_conversion(module, full)
                    out = _Files(folder)
                    try:
                        for file, tensor, position in tensors:
                            data = converted[tensor.name].to(tensor.dtype).contiguous()
                            out.write(file, memoryview(data.view(torch.uint8).numpy()), position)
                            written += tensor.nbytes
                            progress.update(tensor.nbytes)
                    finally:
                        out.close(sync=True)
                except ZloadError as e:
                    problems.append(Problem.of(e))
                except Exception as e:
                    problems.append(Problem(UnsupportedModelError, f"converting {[targets[i].name for i in group]} "
                                                                   f"for saving failed: {type(e).__name__}: {e}"))
        agree(problems, failed)
        gathered += [targets[i].name for i in group]
    return written, gathered


def _full_value(target: Target, master_weights: bool) -> torch.Tensor:
    """A gathered target's whole tensor: its fp32 master where asked for and kept, else its data."""
    if master_weights and target.kind == PARTITION and target.tensor.requires_grad:
        master = full_master(target.tensor)
        if master is not None:
            return master
    return target.tensor.data


def sees(lock: str, token: str) -> bool:
    """Whether this rank sees the staging folder rank 0 just made, i.e. shares its filesystem."""
    try:
        with open(lock) as f:
            return f.readline().strip() == token
    except OSError:
        return False


def create_files(files: list[OutFile], folder: str) -> None:
    for f in files:
        with writing(os.path.join(folder, f.name)), open(os.path.join(folder, f.name), "wb") as out:
            out.write(f.header)
            out.truncate(f.size)


def record_digests(files: list[OutFile], folder: str, writers: int, failed: str) -> None:
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
        out = _Files(folder)
        try:
            for f in files:
                count = block_count(len(f.header), f.size)
                digest = data_digest({k: gathered[(f.name, k)] for k in range(count)}, count)
                out.write(f.name, memoryview(digest.encode()), f.digest_at)
        finally:
            out.close(sync=True)

    _, problems = problems_of("recording the digests", lambda: rank == 0 and record())
    agree(problems, failed)


def write_model_configs(module, folder: str) -> None:
    """The configs transformers / peft need to load a save of ``module``, written into ``folder``."""
    peft = peft_info(module)
    if peft is not None:
        module.peft_config[peft[0]].save_pretrained(folder)
    elif hasattr(module, "config") and hasattr(module.config, "save_pretrained"):
        module.config.save_pretrained(folder)
        generation = getattr(module, "generation_config", None)
        if generation is not None and getattr(module, "can_generate", lambda: False)():
            generation.save_pretrained(folder)


def _stage_configs(write_configs, folder: str) -> list[str]:
    """The configs ``write_configs(folder)`` writes into ``folder``, made durable; their names."""
    before = set(os.listdir(folder))
    with writing(folder):
        write_configs(folder)
    written = sorted(set(os.listdir(folder)) - before)
    for name in written:
        _fsync(os.path.join(folder, name))
    return written


def _fsync(path: str) -> None:
    with writing(path), open(path, "rb+") as f:
        os.fsync(f.fileno())


def _index(files: list[OutFile], metadata: dict | None = None) -> dict:
    """The index of ``files``: which holds each tensor."""
    return {"metadata": {**(metadata or {}), "total_size": sum(t.nbytes for f in files for t, _ in f.tensors)},
            "weight_map": {t.name: f.name for f in files for t, _ in f.tensors}}


def recorded_digest(folder: str, f: OutFile) -> str:
    """The data digest ``record_digests`` wrote into the header of ``f`` in ``folder``."""
    with open(os.path.join(folder, f.name), "rb") as src:
        return os.pread(src.fileno(), len(DIGEST_PLACEHOLDER), f.digest_at).decode()


def publish(folder: SaveFolder, single: str, files: list[OutFile], write_configs,
            beside: Beside | None = None) -> dict[str, str]:
    """Rank 0: configs staged (``write_configs(staging folder)`` writes them), the new checkpoint
    committed (with ``beside``, the files saved beside the weights, whose index records the
    weights' data digests), then the leftovers of killed saves and this save's staging folder
    removed. Returns the shards' names in the folder (``SaveFolder.commit``)."""
    for f in files + (beside.files if beside else []):
        _fsync(os.path.join(folder.staging, f.name))
    configs = _stage_configs(write_configs, folder.staging)
    index = _index(files) if len(files) > 1 else None
    besides = None
    if beside is not None:
        digests = sorted(recorded_digest(folder.staging, f) for f in files)
        besides = ([f.name for f in beside.files], _index(beside.files, {**beside.metadata, "weights": digests}))
    renamed = folder.commit(single, [f.name for f in files] if index else [], index, configs, besides)
    folder.finish()
    return renamed
