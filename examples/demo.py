"""zload demo: write a small sharded fp32 checkpoint, load it into a CPU ZeRO-3 world in bf16.

    ./dev demo                   # 2 ranks
    ./dev demo --world-size 3

Run plainly, this script builds a small model, saves it as a sharded safetensors checkpoint with an
index into a temporary directory, and launches itself under torchrun. Each rank then builds the
same model under ``deepspeed.zero.Init`` in bf16, calls ``zload.load_into``, prints its
``LoadReport``, and rank 0 gathers every parameter to check it bit for bit against the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

# Awkward sizes on purpose: no tensor divides evenly among 2 or 3 ranks, so partitions are padded.
VOCAB, HIDDEN, FFN, MAX_LEN = 5003, 769, 2053, 127
SHARDS = 3


class TinyLM(nn.Module):
    """Embedding, two LayerNorms, an MLP, and an output head tied to the embedding (~28 MB fp32)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm_in = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)
        self.norm_out = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: stored once in the checkpoint, as embed.weight
        self.register_buffer("position_ids", torch.arange(MAX_LEN))  # a plain (persistent) buffer

    def forward(self, ids):
        h = self.norm_in(self.embed(ids))
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm_out(h))


# ---------------------------------------------------------------------------------------------
# Parent: write the checkpoint, launch the ranks.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(folder: str) -> int:
    """Save TinyLM (seed 0, fp32) as SHARDS safetensors files plus model.safetensors.index.json."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = TinyLM()
    # Give the LayerNorms and biases non-default values so a load that skipped them would show.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}

    # Greedy split into shards of roughly equal size, in state-dict order.
    total = sum(t.numel() * t.element_size() for t in state.values())
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name, tensor in state.items():
        if filled >= total * len(shards) / SHARDS and len(shards) < SHARDS:
            shards.append({})
        shards[-1][name] = tensor
        filled += tensor.numel() * tensor.element_size()

    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def launch(world_size: int) -> int:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")  # also keeps torchrun from warning that it set it
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zload-demo-") as folder:
        total = write_checkpoint(folder)
        files = sorted(os.listdir(folder))
        print(f"demo: wrote {total / 1e6:.1f} MB fp32 checkpoint to {folder}: {', '.join(files)}")
        print(f"demo: launching {world_size} CPU ranks (gloo) with torchrun", flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               os.path.abspath(__file__), "--checkpoint", folder]
        rc = subprocess.call(cmd, env=env)
    print(f"demo: {'finished' if rc == 0 else f'FAILED (exit code {rc})'} in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return rc


# ---------------------------------------------------------------------------------------------
# Rank: build under zero.Init, load, report, verify.


def in_rank_order(rank: int, world: int, fn) -> None:
    """Call ``fn`` on one rank at a time, rank 0 first, so output is not interleaved."""
    import torch.distributed as dist

    for r in range(world):
        if r == rank:
            fn()
            sys.stdout.flush()
        dist.barrier()


def verify(model: nn.Module, folder: str) -> tuple[int, int, list[str]]:
    """Compare every parameter (gathered, on rank 0) and buffer with the checkpoint, bit for bit.

    Returns (parameters checked, buffers checked, names that differ)."""
    import deepspeed
    from safetensors.torch import load_file

    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    expected = {}
    for file in sorted(set(index["weight_map"].values())):
        expected.update(load_file(os.path.join(folder, file)))

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        return (got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)))

    failures, n_params = [], 0
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        if torch.distributed.get_rank() == 0:
            for name, p in model.named_parameters():  # tied head.weight appears once, as embed.weight
                n_params += 1
                if not same(p.data, expected[name].to(torch.bfloat16)):
                    failures.append(name)
    n_buffers = 0
    for name, b in model.named_buffers():
        n_buffers += 1
        if not same(b, expected[name].to(b.dtype)):
            failures.append(name)
    return n_params, n_buffers, failures


def read_in_all(read: int, checkpoint: int) -> str:
    """The bytes all ranks read together, against the checkpoint's size. Each rank reads only its
    partition of each parameter, but every buffer whole, so with more than one rank the sum can
    exceed the checkpoint: the line says why."""
    line = f"{read / 1e6:.2f} MB read in all of a {checkpoint / 1e6:.2f} MB checkpoint"
    if read > checkpoint:
        line += (f" ({read - checkpoint:,} bytes more: each rank reads its partition of every parameter, "
                 "but every buffer whole)")
    return line


def rank_main(folder: str) -> int:
    import contextlib
    import io
    import logging
    import warnings

    import deepspeed
    import torch.distributed as dist

    import zload

    # Keep DeepSpeed quiet: its INFO logs, a deprecation warning from inside GatheredParameters, and
    # the "shm_comm_op built successfully" line init_distributed prints on every rank.
    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(1234 + rank)  # a different init than the checkpoint's: the load must overwrite it
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = TinyLM()

    dist.barrier()
    started = time.perf_counter()
    report = zload.load_into(model, folder)
    dist.barrier()
    seconds = time.perf_counter() - started

    in_rank_order(rank, world, lambda: print(report))
    reads = torch.tensor([report.bytes_read], dtype=torch.int64)
    dist.all_reduce(reads)
    if rank == 0:
        print(f"load: {seconds:.3f} s on {world} ranks (slowest rank, barrier to barrier); "
              f"{read_in_all(reads.item(), report.checkpoint_bytes)}", flush=True)

    n_params, n_buffers, failures = verify(model, folder)
    failed = torch.tensor([len(failures)], dtype=torch.int64)
    dist.all_reduce(failed)
    if rank == 0:
        if failed.item() == 0:
            print(f"verified: {n_params} parameters bit-exact (ZeRO-3 bf16 vs checkpoint fp32 -> bf16)")
            print(f"verified: {n_buffers} buffer{'s' * (n_buffers != 1)} bit-exact on every rank")
        else:
            print(f"MISMATCH: {failed.item()} tensors differ from the checkpoint "
                  f"(rank 0: {', '.join(failures) or 'none'})")
    rc = 0 if failed.item() == 0 else 1
    # Every rank is done once all pass this barrier. Leave without tearing down gloo: at interpreter
    # exit a rank sometimes aborts ("terminate called without an active exception") while its
    # peers close their sockets, which would fail a demo that has already succeeded.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="number of CPU ranks (default 2)")
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)  # set by the parent for the ranks
    args = parser.parse_args()
    if "RANK" in os.environ:
        if not args.checkpoint:
            parser.error("under torchrun, --checkpoint DIR is required")
        return rank_main(args.checkpoint)
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    return launch(args.world_size)


if __name__ == "__main__":
    sys.exit(main())
