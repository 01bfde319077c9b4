"""Agreeing on a load before anything is written: every rank indexes the checkpoint and plans its
load, then the ranks settle in one all-reduce that they passed the same arguments, see the same
whole checkpoint, have no problem and plan the same collectives.

When the views differ (node-local shards, a Hub repo id, a bad header) the ranks share the headers
of the files some rank lacks (``checkpoint.views.share_index``), then plan and agree on the plans.
"""

from __future__ import annotations

from typing import Protocol

from ..checkpoint.hub import download
from ..checkpoint.open import refuse_revision
from ..checkpoint.views import LocalView, SharedIndex, Verify, local_view, share_index, verify_fully
from ..distributed import Arguments, Problem, digest, exchange, problems_of, raise_for, reduce_max, same_everywhere
from ..errors import PlanError
from .plan import LoadPlan, collectives_differing


class Planner(Protocol):
    """Plans one rank's load, on every rank, once the ranks see the checkpoint the same way."""

    def plan(self, shared: SharedIndex) -> LoadPlan:
        """This rank's plan against ``shared`` (which files it lacks, the agreed quantization);
        what stands in the way is in its ``problems``, and an exception is a problem too."""


def _planned(planner: Planner, shared: SharedIndex) -> tuple[LoadPlan | None, list[Problem]]:
    """``planner``'s plan of ``shared``, and its problems (an exception, or the plan's own)."""
    plan, problems = problems_of("planning", lambda: planner.plan(shared))
    return plan, (problems if plan is None else [Problem(PlanError, p) for p in plan.problems])


def _refused(source: str) -> str:
    return f"cannot load {source}; the model was not changed"


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


def open_agreed(path: str, revision: str | None, verify: Verify, arguments: Arguments,
                planner: Planner) -> tuple[str, SharedIndex, LoadPlan]:
    """Index the checkpoint and plan the load on every rank; raise on all if any rank cannot.

    Usually every rank sees the same whole checkpoint: each plans against its own view, and one
    all-reduce settles that every rank passed the same ``arguments`` (its first collective,
    whatever they are), that the views are the same (headers, a sample of the data, and the
    quantization config), that no plan has a problem and that every plan makes the same
    collectives (``LoadPlan.collectives``). ``verify="full"`` digests every file after it and
    settles again. Otherwise (node-local shards, copies that differ, a Hub repo id, a bad header)
    the ranks exchange their views, and then plan and agree on the plans.
    ``planner`` plans one rank's load. The returned index's files stay open; the caller closes them.
    """
    view = local_view(path, verify) if arguments.invalid is None else LocalView(path, None)
    try:
        plan, problems = _planned(planner, view.shared()) if view.whole else (None, [])
        same, troubled, differing = _settled(view, arguments, plan, problems)
        if verify == Verify.FULL:  # on every rank, as settled
            verify_fully(view)
            same, troubled, differing = _settled(view, arguments, plan, problems)
        if same:  # the same whole checkpoint everywhere
            refuse_revision(path, revision)
            _agree_on_plans(plan, problems, troubled, differing, arguments, _refused(path))
            return path, view.shared(), plan
        shared = share_index(view, _refused(path))
        source = path
        if shared is None:  # no rank has the path: a Hub repo id
            view.close()
            source = download(path, revision)
            view = local_view(source, verify)
            if verify == Verify.FULL:
                verify_fully(view)
            shared = share_index(view, _refused(source))
            view.forget_sampled()
        else:
            refuse_revision(path, revision)
        plan, problems = _planned(planner, shared)
        collectives = digest(plan.collectives if plan else None)
        troubled, high, negated_low = reduce_max([len(problems), collectives, -collectives])
        _agree_on_plans(plan, problems, bool(troubled), not same_everywhere(high, negated_low), arguments,
                        _refused(source))
        return source, shared, plan
    except BaseException:
        view.close()
        raise
