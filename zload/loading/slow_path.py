"""Tensors that only one rank builds, sent to the ranks that need them.

Some transformers conversions cannot be described as byte ranges of the checkpoint (a transpose,
a permutation). For those, one reader rank (round robin over the conversions) reads the inputs
whole, converts them once for all of the conversion's outputs, and sends each rank its own
partition of each; every rank takes part in the same order.
"""

from __future__ import annotations

from math import prod

import torch
import torch.distributed as dist

from ..checkpoint.views import SharedIndex
from ..distributed import agree, collective, comm_device, problems_of, rank_and_world
from ..errors import CheckpointError, UnsupportedModelError
from ..integrations.deepspeed import zero3_group
from ..model.targets import PARTITION
from .execute import read_tensor
from .plan import LoadPlan


def _build(source, dtype, read) -> tuple[torch.Tensor | None, list]:
    """Run the conversion; a failure becomes a problem so the other ranks are not left waiting."""
    def convert():
        tensor = source.convert(read).to(dtype).reshape(-1).contiguous()
        if tensor.numel() != prod(source.shape):
            raise UnsupportedModelError(f"converting {list(source.names)} gave {tensor.numel()} elements, "
                                        f"expected shape {list(source.shape)}")
        return tensor

    return problems_of(f"converting {list(source.names)}", convert)


def load_converted(plan: LoadPlan, dests: list[torch.Tensor], shared: SharedIndex) -> int:
    """Build every slow-path target on its reader rank and deliver it; returns bytes read here.

    The reader is chosen round robin among the ranks that can read all of a conversion's inputs;
    targets built from the same inputs (one conversion's outputs) share it, which converts once.
    """
    rank, world = rank_and_world()
    bytes_read = 0

    def read(entry):
        nonlocal bytes_read
        bytes_read += entry.nbytes
        return read_tensor(shared.index.opened, entry)

    conversions: dict[tuple[str, ...], int] = {}  # inputs -> round-robin position
    for i in plan.slow:
        target, source, dst = plan.targets[i], plan.sources[i], dests[i]
        candidates = shared.ranks_reading({f for e in source.entries for f in e.files})
        if not candidates:
            raise CheckpointError(f"no single rank can read all of {list(source.names)} (they lie on "
                                  f"different nodes), which converting '{target.name}' needs; put the "
                                  "checkpoint where one node sees all of its files", tensor=target.name)
        reader = candidates[conversions.setdefault(source.names, len(conversions)) % len(candidates)]
        tensor, problems = None, []
        if rank == reader:
            tensor, problems = _build(source, dst.dtype, read)
        agree(problems, f"converting '{target.name}' failed; the model is partly written")
        if target.kind == PARTITION:
            _deliver_partition(target, tensor, dst, reader)
        else:
            if world > 1:
                if tensor is None:
                    tensor = torch.empty(prod(source.shape), dtype=dst.dtype)
                tensor = tensor.to(comm_device())  # the backend's device, not necessarily dst's
                with collective():
                    dist.broadcast(tensor, src=reader)
            dst.copy_(tensor)
    return bytes_read


def _deliver_partition(target, tensor, dst: torch.Tensor, reader: int) -> None:
    """Each rank receives only its own partition (a scatter), unless the parameter's process
    group is smaller than the world: then every rank receives the tensor and keeps its slice."""
    part = target.partition
    rank, world = rank_and_world()
    mine = slice(*part.owned)
    if world == 1:
        dst[:part.valid].copy_(tensor[mine])
        return
    group = zero3_group(target.tensor)
    if dist.get_world_size(group) != world:
        full = tensor if tensor is not None else torch.empty(part.numel, dtype=dst.dtype)
        full = full.to(comm_device())
        with collective():
            dist.broadcast(full, src=reader)
        dst[:part.valid].copy_(full[mine])
        return
    chunks = None
    device = comm_device()
    if rank == reader:
        padded = torch.zeros(part.size * part.world, dtype=dst.dtype, device=device)
        padded[:part.numel] = tensor
        by_partition = padded.split(part.size)
        chunks = [by_partition[dist.get_group_rank(group, g)] for g in range(world)]
    received = torch.empty(part.size, dtype=dst.dtype, device=device)
    with collective():
        dist.scatter(received, chunks, src=reader)
    dst.copy_(received)
