"""zload's exceptions.

Every error a user can trigger with a bad checkpoint or a bad call is a ``ZloadError``, so that a
trainer can catch one type; the subclasses say which stage refused. Where an error means what a
built-in exception means, it is one too (a missing file is a ``FileNotFoundError``, a bad header a
``ValueError``), so that code written for the built-in catches it.

Every ``ZloadError`` has the fields ``path``, ``tensor`` and ``ranks``, each None when unknown. An
error the ranks agreed on (one rank's problem raised on all) is raised on every rank with the
class and fields of the rank that reported it, and ``ranks`` naming the ranks that did.
"""

from __future__ import annotations


class ZloadWarning(UserWarning):
    """Something worked, but not quite as the model, checkpoint or folder suggests (see message)."""


class ZloadError(Exception):
    """Base class of every error zload raises on purpose.

    ``path``: the file or folder at fault; ``tensor``: the tensor at fault (as the checkpoint names
    it); ``ranks``: the ranks that reported the error, when the ranks agreed on it.
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None,
                 ranks: tuple[int, ...] | None = None):
        super().__init__(message)
        self.path = path
        self.tensor = tensor
        self.ranks = ranks

    @property
    def fields(self) -> dict:
        """The keyword arguments, ``ranks`` aside, that rebuild this error on another rank."""
        return {"path": self.path, "tensor": self.tensor}


class CheckpointError(ZloadError):
    """A checkpoint file is missing, unreadable or not valid safetensors.

    The message names the file and, where one is at fault, the tensor.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint, or a file it lists, does not exist (``filename`` is ``path``)."""

    @property
    def filename(self) -> str | None:  # FileNotFoundError's name for the path
        return self.path


class InvalidCheckpointError(CheckpointError, ValueError):
    """A checkpoint file or index breaks the safetensors format, contradicts itself or another
    copy of the checkpoint, or does not match the digest recorded when it was saved."""


class PlanError(ZloadError, ValueError):
    """The checkpoint and the model do not fit together (shapes, dtypes, coverage), or the model
    cannot be saved as it is (a tensor on the meta device, an orphan not yet loaded).

    Raised identically on every rank, before a single byte of the model or the folder is written.
    """


class ArgumentValueError(ZloadError, ValueError):
    """An argument of a zload call has a value zload cannot use."""


class ArgumentTypeError(ZloadError, TypeError):
    """An argument of a zload call is of a type zload cannot use."""


class UnsupportedEnvironmentError(ZloadError):
    """An installed library is of a version zload does not support (a DeepSpeed older than zload
    needs); the message names the version installed and the one to install."""


class PeerLostError(ZloadError):
    """Talking to the other ranks failed part-way through a step (``stage``): a peer process has
    died or become unreachable. The message says what state the model or folder is left in.

    The communication backend's own error is the ``__cause__``.
    """

    def __init__(self, message: str, *, stage: str, **fields):
        super().__init__(message, **fields)
        self.stage = stage

    @property
    def fields(self) -> dict:
        return {**super().fields, "stage": self.stage}


class WriteError(ZloadError, OSError):
    """Writing a file of a save or conversion failed: its filesystem is full (``errno`` ENOSPC),
    the disk quota is spent (EDQUOT), the file is larger than the filesystem or the process allows
    (EFBIG), or another error of the operating system (its ``errno``). ``path`` is the file or
    folder being written; the message says what state the output folder is left in and what to do.
    """

    def __init__(self, message: str, *, errno: int | None = None, **fields):
        super().__init__(message, **fields)
        self.errno = errno

    @property
    def fields(self) -> dict:
        return {**super().fields, "errno": self.errno}


class UnsupportedModelError(ZloadError):
    """The model does something zload cannot follow: it computes a tensor from a parameter's values
    inside ``zload.init`` (which has none yet), or its transformers conversion mapping gives tensors
    other than it declares, or cannot be reversed to save it. The message names the tensors and
    what to do.
    """
