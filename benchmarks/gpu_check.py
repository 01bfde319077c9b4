"""The checks that need a GPU, in one short run (see gpu_check.sh).

1. The Triton scatter-cast kernel against the torch path on CUDA tensors, bit for bit, for random
   segment tables over every fp32/fp16/bf16 pair.
2. Pinned host -> device bandwidth (the ceiling a load from page cache can reach).
3. A single-GPU ZeRO-3 load of a multi-GB bf16 checkpoint from the page cache, in GB/s.

Device time is scarce, so each step's result is written to benchmarks/results/gpu_check.json as
soon as it is known, and a step that fails is recorded (with its error) without stopping the next.
``--device cpu`` runs the same steps as a smoke test on a machine without a GPU (the kernel in
Triton's interpreter, which needs ``TRITON_INTERPRET=1``; the load over gloo; no bandwidth step):
the test suite runs it so that the script works before a GPU machine is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from pathlib import Path

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHARD_SIZE = "100MB"  # benchmarks.load's default: the same checkpoint serves both


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_check(device: torch.device, seed: int = 0) -> dict[str, bool]:
    """For each dtype pair: does the Triton kernel write the bits the torch path writes?"""
    from zload.kernels.torch_scatter import Segment, scatter_cast_torch
    from zload.kernels.triton_scatter import scatter_cast_triton

    gen = torch.Generator().manual_seed(seed)
    results = {}
    for src in DTYPES:
        for dst in DTYPES:
            values = torch.randn(1 << 20, generator=gen).to(src)
            values[:4] = torch.tensor([float("inf"), -0.0, 1e-40, 7e4]).to(src)
            staging = values.view(torch.uint8).to(device)
            largest = 300_001 if device.type == "cuda" else 5_003  # Triton's interpreter is slow
            dests = [torch.full((n,), 3.0, dtype=dst, device=device) for n in (1, 7, 4096, largest)]
            segments, offset = [], 0
            for d, t in enumerate(dests):
                count = t.numel() - (d % 2)
                segments.append(Segment(offset * src.itemsize, src, count, d, d % 2))
                offset += count + 3
            reference = [t.clone() for t in dests]
            scatter_cast_torch(staging, segments, reference)
            kernel = [t.clone() for t in dests]
            left = scatter_cast_triton(staging, segments, kernel)
            _sync(device)
            if left:  # on CPU: TRITON_INTERPRET=1 is not set
                raise RuntimeError(f"the Triton kernel did not take {len(left)} of {len(segments)} "
                                   f"segments on {device}")
            results[f"{src}->{dst}".replace("torch.", "")] = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(reference, kernel))
    return results


def h2d_bandwidth(nbytes: int = 2 << 30) -> float:
    """The best of three pinned host -> device copies of ``nbytes``, in GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - started) / 1e9)
    return best


def single_rank_load(cache: Path, size: str, device: torch.device) -> dict:
    """A one-rank ZeRO-3 load from page cache (checkpoint written by benchmarks.load), checked
    bit for bit against the files."""
    import deepspeed

    import zload
    from benchmarks.load.checkpoint import checkpoint_dir, ensure_checkpoint, llama_config, parse_bytes, warm_page_cache
    from benchmarks.load.methods import verify_partitions

    config = llama_config(parse_bytes(size))
    folder = checkpoint_dir(str(cache), config, SHARD_SIZE)
    ensure_checkpoint(folder, config, SHARD_SIZE)
    warm_page_cache(folder)
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    from transformers import LlamaForCausalLM

    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with zload.init(ds_config, dtype=torch.bfloat16):
        model = LlamaForCausalLM(config)
    runs = []
    for _ in range(3):
        _sync(device)
        report = zload.load_into(model, folder, progress=False)
        _sync(device)
        runs.append(report.bytes_read / report.seconds / 1e9)
    return {"checkpoint_bytes": report.checkpoint_bytes, "load_gbps_runs": runs,
            "load_gbps_median": sorted(runs)[1], "verified": verify_partitions(model, folder)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2.4GB")
    parser.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE", os.path.expanduser("~/.cache/zload-bench")),
                        help="checkpoint cache, shared with benchmarks.load (same default)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run of the same steps without a GPU")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke run)",
               "host": platform.node(), "torch": torch.__version__}
    steps = [("kernel_bit_exact", lambda: kernel_check(device))]
    if device.type == "cuda":
        steps.append(("pinned_h2d_gbps", h2d_bandwidth))
    steps.append(("load", lambda: single_rank_load(Path(args.cache), args.size, device)))
    failed = []
    for name, step in steps:
        try:
            results[name] = step()
        except Exception as e:  # noqa: BLE001 (recorded; the other steps still run)
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
        if name == "load" and not failed and "pinned_h2d_gbps" in results:
            results["load_fraction_of_h2d"] = results["load"]["load_gbps_median"] / results["pinned_h2d_gbps"]
        out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    ok = (not failed and all(results["kernel_bit_exact"].values())
          and results["load"]["verified"]["ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
