"""Node-local checkpoints: ranks that cannot see a file get their bytes from ranks that can.

Each rank first indexes what it sees (``local_view``). When every rank sees every file (a shared
filesystem), their views' fingerprints match and nothing else here runs. Otherwise the ranks
share the headers of the files some rank lacks (``share_index``), plan as usual, and then each
rank that lacks a file asks one of its readers for exactly the byte ranges it would have read
itself; readers send them point to point in bounded batches (``fetch_remote``).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from .digest import DIGEST_KEY, block_count, block_digests, data_digest, recorded_mismatch, sample_digests
from .distributed import (BATCH_FAILED, BATCH_OK, Problem, collective, comm_device, exchange, problems_of, raise_for,
                          rank_and_world)
from .errors import CheckpointError, CheckpointNotFoundError, InvalidCheckpointError
from .execute import DEFAULT_STAGING_BYTES, RangeReader, byte_view, reader_count
from .files import FileTable, OpenFile
from .index import CheckpointIndex, TensorEntry, open_checkpoint
from .kernels import Segment, scatter_cast
from .plan import ALIGN, ReadItem, staging_batches



@dataclass
class SharedIndex:
    """The whole checkpoint as this rank sees it, and which of its files other ranks must send."""

    index: CheckpointIndex
    root: str  # the folder file keys are relative to on this rank
    readers: dict[str, list[int]] = field(default_factory=dict)  # files some rank lacks -> holders
    remote_files: frozenset[str] = frozenset()  # this rank's paths of the files it lacks

    @property
    def sharing(self) -> bool:
        """Some rank lacks some file (the same answer on every rank)."""
        return bool(self.readers)

    def ranks_reading(self, files) -> list[int]:
        """The ranks that can read every one of ``files`` (paths as this rank names them)."""
        ranks = set(range(rank_and_world()[1]))
        for file in files:
            ranks &= set(self.readers.get(file_key(self.root, file), ranks))
        return sorted(ranks)


def file_key(root: str, path: str) -> str:
    """How ranks name a checkpoint file to each other: its path relative to the checkpoint's
    folder (the same on every node, wherever the folder is)."""
    return os.path.relpath(path, root)


def _root(source: str) -> str:
    absolute = os.path.abspath(source)
    return absolute if os.path.isdir(absolute) or not os.path.splitext(absolute)[1] else os.path.dirname(absolute)


@dataclass
class LocalView:
    """What this rank sees of a checkpoint, before any communication."""

    source: str
    index: CheckpointIndex | None  # None: no such path on this rank
    # file key -> (SHA-256 of its header, fingerprint of its data: sampled, whole, or "" unchecked)
    digests: dict[str, tuple[str, str]] = field(default_factory=dict)
    known: list[str] = field(default_factory=list)  # the file keys the index lists
    problems: list[Problem] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        """This rank can read every file of the checkpoint."""
        return self.index is not None and not self.index.absent and not self.problems

    @property
    def fingerprint(self) -> int:
        """Equal on two ranks (but for a 2**-62 chance) exactly when they see the same files with
        the same headers and data digests; non-negative and below 2**62, so that it and its
        negation fit in int64."""
        view = repr((sorted(self.digests.items()), self.known, self.index is not None)).encode()
        return int.from_bytes(hashlib.sha1(view).digest()[:8], "little") >> 2

    def opened(self) -> dict[str, OpenFile]:
        """This rank's open checkpoint files, by file key."""
        if self.index is None:
            return {}
        root = _root(self.source)
        return {file_key(root, path): f for path, f in self.index.opened.files.items()
                if path in self.index.files}

    def shared(self) -> SharedIndex:
        """This view as the whole checkpoint, for when every rank has seen the same whole one."""
        return SharedIndex(self.index, _root(self.source))

    def close(self) -> None:
        if self.index is not None:
            self.index.close()


def local_view(source: str, verify: str = "sample") -> LocalView:
    """Index ``source`` as this rank sees it. Shards it lacks are noted; bad headers, and any other
    exception, become ``problems`` (never raised: every rank must reach the agreement step).

    ``verify`` is ``load_into``'s: "sample" digests a sample of each file's data when there are
    other ranks to compare with; "full" leaves the data to ``verify_fully``.
    """
    def index():
        if not os.path.lexists(source):
            return LocalView(source, None)
        view = LocalView(source, open_checkpoint(source, missing_ok=True))
        try:
            files = view.opened()
            # the data are sampled when there is another rank to compare with, except for files
            # whose header records a digest of all their data (a zload save)
            sampled = [key for key, f in files.items() if DIGEST_KEY not in f.metadata] \
                if verify == "sample" and rank_and_world()[1] > 1 else []
            samples = dict(zip(sampled, sample_digests(
                [(files[k].fd, files[k].data_start, files[k].identity.size) for k in sampled])))
            view.digests = {key: (f.header_sha256, samples.get(key, "")) for key, f in files.items()}
        except BaseException:
            view.close()
            raise
        view.known = sorted(file_key(_root(source), f) for f in view.index.files)
        return view

    view, problems = problems_of(f"indexing {source}", index)
    return view or LocalView(source, None, problems=problems)


def verify_fully(view: LocalView) -> None:
    """``verify="full"``: digest every byte of every file this rank sees, into ``view.digests``.

    Every rank must call it. The ranks that see the same physical file (same host, device and
    inode) split its blocks among themselves, so each node reads each file once; a file whose
    header records its digest (``zload.save``) must match it. Problems go to ``view.problems``.
    """
    rank, world = rank_and_world()
    host = socket.gethostname()
    files = view.opened()
    mine = {key: (host, f.identity) for key, f in files.items()}
    identities = exchange(mine)
    groups = {key: [r for r, theirs in enumerate(identities) if theirs.get(key) == ident]
              for key, ident in mine.items()}

    def hash_my_blocks():
        return {key: block_digests(f.fd, f.data_start, f.identity.size,
                                   range(groups[key].index(rank), block_count(f.data_start, f.identity.size),
                                         len(groups[key])), threads=reader_count())
                for key, f in files.items()}

    computed, problems = problems_of("digesting the checkpoint's files", hash_my_blocks)
    everyone = exchange(computed)
    view.problems += problems
    if any(blocks is None for blocks in everyone):  # share_index raises, naming the rank
        return
    for key, f in files.items():
        blocks = {}
        for r in groups[key]:
            blocks.update(everyone[r][key])
        digest = data_digest(blocks, block_count(f.data_start, f.identity.size))
        wrong = recorded_mismatch(f.path, f.metadata, digest)
        if wrong:
            view.problems.append(Problem.of(InvalidCheckpointError(wrong, path=f.path)))
        view.digests[key] = (f.header_sha256, digest)


def share_index(view: LocalView, what: str) -> SharedIndex | None:
    """Every rank's ``view`` made into the whole checkpoint on each rank, the files this rank lacks
    filled in from others; None when no rank has the path (then it may be a Hub repo id).

    Every rank must call it; any rank's problem raises the same error (headed ``what``) on all.
    When every rank has the same whole checkpoint, ``view.shared()`` is the answer without this
    exchange (see ``load_into``).
    """
    rank, world = rank_and_world()
    source = view.source
    local = view.index
    views = exchange((view.problems, view.digests, view.known, local is not None))
    raise_for([v[0] for v in views], what)
    if not any(v[3] for v in views):
        return None

    keys = sorted(set().union(*(set(v[2]) for v in views)))
    readers = {k: [r for r, v in enumerate(views) if k in v[1]] for k in keys}
    for key in keys:
        if not readers[key]:
            where = "missing on every node" if world > 1 else "it does not exist"
            raise CheckpointNotFoundError(f"{source}: '{key}' is part of the checkpoint but no rank can "
                                          f"read it ({where})", path=os.path.join(_root(source), key))
        copies: dict[tuple[str, str], list[int]] = {}
        for r in readers[key]:
            copies.setdefault(tuple(views[r][1][key]), []).append(r)
        if len(copies) > 1:
            differ = "headers" if len({h for h, _ in copies}) > 1 else "data (same headers)"
            groups = "; ".join(f"ranks {ranks}" for ranks in copies.values())
            raise InvalidCheckpointError(f"{key}: the copies of this file differ in their {differ} between "
                                         f"{groups}; every node must hold the same checkpoint",
                                         path=os.path.join(_root(source), key))
    lacking = [k for k in keys if len(readers[k]) < world]
    if not lacking:
        return SharedIndex(local, _root(source))

    # Each file some rank lacks: its first reader sends that file's header entries.
    root = _root(source)
    mine = {k: [(e.name, e.dtype, e.shape, e.start, e.nbytes) for e in local.tensors.values()
                if file_key(root, e.file) == k]
            for k in lacking if readers[k][0] == rank}
    shared: dict[str, list] = {}
    for part in exchange(mine):
        shared.update(part)
    tensors = dict(local.tensors) if local else {}
    for key, rows in shared.items():
        if rank not in readers[key]:
            for name, dtype, shape, start, nbytes in rows:
                tensors[name] = TensorEntry(name, os.path.join(root, key), dtype, tuple(shape), start, nbytes)
    files = tuple(os.path.join(root, k) for k in keys)
    index = CheckpointIndex(local.source if local else source, files, tensors,
                            opened=local.opened if local else FileTable())
    remote = frozenset(os.path.join(root, k) for k in lacking if rank not in readers[k])
    return SharedIndex(index, root, {k: readers[k] for k in lacking}, remote)


def _server(readers: list[int], requester: int, world: int) -> int:
    """The reader that serves ``requester``: the ranks lacking a file are spread over its readers."""
    lacking = [r for r in range(world) if r not in readers]
    return readers[lacking.index(requester) % len(readers)]


def fetch_remote(shared: SharedIndex, items: list[ReadItem], dests: list[torch.Tensor],
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> tuple[int, int, int, list]:
    """Exchange the byte ranges ``items`` (this rank's reads of files it lacks) with their readers.

    Every rank must call this when ``shared.sharing``. Returns (bytes read for others, bytes
    sent, bytes received, problems). Pairs (reader -> requester) are served in one global order, so
    the sends and receives cannot deadlock. Within a pair, batches of half of
    ``staging_bytes`` alternate between two buffers: the reader reads the next batch while the
    last is being sent, the requester receives the next while writing the last.
    Each batch ends in a status byte: a reader whose read fails still sends every batch it owes
    (marked failed, unread), and a rank that fails to write what it received keeps receiving, so
    no rank waits forever; the caller agrees on the problems.
    """
    rank, world = rank_and_world()
    key = partial(file_key, shared.root)
    requests = [(_server(shared.readers[key(i.file)], rank, world), i) for i in items]
    wire = [(server, key(i.file), i.offset, i.nbytes, i.numel, i.src_dtype) for server, i in requests]
    everyone = exchange(wire)
    read = sent = received = 0
    problems: list[Problem] = []
    capacity = max(ALIGN * 2, staging_bytes // 2)
    outboxes = inboxes = None  # allocated once, when first needed; fresh ones would page-fault
    with RangeReader(shared.index.opened) as reader:  # its threads serve every batch read here
        for requester in range(world):
            for server in sorted({w[0] for w in everyone[requester]}):
                if rank == server:
                    mine = [ReadItem(os.path.join(shared.root, k), offset, nbytes, dtype, 0, 0, numel)
                            for s, k, offset, nbytes, numel, dtype in everyone[requester] if s == server]
                    outboxes = outboxes or [torch.empty(capacity + 1, dtype=torch.uint8) for _ in range(2)]
                    got, out, problems = _serve(staging_batches(mine, capacity), requester, outboxes, reader,
                                                problems)
                    read, sent = read + got, sent + out
                elif rank == requester:
                    mine = [i for s, i in requests if s == server]
                    inboxes = inboxes or [torch.empty(capacity + 1, dtype=torch.uint8, device=comm_device())
                                          for _ in range(2)]
                    got, problems = _receive(staging_batches(mine, capacity), server, inboxes, dests, problems)
                    received += got
    return read, sent, received, problems


def _used(batch: list[tuple[int, ReadItem]]) -> int:
    return batch[-1][0] + batch[-1][1].nbytes


def _serve(batches, requester: int, outboxes: list[torch.Tensor], reader: RangeReader,
           problems: list) -> tuple[int, int, list]:
    """Read and send each batch to ``requester``; returns (bytes read, bytes sent, problems).

    Batch k goes through ``outboxes[k % 2]``, whose send from batch k - 2 was waited for before
    batch k - 1 was sent.
    """
    read = sent = 0
    in_flight = None  # (work, the tensor being sent)
    for k, batch in enumerate(batches):
        used = _used(batch)
        message = outboxes[k % 2][:used + 1]  # the batch, then its status
        if not problems:
            view = byte_view(message)
            ranges = [(part.file, part.offset, view[start:start + part.nbytes]) for start, part in batch]
            got, problems = problems_of(f"reading for rank {requester}", partial(reader.read, ranges))
            read += got or 0
        message[used] = BATCH_FAILED if problems else BATCH_OK
        with collective():
            if in_flight is not None:
                in_flight[0].wait()
            outgoing = message.to(comm_device())
            in_flight = (dist.isend(outgoing, dst=requester), outgoing)
        sent += used
    if in_flight is not None:
        with collective():
            in_flight[0].wait()
    return read, sent, problems


def _receive(batches, server: int, inboxes: list[torch.Tensor], dests: list[torch.Tensor],
             problems: list) -> tuple[int, list]:
    """Receive each batch from ``server`` and write it; returns (bytes received, problems).

    Batch k lands in ``inboxes[k % 2]``, posted once batch k - 2 has been written from it.
    """
    received = 0
    pending = None  # (work, buffer, batch) received into but not yet written
    for k, batch in enumerate(batches):
        used = _used(batch)
        incoming = inboxes[k % 2][:used + 1]
        with collective():
            work = dist.irecv(incoming, src=server)
        if pending is not None:
            problems = _write_received(*pending, server, dests, problems)
        pending = (work, incoming, batch)
        received += used
    if pending is not None:
        problems = _write_received(*pending, server, dests, problems)
    return received, problems


def _write_received(work, incoming: torch.Tensor, batch, server: int, dests: list[torch.Tensor],
                    problems: list) -> list:
    """Wait for one received batch and write it into ``dests``, unless the load already failed."""
    with collective():
        work.wait()
    if int(incoming[-1]) != BATCH_OK and not problems:
        problems = [*problems, Problem(CheckpointError, f"rank {server} could not read the bytes this rank "
                                                        f"lacks (see rank {server}'s problem)")]
    if problems:
        return problems  # the load has failed: keep receiving, write no more
    segments = [Segment(start, getattr(torch, part.src_dtype), part.numel, part.target, part.dst_offset)
                for start, part in batch]
    _, problems = problems_of(f"writing the bytes rank {server} sent",
                              partial(scatter_cast, incoming, segments, dests))
    return problems
