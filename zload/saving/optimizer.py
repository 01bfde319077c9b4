"""Saving a live engine's optimizer state beside its weights: ``save(engine, path, optimizer=True)``.

For each parameter the engine's optimizer trains, one tensor per state, of the parameter's whole
shape: ``<param>.fp32`` (the fp32 master weights), ``<param>.exp_avg``, ``<param>.exp_avg_sq`` (or
whatever states the optimizer keeps), in ``optimizer-0000k-of-0000N.safetensors`` shards, and the
parameter groups (hyperparameters, members, step count), the loss scaler, the engine's counters
and the LR scheduler in the metadata of their index ``optimizer.safetensors.index.json``
(docs/optimizer-format.md). The layout is planned alike on every rank, from what each knows; then
each rank writes the elements its own flat partitions hold (``plan_writes``, as for the weights),
nothing gathered, and the files are committed with the weights (``SaveFolder.commit``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

import torch

from ..checkpoint.optimizer_state import (
    MASTER,
    OPTIMIZER_SINGLE,
    GroupState,
    NotPlain,
    check_json,
    index_metadata,
    plain,
    state_tensor_name,
)
from ..distributed import rank_and_world
from ..errors import ArgumentTypeError, UnsupportedModelError
from ..integrations.deepspeed import (
    Flat,
    flat_states,
    hyperparameters,
    is_zero3,
    loss_scale_state,
    lr_scheduler,
    optimized_parameters,
    optimizer_flats,
    training_counters,
    zero3_shape,
)
from ..model.targets import PARTITION, Target
from ..progress import progress_for
from . import writer
from .plan import Beside, OutTensor, SavePlan, layout, parse_size, plan_writes


@dataclass(frozen=True)
class _Held:
    """The elements ``[low, high)`` of a parameter's state that this rank's optimizer holds: what
    ``plan_writes`` asks of a partition (``owned``)."""

    low: int
    high: int

    @property
    def owned(self) -> tuple[int, int]:
        return self.low, self.high


def _number(tensor, what: str):
    """A one-element tensor's value (an LR scheduler may keep one)."""
    return tensor.item() if isinstance(tensor, torch.Tensor) and tensor.numel() == 1 else None


def _keys(states: list[dict]) -> list[str]:
    """The states the optimizer keeps per flat partition, MASTER first (none before its first step)."""
    kept = sorted({k for state in states for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0})
    return [MASTER, *kept]


def _step(state: dict):
    step = state.get("step")
    if isinstance(step, torch.Tensor):
        step = step.item()
    return int(step) if isinstance(step, float) and step.is_integer() else step


def _plan(engine, model: list[Target], max_shard_size, rank: int, world: int):
    """(the files beside the weights, this rank's writes into them, and the flat tensor each write
    takes its elements from); ``model``: the targets of the model's save, for their names."""
    flats, _ = optimizer_flats(engine)
    states = flat_states(engine, flats)
    keys = _keys(states)
    names = {id(t.tensor): t.name for t in model}
    held: dict[int, tuple[Flat, dict, object]] = {}
    for flat, state in zip(flats, states):
        for slot in flat.slots:
            held[id(slot.param)] = (flat, state, slot)
    groups, targets, tensors, sources = [], [], [], {}
    for g, (params, values) in enumerate(zip(optimized_parameters(engine), hyperparameters(engine))):
        steps = {_step(state) for flat, state in zip(flats, states) if flat.group == g}
        if len(steps) > 1:  # one step per group is what the format holds; ZeRO's ranks step together
            raise UnsupportedModelError(f"cannot save the optimizer state: the flat partitions of parameter group "
                                        f"{g} on rank {rank} have taken different numbers of steps "
                                        f"({', '.join(map(str, sorted(steps, key=str)))}), and the format "
                                        "holds one per group; save with engine.save_checkpoint instead")
        try:
            values = plain(values, _number, f"the hyperparameters of parameter group {g}")
        except NotPlain as e:
            raise UnsupportedModelError(f"cannot save the optimizer state: {e}") from None
        groups.append(GroupState(values, tuple(names[id(p)] for p in params), steps.pop() if steps else None))
        for param in params:
            shape = zero3_shape(param) if is_zero3(param) else tuple(param.shape)
            flat, state, slot = held.get(id(param), (flats[0], {}, None))
            for key in keys:
                tensor = flat.master if key == MASTER else state.get(key, flat.master)
                name = state_tensor_name(names[id(param)], key)
                low, high = (slot.first, slot.first + slot.count) if slot else (0, 0)
                if slot is not None:
                    sources[len(targets)] = tensor.detach().view(-1)[slot.offset:slot.offset + slot.count]
                tensors.append(OutTensor(name, flats[0].master.dtype, shape, ((len(targets), 0, 0, prod(shape)),)))
                targets.append(Target((name,), PARTITION, shape, flats[0].master.dtype, True, _Held(low, high)))
    scheduler = lr_scheduler(engine)
    try:
        state = plain(scheduler.state_dict(), _number, "the LR scheduler's state") if scheduler is not None else None
        metadata = index_metadata(keys, groups, loss_scale_state(engine), state, training_counters(engine), world)
        check_json(metadata)
    except NotPlain as e:
        raise UnsupportedModelError(f"cannot save the optimizer state: {e}; zload writes it as JSON") from None
    shards = layout(tensors, parse_size(max_shard_size), OPTIMIZER_SINGLE)
    shards = [replace(f, name=f"{OPTIMIZER_SINGLE.removesuffix('.safetensors')}-{k + 1:05d}-of-{len(shards):05d}"
                               ".safetensors") for k, f in enumerate(shards)]
    return Beside(OPTIMIZER_SINGLE, shards, metadata), plan_writes(shards, targets, rank, world), sources


@dataclass
class _WithOptimizer:
    """``save``'s sink with optimizer=True: the model's (``sink``), and the optimizer state beside."""

    sink: object  # the model's ``Sink``
    engine: object
    max_shard_size: int | str
    staging_bytes: int
    writes: tuple = ()  # once planned: this rank's writes beside the weights, and their sources

    def plan(self) -> SavePlan:
        model = self.sink.plan()
        beside, *self.writes = _plan(self.engine, model.targets, self.max_shard_size, *rank_and_world())
        return replace(model, beside=beside)

    def write(self, plan: SavePlan, staging: str, shared: bool, failed: str) -> tuple[int, list[str]]:
        written, gathered = self.sink.write(plan, staging, shared, failed)
        items, sources = self.writes
        total = writer.bytes_written_here(items, plan.beside.files, shared)
        with progress_for(total, rank=rank_and_world()[0], enabled=self.sink.progress) as bar:
            written += writer.write_own(items, sources, staging, shared, self.staging_bytes, [], failed, bar)
        return written, gathered

    def write_configs(self, plan: SavePlan, folder: str) -> None:
        self.sink.write_configs(plan, folder)


def with_optimizer(sink, engine, optimizer, max_shard_size, staging_bytes: int):
    """``sink`` (the model's) writing the optimizer state of ``engine`` beside the weights."""
    if optimizer is not True:
        raise ArgumentTypeError(f"zload.save: optimizer must be True or False, got {type(optimizer).__name__}")
    if engine is None:
        raise ArgumentTypeError("zload.save(optimizer=True) saves a DeepSpeedEngine's optimizer: pass the engine, "
                                "not its module")
    return _WithOptimizer(sink, engine, max_shard_size, staging_bytes)

