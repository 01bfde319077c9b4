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
import stat
import warnings
from dataclasses import dataclass, field

from .digest import DIGEST_KEY, block_count, block_digests, data_digest, recorded_mismatch, sample_digests
from .distributed import (Arguments, Problem, agree, digest, exchange, problems_of, raise_for, rank_and_world,
                          reduce_max, same_everywhere)
from .errors import (ArgumentValueError, CheckpointError, CheckpointNotFoundError, InvalidCheckpointError, PlanError,
                     ZloadWarning)
from .execute import reader_count
from .files import FileTable, OpenFile, open_regular, refuse_irregular, stat_path
from .hub import download
from .index import INDEX_FILE, SINGLE_FILE, CheckpointIndex, TensorEntry, index_from_weight_map, parse_header
from .native import LATEST, native_folder, open_native
from .pagecache import forget
from .plan import LoadPlan, collectives_differing
from .report import shortened
from .quantized import Quantization, agreed_quantization, read_quantization


def _start_file(path: str) -> str | None:
    """The file to start from: a .safetensors file or an index .json; None for a folder without
    safetensors files. In a folder, the names ``from_pretrained`` looks for come first, in its
    order (``model.safetensors``, then the index)."""
    st = stat_path(path) if os.path.lexists(path) else None
    if st is None:
        raise CheckpointNotFoundError(f"{path}: no such file or directory", path=path)
    if not stat.S_ISDIR(st.st_mode):
        refuse_irregular(path, st)
        return path
    for name in (SINGLE_FILE, INDEX_FILE):
        if os.path.lexists(os.path.join(path, name)):
            if name == SINGLE_FILE and os.path.lexists(os.path.join(path, INDEX_FILE)):
                warnings.warn(f"zload: {path} holds both {SINGLE_FILE} and {INDEX_FILE}; loading "
                              f"{SINGLE_FILE}, as from_pretrained does", ZloadWarning, stacklevel=2)
            return os.path.join(path, name)
    try:
        listing = sorted(os.listdir(path))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list: {e.strerror}", path=path) from e
    indexes = [n for n in listing if n.endswith(".safetensors.index.json")]
    singles = [n for n in listing if n.endswith(".safetensors")]
    if len(indexes) == 1:
        return os.path.join(path, indexes[0])
    if not indexes and len(singles) == 1:
        return os.path.join(path, singles[0])
    if indexes + singles:
        raise InvalidCheckpointError(f"{path}: expected {INDEX_FILE} or {SINGLE_FILE}; found "
                                     f"{', '.join(indexes + singles)}", path=path)
    return None  # no safetensors: perhaps a DeepSpeed checkpoint


def open_checkpoint(path: str | os.PathLike, *, missing_ok: bool = False) -> CheckpointIndex:
    """Index a checkpoint: a .safetensors file, an index .json, a directory holding either, or a
    DeepSpeed checkpoint (the folder ``save_checkpoint`` wrote, or one of its tag folders).

    The files stay open (``index.opened``) until ``index.close()`` or the end of a ``with`` block.
    ``missing_ok``: shards the index lists but this machine lacks are recorded in ``absent``
    instead of raising (another node may hold them).
    """
    table = FileTable()
    try:
        path = os.fspath(path)
        start = _start_file(path)
        if start is None:
            folder = native_folder(path)
            if folder is None:
                raise CheckpointNotFoundError(f"{path}: expected {INDEX_FILE} or {SINGLE_FILE}, or a DeepSpeed "
                                              f"checkpoint ('{LATEST}' or *_model_states.pt); found no safetensors files "
                                              "and no DeepSpeed checkpoint",
                                              path=path)
            return open_native(path, folder, table)
        if start.endswith(".json"):
            return index_from_weight_map(start, missing_ok, table)
        root, key = os.path.split(os.path.abspath(start))
        return CheckpointIndex(start, (key,), parse_header(table.add(open_regular(start), key), key),
                               opened=table, root=root)
    except BaseException:
        table.close()
        raise


def open_source(path: str | os.PathLike, revision: str | None = None) -> CheckpointIndex:
    """Index ``path`` in one process as ``load_into`` would: a local path, else a Hub repo id's
    snapshot at ``revision`` (downloaded into the Hugging Face cache if it is not there)."""
    return open_checkpoint(local_path(path, revision))


def local_path(path: str | os.PathLike, revision: str | None = None, also: tuple[str, ...] = ()) -> str:
    """Where every rank reads ``path`` from: ``path`` itself when every rank has it, else the
    snapshot of Hub repo id ``path`` at ``revision`` (and the files matching ``also``, see
    ``download``), downloaded once per node. Every rank must call it; a path that only some ranks
    have is refused on all, since what is read outside the index (a config) must be everywhere."""
    path = os.fspath(path)
    here = os.path.lexists(path)
    lacking, having = reduce_max([int(not here), int(here)])
    if not having:
        return download(path, revision, also)
    if lacking:
        agree([] if here else [Problem.of(CheckpointNotFoundError(
            f"{path}: no such file or directory on this rank, though other ranks have it: every node "
            f"must hold it (copy it there, or pass a Hub repo id, which each node downloads)", path=path))],
            f"cannot read {path}")
    _no_revision(path, revision)
    return path


def _no_revision(path: str, revision: str | None) -> None:
    if revision is not None:
        raise ArgumentValueError(f"{path}: revision={revision!r} applies to Hub repo ids only, and "
                                 f"this is a local path; drop revision= or pass the repo id", path=path)


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


def local_view(source: str, verify: str = "sample") -> LocalView:
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


def viewed(source: str, index: CheckpointIndex, verify: str = "sample") -> LocalView:
    """``index`` as this rank's view of ``source``, with what tells its files from other copies: the
    SHA-256 of each header and, when there is another rank to compare with (``verify="sample"``),
    a sample of the data, except in files whose header records a digest of all of it (a zload
    save). Closes ``index`` if that fails."""
    view = LocalView(source, index, known=sorted(index.files))
    try:
        files = view.opened()
        sampled = [key for key, f in files.items() if DIGEST_KEY not in f.metadata] \
            if verify == "sample" and rank_and_world()[1] > 1 else []
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
        seen = "; ".join(f"ranks {r} see files {shortened(list(known), 4)}" for (known, _), r in ranks.items())
    else:
        seen = "; ".join(f"ranks {r}" for r in ranks.values()) + ": the same files, but different weight maps"
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
            groups = "; ".join(f"ranks {ranks}" for ranks in copies.values())
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


def _planned(plan_load, shared: SharedIndex) -> tuple[LoadPlan | None, list[Problem]]:
    """``plan_load(index, remote_files, quantization)`` of ``shared``, and its problems (an
    exception, or the plan's own)."""
    plan, problems = problems_of("planning", lambda: plan_load(shared.index, shared.remote_files,
                                                              shared.quantization))
    return plan, (problems if plan is None else [Problem(PlanError, p) for p in plan.problems])


def _refused(source: str) -> str:
    return f"zload: cannot load {source}; the model was not changed"


def _settled(view: LocalView, arguments: Arguments, plan: LoadPlan | None,
             problems: list[Problem]) -> tuple[bool, bool, bool]:
    """The all-reduce after planning, the first collective of every ``open_agreed`` whatever its
    arguments. Raises on every rank if the ranks passed different ``arguments`` (naming them), or
    the same invalid one; else (whether every rank sees the same whole checkpoint, whether some
    rank's plan has problems, whether the plans make different collectives)."""
    fingerprint, called = view.fingerprint, arguments.digest
    collectives = digest(plan.collectives if plan else None)
    (high, negated_low, called_high, called_negated_low, collectives_high, collectives_negated_low,
     partial, troubled) = reduce_max([fingerprint, -fingerprint, called, -called, collectives, -collectives,
                                      int(not view.whole), len(problems)])
    view.forget_sampled()
    if not same_everywhere(called_high, called_negated_low):
        raise arguments.differing(exchange(arguments.values), _refused(view.source))
    if arguments.invalid:
        raise arguments.invalid
    return (same_everywhere(high, negated_low) and not partial, bool(troubled),
            not same_everywhere(collectives_high, collectives_negated_low))


def _agree_on_plans(plan: LoadPlan | None, problems: list[Problem], troubled: bool, differing: bool,
                    arguments: Arguments, what: str) -> None:
    """Raise on every rank if some rank's plan has problems (``troubled``), or if the plans make
    different collectives (``differing``): which is learnt from an exchange made only then."""
    if troubled:
        raise_for(exchange(problems), what)
    if differing:
        gathered = exchange(plan.collectives)
        raise PlanError(f"{what}: the ranks' models differ: {collectives_differing(gathered)}; every rank "
                        f"must call {arguments.call} with the same arguments and the same model (built the "
                        "same way on every rank)", ranks=tuple(range(len(gathered))))


def open_agreed(path: str, revision: str | None, verify: str, arguments: Arguments,
                plan_load) -> tuple[str, SharedIndex, LoadPlan]:
    """Index the checkpoint and plan the load on every rank; raise on all if any rank cannot.

    Usually every rank sees the same whole checkpoint: each plans against its own view, and one
    all-reduce settles that every rank passed the same ``arguments`` (its first collective,
    whatever they are), that the views are the same (headers, a sample of the data, and the
    quantization config), that no plan has a problem and that every plan makes the same
    collectives (``LoadPlan.collectives``). ``verify="full"`` digests every file after it and
    settles again. Otherwise (node-local shards, copies that differ, a Hub repo id, a bad header)
    the ranks exchange their views, and then plan and agree on the plans.
    ``plan_load(index, remote_files, quantization)`` plans one rank's load. The returned index's
    files stay open; the caller closes them.
    """
    view = local_view(path, verify) if arguments.invalid is None else LocalView(path, None)
    try:
        plan, problems = _planned(plan_load, view.shared()) if view.whole else (None, [])
        same, troubled, differing = _settled(view, arguments, plan, problems)
        if verify == "full":  # on every rank, as settled
            verify_fully(view)
            same, troubled, differing = _settled(view, arguments, plan, problems)
        if same:  # the same whole checkpoint everywhere
            _no_revision(path, revision)
            _agree_on_plans(plan, problems, troubled, differing, arguments, _refused(path))
            return path, view.shared(), plan
        shared = share_index(view, _refused(path))
        source = path
        if shared is None:  # no rank has the path: a Hub repo id
            view.close()
            source = download(path, revision)
            view = local_view(source, verify)
            if verify == "full":
                verify_fully(view)
            shared = share_index(view, _refused(source))
            view.forget_sampled()
        else:
            _no_revision(path, revision)
        plan, problems = _planned(plan_load, shared)
        collectives = digest(plan.collectives if plan else None)
        troubled, high, negated_low = reduce_max([len(problems), collectives, -collectives])
        _agree_on_plans(plan, problems, bool(troubled), not same_everywhere(high, negated_low), arguments,
                        _refused(source))
        return source, shared, plan
    except BaseException:
        view.close()
        raise
