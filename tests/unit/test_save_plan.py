"""zload.save_plan without processes: the shards, their headers, and each rank's share of the writes.

A save is simulated in memory: each rank's writes, cut into staging batches as the writer sends
them, are copied from that rank's partitions into byte arrays standing for the files; the result
must be the checkpoint ``safetensors`` itself writes for the same tensors.
"""

from __future__ import annotations

from math import prod

import pytest
import torch
from safetensors.torch import load

from zload.loading.plan import staging_batches
from zload.saving.plan import OutTensor, layout, make_save_plan
from zload.model.targets import FULL, PARTITION, Target
from zload.checkpoint.partition import Partition

SHAPES = {"embed.weight": ((7, 5), torch.bfloat16), "norm.weight": ((5,), torch.float32),
          "proj.weight": ((11, 3), torch.float32), "steps": ((2,), torch.int64), "bias": ((1,), torch.bfloat16)}
STATE = {name: torch.arange(prod(shape)).reshape(shape).to(dtype) * (k + 1) for k, (name, (shape, dtype))
         in enumerate(SHAPES.items())}


def _targets(rank: int, world: int) -> tuple[list[Target], dict[int, torch.Tensor]]:
    """Targets as a ZeRO-3 rank sees them (1-D tensors stay whole, as persistent small parameters
    would), and the flat tensor this rank takes each one's elements from (its padded partition)."""
    targets, sources = [], {}
    for name, tensor in STATE.items():
        flat = tensor.reshape(-1)
        if tensor.dim() > 1:
            part = Partition(flat.numel(), world, rank)
            padded = torch.zeros(part.size, dtype=tensor.dtype)
            padded[:part.valid] = flat[part.start:part.start + part.valid]
            targets.append(Target((name,), PARTITION, tuple(tensor.shape), tensor.dtype, True, part))
            sources[len(targets) - 1] = padded
        else:
            targets.append(Target((name,), FULL, tuple(tensor.shape), tensor.dtype, True))
            sources[len(targets) - 1] = flat
    return targets, sources


def _saved(world: int, dtype: torch.dtype | None, capacity: int) -> dict[str, bytes]:
    """The files an in-memory save at ``world`` ranks writes, sent through staging batches."""
    blobs = None
    for rank in range(world):
        targets, sources = _targets(rank, world)
        plan = make_save_plan(torch.nn.Module(), targets, dtype, 150, rank, world)
        if blobs is None:
            blobs = {f.name: bytearray(f.header) + bytearray(f.size - len(f.header)) for f in plan.files}
            written = {f.name: bytearray(f.size) for f in plan.files}
        for batch in staging_batches(plan.items, capacity):
            assert batch[-1][0] + batch[-1][1].nbytes <= capacity
            for _, item in batch:
                part = sources[item.target][item.src_offset:item.src_offset + item.numel]
                data = part.to(item.dtype).view(torch.uint8).numpy().tobytes()
                blobs[item.file][item.offset:item.offset + item.nbytes] = data
                for k in range(item.offset, item.offset + item.nbytes):
                    written[item.file][k] += 1
    for f in plan.files:  # every data byte once, by one rank, and no header byte
        assert set(written[f.name][len(f.header):]) == {1} and not any(written[f.name][:len(f.header)])
    return {name: bytes(blob) for name, blob in blobs.items()}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_the_ranks_writes_make_the_checkpoint(world, dtype):
    files = _saved(world, dtype, capacity=192)
    assert len(files) > 1  # 150-byte shards: the plan spans several files
    saved = {}
    for blob in files.values():
        saved.update(load(blob))
    assert saved.keys() == STATE.keys()
    for name, tensor in STATE.items():
        want = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        assert saved[name].dtype == want.dtype and torch.equal(saved[name], want), name


@pytest.mark.parametrize("sizes,limit", [((3, 20, 3), 10), ((6, 6, 2, 6, 2, 2), 10), ((4, 4), 100), ((11,), 10)])
def test_shards_are_the_ones_huggingface_hub_makes(sizes, limit):
    """transformers' save_pretrained shards with huggingface_hub's splitter; a tensor over the
    limit gets a shard of its own (3, 20, 3 under 10: two shards, not three)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    state = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    want = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=limit).filename_to_tensors
    files = layout([OutTensor(name, torch.uint8, tuple(t.shape), ()) for name, t in state.items()], limit)
    assert {f.name: [t.name for t, _ in f.tensors] for f in files} == want
