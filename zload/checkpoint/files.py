"""Checkpoint files opened once, then read only through the descriptors whose headers were checked.

A file renamed over a checkpoint's shard after its header was read (a concurrent save) must not
feed bytes that were never validated, so readers never open a checkpoint file by name again: they
read through the descriptor the header was read from. A file changed in place shows up as a new
size or modification time, which readers check after reading. Only regular files are opened:
opening a FIFO blocks, and a device or a ``/proc`` file says nothing true about its size.
"""

from __future__ import annotations

import os
import stat
import tempfile
import weakref
from dataclasses import dataclass, field

from ..errors import CheckpointError, CheckpointNotFoundError, InvalidCheckpointError


@dataclass(frozen=True)
class Identity:
    """What says a file is still the one that was opened: a change to its bytes moves its mtime."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def absolute_path(path) -> str:
    """``path`` made absolute as the kernel (and transformers) resolve it: ``..`` after a symbolic
    link goes up from where the link leads. ``os.path.abspath`` drops such a pair as text and
    names another folder (``latest/../other``, ``latest`` a link into ``runs/``: ``./other``, not
    ``runs/other``), whose files a load would then read or a save replace. The last component is
    kept as given, so that a link there is seen as a link (a Hub snapshot's file, a save target, a
    tag folder). Where the parent does not exist (a dangling link on the way), the path is left
    as text for the kernel to refuse, not followed to wherever the link points."""
    path = os.fspath(path)
    try:
        absolute = (path if os.path.isabs(path) else os.path.join(os.getcwd(), path)).rstrip(os.sep) or os.sep
        parent, name = os.path.split(absolute)
        if name in ("", os.curdir, os.pardir):  # the folder itself is named by the links above it
            resolved = os.path.realpath(absolute)
            return resolved if os.path.exists(resolved) else absolute
        resolved = os.path.realpath(parent)
        return os.path.join(resolved, name) if os.path.isdir(resolved) else absolute
    except ValueError:  # a NUL byte: no file has this name, and opening it says so
        return os.path.abspath(path)


def file_kind(mode: int) -> str:
    """What a file of ``mode`` that is not a regular file is, for messages."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def refuse_irregular(path: str, st: os.stat_result) -> None:
    """Raise unless ``st`` (of ``path``, links followed) is a regular file."""
    if not stat.S_ISREG(st.st_mode):
        raise InvalidCheckpointError(f"{path}: is {file_kind(st.st_mode)}, not a regular file; a checkpoint "
                                     "file must be a regular file (or a link to one)", path=path)


def _failed(path: str, doing: str, e: Exception) -> CheckpointError:
    """``e``, raised ``doing`` something to ``path``, as a ``CheckpointError`` naming ``path`` (a
    ``CheckpointNotFoundError`` when there is no such file)."""
    kind = CheckpointNotFoundError if isinstance(e, FileNotFoundError) else CheckpointError
    return kind(f"{path}: {doing}: {getattr(e, 'strerror', None) or e}", path=path)


def stat_path(path: str) -> os.stat_result:
    """``os.stat`` with a ``CheckpointError`` that names ``path``."""
    try:
        return os.stat(path)
    except (OSError, ValueError) as e:  # ValueError: a NUL or an unencodable character in the name
        raise _failed(path, "cannot read", e) from e


@dataclass
class OpenFile:
    """One checkpoint file, open for reading, and what its header said."""

    path: str
    fd: int
    identity: Identity
    header_sha256: str = ""  # of the raw header bytes (length prefix excluded)
    data_start: int = 0  # offset of the first tensor byte
    metadata: dict[str, str] = field(default_factory=dict)  # the header's __metadata__

    def change(self) -> str | None:
        """How the file differs from when it was opened (size, mtime, gone), or None."""
        try:
            now = Identity.of(os.fstat(self.fd))
        except OSError as e:
            return f"cannot be checked any more ({e.strerror})"
        if now == self.identity:
            return None
        return (f"changed while it was being read (size {self.identity.size} -> {now.size}, "
                f"modified {now.mtime_ns - self.identity.mtime_ns} ns later)")


def open_regular(path: str) -> OpenFile:
    """Open a regular file for reading without ever blocking on a FIFO or a device."""
    refuse_irregular(path, stat_path(path))
    try:  # O_NONBLOCK: should a FIFO have taken the file's place since the stat, open returns
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise _failed(path, "cannot open", e) from e
    try:
        st = os.fstat(fd)
        refuse_irregular(path, st)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return OpenFile(path, fd, Identity.of(st))


def header_only(path: str, data: bytes, size: int) -> OpenFile:
    """The file ``path`` that is not on this machine (a Hub repo's, read by HTTP range requests) as
    far as ``data``, its first bytes, go: an anonymous sparse temporary file of the file's ``size``
    bytes, so that its header is parsed and checked against that size exactly as a local file's.
    The rest is a hole: only commands that read no tensor data open files this way."""
    fd, name = tempfile.mkstemp(prefix="zload-header-")
    try:
        os.unlink(name)
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, size)
        return OpenFile(path, fd, Identity.of(os.fstat(fd)))
    except BaseException:
        os.close(fd)
        raise


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class FileTable:
    """The files of a checkpoint this process opened, by file key (the file's name in the
    checkpoint folder, as the index names it); every read goes through these.

    Closed by ``close`` (``load_into`` and the CLI do it as soon as they are done), or when the
    table is garbage-collected.
    """

    def __init__(self):
        self.files: dict[str, OpenFile] = {}
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    def add(self, opened: OpenFile, key: str) -> OpenFile:
        previous = self.files.get(key)
        if previous is not None:  # the same file again (an index listing a shard twice): keep one
            os.close(opened.fd)
            return previous
        self.files[key] = opened
        self._fds.append(opened.fd)
        return opened

    def get(self, key: str) -> OpenFile:
        opened = self.files.get(key)
        if opened is None:
            raise CheckpointError(f"{key}: not among the files whose headers this rank read", path=key)
        return opened

    def check_unchanged(self, keys) -> None:
        """Raise if any of the files ``keys`` names changed since it was opened."""
        for key in sorted(set(keys)):
            opened = self.get(key)
            change = opened.change()
            if change:
                raise CheckpointError(f"{opened.path}: {change}; the bytes read from it cannot be trusted. "
                                      "Do not modify a checkpoint while it is being loaded", path=opened.path)

    def close(self) -> None:
        self.files.clear()
        self._finalizer()

    def __enter__(self) -> FileTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
