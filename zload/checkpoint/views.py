"""What the checkpoint is: a user's path made into the checkpoint's files and index.

A path is a ``.safetensors`` file, an index ``.json``, a folder holding either, or a Hugging Face
Hub repo id (``hub`` downloads it). One process indexes what it sees (``open_checkpoint``; the
command line's ``open_source`` also takes repo ids). In a job, each rank indexes its own view
(``local_view``); when the views differ (node-local shards) the ranks share the headers of the
files some rank lacks (``share_index``), and ``open_agreed`` settles on one whole checkpoint on
every rank, planning the load on the way so that the common case costs one all-reduce.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from ..distributed import (
    Choice,
    Problem,
    digest,
    exchange,
    problems_of,
    raise_for,
    rank_and_world,
    reader_count,
)
from ..errors import (
    CheckpointNotFoundError,
    InvalidCheckpointError,
)
from ..report import ranks_listed, shortened
from .digest import DIGEST_KEY, block_count, block_digests, data_digest, recorded_mismatch, sample_digests
from .files import FileTable, OpenFile, absolute_path
from .index import CheckpointIndex, TensorEntry
from .open import open_checkpoint
from .pagecache import forget
from .quantized import Quantization, agreed_quantization, read_quantization


class Verify(Choice):
    """How the ranks make sure they read the same bytes (``load_into``'s ``verify``)."""

    SAMPLE = "sample"  # the headers, and a sample of each file's data when there are other ranks
    FULL = "full"  # every byte, digested once per node (``verify_fully``), and a recorded digest checked


@dataclass
class SharedIndex:
    """The whole checkpoint as this rank sees it, and which of its files other ranks must send."""

    index: CheckpointIndex
    readers: dict[str, list[int]] = field(default_factory=dict)  # keys of files some rank lacks -> holders
    remote_files: frozenset[str] = frozenset()  # the keys of the files this rank lacks
    quantization: Quantization = Quantization()  # its config.json's, as the ranks agreed

    @property
    def sharing(self) -> bool:
        """Some rank lacks some file (the same answer on every rank)."""
        return bool(self.readers)

    def ranks_reading(self, files) -> list[int]:
        """The ranks that can read every one of ``files`` (keys)."""
        ranks = set(range(rank_and_world()[1]))
        for file in files:
            ranks &= set(self.readers.get(file, ranks))
        return sorted(ranks)


def _root(source: str) -> str:
    """The folder a checkpoint's keys are relative to, judged from the path alone (for a rank that
    does not have it)."""
    absolute = absolute_path(source)
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
    # (fd, offset, length): the sampled windows of files that looked uncached (this rank hinted them)
    sampled_cold: list[tuple[int, int, int]] = field(default_factory=list)
    # what its config.json says FP8 weights dequantise with: values depend on it as on the headers
    quantization: Quantization = Quantization()

    @property
    def whole(self) -> bool:
        """This rank can read every file of the checkpoint."""
        return self.index is not None and not self.index.absent and not self.problems

    @property
    def layout(self) -> tuple[list[str], str]:
        """The files the checkpoint is made of, and which holds each tensor (its weight map's digest)."""
        return self.known, self.index.weight_map_sha256 if self.index is not None else ""

    @property
    def fingerprint(self) -> int:
        """Equal on two ranks (a ``digest``) exactly when they see the same files with the same
        headers and data digests, the same weight map and the same quantization config."""
        return digest((sorted(self.digests.items()), self.layout, self.index is not None, self.quantization))

    def opened(self) -> dict[str, OpenFile]:
        """This rank's open checkpoint files, by file key."""
        if self.index is None:
            return {}
        return {key: f for key, f in self.index.opened.files.items() if key in self.index.files}

    def forget_sampled(self) -> None:
        """Drop from the page cache the sampled windows of files that looked uncached, once every
        rank has sampled (after a collective): they would break up the large requests of a cold
        load. A rank already reading may lose a window's page it pulled: it reads it again."""
        forget(self.sampled_cold)
        self.sampled_cold = []

    def shared(self) -> SharedIndex:
        """This view as the whole checkpoint, for when every rank has seen the same whole one."""
        return SharedIndex(self.index, quantization=self.quantization)

    def close(self) -> None:
        if self.index is not None:
            self.index.close()


def local_view(source: str, verify: Verify = Verify.SAMPLE) -> LocalView:
    """Index ``source`` as this rank sees it, and read its quantization config. Shards it lacks are
    noted; bad headers, and any other exception, become ``problems`` (never raised: every rank must
    reach the agreement step).

    ``verify`` is ``load_into``'s: "sample" digests a sample of each file's data when there are
    other ranks to compare with; "full" leaves the data to ``verify_fully``.
    """
    def index():
        if not os.path.lexists(source):
            return LocalView(source, None)
        view = viewed(source, open_checkpoint(source, missing_ok=True), verify)
        view.quantization = read_quantization(view.index.root)  # never raises
        return view

    view, problems = problems_of(f"indexing {source}", index)
    return view or LocalView(source, None, problems=problems)


def viewed(source: str, index: CheckpointIndex, verify: Verify = Verify.SAMPLE) -> LocalView:
    """``index`` as this rank's view of ``source``, with what tells its files from other copies: the
    SHA-256 of each header and, when there is another rank to compare with (``verify="sample"``),
    a sample of the data, except in files whose header records a digest of all of it (a zload
    save). Closes ``index`` if that fails."""
    view = LocalView(source, index, known=sorted(index.files))
    try:
        files = view.opened()
        sampled = [key for key, f in files.items() if DIGEST_KEY not in f.metadata] \
            if verify == Verify.SAMPLE and rank_and_world()[1] > 1 else []
        digests, view.sampled_cold = sample_digests(
            [(files[k].fd, files[k].data_start, files[k].identity.size) for k in sampled])
        samples = dict(zip(sampled, digests))
        view.digests = {key: (f.header_sha256, samples.get(key, "")) for key, f in files.items()}
    except BaseException:
        view.close()
        raise
    return view


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


def _same_layout(source: str, layouts: dict[int, tuple[list[str], str]]) -> None:
    """Raise unless the ranks that have ``source`` (``layouts``, by rank) see it made of the same
    files, with the same tensors in each: a rank lacking a file takes its tensors from another
    rank's view, so views that differ would mix two checkpoints."""
    ranks: dict[tuple, list[int]] = {}
    for rank, (known, weight_map) in layouts.items():
        ranks.setdefault((tuple(known), weight_map), []).append(rank)
    if len(ranks) <= 1:
        return
    files = {known for known, _ in ranks}
    if len(files) > 1:
        seen = "; ".join(f"ranks {ranks_listed(r)} see files {shortened(list(known), 4)}"
                         for (known, _), r in ranks.items())
    else:
        seen = "; ".join(f"ranks {ranks_listed(r)}" for r in ranks.values())
        seen += ": the same files, but different weight maps"
    raise InvalidCheckpointError(f"{source}: the ranks see different checkpoints there ({seen}); every node "
                                 "must hold the same checkpoint (the same files and index, or none of it)",
                                 path=source)


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
    views = exchange((view.problems, view.digests, view.known, local is not None, view.quantization, view.layout))
    raise_for([v[0] for v in views], what)
    if not any(v[3] for v in views):
        return None
    _same_layout(source, {r: v[5] for r, v in enumerate(views) if v[3]})

    keys = sorted(set().union(*(set(v[2]) for v in views)))
    readers = {k: [r for r, v in enumerate(views) if k in v[1]] for k in keys}
    root = local.root if local else _root(source)
    for key in keys:
        if not readers[key]:
            where = "missing on every node" if world > 1 else "it does not exist"
            raise CheckpointNotFoundError(f"{source}: '{key}' is part of the checkpoint but no rank can "
                                          f"read it ({where})", path=os.path.join(root, key))
        copies: dict[tuple[str, str], list[int]] = {}
        for r in readers[key]:
            copies.setdefault(tuple(views[r][1][key]), []).append(r)
        if len(copies) > 1:
            differ = "headers" if len({h for h, _ in copies}) > 1 else "data (same headers)"
            groups = "; ".join(f"ranks {ranks_listed(ranks)}" for ranks in copies.values())
            raise InvalidCheckpointError(f"{key}: the copies of this file differ in their {differ} between "
                                         f"{groups}; every node must hold the same checkpoint",
                                         path=os.path.join(root, key))
    quantization = agreed_quantization({r: v[4] for r, v in enumerate(views) if v[3]})
    lacking = [k for k in keys if len(readers[k]) < world]
    if not lacking:
        return SharedIndex(local, quantization=quantization)

    # Each file some rank lacks: its first reader sends that file's entries, whole (a DeepSpeed
    # checkpoint's tensors are fragments of several files, listed under the first).
    mine = {k: [e for e in local.tensors.values() if e.file == k] for k in lacking if readers[k][0] == rank}
    shared: dict[str, list[TensorEntry]] = {}
    for part in exchange(mine):
        shared.update(part)
    tensors = dict(local.tensors) if local else {}
    for key, entries in shared.items():
        if rank not in readers[key]:
            tensors.update((e.name, e) for e in entries)
    index = CheckpointIndex(local.source if local else source, tuple(keys), tensors,
                            opened=local.opened if local else FileTable(),
                            root=root)
    remote = frozenset(k for k in lacking if rank not in readers[k])
    return SharedIndex(index, {k: readers[k] for k in lacking}, remote, quantization)


