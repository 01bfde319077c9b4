"""The checks that need a GPU, in one short run (see gpu_check.sh).

1. The Triton scatter-cast kernel against the torch path on CUDA tensors, bit for bit, for random
   segment tables over every fp32/fp16/bf16 pair.
2. Pinned host -> device bandwidth (the ceiling a load from page cache can reach).
3. A single-GPU ZeRO-3 load of a multi-GB bf16 checkpoint from the page cache, in GB/s.

Writes one JSON file to benchmarks/results/ and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernel_check(seed: int = 0) -> dict:
    from zload.kernels import Segment, scatter_cast

    gen = torch.Generator().manual_seed(seed)
    results = {}
    for src in DTYPES:
        for dst in DTYPES:
            values = torch.randn(1 << 20, generator=gen).to(src)
            values[:4] = torch.tensor([float("inf"), -0.0, 1e-40, 7e4]).to(src)
            staging = values.view(torch.uint8).cuda()
            dests = [torch.full((n,), 3.0, dtype=dst, device="cuda") for n in (1, 7, 4096, 300_001)]
            segments, offset = [], 0
            for d, t in enumerate(dests):
                count = t.numel() - (d % 2)
                segments.append(Segment(offset * src.itemsize, src, count, d, d % 2))
                offset += count + 3
            outputs = {}
            for kernel in ("torch", "triton"):
                os.environ["ZLOAD_KERNEL"] = kernel
                copies = [t.clone() for t in dests]
                scatter_cast(staging, segments, copies)
                torch.cuda.synchronize()
                outputs[kernel] = copies
            os.environ.pop("ZLOAD_KERNEL")
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(outputs["torch"], outputs["triton"]))
            results[f"{src}->{dst}".replace("torch.", "")] = same
    return results


def _h2d_bandwidth(nbytes: int = 2 << 30) -> float:
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


def _gpu_load(folder: Path, size: str) -> dict:
    """Single-rank ZeRO-3 load from page cache (checkpoint written by benchmarks.load)."""
    import deepspeed

    import zload
    from benchmarks.load import checkpoint_dir, ensure_checkpoint, llama_config, parse_bytes, warm_page_cache

    config = llama_config(parse_bytes(size))
    folder = Path(checkpoint_dir(str(folder), config, "2GB"))
    ensure_checkpoint(str(folder), config, "2GB")
    warm_page_cache(str(folder))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    from transformers import LlamaForCausalLM

    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with zload.init(ds_config, dtype=torch.bfloat16):
        model = LlamaForCausalLM(config)
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        report = zload.load_into(model, folder)
        torch.cuda.synchronize()
        runs.append(report.bytes_read / report.seconds / 1e9)
    return {"checkpoint_bytes": report.checkpoint_bytes, "load_gbps_runs": runs,
            "load_gbps_median": sorted(runs)[1]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="4GB")
    parser.add_argument("--cache", default="/tmp/zload-gpu-check")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__}
    results["kernel_bit_exact"] = _kernel_check()
    results["pinned_h2d_gbps"] = _h2d_bandwidth()
    results["load"] = _gpu_load(Path(args.cache), args.size)
    results["load_fraction_of_h2d"] = results["load"]["load_gbps_median"] / results["pinned_h2d_gbps"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0 if all(results["kernel_bit_exact"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
