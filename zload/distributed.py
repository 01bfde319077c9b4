"""The thin distributed layer: who we are, and agreeing on problems before acting.

Every rank plans on its own; then the ranks agree, so that a problem seen by any rank raises the
same error on every rank instead of leaving the others blocked in a later collective. Agreeing
costs one all-reduce of a few numbers (``reduce_max``) when no rank has a problem, as in nearly
every load; only then are the problems themselves exchanged. What must be the same on every rank
(a call's ``Arguments``, a view of the checkpoint) travels in that all-reduce as a ``digest`` and
its negation: their maxima are each other's negation exactly when every rank holds the same.
"""

from __future__ import annotations

import hashlib
import logging
import os
import traceback
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist

from . import errors
from .report import brief, ranks_named, shortened

logger = logging.getLogger("zload")


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


ALL_RANKS_VARIABLE = "ZLOAD_ALL_RANKS"  # "1": every rank warns and logs, not rank 0 alone


def speaks_for_all() -> bool:
    """Whether this rank tells what every rank sees alike: the warnings about a call, its model and
    its checkpoint (which every rank shares), and the load's report. Rank 0 does, unless
    ``ZLOAD_ALL_RANKS=1`` asks every rank to; 64 ranks saying the same is noise. What one rank sees
    alone (a read-ahead that stopped, an unexpected error) it says itself, and an error is raised
    on every rank."""
    return rank_and_world()[0] == 0 or os.environ.get(ALL_RANKS_VARIABLE) == "1"


def speaks_for_node() -> bool:
    """Whether this rank tells what each node sees alike (the DeepSpeed installed): the node's first
    rank (``LOCAL_RANK`` 0, from torchrun or the DeepSpeed launcher), or every rank with
    ``ZLOAD_ALL_RANKS=1``."""
    local = os.environ.get("LOCAL_RANK", str(rank_and_world()[0]))
    return local == "0" or os.environ.get(ALL_RANKS_VARIABLE) == "1"


def warn_for_all(message: str, stacklevel: int = 1, category: type[Warning] = errors.ZloadWarning) -> None:
    """``warnings.warn`` where ``speaks_for_all``: about what every rank sees alike. ``stacklevel``
    counts from the caller, as ``warnings.warn``'s does."""
    if speaks_for_all():
        warnings.warn(message, category, stacklevel=stacklevel + 1)


def comm_device():
    """Where the backend takes tensors: the current GPU for NCCL, else the CPU (gloo)."""

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# The status byte that ends each batch one rank sends another point to point: a rank that failed
# still sends (and receives) every batch it owes, marked failed, so its peer never waits forever.
BATCH_OK, BATCH_FAILED = 0, 1

_stage: ContextVar[tuple[str, str]] = ContextVar("zload_stage", default=("communicating", ""))


@contextmanager
def stage(what: str, leaves: str):
    """Name the step the ranks are in (``what``) and the state a failure in it ``leaves`` the
    model or folder in, for the error raised if a peer process dies meanwhile."""
    token = _stage.set((what, leaves))
    try:
        yield
    finally:
        _stage.reset(token)


@contextmanager
def collective():
    """Around calls that talk to other ranks. gloo and NCCL raise a bare ``RuntimeError`` when a
    peer process is gone; it becomes a ``PeerLostError`` that names the step and the state left."""
    try:
        yield
    except (RecursionError, NotImplementedError, torch.OutOfMemoryError):  # no transport failures
        raise
    except RuntimeError as e:
        what, leaves = _stage.get()
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise errors.PeerLostError(
            f"{what} was interrupted: talking to the other ranks failed ({detail}); another "
            f"rank's process has probably died or become unreachable (see its log). {leaves}",
            stage=what) from e


def exchange(obj) -> list:
    """Every rank's ``obj``, in rank order (a list of one without torch.distributed)."""
    _, world = rank_and_world()
    if world == 1:
        return [obj]
    gathered = [None] * world
    with collective():
        dist.all_gather_object(gathered, obj)
    return gathered


def reduce_max(values: list[int]) -> list[int]:
    """The element-wise maximum over ranks of ``values`` (signed 64-bit integers)."""
    _, world = rank_and_world()
    if world == 1:
        return list(values)

    tensor = torch.tensor(values, dtype=torch.int64, device=comm_device())
    with collective():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def digest(value) -> int:
    """A digest of ``repr(value)``, equal on two ranks (but for a 2**-62 chance) exactly when the
    reprs are; non-negative and below 2**62, so that it and its negation fit in int64."""
    return int.from_bytes(hashlib.sha1(repr(value).encode()).digest()[:8], "little") >> 2


def same_everywhere(high: int, negated_low: int) -> bool:
    """Whether every rank held the same digest, given the maxima over ranks of it and its negation."""
    return high == -negated_low


class Choice(str, Enum):
    """A mode named by a string: its members are strings (``Verify.FULL == "full"``) and print as
    their values, so users pass plain strings and messages read as they did."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value, argument: str):
        """``value`` (a member or its string) as a member, or an ``ArgumentValueError`` naming
        ``argument`` and the values allowed."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in cls)
            raise errors.ArgumentValueError(f"{argument}={brief(value)}: expected one of {allowed}") from None


@dataclass(frozen=True)
class Arguments:
    """A call's arguments as the ranks compare them: ``values``, by name, each as a value whose
    repr is the same on every rank that passed the same (a function as its kind, not its address);
    and the error of an invalid one, raised only once the ranks know that every rank passed it
    (a rank that alone passed one must still meet the others in their first collective)."""

    call: str  # e.g. "load_into"
    values: dict
    invalid: errors.ZloadError | None = None

    @property
    def digest(self) -> int:
        return digest(self.values)

    def differing(self, gathered: list[dict], what: str) -> errors.ArgumentValueError:
        """The error for every rank's ``values`` (``gathered``, in rank order) when they differ:
        each argument that differs, and what each rank passed."""
        lines = []
        for name in self.values:
            passed: dict[str, list[int]] = {}
            for rank, values in enumerate(gathered):
                passed.setdefault(brief(values.get(name)), []).append(rank)
            if len(passed) > 1:
                lines.append(f"{name}: " + shortened([f"{value} on {ranks_named(ranks)}"
                                                      for value, ranks in passed.items()], 4))
        return errors.ArgumentValueError(
            f"{what}: the ranks passed {self.call} different arguments ({'; '.join(lines)}); every rank "
            f"must call {self.call} with the same arguments and the same model", ranks=tuple(range(len(gathered))))


@dataclass(frozen=True)
class Problem:
    """Why one rank cannot go on, as it travels to the others: the class, message and fields of
    the ``ZloadError`` it raised (or would raise), which ``raise_for`` rebuilds on every rank."""

    kind: type[errors.ZloadError]
    message: str
    fields: dict = field(default_factory=dict)

    @classmethod
    def of(cls, error: errors.ZloadError) -> Problem:
        return cls(type(error), str(error), error.fields)


def agree_arguments(call: str, values: dict, invalid: errors.ZloadError | None, what: str) -> None:
    """Raise on every rank if the ranks passed ``call`` different ``values`` (plain values as they
    are, others by their ``str``; the error names each and what each rank passed), or the same
    invalid one (``invalid``): one all-reduce, which every rank reaches whatever it passed."""
    arguments = Arguments(call, {name: value if isinstance(value, (str, int, float, type(None))) else str(value)
                                 for name, value in values.items()}, invalid)
    high, negated_low = reduce_max([arguments.digest, -arguments.digest])
    if not same_everywhere(high, negated_low):
        raise arguments.differing(exchange(arguments.values), what)
    if arguments.invalid:
        raise arguments.invalid


def agree(problems: list[Problem], what: str) -> None:
    """Raise on every rank if any rank has problems."""
    if reduce_max([len(problems)])[0]:
        raise_for(exchange(problems), what)


MAX_PROBLEMS_SHOWN = 10  # an agreed error lists this many problems, then how many more: 64 ranks' are pages

# ``raise_for`` raises the error of the first problem (in rank order) of the first of these classes
# that any rank reported: a checkpoint problem explains plan problems that follow from it.
_PRECEDENCE = (errors.CheckpointError, errors.PlanError, errors.ZloadError)


def raise_for(gathered: list[list[Problem]], what: str) -> None:
    """Raise if any rank's list of problems (``gathered``, in rank order) is not empty.

    The message lists every problem once (the first ``MAX_PROBLEMS_SHOWN``, the error's own among
    them, then how many more), prefixed by the ranks that saw it when not all ranks did. The error
    is that of one problem: the first checkpoint problem in rank order, else the first plan
    problem, else the first problem; it has that problem's class and fields, and ``ranks``, the
    ranks that reported it.
    """
    seen: dict[tuple[type, str], tuple[Problem, list[int]]] = {}
    for r, rank_problems in enumerate(gathered):
        for problem in rank_problems:
            ranks = seen.setdefault((problem.kind, problem.message), (problem, []))[1]
            if r not in ranks:
                ranks.append(r)
    if not seen:
        return
    reported = list(seen.values())
    chosen, ranks = next(r for cls in _PRECEDENCE for r in reported if issubclass(r[0].kind, cls))
    shown = reported[:MAX_PROBLEMS_SHOWN]
    if all(problem is not chosen for problem, _ in shown):  # the error's own problem is always shown
        shown[-1] = (chosen, ranks)
    lines = [f"  - {_seen_by(r, len(gathered))}{problem.message}" for problem, r in shown]
    if len(reported) > len(shown):
        lines.append(f"  - ... and {len(reported) - len(shown)} more problems")
    raise chosen.kind(f"{what}:\n" + "\n".join(lines), **chosen.fields, ranks=tuple(ranks))


def _seen_by(ranks: list[int], world: int) -> str:
    """``"[rank 1, 3] "`` (the first few of many), or nothing when every rank saw a problem."""
    return "" if len(ranks) == world else f"[rank {shortened(ranks)}] "


def problems_of(doing: str, call) -> tuple[object, list[Problem]]:
    """Run ``call``; turn any exception into problems so every rank can still reach ``agree``."""
    try:
        return call(), []
    except errors.ZloadError as e:
        return None, [Problem.of(e)]
    except Exception as e:  # a bug or an environment error must not leave other ranks hanging
        logger.error("unexpected error while %s:\n%s", doing, traceback.format_exc())
        return None, [Problem(errors.ZloadError, f"unexpected error while {doing}: {type(e).__name__}: {e}")]


DEFAULT_READ_THREADS = 4  # readers per rank (the calling thread included), at most


def local_ranks() -> int:
    """Ranks on this node (``LOCAL_WORLD_SIZE`` from torchrun, ``LOCAL_SIZE`` from the DeepSpeed
    launcher; 1 when neither says)."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"
    return max(1, int(local)) if local.isdigit() else 1


def reader_count(limit: int = DEFAULT_READ_THREADS) -> int:
    """Reader threads for this rank: ``limit``, but at most its share of the usable CPUs among the
    ranks of this node."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(limit, cpus // local_ranks()))
