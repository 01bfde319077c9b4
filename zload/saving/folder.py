"""The folder ``zload.save`` writes into: which files zload owns there, and how a new checkpoint
takes the place of the old one without a moment in which neither is whole.

zload owns only the files it writes: the weights (``model.safetensors``, or shards and
``model.safetensors.index.json``; ``adapter_model.safetensors`` for an adapter), the configs
(``config.json``, ``generation_config.json``, ``adapter_config.json``) and the optimizer state
(``optimizer.safetensors.index.json`` and the shards it lists). Everything else in the folder is
left as it is. A save, run by rank 0 here:

1. ``begin``: refuses a path that is not a folder, and creates a hidden staging folder
   ``.zload-save-<token>`` inside it, locked (flock) for as long as the save runs; while another
   save into the folder holds its lock, the save is refused. Every rank writes the new files there.
2. ``commit``: records in the staging folder (its manifest) the files it will create and the
   earlier files of the same weights name that will become stale, each with its identity (device,
   inode, size, modification time);
   moves the new shards in under names no file has (the optimizer state's too); renames the index
   (or the single file) into place, and, when a single file gives way to shards, removes the
   single file (``from_pretrained`` and zload both prefer it to an index). That is the commit
   point: before it a reader finds the old checkpoint, after it the new one. Then the configs and
   the optimizer state's index replace theirs and the stale files go (the optimizer state of an
   earlier save too, when this one writes none). In between, a reader finds the new weights with
   the old optimizer state, whose index records the digests of the weights it was saved with, so
   that ``load_into(optimizer=True)`` refuses the pair.
3. The staging folders of killed saves (their lock is free) are cleaned up by the next save into
   the folder, as its last step: one that had not committed is rolled back (the files it created
   are removed), one that had is rolled forward (its configs moved in, its stale files removed).
   A file is removed only if it is still the one recorded (same identity) and the current
   checkpoint does not use it.
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
from contextlib import contextmanager

from ..checkpoint.files import FileTable, file_kind, open_regular
from ..checkpoint.index import MAX_INDEX_BYTES, read_weight_map, shard_path
from ..checkpoint.optimizer_state import OPTIMIZER_SINGLE
from ..errors import ArgumentValueError, WriteError, ZloadError
from ..report import shortened

STAGING_PREFIX = ".zload-save-"
LOCK = "lock"  # in the staging folder: flocked by the running save; says who it is
MANIFEST = "manifest.json"  # in the staging folder: what the commit creates and makes stale
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# names zload may remove: its weights files and indexes (a manifest is checked against this)
_WEIGHTS_NAME = re.compile(r"[^/\\\x00]+\.safetensors(\.index\.json)?")


def index_name(single: str) -> str:
    """``model.safetensors`` -> ``model.safetensors.index.json``."""
    return single + ".index.json"


def shard_name(single: str, k: int, count: int, tag: str = "") -> str:
    """``model-00001-of-00003.safetensors``; with a tag ``model-<tag>-00001-of-00003.safetensors``
    (still a shard name to transformers' own cleanup)."""
    stem = single.removesuffix(".safetensors")
    return f"{stem}{'-' + tag if tag else ''}-{k + 1:05d}-of-{count:05d}.safetensors"


# why writing failed, and what to do, for the errors a user can do something about
_WRITE_ERRORS = {
    errno.ENOSPC: ("no space left on its filesystem (ENOSPC)", "free space there (until the new files take "
                   "the place of a checkpoint already there, both need room), or write elsewhere"),
    errno.EDQUOT: ("the disk quota is exceeded (EDQUOT)", "free space within the quota (until the new files "
                   "take the place of a checkpoint already there, both count), or write elsewhere"),
    errno.EFBIG: ("the file would be larger than its filesystem or this process (ulimit -f) allows (EFBIG)",
                  "write smaller shards (max_shard_size), or elsewhere"),
    errno.EROFS: ("its filesystem is read-only (EROFS)", "write elsewhere"),
    errno.EACCES: ("permission denied (EACCES)", "write to a folder you may write in"),
}


@contextmanager
def writing(path: str):
    """Around writing ``path``, a file or folder of a save: an ``OSError`` (a full disk, a spent
    quota) is the environment's, not a bug: it becomes a ``WriteError`` that names ``path`` and
    says what to do (the caller's error says what state the folder is left in)."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        why, advice = _WRITE_ERRORS.get(e.errno) or (
            f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})", "fix that, or write elsewhere")
        raise WriteError(f"cannot write {path}: {why}; {advice}", path=path, errno=e.errno) from e


def _fsync_dir(folder: str) -> None:
    with writing(folder):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json(path: str, content) -> None:
    """Write, fsync and rename into place: the file is whole or absent."""
    with writing(path):
        with open(path + ".partial", "w") as out:
            json.dump(content, out, indent=2, sort_keys=True)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(path + ".partial", path)


def _read_json(path: str):
    """A small JSON file of ours, read without blocking on whatever was put in its place."""
    with FileTable() as table:
        opened = table.add(open_regular(path), path)
        return json.loads(os.pread(opened.fd, min(opened.identity.size, MAX_INDEX_BYTES), 0))


def check_target(final: str) -> None:
    """Refuse a save path that is not a folder (a file, a FIFO, a dangling link), touching nothing.
    A link to a folder is written through, as ``save_pretrained`` does."""
    if not os.path.lexists(final):
        return
    if os.path.islink(final) and not os.path.exists(final):
        raise ArgumentValueError(f"{final} is a symbolic link to {os.readlink(final)}, which does not exist; "
                                 "pass a folder (or a link to one)", path=final)
    if not os.path.isdir(final):
        kind = "a file" if os.path.isfile(final) else "not a folder"
        raise ArgumentValueError(f"{final} is {kind}; zload.save writes a folder of files "
                                 "(model.safetensors or shards, an index, config.json): pass a folder path",
                                 path=final)


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
        try:
            with FileTable() as table:
                weight_map = read_weight_map(os.path.join(folder, index), table)
            shards = {s for s in set(weight_map.values())
                      if s == os.path.basename(s) and shard_path(folder, s) is not None}
        except ZloadError:
            pass  # an unreadable index: its shards are not known, so none of them is touched
    names |= shards
    used = {single} if single in names else ({index} | shards if index in names else set())
    return used, names


def _identity(path: str) -> list[int] | None:
    """What tells a file from another that took its name since: an inode number alone can be
    reused once the file is gone."""
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _remove(folder: str, names: dict[str, list[int] | None]) -> list[str]:
    """Remove each of ``names`` that zload may remove: a weights file or index directly in
    ``folder``, a file or a link (never a folder), and still the file recorded (its identity,
    where one is given). Returns those that should have gone but could not."""
    failed = []
    for name, identity in names.items():
        path = os.path.join(folder, name)
        if not isinstance(name, str) or not _WEIGHTS_NAME.fullmatch(name) or name in (".", ".."):
            continue
        try:
            st = os.lstat(path)
        except (OSError, ValueError):
            continue
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            continue
        if identity is not None and _identity(path) != list(identity):
            continue  # another file has taken the name since: not the one recorded
        try:
            os.remove(path)
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


def _open_lock(staging: str) -> int | None:
    """The lock file of a staging folder, open, or None if it has none: killed between making the
    folder and the lock. Read-write where allowed (NFS locks want it), else read-only, never
    waiting on a FIFO. A lock that is not a regular file, or that cannot be opened (another
    user's), raises ``WriteError``: whether its save still runs cannot be told, so it stays."""
    path = os.path.join(staging, LOCK)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _unknown_lock(path, staging, f"cannot be looked at ({e.strerror})") from e
    problem = None
    for flags in (os.O_RDWR, os.O_RDONLY) if stat.S_ISREG(mode) else ():
        try:
            fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            problem = f"cannot be opened ({e.strerror})"
            continue
        mode = os.fstat(fd).st_mode  # a FIFO may have taken its place since the lstat
        if stat.S_ISREG(mode):
            return fd
        os.close(fd)
        break
    raise _unknown_lock(path, staging, problem if stat.S_ISREG(mode) else
                        f"is {file_kind(mode)}, not the lock file a save makes")


def _unknown_lock(path: str, staging: str, problem: str) -> WriteError:
    return WriteError(f"{path} {problem}: whether the save that made {staging} still runs cannot be told; "
                      "remove that folder once no save into it runs", path=path)


def _staging_folders(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(os.path.join(folder, n) for n in names if n.startswith(STAGING_PREFIX)
                  and not os.path.islink(os.path.join(folder, n))
                  and os.path.isdir(os.path.join(folder, n)))


def _old_leftovers(final: str) -> list[str]:
    """What to say about the ``<path>.zload-tmp-*`` folders that killed saves of zload before 0.2
    left next to ``path``. They are not removed: those versions took no lock, so a running one
    cannot be told from a killed one."""
    leftovers = sorted(glob.glob(glob.escape(final) + ".zload-tmp-*"))
    if not leftovers:
        return []
    return [f"{len(leftovers)} temporary folders that killed saves of an earlier zload version "
            f"left next to {final} are still there; delete them once no such save is running: "
            f"{shortened(leftovers)}"]


class SaveFolder:
    """Rank 0's side of one save into ``final`` (see the module docstring)."""

    def __init__(self, final: str, token: str):
        self.final = final
        self.token = token
        self.staging = os.path.join(final, STAGING_PREFIX + token)
        self.created: list[str] = []  # folders this save made, outermost first
        self.moved: list[str] = []  # files this save moved into ``final``
        self.committed = False
        self.notes: list[str] = []  # warnings for the caller of save
        self._lock_fd: int | None = None

    def begin(self) -> None:
        """Check the path, create the folder if needed and the locked staging folder in it.
        Another save holding its lock, seen before or after this one took its own, refuses this
        one (two saves starting together both refuse rather than both go on)."""
        check_target(self.final)
        self.notes += _old_leftovers(self.final)
        self._refuse_if_another_save_runs()
        missing, folder = [], self.final
        while not os.path.lexists(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for folder in reversed(missing):
            with writing(folder):
                os.mkdir(folder)
            self.created.append(folder)
        with writing(self.staging):
            os.mkdir(self.staging)
            self._lock_fd = os.open(os.path.join(self.staging, LOCK),
                                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            _try_lock(self._lock_fd)
            os.write(self._lock_fd, f"{self.token}\npid {os.getpid()} on {socket.gethostname()}\n".encode())
            os.fsync(self._lock_fd)
        self._refuse_if_another_save_runs()

    def _refuse_if_another_save_runs(self) -> None:
        for staging in _staging_folders(self.final):
            if staging == self.staging:
                continue
            try:
                fd = _open_lock(staging)
            except WriteError:
                continue  # not a lock of a save: not a reason to refuse
            if fd is None:
                continue
            try:
                try:
                    held = _try_lock(fd) is False
                except OSError:
                    held = False  # cannot tell: not a reason to refuse
                if held:
                    lines = os.pread(fd, 200, 0).decode(errors="replace").splitlines()
                    raise WriteError(f"another zload.save into {self.final} is running ("
                                     f"{lines[1] if len(lines) > 1 else 'unknown process'}); two "
                                     "saves into one folder would replace each other's files. Wait "
                                     "for it, or save elsewhere", path=self.final, errno=errno.EBUSY)
            finally:
                os.close(fd)  # releases the lock if this took it

    def _stage_index(self, single: str, shards: list[str], index: dict) -> dict[str, str]:
        """Stage the index of ``shards`` (``index`` its content, naming the staged shards) under
        ``single``'s index name, naming them as they will be in the folder (standard names, tagged
        with the save's token where one is taken); returns staged name -> name in the folder."""
        taken = any(os.path.lexists(os.path.join(self.final, n)) for n in shards)
        renamed = {n: shard_name(single, k, len(shards), self.token[:8] if taken else "")
                   for k, n in enumerate(shards)}
        _write_json(os.path.join(self.staging, index_name(single)), dict(index, weight_map={
            tensor: renamed[shard] for tensor, shard in index["weight_map"].items()}))
        return renamed

    def commit(self, single: str, shards: list[str], index: dict | None, configs: list[str],
               beside: tuple[list[str], dict] | None = None) -> dict[str, str]:
        """Put the staged files in place. Weights name ``single``: written in the staging folder
        under that name when ``index`` is None, else as ``shards`` (standard names) with ``index``
        the index's content naming them. ``configs``: files staged there that replace theirs.
        ``beside``: the optimizer state's staged shards and index content (named from
        ``OPTIMIZER_SINGLE``): its shards go in before the commit point, its index after it, as
        the configs do; without it, the optimizer state an earlier save left is stale. The order is
        the module docstring's. Returns staged shard name -> its name in the folder."""
        _, earlier = _referenced(self.final, single)
        _, earlier_beside = _referenced(self.final, OPTIMIZER_SINGLE)
        renamed, renamed_beside = {}, {}
        if index is None:
            commit_name = single
        else:
            renamed = self._stage_index(single, shards, index)
            commit_name = index_name(single)
        if beside is not None:
            renamed_beside = self._stage_index(OPTIMIZER_SINGLE, *beside)
            configs = [*configs, index_name(OPTIMIZER_SINGLE)]
            earlier_beside.discard(index_name(OPTIMIZER_SINGLE))  # replaced, as a config is
        created = {target: _identity(os.path.join(self.staging, name))
                   for name, target in [*renamed.items(), (commit_name, commit_name), *renamed_beside.items()]}
        stale = {n: _identity(os.path.join(self.final, n)) for n in sorted((earlier | earlier_beside) - set(created))}
        _write_json(os.path.join(self.staging, MANIFEST), {
            "single": single, "commit": commit_name, "created": created, "stale": stale,
            "configs": configs, "beside": OPTIMIZER_SINGLE})
        _fsync_dir(self.staging)
        self._move_in({**renamed, **renamed_beside})
        self._commit(single, commit_name)
        self._move_in({name: name for name in configs})
        left = _remove(self.final, stale)
        _fsync_dir(self.final)
        if left:
            self.notes.append(f"saved {self.final}, but could not remove these files of the "
                              f"earlier checkpoint, which it no longer uses: {shortened(left)}")
        return {**renamed, **renamed_beside}

    def _move_in(self, names: dict[str, str]) -> None:
        """Rename staged files (staging name -> name in the folder) into the folder."""
        for name, target in names.items():
            with writing(os.path.join(self.final, target)):
                os.replace(os.path.join(self.staging, name), os.path.join(self.final, target))
            self.moved.append(target)
        _fsync_dir(self.final)

    def _commit(self, single: str, name: str) -> None:
        """The commit point: the index (or single file) replaces the old one in one rename, and a
        single file that would hide a new index is removed."""
        with writing(os.path.join(self.final, name)):
            os.replace(os.path.join(self.staging, name), os.path.join(self.final, name))
        self.moved.append(name)
        if name != single and os.path.lexists(os.path.join(self.final, single)):
            _remove(self.final, {single: None})
            if os.path.lexists(os.path.join(self.final, single)):
                raise WriteError(f"cannot remove {os.path.join(self.final, single)}, which readers "
                                 "would load instead of the new checkpoint's index",
                                 path=os.path.join(self.final, single))
        self.committed = True
        _fsync_dir(self.final)

    def finish(self) -> None:
        """After a commit: clean up after earlier killed saves, then remove this save's staging."""
        self.clean_up_killed_saves()
        self._remove_staging()

    def abort(self) -> str:
        """Undo an uncommitted save (its staging folder, the files it moved in, the folders it
        made); returns what the folder holds now, for the error message."""
        if self.committed:
            self._remove_staging()
            return f"{self.final} holds the new checkpoint"
        _remove(self.final, dict.fromkeys(self.moved))
        self.moved = []
        self._remove_staging()
        for folder in reversed(self.created):
            try:
                os.rmdir(folder)
            except OSError:
                break
        self.created = []
        return f"{self.final} is as it was"

    def _remove_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def clean_up_killed_saves(self) -> None:
        """Finish off the saves into this folder that were killed: staging folders whose lock
        nobody holds (see the module docstring)."""
        unknown = []
        for staging in _staging_folders(self.final):
            if staging == self.staging:
                continue
            fd = None
            try:
                fd = _open_lock(staging)
                held = _try_lock(fd) if fd is not None else True
                if held is None:
                    unknown.append(staging)
                elif held:
                    self._finish_killed(staging)
                    shutil.rmtree(staging, ignore_errors=True)
            except (OSError, ValueError, ZloadError) as e:
                self.notes.append(f"could not clean up after the killed save in {staging}: {e}")
            finally:
                if fd is not None:
                    os.close(fd)
        if unknown:
            self.notes.append(f"cannot tell whether the saves that left {shortened(unknown)} "
                              "are still running (this filesystem has no file locks); delete them "
                              "once they are not")

    def _finish_killed(self, staging: str) -> None:
        """Finish off a killed save: every file it recorded (created or made stale) that a reader
        does not use now goes, which rolls it back if it had not committed and forward if it had;
        if its commit is what readers use, its configs are moved in too."""
        try:
            manifest = _read_json(os.path.join(staging, MANIFEST))
            single, commit = manifest["single"], manifest["commit"]
            created, stale, configs = manifest["created"], manifest["stale"], manifest["configs"]
            if not (isinstance(single, str) and _WEIGHTS_NAME.fullmatch(single)
                    and isinstance(created, dict) and isinstance(stale, dict)
                    and isinstance(configs, list)):
                return
        except (ZloadError, OSError, ValueError, KeyError, TypeError, RecursionError):
            return  # no manifest: killed before it moved anything into the folder
        in_use, _ = _referenced(self.final, single)
        committed = commit in in_use and _identity(os.path.join(self.final, commit)) == created.get(commit)
        if committed:
            for name in configs:  # its commit is what readers use: its configs belong with it
                source = os.path.join(staging, name) if isinstance(name, str) else ""
                if (name == os.path.basename(name) and not name.startswith(".")
                        and os.path.isfile(source) and not os.path.islink(source)):
                    os.replace(source, os.path.join(self.final, name))
        # the optimizer state readers find belongs with the weights they find: the earlier one until
        # the commit, then this save's (none if it saved none: the earlier one's files are stale)
        if manifest.get("beside") == OPTIMIZER_SINGLE and (not committed or index_name(OPTIMIZER_SINGLE) in configs):
            in_use |= _referenced(self.final, OPTIMIZER_SINGLE)[0]
        _remove(self.final, {n: i for n, i in [*created.items(), *stale.items()] if n not in in_use})
        _fsync_dir(self.final)
