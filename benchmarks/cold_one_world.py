"""Cold loads in one world, side by side: zload, PyTorch DCP's reader and the device ceilings.

    python -m benchmarks.cold_one_world --size 300MB --world 1 2 --rounds 10

The load benchmark's ``--cold`` mode starts a fresh world for every measurement, so each of its
numbers also carries W process starts, the model's construction and what the machine did just
before. Here one world of W ranks (torchrun, gloo, CPU) builds everything once: a model under
``zload.init``, one under ``deepspeed.zero.Init`` and DCP's row-sharded DTensors. Each method is
run once warm (its one-time costs: imports, threads, transformers' name mapping), then, round
after round, the checkpoint's page cache is emptied before each method and the method is timed
barrier to barrier (the slowest rank), the order of the methods reversed every other round. So
what differs between the methods is what they read and copy, and the two zload loads differ only
in the model they write into. The loads are checked against the checkpoint after the last round
(but with ``--no-verify``). Results: ``OUT/cold-one-world-<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

from .load import MB, REPO, exit_without_teardown, log
from .load.checkpoint import checkpoint_bytes, checkpoint_dir, ensure_checkpoint, evict_page_cache, llama_config, \
    parse_bytes
from .load.launch import launch_local, scratch_folders

METHODS = {  # name (as the load benchmark's) -> what it times
    "zload+init": "`zload.load_into` into the model built under `zload.init`",
    "zload": "`zload.load_into` into the model built under `deepspeed.zero.Init`",
    "dcp": "`dcp.load` with `HuggingFaceStorageReader` into DTensors sharded `Shard(0)` (its default, one thread)",
    "ceiling": "each rank's contiguous 1/W of the files in 16 MiB blocks, four threads (the load benchmark's)",
    "ceiling-1": "the same, one thread a rank",
}


class Stopwatch:
    """The load benchmark's meter reduced to time: ``begin``/``end`` wait for every rank, so a
    segment's seconds are the slowest rank's."""

    def __init__(self):
        self.started, self.seconds = {}, {}

    def begin(self, name: str) -> None:
        import torch.distributed as dist

        dist.barrier()
        self.started[name] = time.perf_counter()

    def end(self, name: str) -> None:
        import torch.distributed as dist

        dist.barrier()
        self.seconds[name] = time.perf_counter() - self.started.pop(name)


def _runners(folder: str, methods: list[str]) -> dict:
    """Each method as a function of a Stopwatch that times its "load" segment, with what it writes
    into built now."""
    import torch.distributed.checkpoint as dcp

    import zload
    from .load.methods import build_model, ceiling, dcp_state_dict

    built = SimpleNamespace(model_dtype="bfloat16")
    models = {name: build_model(folder, Stopwatch(), built, how)
              for name, how in (("zload+init", "zload.init"), ("zload", "zero.Init")) if name in methods}
    state_dict = dcp_state_dict(folder) if "dcp" in methods else None

    def load_into(model):
        def run(watch):
            watch.begin("load")
            zload.load_into(model, folder, progress=False)
            watch.end("load")
        return run

    def dcp_load(watch):
        reader = dcp.HuggingFaceStorageReader(folder)
        watch.begin("load")
        dcp.load(state_dict, storage_reader=reader)
        watch.end("load")

    runners = {name: load_into(model) for name, model in models.items()}
    runners.update(dcp=dcp_load, ceiling=lambda watch: ceiling(folder, watch, None),
                   **{"ceiling-1": lambda watch: ceiling(folder, watch, None, threads=1)})
    return {name: runners[name] for name in methods}, models, state_dict


def _verify(folder: str, models: dict, state_dict) -> dict:
    from .load.methods import verify_partitions, verify_row_shards

    checks = {name: verify_partitions(model, folder) for name, model in models.items()}
    if state_dict is not None:
        checks["dcp"] = verify_row_shards(state_dict, folder)
    return checks


def worker(args) -> None:
    """One rank: build, warm up, then the cold rounds; rank 0 writes ``RESULT``."""
    import contextlib
    import io
    import logging
    import traceback
    import warnings

    status = 1
    try:
        import deepspeed
        import torch.distributed as dist
        import transformers

        deepspeed.utils.logger.setLevel(logging.WARNING)
        transformers.logging.set_verbosity_error()
        warnings.filterwarnings("ignore")
        with contextlib.redirect_stdout(io.StringIO()):
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        node_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
        runners, models, state_dict = _runners(args.checkpoint, args.methods)
        for run in runners.values():
            run(Stopwatch())  # warm: one-time costs out of the way
        seconds = {name: [] for name in runners}
        residency = []
        for round_ in range(args.rounds):
            for name in (args.methods if round_ % 2 == 0 else args.methods[::-1]):
                dist.barrier()
                if node_first:
                    residency.append(evict_page_cache(args.checkpoint)["resident_fraction"])
                watch = Stopwatch()
                runners[name](watch)  # its "load" begins with a barrier, so after the eviction
                seconds[name].append(round(watch.seconds["load"], 4))
        checks = [None] * dist.get_world_size()  # every rank's, rank by rank
        dist.all_gather_object(checks, _verify(args.checkpoint, models, state_dict) if args.verify else {})
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump({"seconds": seconds, "residency": residency, "checks": checks}, f)
        dist.barrier()
        status = 0
    except BaseException:  # noqa: BLE001 - report, then leave with a failing status
        traceback.print_exc()
    exit_without_teardown(status)


def _table(data: dict, worlds: list[int], methods: list[str]) -> list[str]:
    total = data["bytes"]
    lines = ["| method | what it times | " + " | ".join(f"W={w} s (GB/s)" for w in worlds) + " |",
             "|---|---|" + "---:|" * len(worlds)]
    for name in methods:
        cells = [f"{m:.3f} ({total / m / 1e9:.2f})" for m in (data["median"][str(w)][name] for w in worlds)]
        lines.append(f"| {name} | {METHODS[name]} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio of medians | " + " | ".join(f"W={w}" for w in worlds) + " |",
              "|---|" + "---:|" * len(worlds)]
    ratios = [("zload+init / dcp", "zload+init", "dcp"), ("zload / dcp", "zload", "dcp"),
              ("zload / zload+init", "zload", "zload+init")]
    ceilings = [c for c in ("ceiling", "ceiling-1") if c in methods]
    for name in ("zload+init", "zload", "dcp"):
        ratios += [(f"{name} / {c}", name, c) for c in ceilings]
    for label, a, b in ratios:
        if a in methods and b in methods:
            cells = [f"{data['median'][str(w)][a] / data['median'][str(w)][b]:.2f}x" for w in worlds]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cold_one_world", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="300MB", help="checkpoint size, as the load benchmark's --size")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the check after the last round")
    p.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE", os.path.expanduser("~/.cache/zload-bench")))
    p.add_argument("--shard-size", default="100MB")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--name", default="cpu")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per world")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    config = llama_config(parse_bytes(args.size))
    folder = checkpoint_dir(args.cache, config, args.shard_size)
    ensure_checkpoint(folder, config, args.shard_size)
    data = {"command": "python -m benchmarks.cold_one_world " + shlex.join(sys.argv[1:]), "checkpoint": folder,
            "bytes": checkpoint_bytes(folder), "rounds": args.rounds, "worlds": {}, "median": {}}
    with scratch_folders() as (args.snapshot, logs), tempfile.TemporaryDirectory(prefix="zload-bench-") as results:
        for world in args.world:
            result = os.path.join(results, f"world{world}.json")
            log(f"world {world}: building, then {args.rounds} cold rounds of {', '.join(args.methods)}")
            launch_local(["-m", "benchmarks.cold_one_world", "--worker", "--checkpoint", folder, "--result", result,
                          "--rounds", str(args.rounds), "--methods", *args.methods]
                         + ([] if args.verify else ["--no-verify"]),
                         world, args, os.path.join(logs, f"world{world}.log"), f"the cold rounds at world {world}")
            with open(result) as f:
                got = json.load(f)
            failed = {f"{name} on rank {rank}": check for rank, checks in enumerate(got["checks"])
                      for name, check in checks.items() if not check["ok"]}
            if failed:
                raise RuntimeError(f"world {world}: a load differs from the checkpoint: {failed}")
            data["worlds"][str(world)] = got
            data["median"][str(world)] = {name: statistics.median(s) for name, s in got["seconds"].items()}
    residency = [r for got in data["worlds"].values() for r in got["residency"] if r is not None]
    data["highest_residency_before"] = max(residency, default=None)
    checked = "each load checked against the checkpoint after the last round" if args.verify else "not checked"
    lines = [f"`{data['command']}`", "",
             f"{data['bytes'] / MB:,.0f} MB of tensors; one world per W, page cache emptied before every "
             f"measurement (highest residency left: {data['highest_residency_before']}); median of "
             f"{args.rounds} rounds, the order reversed every other round; the slowest rank's seconds; "
             f"{checked}.", "", *_table(data, args.world, args.methods)]
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"cold-one-world-{args.name}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
