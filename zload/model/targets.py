"""Targets: what each name of the model needs, and where its bytes land on this rank.

``collect_targets`` walks the model once and turns every parameter and buffer into a plain
``Target`` record. The planner only reads the record's plain fields; the executor uses ``tensor``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint.partition import Partition
from ..distributed import Choice
from ..errors import ArgumentTypeError
from ..integrations.deepspeed import (
    as_engine,
    gathered_status,
    is_zero3,
    partition_dtype,
    partition_size,
    stored_quantized,
    swapped_to_nvme,
    zero3_group,
    zero3_numel,
    zero3_shape,
)


class Kind(Choice):
    """Where a target's bytes land on this rank."""

    PARTITION = "partition"  # ZeRO-3 parameter: this rank owns a flat slice, written into ds_tensor
    FULL = "full"  # plain parameter or buffer: every rank writes the whole tensor
    ORPHAN = "orphan"  # plain [0]-shaped parameter re-created after zero.Init: shape comes from the file


PARTITION, FULL, ORPHAN = Kind.PARTITION, Kind.FULL, Kind.ORPHAN  # the names the pipeline compares kinds by


@dataclass(frozen=True)
class Target:
    """One destination tensor of the model, under every name the model gives it."""

    names: tuple[str, ...]  # tied weights have several; the first is the canonical one
    kind: Kind
    shape: tuple[int, ...]  # full logical shape (ds_shape for partitions); () unused for ORPHAN
    dtype: torch.dtype  # of the destination
    required: bool  # parameters and persistent buffers must be covered by the checkpoint
    partition: Partition | None = None  # only for PARTITION
    problem: str | None = None  # why this tensor cannot be loaded at all (reported by the planner)
    tensor: Any = field(default=None, compare=False, repr=False)  # the parameter or buffer

    @property
    def name(self) -> str:
        return self.names[0]


def unwrap(model, call: str):
    """(module, engine or None) for an nn.Module or a DeepSpeedEngine passed to ``call``."""
    if as_engine(model) is not None:
        return model.module, model
    if isinstance(model, torch.nn.Module):
        return model, None
    raise ArgumentTypeError(f"{call} expects an nn.Module or a DeepSpeedEngine, got {type(model).__name__}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as messages and reports name a dtype."""
    return str(dtype).removeprefix("torch.")


def _zero_partition_problem(param, live_engine: bool) -> str | None:
    """Why a ZeRO-3 partition cannot be written in place right now, if it cannot."""
    # A live engine's persistent parameters stay gathered; its optimizer re-partitions them.
    status = gathered_status(param)
    if not live_engine and status is not None:
        return (f"is gathered ({status}); load outside GatheredParameters, or pass the DeepSpeedEngine "
                "(a Trainer's trainer.model_wrapped) so zload can re-partition it")
    if swapped_to_nvme(param):
        return "is offloaded to NVMe, which zload does not load into yet"
    if stored_quantized(param):
        return "is stored quantised (zero_quantized_nontrainable_weights), which zload does not load into yet"
    return None


def zero_partition(param, places: dict | None = None) -> Partition:
    """This rank's partition of ZeRO-3 parameter ``param`` in its own process group. ``places``
    keeps each group's (world size, rank) over the parameters of one model walk: asked of
    torch.distributed for each of 800 parameters they took about a millisecond of a load."""
    import torch.distributed as dist

    group = zero3_group(param)
    place = None if places is None else places.get(group)
    if place is None:
        place = dist.get_world_size(group=group), dist.get_rank(group=group)
        if places is not None:
            places[group] = place
    return Partition(zero3_numel(param), *place)


def _zero_target(names, param, live_engine: bool, places: dict) -> Target:
    part = zero_partition(param, places)
    problem = _zero_partition_problem(param, live_engine)
    if problem is None and partition_size(param) != part.size:
        problem = (f"has a {partition_size(param)}-element partition where ceil({part.numel}/"
                   f"{part.world}) = {part.size} was expected; unsupported partitioning")
    return Target(tuple(names), PARTITION, zero3_shape(param), partition_dtype(param),
                  True, part, problem, param)


def collect_targets(module, live_engine: bool = False) -> list[Target]:
    """Every parameter and buffer of ``module`` as a Target, tied aliases folded together.

    ``live_engine``: the module belongs to a DeepSpeedEngine whose optimizer brackets the writes.
    """
    params, buffers = _members(module)

    under_zero3 = any(is_zero3(p) for p, _ in params.values())
    targets, places = [], {}
    for p, names in params.values():
        if is_zero3(p):
            targets.append(_zero_target(names, p, live_engine, places))
        elif under_zero3 and p.numel() == 0:
            dtype = partition_dtype(zero_sibling(module, names[0]))
            targets.append(Target(tuple(names), ORPHAN, (), dtype, True, tensor=p))
        else:
            targets.append(_full_target(names, p, required=True))
    for b, names, persistent in buffers.values():
        targets.append(_full_target(names, b, required=persistent))
    return targets


def zero_sibling(module, name: str):
    """The ZeRO-3 parameter nearest to parameter ``name``: first in its own module, then in each
    enclosing module. An orphan is converted in that parameter's process group and dtype."""
    path = name.split(".")[:-1]
    for depth in range(len(path), -1, -1):
        owner = module.get_submodule(".".join(path[:depth]))
        for p in owner.parameters():
            if is_zero3(p):
                return p
    raise AssertionError("zero_sibling called on a model without ZeRO-3 parameters")


def _full_target(names, tensor, required: bool) -> Target:
    problem = None
    if tensor.is_meta:
        problem = "is on the meta device; materialise the model (to_empty) before loading"
    elif not tensor.is_contiguous():
        problem = "is not contiguous"
    return Target(tuple(names), FULL, tuple(tensor.shape), tensor.dtype, required,
                  problem=problem, tensor=tensor)


def _members(module) -> tuple[dict[int, list], dict[int, list]]:
    """Every parameter as ``[tensor, names]`` and every buffer as ``[tensor, names, persistent]``,
    by ``id``, tied ones under each of their names, as ``named_parameters(remove_duplicate=False)``
    and ``named_buffers`` name them. Both walk ``named_modules``; one walk serves both (a walk is a
    visible part of a load's planning: benchmarks/README.md, plan_cost) unless the model names its
    parameters its own way."""
    params: dict[int, list] = {}
    buffers: dict[int, list] = {}
    own_naming = any(getattr(type(module), method) is not getattr(torch.nn.Module, method)
                     or method in vars(module) for method in ("named_parameters", "_named_members"))
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        if not own_naming:
            for local, p in sub._parameters.items():
                if p is not None:
                    params.setdefault(id(p), [p, []])[1].append(dot + local)
        for local, b in sub._buffers.items():
            if b is not None:
                persistent = local not in sub._non_persistent_buffers_set
                buffers.setdefault(id(b), [b, [], persistent])[1].append(dot + local)
    if own_naming:
        for name, p in module.named_parameters(remove_duplicate=False):
            params.setdefault(id(p), [p, []])[1].append(name)
    return params, buffers
