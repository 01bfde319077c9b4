"""FP8 -> bf16 load against bf16 -> bf16 load of the same Llama, through ``zload.load_into``.

    python -m benchmarks.fp8_load --size 300MB --world 1 2 --runs 3

The load benchmark's bf16 Llama of ``--size`` (one file) and an FP8 copy made with the reference
block quantisation (E4M3, 128x128 blocks, ``weight_scale_inv``; embeddings, norms and lm_head stay
bf16), each loaded into a bf16 ZeRO-3 model by W CPU ranks from a warm page cache, alternately;
the best of ``--runs`` per kind. Throughput is the bf16 bytes written per second (the same for
both), so the lines compare like with like. Prints one line per world size, nothing else.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

from benchmarks.load.checkpoint import (
    checkpoint_dir, ensure_checkpoint, llama_config, parse_bytes, warm_page_cache,
)

SHARD = "100GB"  # one file: the FP8 copy is made from it


def fp8_copy(bf16_folder: str) -> str:
    """The FP8 copy of ``bf16_folder`` (written once, beside it)."""
    from pathlib import Path

    from tests.support.fp8_checkpoints import write_fp8

    folder = bf16_folder + "-fp8-128x128"
    if not os.path.exists(os.path.join(folder, "config.json")):
        write_fp8(Path(bf16_folder), Path(folder + ".tmp"), (128, 128))
        os.rename(folder + ".tmp", folder)
    return folder


def timed_loads(folders: dict[str, str], runs: int) -> dict[str, float]:
    """On every rank: the best seconds of ``runs`` loads of each folder into one bf16 ZeRO-3 Llama."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zload

    logging.getLogger("zload").setLevel(logging.ERROR)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    config = LlamaConfig.from_pretrained(folders["bf16"])
    ds_config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 3}}
    with zload.init(ds_config, dtype=torch.bfloat16):
        model = LlamaForCausalLM(config)
    best = {kind: float("inf") for kind in folders}
    for _ in range(runs):
        for kind, folder in folders.items():
            warm_page_cache(folder)
            dist.barrier()
            started = time.perf_counter()
            zload.load_into(model, folder, progress=False)
            dist.barrier()
            best[kind] = min(best[kind], time.perf_counter() - started)
    del deepspeed
    return best


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_bytes, default=parse_bytes("300MB"), help="bf16 bytes (300MB)")
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE",
                                                          os.path.expanduser("~/.cache/zload-bench")))
    args = parser.parse_args()
    config = llama_config(args.size)
    bf16 = checkpoint_dir(args.cache, config, SHARD)
    ensure_checkpoint(bf16, config, SHARD)
    folders = {"bf16": bf16, "fp8": fp8_copy(bf16)}
    output = 2 * sum(p for p in _parameter_counts(config))
    from tests.support.harness import close_worlds, run_world

    try:
        for world in args.world:
            best = run_world(world, timed_loads, folders, args.runs)[0]
            rates = {kind: output / seconds / 1e9 for kind, seconds in best.items()}
            print(f"W={world} {output / 1e6:.0f} MB bf16: FP8->bf16 {best['fp8']:.3f} s "
                  f"({rates['fp8']:.2f} GB/s), bf16->bf16 {best['bf16']:.3f} s ({rates['bf16']:.2f} GB/s), "
                  f"FP8 at {rates['fp8'] / rates['bf16']:.2f}x", flush=True)
    finally:
        close_worlds()


def _parameter_counts(config):
    """Elements of each parameter of the benchmark Llama (no model built)."""
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return [v * h, n * layer, h, v * h]


if __name__ == "__main__":
    main()
