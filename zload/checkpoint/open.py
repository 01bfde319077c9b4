"""What the checkpoint is: a user's path made into the checkpoint's files and index.

A path is a ``.safetensors`` file, an index ``.json``, a folder holding either, a DeepSpeed
checkpoint (``native``), or a Hugging Face Hub repo id (``hub`` downloads it). One process indexes
what it sees (``open_checkpoint``; the command line's ``open_source`` also takes repo ids).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from ..distributed import Problem, agree, reduce_max, warn_for_all
from ..errors import (
    ArgumentValueError,
    CheckpointError,
    CheckpointNotFoundError,
    InvalidCheckpointError,
)
from ..report import shortened
from .files import FileTable, absolute_path, open_regular, refuse_irregular, stat_path
from .hub import RemoteRepo, download, remote_repo
from .index import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointIndex,
    index_from_weight_map,
    parse_header,
    pytorch_weights_hint,
)
from .native import LATEST, native_folder, open_native
from .quantized import CONFIG_FILE


def _start_file(path: str) -> str | None:
    """The file to start from: a .safetensors file or an index .json; None for a folder without
    safetensors files."""
    st = stat_path(path) if os.path.lexists(path) else None
    if st is None:
        raise CheckpointNotFoundError(f"{path}: no such file or directory", path=path)
    if not stat.S_ISDIR(st.st_mode):
        refuse_irregular(path, st)
        return path

    def listing() -> list[str]:
        try:
            return os.listdir(path)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot list: {e.strerror}", path=path) from e

    name = _start_name(path, lambda name: os.path.lexists(os.path.join(path, name)), listing)
    return None if name is None else os.path.join(path, name)


def _start_name(folder: str, holds: Callable[[str], bool], listing: Callable[[], list[str]]) -> str | None:
    """The name of the file to start from in ``folder`` (a local folder or a Hub repo), which
    ``holds`` a name or not and lists its names; None if it holds no safetensors file. The names
    ``from_pretrained`` looks for come first, in its order (``model.safetensors``, then the index),
    and are looked for without listing the folder."""
    for name in (SINGLE_FILE, INDEX_FILE):
        if holds(name):
            if name == SINGLE_FILE and holds(INDEX_FILE):
                warn_for_all(f"{folder} holds both {SINGLE_FILE} and {INDEX_FILE}; loading {SINGLE_FILE}, as "
                             "from_pretrained does", stacklevel=3)
            return name
    names = sorted(listing())
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    singles = [n for n in names if n.endswith(".safetensors")]
    if len(indexes) == 1:
        return indexes[0]
    if not indexes and len(singles) == 1:
        return singles[0]
    if indexes + singles:
        raise InvalidCheckpointError(f"{folder}: expected {INDEX_FILE} or {SINGLE_FILE}; found "
                                     f"{shortened(indexes + singles)}", path=folder)
    return None  # no safetensors: perhaps a DeepSpeed checkpoint


class IndexReader(Protocol):
    """One format of checkpoint: the index of the checkpoint ``path`` starts (``_reader`` says which
    format a path is in), its files opened into ``table``. With ``missing_ok``, files this machine
    lacks are recorded in ``absent`` instead of raising (another node may hold them)."""

    def __call__(self, path: str, table: FileTable, missing_ok: bool) -> CheckpointIndex: ...


def _single_file(path: str, table: FileTable, missing_ok: bool) -> CheckpointIndex:
    """A lone ``.safetensors`` file."""
    root, key = os.path.split(absolute_path(path))
    return CheckpointIndex(path, (key,), parse_header(table.add(open_regular(path), key), key), opened=table,
                           root=root)


def _native(path: str, table: FileTable, missing_ok: bool) -> CheckpointIndex:
    """A DeepSpeed checkpoint: the folder ``save_checkpoint`` wrote, or one of its tag folders."""
    folder = native_folder(path)
    if folder is None:
        raise CheckpointNotFoundError(f"{path}: expected {INDEX_FILE} or {SINGLE_FILE}, or a DeepSpeed "
                                      f"checkpoint ('{LATEST}' or *_model_states.pt); found no safetensors "
                                      "files and no DeepSpeed checkpoint" + pytorch_weights_hint(os.listdir(path)),
                                      path=path)
    return open_native(path, folder, table)


def _reader(path: str) -> tuple[IndexReader, str]:
    """The reader of the checkpoint at ``path``, and the path it starts from: a safetensors file,
    an index and its shards (a folder holding either: the file in it), else a DeepSpeed checkpoint."""
    start = _start_file(path)
    if start is None:
        return _native, path
    hint = pytorch_weights_hint([os.path.basename(start)])
    if hint:
        raise InvalidCheckpointError(f"{start}: not a safetensors file or index{hint}", path=start)
    return (index_from_weight_map if start.endswith(".json") else _single_file), start


def open_checkpoint(path: str | os.PathLike, *, missing_ok: bool = False) -> CheckpointIndex:
    """Index a checkpoint: a .safetensors file, an index .json, a directory holding either, or a
    DeepSpeed checkpoint (the folder ``save_checkpoint`` wrote, or one of its tag folders).

    The files stay open (``index.opened``) until ``index.close()`` or the end of a ``with`` block.
    ``missing_ok``: shards the index lists but this machine lacks are recorded in ``absent``
    instead of raising (another node may hold them).
    """
    table = FileTable()
    try:
        reader, start = _reader(os.fspath(path))
        return reader(start, table, missing_ok)
    except BaseException:
        table.close()
        raise


def open_source(path: str | os.PathLike, revision: str | None = None, *, headers_only: bool = False) -> CheckpointIndex:
    """Index ``path`` in one process as ``load_into`` would: a local path, else a Hub repo id's
    snapshot at ``revision`` (downloaded into the Hugging Face cache if it is not there).

    ``headers_only`` (for commands that read no tensor data): a repo id is read from the Hub by
    range requests of its headers, its weights never downloaded; its files are opened only as far
    as their headers (``files.header_only``). Offline, the cached snapshot is read as without it.
    """
    path = os.fspath(path)
    remote = None if os.path.lexists(path) or not headers_only else remote_repo(path, revision)
    if remote is None:
        return open_checkpoint(local_path(path, revision))
    table = FileTable()
    try:
        return _remote_index(remote, table)
    except BaseException:
        table.close()
        raise


def _remote_index(remote: RemoteRepo, table: FileTable) -> CheckpointIndex:
    """The checkpoint of Hub repo ``remote``, found as in a local folder (``_start_name``), its
    index and config downloaded (``root``: where the cache holds them), its safetensors files
    opened as far as their headers; ``source`` names the repo and the commit read."""
    names = [n for n in remote.sizes if "/" not in n]  # the repo's top folder, as a local folder's listing
    where = f"{remote.repo} (revision {remote.revision or 'main'}, commit {remote.commit})"
    start = _start_name(where, set(names).__contains__, lambda: names)
    if start is None:
        raise CheckpointNotFoundError(f"{where}: the Hub repo holds neither {INDEX_FILE} nor {SINGLE_FILE}"
                                      + pytorch_weights_hint(names, repr(remote.repo)), path=remote.repo)
    hint = pytorch_weights_hint([start])
    if hint:
        raise InvalidCheckpointError(f"{remote.url(start)}: not a safetensors file or index{hint}", path=start)
    config = remote.download(CONFIG_FILE) if CONFIG_FILE in remote.sizes else None
    if start.endswith(".json"):
        index_path = remote.download(start)
        folder = os.path.dirname(absolute_path(index_path))  # as index_from_weight_map joins the shards to
        index = index_from_weight_map(index_path, table, False,
                                      lambda path: remote.header(os.path.relpath(path, folder)))
    else:
        index = CheckpointIndex(start, (start,), parse_header(table.add(remote.header(start), start), start),
                                opened=table)
    return replace(index, source=where, root=os.path.dirname(config) if config else "", remote=remote.url(""))


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
    refuse_revision(path, revision)
    return path


def refuse_revision(path: str, revision: str | None) -> None:
    if revision is not None:
        raise ArgumentValueError(f"{path}: revision={revision!r} applies to Hub repo ids only, and "
                                 f"this is a local path; drop revision= or pass the repo id", path=path)
