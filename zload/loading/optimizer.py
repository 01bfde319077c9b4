"""Resuming a live engine's optimizer: ``load_into(engine, path, optimizer=True)``.

Planned with the weights, on every rank, before anything is written (``plan_optimizer``: its
problems are the load's, agreed on by every rank): the checkpoint's parameter groups must hold the
engine's trainable parameters, group by group, with a state of each parameter's shape for every
state the checkpoint keeps. Each rank then reads, for each of its flat fp32 partitions, only the
elements of the parameters the partition holds, of the masters and of each state, at whatever
world size the checkpoint was saved, and sets the step counts, the hyperparameters, the loss
scaler, the training counters and the LR scheduler (``restore_optimizer``, the last of the load's
byte sources); the engine's bracket (``engine_writes``) then sets the 16-bit weights from the
masters.
Nothing is gathered: no collective but the agreement on problems.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from ..checkpoint.digest import DIGEST_KEY
from ..checkpoint.dtypes import TORCH_DTYPES
from ..checkpoint.index import CheckpointIndex
from ..checkpoint.optimizer_state import MASTER, OptimizerIndex, native_optimizer, saved_optimizer
from ..distributed import agree, problems_of, warn_for_all
from ..errors import UnsupportedModelError
from ..integrations.deepspeed import (
    Flat,
    flat_states,
    hyperparameters,
    is_zero3,
    lr_scheduler,
    optimized_parameters,
    optimizer_flats,
    set_loss_scale_state,
    set_optimizer_state,
    set_training_counters,
    zero3_shape,
)
from ..model.targets import Target
from ..report import brief, shortened
from .execute import execute
from .plan import ReadItem

_LR_SCHEDULER_ADDS = frozenset({"initial_lr"})  # a hyperparameter torch's schedulers add to a group


@dataclass
class OptimizerPlan:
    """What a resume reads into the engine's optimizer on this rank, and what stands in the way."""

    index: OptimizerIndex | None = None
    engine: object = field(default=None, repr=False)
    flats: list[Flat] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # the states, MASTER first
    items: list[ReadItem] = field(default_factory=list)  # target k * len(keys) + s: flat k's state s
    padding: list[tuple[int, int, int]] = field(default_factory=list)  # (destination, first, count) zeroed
    # the ``id`` of each parameter whose 16-bit partition is set from its masters (ZeRO-3's: the
    # load need not read its weights; ZeRO-1/2 set only this rank's fragments, the rest is read)
    from_masters: set[int] = field(default_factory=set)
    groups: list[dict] = field(default_factory=list)  # hyperparameters to set, in the engine's types
    scheduler: dict | None = None
    problems: list[str] = field(default_factory=list)
    agreed: str = ""  # what every rank's plan must say alike (``LoadPlan.collectives``)

    def close(self) -> None:
        if self.index is not None:
            self.index.close()


def _optimizer_index(weights: CheckpointIndex) -> tuple[OptimizerIndex | None, list[str]]:
    """The optimizer state beside the weights ``weights`` index: a DeepSpeed checkpoint's own, or
    zload's files in the weights' folder."""
    if weights.layout is not None:
        return native_optimizer(weights.layout, weights.source)
    if any(key.endswith(".pt") for key in weights.files):
        return None, ["the ranks see different DeepSpeed checkpoints, or not all of it: restoring the optimizer "
                      "state needs every rank to see the whole checkpoint"]
    return saved_optimizer(weights.root, weights.source), []


def _tie_problem(index: OptimizerIndex, weights: CheckpointIndex) -> str | None:
    """Where zload's optimizer files were not saved with the weights beside them (a save of the
    weights alone since, or one killed between the two)."""
    if index.owns_files is False:
        return None
    digests = sorted(weights.opened.get(key).metadata.get(DIGEST_KEY, "") for key in weights.files)
    if list(index.weights) == digests:
        return None
    return (f"its optimizer state was saved with other weights than those now in {weights.root} (their data "
            "digests differ): a save of the weights alone since, or one that was interrupted; save again with "
            "optimizer=True, or load the weights alone")


def _names(targets: list[Target]) -> dict[int, tuple[str, ...]]:
    return {id(t.tensor): t.names for t in targets}


def _matched(index: OptimizerIndex, live: list[list], names: dict[int, tuple[str, ...]],
             problems: list[str]) -> dict[int, str]:
    """Each optimized parameter of the engine (by ``id``) -> its name in the checkpoint; the
    differences between the engine's parameter groups and the checkpoint's go to ``problems``."""
    saved = {n: g for g, group in enumerate(index.groups) for n in group.members}
    if len(index.groups) != len(live):
        problems.append(f"the checkpoint's optimizer has {len(index.groups)} parameter groups, the engine's "
                        f"{len(live)}: build the optimizer with the parameter groups it was saved with")
    matched, unsaved, moved = {}, [], {}
    for g, params in enumerate(live):
        for param in params:
            found = next((n for n in names.get(id(param), ()) if n in saved), None)
            if found is None:
                unsaved.append(f"'{names.get(id(param), ('?',))[0]}' (group {g})")
            elif saved[found] != g:
                moved[found] = f"'{found}' (group {saved[found]} in the checkpoint, {g} in the engine)"
            else:
                matched[id(param)] = found
    extra = sorted(set(saved) - set(matched.values()) - set(moved))
    if unsaved:
        problems.append(f"{len(unsaved)} parameters the engine optimizes have no optimizer state in the checkpoint "
                        f"(added to the model or unfrozen since it was saved?): {shortened(unsaved, 5)}")
    if moved:
        problems.append(f"{len(moved)} parameters are in other parameter groups than in the checkpoint (groups "
                        f"built in another order, or of other parameters): {shortened(list(moved.values()), 5)}")
    if extra:
        problems.append(f"{len(extra)} parameters the checkpoint's optimizer optimizes are not optimized by the "
                        f"engine (frozen, or not in the model): {shortened([f'{n!r}' for n in extra], 5)}")
    return matched


def _fits(saved, live) -> bool:
    """Whether ``saved`` (JSON values) may take the place of the engine's ``live`` value: of its
    kind (numbers finite, sequences as long, mappings of the same keys); None and a bool stand for
    each other (torch's optimizers' flags ``foreach``, ``fused``... are True, False or None)."""
    if live is None or isinstance(live, bool):
        return saved is None or isinstance(saved, bool)
    if isinstance(live, (int, float)) or isinstance(live, torch.Tensor) and live.numel() == 1:
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(live, str):
        return isinstance(saved, str)
    if isinstance(live, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(live) and all(map(_fits, saved, live))
    if isinstance(live, dict):
        return (isinstance(saved, dict) and set(saved) == {str(k) for k in live}
                and all(_fits(saved[str(k)], v) for k, v in live.items()))
    return False


def _hyperparameter_problems(index: OptimizerIndex, live: list[dict]) -> list[str]:
    """Groups whose hyperparameters are named otherwise than the checkpoint's (another optimizer),
    or of other kinds (a hostile index: they are set on the engine's optimizer as they are)."""
    problems = []
    for g, (saved, values) in enumerate(zip(index.groups, live)):
        theirs, ours = set(saved.hyperparameters) - _LR_SCHEDULER_ADDS, set(values) - _LR_SCHEDULER_ADDS
        if theirs != ours:
            problems.append(f"parameter group {g}: the checkpoint's optimizer has the hyperparameters "
                            f"{sorted(theirs - ours)} the engine's lacks, and lacks {sorted(ours - theirs)}: "
                            "another optimizer than the one saved?")
            continue
        odd = [f"{key!r} is {brief(value, 60)}, the engine's {brief(values.get(key, 0.0), 60)}"
               for key, value in saved.hyperparameters.items() if not _fits(value, values.get(key, 0.0))]
        if odd:
            problems.append(f"{index.groups_file}: parameter group {g}'s hyperparameters are not of the kinds of "
                            f"the engine's: {shortened(odd, 3)}")
    return problems


def _in_engine_types(saved: dict, live: dict) -> dict:
    """The checkpoint's hyperparameters, each in the type of the engine's value: JSON keeps a
    tuple (Adam's ``betas``) as a list, a tensor (a capturable ``lr``) as a number."""
    out = {}
    for key, value in saved.items():
        current = live.get(key)
        if isinstance(current, tuple) and isinstance(value, list):
            value = tuple(value)
        elif isinstance(current, torch.Tensor) and isinstance(value, (int, float)):
            value = torch.tensor(value, dtype=current.dtype, device=current.device)
        out[key] = value
    return out


def _padding(flat: Flat) -> list[tuple[int, int]]:
    """(first, count) of the elements of ``flat`` no slot holds."""
    gaps, position = [], 0
    for slot in sorted(flat.slots, key=lambda s: s.offset):
        if slot.offset > position:
            gaps.append((position, slot.offset - position))
        position = max(position, slot.offset + slot.count)
    if flat.master.numel() > position:
        gaps.append((position, flat.master.numel() - position))
    return gaps


def plan_optimizer(plan: OptimizerPlan, targets: list[Target], weights: CheckpointIndex) -> None:
    """Fill ``plan``, this rank's plan to restore its engine's optimizer from the checkpoint whose
    weights ``weights`` indexes (made by the caller first, so that the caller closes the files it
    opens whatever happens); never raises for a checkpoint or engine that do not fit (``problems``)."""
    engine = plan.engine
    try:
        plan.flats, _ = optimizer_flats(engine)
        live = optimized_parameters(engine)
        live_values = hyperparameters(engine)
    except UnsupportedModelError as e:
        plan.problems.append(str(e))
        return
    index, problems = _optimizer_index(weights)
    plan.problems += problems
    if index is None:
        if not problems:
            plan.problems.append(f"{weights.source} holds no optimizer state (saved without optimizer=True?); "
                                 "load the weights alone (optimizer=False) to start the optimizer afresh")
        return
    plan.index = index
    tie = _tie_problem(index, weights)
    if tie:
        plan.problems.append(tie)
    matched = _matched(index, live, _names(targets), plan.problems)
    plan.problems += _hyperparameter_problems(index, live_values)
    plan.keys = list(index.states)
    states = set(plan.keys) - {MASTER}
    for state in flat_states(engine, plan.flats):
        kept = {key for key, value in state.items() if isinstance(value, torch.Tensor) and value.dim() > 0}
        if state and kept != states:
            plan.problems.append(f"the engine's optimizer keeps the states {sorted(kept)}, the checkpoint's "
                                 f"{sorted(states)}: another optimizer, or other settings (amsgrad?)")
            break
    shapes = []
    for params in live:
        for param in params:
            name = matched.get(id(param))
            shape = zero3_shape(param) if is_zero3(param) else tuple(param.shape)
            wrong = [s for s in plan.keys if name is not None and index.states[s][name].shape != shape]
            if wrong:
                entry = index.states[wrong[0]][name]
                shapes.append(f"'{name}': {wrong[0]} {list(entry.shape)} ({entry.file}) != model {list(shape)}")
            cast = [s for s in plan.keys if name is not None
                    and not TORCH_DTYPES[index.states[s][name].dtype].is_floating_point]
            if cast:
                shapes.append(f"'{name}': its {cast[0]} state is {index.states[cast[0]][name].dtype}, not floating")
    if shapes:
        plan.problems.append(f"{len(shapes)} optimizer states do not fit the model: {shortened(shapes, 5)}")
    scheduler = lr_scheduler(engine)
    if scheduler is not None and index.lr_scheduler_problem:
        plan.problems.append(f"the LR scheduler's state cannot be restored: {index.lr_scheduler_problem}")
    elif scheduler is not None and index.lr_scheduler is not None and not _fits(index.lr_scheduler,
                                                                                 scheduler.state_dict()):
        plan.problems.append(f"{index.scheduler_file}: the LR scheduler's state {brief(index.lr_scheduler, 120)} is "
                             f"not of the kinds of the engine's {type(scheduler).__name__}'s "
                             f"{brief(scheduler.state_dict(), 120)}: another scheduler than the one saved?")
    if plan.problems:
        return

    plan.groups = [_in_engine_types(saved.hyperparameters, values) for saved, values in zip(index.groups, live_values)]
    plan.from_masters = {id(param) for params in live for param in params if is_zero3(param)}
    plan.scheduler = index.lr_scheduler if lr_scheduler(engine) is not None else None
    width = len(plan.keys)
    for k, flat in enumerate(plan.flats):
        for slot in flat.slots:
            for s, key in enumerate(plan.keys):
                entry = index.states[key][matched[id(slot.param)]]
                for file, offset, skip, count in entry.spans(slot.first, slot.count):
                    plan.items.append(ReadItem(file, offset, count * entry.itemsize, TORCH_DTYPES[entry.dtype],
                                               k * width + s, slot.offset + skip, count))
        plan.padding += [(k * width + s, first, count) for first, count in _padding(flat) for s in range(width)]
    headers = sorted(f.header_sha256 or "" for f in index.files.files.values()) if index.owns_files else []
    plan.agreed = (f"the optimizer state of {index.source}: {len(index.groups)} parameter groups, states "
                   f"{plan.keys}, files {hashlib.sha256(repr(headers).encode()).hexdigest()[:16]}")


def _step(step, current):
    """A step count in the type the optimizer keeps it in (torch's Adam: a float32 0-d tensor)."""
    if isinstance(current, torch.Tensor):
        return torch.tensor(float(step), dtype=current.dtype, device=current.device)
    if isinstance(current, (int, float)):
        return type(current)(step)
    return torch.tensor(float(step), dtype=torch.float32)


def restore_optimizer(plan: OptimizerPlan, files, staging_bytes: int, source: str) -> int:
    """Restore everything ``plan`` (agreed on) says, on every rank: each flat partition's masters
    and states read (DeepSpeed's checkpoint through ``files``, the weights' table), then the step
    counts, hyperparameters, loss scaler, training counters and LR scheduler. Returns the bytes
    read; a failure on any rank raises on all."""
    read, problems = problems_of("restoring the optimizer state",
                                 lambda: _restore(plan, plan.index.files if plan.index.owns_files else files,
                                                  staging_bytes))
    agree(problems, f"restoring the optimizer state of {source} failed part-way; the engine is partly "
                    "written")
    scheduler = lr_scheduler(plan.engine)
    if scheduler is not None and plan.scheduler is None:
        warn_for_all(f"{source} holds no LR scheduler state: the engine's {type(scheduler).__name__} starts "
                     "afresh (a warm-up runs again), while each parameter group's saved learning rate is "
                     "restored; set the scheduler's state yourself, or build the engine without one", stacklevel=3)
    return read


def _restore(plan: OptimizerPlan, files, staging_bytes: int) -> int:
    engine, index = plan.engine, plan.index
    destinations, states = [], []
    for flat, state in zip(plan.flats, flat_states(engine, plan.flats)):
        new = {}
        for key in plan.keys:
            if key == MASTER:
                tensor = flat.master
            else:
                tensor = state.get(key)
                if not isinstance(tensor, torch.Tensor) or tensor.shape != flat.master.shape:
                    # before the optimizer's first step: every element is read or zeroed (``padding``)
                    tensor = torch.empty_like(flat.master)
                new[key] = tensor
            destinations.append(tensor.detach().view(-1))
        step = index.groups[flat.group].step
        if step is not None:
            new["step"] = _step(step, state.get("step"))
        states.append(new)
    read = execute(files, plan.items, destinations, staging_bytes)
    for destination, first, count in plan.padding:
        destinations[destination][first:first + count].zero_()
    set_optimizer_state(engine, plan.flats, states, plan.groups)
    set_loss_scale_state(engine, index.loss_scaler)
    set_training_counters(engine, index.counters)
    if plan.scheduler is not None:
        lr_scheduler(engine).load_state_dict(dict(plan.scheduler))
    return read
