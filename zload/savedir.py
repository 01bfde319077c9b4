"""The folder ``zload.save`` writes into: which files zload owns there, and how a new checkpoint
takes the place of the old one without a moment in which neither is whole.

zload owns only the files it writes: the weights (``model.safetensors``, or shards and
``model.safetensors.index.json``; ``adapter_model.safetensors`` for an adapter) and the configs
(``config.json``, ``generation_config.json``, ``adapter_config.json``). Everything else in the
folder is left as it is. A save, run by rank 0 here:

1. ``begin``: refuses a path that is not a folder, refuses while another save into the folder is
   running, and creates a hidden staging folder ``.zload-save-<token>`` inside it, locked (flock)
   for as long as the save runs. Every rank writes the new files there.
2. ``commit``: records in the staging folder which files it will create and which earlier files
   of the same weights name will become stale; moves the new shards in under names no file has;
   then renames the index (or the single file) into place: the commit point, before which a
   reader finds the old checkpoint and after which the new one (``from_pretrained`` and zload both
   prefer ``model.safetensors`` to the index, so when a single file gives way to shards, removing
   it is the commit point). Then the configs replace theirs, and the stale files are removed.
3. Staging folders of saves that were killed (their lock is free) are cleaned up by the next save
   into the folder: the files they record are removed unless the current checkpoint uses them.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import stat

from .errors import ZloadError
from .files import FileTable, open_regular
from .index import MAX_INDEX_BYTES, shard_path

STAGING_PREFIX = ".zload-save-"
LOCK = "lock"  # in the staging folder: flocked by the running save; says who it is
MANIFEST = "manifest.json"  # in the staging folder: what the commit creates and makes stale
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)
# names zload may remove: its weights files and indexes (a manifest is checked against this)
_WEIGHTS_NAME = re.compile(r"[^/\\]+\.safetensors(\.index\.json)?")


def index_name(single: str) -> str:
    """``model.safetensors`` -> ``model.safetensors.index.json``."""
    return single + ".index.json"


def shard_name(single: str, k: int, count: int, tag: str = "") -> str:
    """``model-00001-of-00003.safetensors``; with a tag ``model-<tag>-00001-of-00003.safetensors``
    (still a shard name to transformers' own cleanup)."""
    stem = single.removesuffix(".safetensors")
    return f"{stem}{'-' + tag if tag else ''}-{k + 1:05d}-of-{count:05d}.safetensors"


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_target(final: str) -> None:
    """Refuse a save path that is not a folder (a file, a FIFO, a dangling link), touching nothing.
    A link to a folder is written through, as ``save_pretrained`` does."""
    if not os.path.lexists(final):
        return
    if os.path.islink(final) and not os.path.exists(final):
        raise ZloadError(f"{final} is a symbolic link to {os.readlink(final)}, which does not exist; "
                         "pass a folder (or a link to one)")
    if not os.path.isdir(final):
        kind = "a file" if os.path.isfile(final) else "not a folder"
        raise ZloadError(f"{final} is {kind}; zload.save writes a folder of files "
                         "(model.safetensors or shards, an index, config.json): pass a folder path")


def _referenced(folder: str, single: str) -> tuple[set[str], set[str]]:
    """(the files a reader of ``folder`` uses for weights name ``single`` now, every file of that
    name there: the single file, the index and the plain shard names it lists)."""
    names: set[str] = set()
    if os.path.lexists(os.path.join(folder, single)):
        names.add(single)
    index = index_name(single)
    shards: set[str] = set()
    if os.path.lexists(os.path.join(folder, index)):
        names.add(index)
        try:  # never blocks: a FIFO or a device there is refused, not opened
            with FileTable() as table:
                opened = table.add(open_regular(os.path.join(folder, index)))
                text = os.pread(opened.fd, min(opened.identity.size, MAX_INDEX_BYTES), 0)
            weight_map = json.loads(text).get("weight_map", {})
            shards = {s for s in set(weight_map.values()) if isinstance(s, str)
                      and s == os.path.basename(s) and shard_path(folder, s) is not None}
        except (ZloadError, OSError, ValueError, AttributeError, RecursionError):
            pass  # an unreadable index: its shards are not known, so none of them is touched
    names |= shards
    used = {single} if single in names else ({index} | shards if index in names else set())
    return used, names


def _removable(folder: str, name: str) -> bool:
    """A name zload may remove from ``folder``: a weights file or index, directly in it, and a
    file or a link (never a folder)."""
    if not _WEIGHTS_NAME.fullmatch(name) or name in (".", ".."):
        return False
    try:
        mode = os.lstat(os.path.join(folder, name)).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)


def _remove(folder: str, names) -> list[str]:
    """Remove ``names`` that zload may remove; returns those that could not be removed."""
    failed = []
    for name in names:
        if _removable(folder, name):
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                failed.append(name)
    return failed


def _try_lock(fd: int) -> bool | None:
    """Lock ``fd`` exclusively without waiting: True, False (someone holds it), or None when the
    filesystem has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise


def _staging_folders(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(STAGING_PREFIX)
                  and not os.path.islink(os.path.join(folder, n))
                  and os.path.isdir(os.path.join(folder, n)))


def _old_leftovers(final: str) -> list[str]:
    """What to say about the ``<path>.zload-tmp-*`` folders that killed saves of zload before 0.2
    left next to ``path``. They are not removed: those versions took no lock, so a running one
    cannot be told from a killed one."""
    leftovers = sorted(glob.glob(glob.escape(final) + ".zload-tmp-*"))
    if not leftovers:
        return []
    return [f"zload: {len(leftovers)} temporary folders that killed saves of an earlier zload version "
            f"left next to {final} are still there; delete them once no such save is running: "
            f"{', '.join(leftovers)}"]


class SaveFolder:
    """Rank 0's side of one save into ``final`` (see the module docstring)."""

    def __init__(self, final: str, token: str):
        self.final = final
        self.token = token
        self.staging = os.path.join(final, STAGING_PREFIX + token)
        self.created_folder = False
        self.moved: list[str] = []  # files this save moved into ``final``
        self.committed = False
        self.notes: list[str] = []  # warnings for the caller of save
        self._lock_fd: int | None = None

    @property
    def lock_path(self) -> str:
        return os.path.join(self.staging, LOCK)

    def begin(self) -> None:
        """Check the path, create the folder if needed and the locked staging folder in it."""
        check_target(self.final)
        self.notes += _old_leftovers(self.final)
        if not os.path.lexists(self.final):
            os.makedirs(self.final)
            self.created_folder = True
        for name in _staging_folders(self.final):
            holder = self._holder(os.path.join(self.final, name))
            if holder is not None:
                raise ZloadError(f"another zload.save into {self.final} is running ({holder}); "
                                 "two saves into one folder would replace each other's files. "
                                 "Wait for it, or save elsewhere")
        os.mkdir(self.staging)
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if _try_lock(self._lock_fd) is False:
            raise ZloadError(f"{self.staging} is locked by another process")
        os.write(self._lock_fd, f"{self.token}\npid {os.getpid()} on {socket.gethostname()}\n".encode())
        os.fsync(self._lock_fd)

    def _holder(self, staging: str) -> str | None:
        """Who holds the lock of another save's staging folder (None: nobody, or unknowable)."""
        try:
            fd = os.open(os.path.join(staging, LOCK), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if _try_lock(fd) is False:
                lines = os.pread(fd, 200, 0).decode(errors="replace").splitlines()
                return lines[1] if len(lines) > 1 else "unknown process"
            return None
        finally:
            os.close(fd)  # releases the lock if this took it

    def commit(self, single: str, shards: list[str], index: dict | None, others: list[str]) -> None:
        """Put the staged files in place. Weights name ``single``: written in the staging folder
        under that name when ``index`` is None, else as ``shards`` (standard names) with ``index``
        the index's content naming them. ``others``: config files staged there. The order is the
        module docstring's."""
        _, earlier = _referenced(self.final, single)
        if index is None:
            created, commit_name = [single], single
        else:
            taken = any(os.path.lexists(os.path.join(self.final, n)) for n in shards)
            renamed = {n: shard_name(single, k, len(shards), self.token[:8] if taken else "")
                       for k, n in enumerate(shards)}
            commit_name = index_name(single)
            self._stage_index(commit_name, dict(index, weight_map={
                tensor: renamed[shard] for tensor, shard in index["weight_map"].items()}))
            created = sorted(renamed.values()) + [commit_name]
        stale = sorted(sorted(earlier - set(created)), key=lambda n: n != single)  # a hiding single first
        self._write_manifest({"single": single, "created": created, "stale": stale})
        if index is not None:
            self._move_in(renamed)
        self._commit(commit_name)
        self._move_in({name: name for name in others})
        left = _remove(self.final, stale)
        _fsync_dir(self.final)
        if left:
            self.notes.append(f"zload: saved {self.final}, but could not remove these files of the "
                              f"earlier checkpoint, which it no longer uses: {', '.join(left)}")

    def _stage_index(self, name: str, index: dict) -> None:
        with open(os.path.join(self.staging, name), "w") as out:
            json.dump(index, out, indent=2, sort_keys=True)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())

    def _move_in(self, names: dict[str, str]) -> None:
        """Rename staged files (staging name -> name in the folder) into the folder."""
        for name, target in names.items():
            os.replace(os.path.join(self.staging, name), os.path.join(self.final, target))
            self.moved.append(target)
        _fsync_dir(self.final)

    def _commit(self, name: str) -> None:
        """The commit point: the index (or single file) replaces the old one in one rename."""
        os.replace(os.path.join(self.staging, name), os.path.join(self.final, name))
        self.committed = True
        _fsync_dir(self.final)

    def _write_manifest(self, manifest: dict) -> None:
        path = os.path.join(self.staging, MANIFEST)
        with open(path + ".partial", "w") as out:
            json.dump(manifest, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(path + ".partial", path)
        _fsync_dir(self.staging)

    def finish(self) -> None:
        """After a commit: clean up after earlier killed saves, then remove this save's staging."""
        self.clean_up_killed_saves(skip=self.staging)
        self._remove_staging()

    def abort(self) -> str:
        """Undo an uncommitted save (its staging folder, the shards it moved in, the folder if it
        made it); returns what the folder holds now, for the error message."""
        if self.committed:
            self._remove_staging()
            return f"{self.final} holds the new checkpoint"
        _remove(self.final, self.moved)
        self._remove_staging()
        if self.created_folder:
            try:
                os.rmdir(self.final)
            except OSError:
                pass
        return f"{self.final} is as it was"

    def _remove_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def clean_up_killed_saves(self, skip: str | None = None) -> None:
        """Remove the staging folders of saves into this folder that were killed (nobody holds
        their lock), and the files they record, except those the current checkpoint uses."""
        unknown = []
        for name in _staging_folders(self.final):
            staging = os.path.join(self.final, name)
            if staging == skip:
                continue
            try:
                fd = os.open(os.path.join(staging, LOCK), os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None  # killed before it made its lock: it created nothing outside
            except OSError:
                continue
            try:
                held = _try_lock(fd) if fd is not None else True
                if held is None:
                    unknown.append(staging)
                if not held:
                    continue
                self._undo(staging)
                shutil.rmtree(staging, ignore_errors=True)
            finally:
                if fd is not None:
                    os.close(fd)
        if unknown:
            self.notes.append(f"zload: cannot tell whether the saves that left {', '.join(unknown)} "
                              "are still running (this filesystem has no file locks); delete them "
                              "once they are not")

    def _undo(self, staging: str) -> None:
        """Remove the files a killed save recorded, except those a reader uses now: the new ones
        if it had not committed, the stale ones it had not removed yet if it had."""
        try:
            with open(os.path.join(staging, MANIFEST)) as f:
                manifest = json.load(f)
            single = manifest["single"]
            names = [n for n in manifest["created"] + manifest["stale"] if isinstance(n, str)]
        except (OSError, ValueError, KeyError, TypeError):
            return  # no manifest: it was killed before it moved anything into the folder
        if not isinstance(single, str) or not _WEIGHTS_NAME.fullmatch(single):
            return
        in_use, _ = _referenced(self.final, single)
        _remove(self.final, [n for n in names if n not in in_use])
