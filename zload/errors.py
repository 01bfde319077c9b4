"""zload's exceptions.

Every error a user can trigger with a bad checkpoint or a bad call is a ``ZloadError``, so that a
trainer can catch one type; the subclasses say which stage refused.
"""


class ZloadWarning(UserWarning):
    """Something worked, but not quite as the model, checkpoint or folder suggests (see message)."""


class ZloadError(Exception):
    """Base class of every error zload raises on purpose."""


class CheckpointError(ZloadError):
    """A checkpoint file is missing, unreadable or not valid safetensors.

    The message names the file and, where one is at fault, the tensor.
    """


class PlanError(ZloadError):
    """The checkpoint and the model do not fit together (shapes, dtypes, coverage).

    Raised identically on every rank, before a single byte of the model is written.
    """


class PeerLostError(ZloadError):
    """Talking to the other ranks failed part-way through a step (``stage``): a peer process has
    died or become unreachable. The message says what state the model or folder is left in.

    The communication backend's own error is the ``__cause__``.
    """

    def __init__(self, message: str, *, stage: str):
        super().__init__(message)
        self.stage = stage
