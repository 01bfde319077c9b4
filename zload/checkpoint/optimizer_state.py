"""Optimizer state in a checkpoint: where each trainable parameter's fp32 master weights and
optimizer states (Adam's ``exp_avg`` and ``exp_avg_sq``...) lie, and the parameter groups (their
hyperparameters, members and step count), in DeepSpeed's own checkpoints and in the files
``zload.save(..., optimizer=True)`` writes beside the weights (docs/optimizer-format.md).

Both are indexed alike (``OptimizerIndex``): per state, per parameter, a ``TensorEntry`` of the
parameter's whole shape, stored whole (zload's files) or as fragments of the saved ranks' flat
partitions (DeepSpeed's: each state is laid out like the fp32 flat groups, which ``native``
already cuts into parameters), so that a resume at any world size reads only the byte ranges of
its own new partitions.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

from ..errors import InvalidCheckpointError
from ..report import brief, shortened
from .files import FileTable
from .index import CheckpointIndex, TensorEntry, index_from_weight_map, read_json
from .native import NativeLayout, native_entries

MASTER = "fp32"  # the state name of the fp32 master weights (as ds_to_universal names it)
OPTIMIZER_SINGLE = "optimizer.safetensors"  # the name zload's optimizer shards are named from
OPTIMIZER_INDEX = OPTIMIZER_SINGLE + ".index.json"
FORMAT = "zload-optimizer"
VERSION = 1
LOSS_SCALE_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
COUNTERS = ("global_steps", "global_samples", "skipped_steps")


@dataclass(frozen=True)
class GroupState:
    """One parameter group of the optimizer."""

    hyperparameters: dict  # every key of the group but ``params``, as plain (JSON) values
    members: tuple[str, ...]  # the names of the parameters it optimizes
    step: int | float | None  # its step count; None before the first step


@dataclass(frozen=True)
class OptimizerIndex:
    """Everything a resume restores beyond the weights."""

    source: str
    states: dict[str, dict[str, TensorEntry]]  # state name (MASTER first) -> parameter name -> entry
    groups: tuple[GroupState, ...]
    loss_scaler: dict = field(default_factory=dict)  # LOSS_SCALE_KEYS found
    lr_scheduler: dict | None = None  # the scheduler's state_dict, None where none was saved
    lr_scheduler_problem: str | None = None  # why a saved scheduler state cannot be restored
    counters: dict = field(default_factory=dict)  # COUNTERS found
    weights: tuple[str, ...] = ()  # zload's files: the data digests of the weights saved with them
    groups_file: str = ""  # the file the parameter groups are read from
    scheduler_file: str = ""  # the file the LR scheduler's state is read from
    files: FileTable | None = field(default=None, compare=False, repr=False)  # where the bytes are read
    owns_files: bool = False  # whether ``files`` was opened for this index (else the weights index's)

    def close(self) -> None:
        if self.owns_files and self.files is not None:
            self.files.close()


def state_tensor_name(param: str, state: str) -> str:
    """``model.embed_tokens.weight`` + ``exp_avg`` -> ``model.embed_tokens.weight.exp_avg``: the
    name of one state of one parameter in zload's optimizer files (states have no dots)."""
    return f"{param}.{state}"


class NotPlain(ValueError):
    """A value a checkpoint holds that zload does not restore (an object, a tensor of many elements)."""


def plain(value, number=None, what: str = "value"):
    """``value`` as JSON values (tuples become lists), refusing any other kind; ``number(tensor,
    what)`` reads a one-element tensor of a DeepSpeed pickle (None where there is none)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NotPlain(f"{what} is {value}, which JSON cannot hold")
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, number, f"{what}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise NotPlain(f"{what} has keys that are neither names nor numbers")
        return {str(k): plain(v, number, f"{what}[{k!r}]") for k, v in value.items()}
    found = number(value, what) if number is not None else None
    if found is None:
        raise NotPlain(f"{what} is {brief(value, 80)} ({type(value).__name__}), which zload does not restore")
    return plain(found, None, what)


def _count(value) -> int | float | None:
    """A step count as an int where it is whole (DeepSpeed saves torch's float32 tensor)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_MAX_COUNT = 2 ** 53  # counts past it are not exact in a float64 (torch's Adam keeps a step in a float)


def count_problem(value, what: str, low: int = 0) -> str | None:
    """Why ``value`` is no count a resume may set on the engine (a step, which Adam's bias
    correction raises betas to, an iteration): a whole number from ``low`` to 2**53."""
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= _MAX_COUNT:
        return None
    return f"{what} is {brief(value)}, not a whole number from {low} to 2**53"


def scaler_problem(state: dict, what: str) -> str | None:
    """Why the loss scaler's ``state`` cannot be set on the engine's: its scale (which gradients
    are divided by) a positive finite number, its iterations counts (-1: no overflow yet)."""
    for key, value in state.items():
        if key != "cur_scale":
            problem = count_problem(value, f"{what}[{key!r}]", low=-1)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            problem = f"{what}[{key!r}] is {brief(value)}, not a positive finite number"
        else:
            problem = None
        if problem:
            return problem
    return None


def counters_problem(counters: dict, what: str) -> str | None:
    """Why the engine's ``counters`` (``global_steps``...) cannot be set on it."""
    return next((p for k, v in counters.items() if (p := count_problem(v, f"{what}[{k!r}]"))), None)


# ---- DeepSpeed's checkpoints


def native_optimizer(layout: NativeLayout, source: str) -> tuple[OptimizerIndex | None, list[str]]:
    """The optimizer state of the DeepSpeed checkpoint ``layout`` describes, and what is wrong.

    Each rank's optimizer states hold a torch optimizer's ``state_dict`` whose parameters are the
    rank's flat fp32 partitions (ZeRO-3: ``optimizer_state_dict``, one per sub-group, numbered as
    the sub-groups; ZeRO-1/2: ``base_optimizer_state``, one per group): per flat, each tensor state
    is laid out like the flat (ZeRO-1/2's with the group's padding kept), and ``step`` is a number.
    ``param_groups`` lists each group's flats: its members are the parameters param_shapes lists
    for them."""
    files, problems = layout.optim_files, []
    if not files or layout.model_file is None:
        return None, ["the checkpoint's files were not kept with its index"]
    base_key = "optimizer_state_dict" if layout.stage == 3 else "base_optimizer_state"
    bases = [f.state.get("optimizer_state_dict", {}).get(base_key) for f in files]
    if not all(isinstance(b, dict) and isinstance(b.get("state"), dict) and isinstance(b.get("param_groups"), list)
               for b in bases):
        rank = next(r for r, b in enumerate(bases) if not isinstance(b, dict) or not isinstance(
            b.get("state"), dict) or not isinstance(b.get("param_groups"), list))
        return None, [f"{files[rank].opened.path}: {base_key} is not a torch optimizer's state_dict (a ZeRO-1/2 "
                      "'elastic_checkpoint' save?), which zload does not restore optimizer states from"]
    first, base = files[0], bases[0]
    flats = len(layout.flat[0])

    # which flats each group holds: numbered in group order, as torch numbers them
    taken, members = 0, []
    for g, group in enumerate(base["param_groups"]):
        indices = group.get("params") if isinstance(group, dict) else None
        if not isinstance(indices, list) or indices != list(range(taken, taken + len(indices))):
            return None, [f"{first.opened.path}: param_groups[{g}]['params'] is {brief(indices)}, not the next of "
                          f"its {flats} flat partitions in order as DeepSpeed saves them"]
        members.append([name for k in indices if k < flats for name in layout.param_shapes[k]])
        taken += len(indices)
    if taken != flats or len(layout.param_shapes) != flats:
        return None, [f"{first.opened.path}: param_groups list {taken} flat partitions, but the checkpoint holds "
                      f"{flats} ({len(layout.param_shapes)} in param_shapes)"]

    # the states: the same tensor keys for every flat of every rank (none before the first step)
    keys: list[str] | None = None
    for f, b in zip(files, bases):
        for k in range(flats):
            entry = b["state"].get(k, {})
            if not isinstance(entry, dict):
                return None, [f"{f.opened.path}: {base_key}['state'][{k}] is {type(entry).__name__}, not the "
                              "optimizer's state of a flat partition (a dict)"]
            found = sorted(key for key, value in entry.items() if _is_flat_state(value))
            if keys is None:
                keys = found
            if found != keys:
                return None, [f"{f.opened.path}: the optimizer state of flat partition {k} holds {brief(found)}, "
                              f"but that of flat partition 0 of rank 0 {brief(keys)}: files of different saves?"]
    stored = {key: [[f.tensor(b["state"][k][key], f"{base_key}['state'][{k}][{key!r}]") for k in range(flats)]
                    for f, b in zip(files, bases)] for key in keys or []}
    trainable = [name for group in layout.param_shapes for name in group]
    states: dict[str, dict[str, TensorEntry]] = {}
    for key, flat in [(MASTER, layout.flat), *stored.items()]:
        entries, found = native_entries(replace(layout, flat=flat))
        problems += [f"optimizer state {key!r}: {p}" for p in found]
        states[key] = {name: entries[name] for name in trainable if name in entries}
    if problems:
        return None, problems

    groups = []
    for g, (group, names) in enumerate(zip(base["param_groups"], members)):
        steps = {_count(first.number(base["state"].get(k, {}).get("step"), f"{base_key}['state'][{k}]['step']"))
                 for k in group["params"]}
        if len(steps) > 1:
            return None, [f"{first.opened.path}: the flat partitions of parameter group {g} have taken different "
                          f"numbers of steps {sorted(steps, key=str)}"]
        wrong = next((p for s in steps if s is not None
                      and (p := count_problem(s, f"{base_key}['param_groups'][{g}]'s step"))), None)
        if wrong:
            return None, [f"{first.opened.path}: {wrong}"]
        try:
            values = plain({k: v for k, v in group.items() if k != "params"}, first.number,
                           f"{base_key}['param_groups'][{g}]")
        except NotPlain as e:
            return None, [f"{first.opened.path}: {e}"]
        groups.append(GroupState(values, tuple(names), steps.pop() if steps else None))

    main = layout.model_file
    scaler = files[0].state.get("optimizer_state_dict", {}).get("loss_scaler")
    scaler_state = getattr(scaler, "state", None)
    loss_scaler = {k: v for k, v in scaler_state.items() if k in LOSS_SCALE_KEYS and isinstance(v, (int, float))} \
        if isinstance(scaler_state, dict) else {}
    scheduler, scheduler_problem = main.state.get("lr_scheduler"), None
    try:
        scheduler = plain(scheduler, main.number, "lr_scheduler")
    except NotPlain as e:
        scheduler, scheduler_problem = None, f"{main.opened.path}: {e}"
    counters = {k: main.state[k] for k in COUNTERS if isinstance(main.state.get(k), int)}
    wrong = (scaler_problem(loss_scaler, f"{first.opened.path}: optimizer_state_dict['loss_scaler']")
             or counters_problem(counters, f"{main.opened.path}: the engine's counter"))
    if wrong:
        return None, [wrong]
    return OptimizerIndex(source, states, tuple(groups), loss_scaler, scheduler, scheduler_problem, counters,
                          groups_file=first.opened.path, scheduler_file=main.opened.path, files=None), []


def _is_flat_state(value) -> bool:
    """A tensor state laid out like its flat partition (not a 0-d step count)."""
    import torch

    return isinstance(value, torch.Tensor) and torch.Tensor.dim(value) > 0


# ---- zload's own files


def saved_optimizer(folder: str, source: str) -> OptimizerIndex | None:
    """The optimizer state ``zload.save(..., optimizer=True)`` wrote into ``folder``, its files
    opened; None where there is none. Raises ``InvalidCheckpointError`` for files zload did not
    write so (docs/optimizer-format.md)."""
    path = os.path.join(folder, OPTIMIZER_INDEX)
    if not os.path.lexists(path):
        return None
    table = FileTable()
    try:
        tensors = index_from_weight_map(path, table, missing_ok=False)
        document, _ = read_json(table.files[OPTIMIZER_INDEX])  # the descriptor the weight map came from
        return _saved(path, source, document, tensors, table)
    except BaseException:
        table.close()
        raise


def _saved(path: str, source: str, document, tensors: CheckpointIndex, table: FileTable) -> OptimizerIndex:
    def bad(why: str) -> InvalidCheckpointError:
        return InvalidCheckpointError(f"{path}: {why}; not an optimizer index zload wrote "
                                      "(docs/optimizer-format.md)", path=path)

    metadata = document.get("metadata") if isinstance(document, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise bad(f"its metadata's format is {brief((metadata or {}).get('format'))}, not {FORMAT!r}")
    if metadata.get("version") != VERSION:
        raise bad(f"format version {brief(metadata.get('version'))}; this zload reads version {VERSION}")
    names = metadata.get("states")
    if not isinstance(names, list) or not names or names[0] != MASTER or not all(
            isinstance(n, str) and n and "." not in n for n in names) or len(set(names)) != len(names):
        raise bad(f"'states' is {brief(names)}, not a list of state names starting with {MASTER!r}")
    groups, listed = [], metadata.get("param_groups")
    for g, group in enumerate(listed if isinstance(listed, list) else [None]):
        if not (isinstance(group, dict) and isinstance(group.get("hyperparameters"), dict)
                and isinstance(group.get("params"), list) and all(isinstance(n, str) for n in group["params"])
                and (group.get("step") is None or isinstance(group["step"], (int, float)))):
            raise bad(f"param_groups[{g}] is {brief(group)}, not {{'hyperparameters': {{...}}, 'params': [names], "
                      "'step': a number or null}")
        if group.get("step") is not None and (wrong := count_problem(group["step"], f"param_groups[{g}]['step']")):
            raise bad(wrong)
        groups.append(GroupState(group["hyperparameters"], tuple(group["params"]), group.get("step")))
    members = [n for group in groups for n in group.members]
    if len(set(members)) != len(members):
        twice = sorted({n for n in members if members.count(n) > 1})
        raise bad(f"parameters listed in more than one group or twice: {shortened(twice, 5)}")
    states: dict[str, dict[str, TensorEntry]] = {name: {} for name in names}
    for name, entry in tensors.tensors.items():
        param, _, state = name.rpartition(".")
        if state not in states or param not in set(members):
            raise bad(f"tensor {brief(name)} is no state {names} of a parameter its param_groups list")
        states[state][param] = entry
    for state, entries in states.items():
        lacking = [n for n in members if n not in entries]
        if lacking:
            raise bad(f"no {state!r} state for {shortened(lacking, 5)}")
        odd = [n for n in members if entries[n].shape != states[MASTER][n].shape]
        if odd:
            raise bad(f"the {state!r} state of {shortened(odd, 5)} is not of its parameter's shape")
    weights = metadata.get("weights")
    if not isinstance(weights, list) or not all(isinstance(w, str) for w in weights):
        raise bad(f"'weights' is {brief(weights)}, not the list of the weights files' digests")

    def mapping(key: str) -> dict:
        value = metadata.get(key)
        if value is not None and not isinstance(value, dict):
            raise bad(f"{key!r} is {brief(value)}, not a mapping")
        return value or {}

    loss_scaler = {k: v for k, v in mapping("loss_scaler").items() if k in LOSS_SCALE_KEYS}
    counters = {k: v for k, v in mapping("engine").items() if k in COUNTERS}
    wrong = scaler_problem(loss_scaler, "'loss_scaler'") or counters_problem(counters, "'engine'")
    if wrong:
        raise bad(wrong)
    scheduler = None if metadata.get("lr_scheduler") is None else mapping("lr_scheduler")
    return OptimizerIndex(source, states, tuple(groups), loss_scaler, scheduler, None, counters,
                          tuple(sorted(weights)), path, path, files=table, owns_files=True)


def index_metadata(states: list[str], groups: list[GroupState], loss_scaler: dict, lr_scheduler: dict | None,
                   counters: dict, world: int) -> dict:
    """The metadata of zload's optimizer index (docs/optimizer-format.md), but the weights' data
    digests, known once they are written."""
    return {"format": FORMAT, "version": VERSION, "states": list(states),
            "param_groups": [{"hyperparameters": g.hyperparameters, "params": list(g.members), "step": g.step}
                             for g in groups],
            "loss_scaler": loss_scaler, "lr_scheduler": lr_scheduler, "engine": counters, "world_size": world}


def check_json(metadata: dict) -> None:
    """Raise ``NotPlain`` unless ``metadata`` is JSON that reads back as it is."""
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise NotPlain(str(e)) from e
