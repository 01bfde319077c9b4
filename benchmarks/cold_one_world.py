"""Cold loads in one world, side by side: zload, PyTorch DCP's reader and the device ceilings.

    python -m benchmarks.cold_one_world --size 300MB 1.2GB 2.4GB@2 --world 1 2 --rounds 10
    python -m benchmarks.cold_one_world --size issue43-1.1GB@1,2 --evict drop-caches --no-warm-up

The load benchmark's ``--cold`` mode starts a fresh world for every measurement, so each of its
numbers also carries W process starts, the model's construction and what the machine did just
before. Here one world of W ranks (torchrun; set up as the load benchmark's: gloo and CPU
partitions, or NCCL and GPU ones where CUDA is) builds everything once: a model under
``zload.init``, one under ``deepspeed.zero.Init`` and DCP's row-sharded DTensors. Each method is
run once warm (its one-time costs: imports, threads, transformers' name mapping; not with
``--no-warm-up``, where the first cold round carries them), then, round after round, the page
cache is emptied before each method (``--evict``: ``fadvise``, the checkpoint's pages only, or
``drop-caches``, the whole machine's, by node rank 0 between the ranks' barriers) and the method
is timed barrier to barrier (the slowest rank), the order of the methods reversed every other
round. So what differs between the methods is what they read and copy, and the two zload loads
differ only in the model they write into. Round 1 is also reported apart, beside the median of the
later rounds. ``--size`` also takes a named shape (``SHAPES`` of benchmarks/load/checkpoint.py,
with its own shard size). The loads are checked against the checkpoint after the last round
(but with ``--no-verify``). Results: ``OUT/cold-one-world-<name>.{json,md,png}``. A point whose
world fails (a crash, a timeout) is left out and the others are still measured; the results are
then saved as ``OUT/cold-one-world-<name>-partial.*``, naming it, and the command fails. A load
that differs from the checkpoint stops the command at once, nothing saved.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

from benchmarks.load import REPO, exit_without_teardown, log
from benchmarks.load.checkpoint import (
    EVICTIONS, checkpoint_bytes, checkpoint_dir, checkpoint_shape, drop_caches_problem, ensure_checkpoint,
    evict_page_cache, parse_size_spec,
)
from benchmarks.load.launch import launch_local, scratch_folders
from benchmarks.load.methods import partition_device
from benchmarks.load.report import save_results
from benchmarks.load.worker import join_world

METHODS = {  # name (as the load benchmark's) -> what it times
    "zload+init": "`zload.load_into` into the model built under `zload.init`",
    "zload": "`zload.load_into` into the model built under `deepspeed.zero.Init`",
    "dcp": "`dcp.load` with `HuggingFaceStorageReader` into DTensors sharded `Shard(0)` (its default, one thread)",
    "ceiling": "each rank's contiguous 1/W of the files in 16 MiB blocks, four threads (the load benchmark's)",
    "ceiling-1": "the same, one thread a rank",
    "ceiling-one-reader": "rank 0 alone reads every file in 16 MiB blocks, one thread",
}
CEILINGS = ("ceiling", "ceiling-1", "ceiling-one-reader")


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


def _runners(folder: str, methods: list[str]) -> tuple[dict, dict, dict | None]:
    """Each method as a function of a Stopwatch that times its "load" segment, with what it writes
    into built now; also the models and DCP's state dict, for the check after the rounds."""
    import torch.distributed.checkpoint as dcp

    import zload
    from benchmarks.load.methods import build_model, ceiling, dcp_state_dict

    build_args = SimpleNamespace(model_dtype="bfloat16")
    models = {name: build_model(folder, Stopwatch(), build_args, how)
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
    runners.update(dcp=dcp_load, ceiling=lambda watch: ceiling(folder, watch, build_args),
                   **{"ceiling-1": lambda watch: ceiling(folder, watch, build_args, threads=1),
                      "ceiling-one-reader": lambda watch: ceiling(folder, watch, build_args, threads=1, world=1)})
    return {name: runners[name] for name in methods}, models, state_dict


def _verify(folder: str, models: dict, state_dict) -> dict:
    from benchmarks.load.methods import verify_partitions, verify_row_shards

    checks = {name: verify_partitions(model, folder) for name, model in models.items()}
    if state_dict is not None:
        checks["dcp"] = verify_row_shards(state_dict, folder)
    return checks


def worker(args) -> None:
    """One rank: build, warm up, then the cold rounds; rank 0 writes ``RESULT``."""
    import traceback

    status = 1
    try:
        import torch
        import torch.distributed as dist

        join_world()
        node_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
        runners, models, state_dict = _runners(args.checkpoint, args.methods)
        for run in runners.values() if args.warm_up else ():
            run(Stopwatch())  # warm: one-time costs out of the way
        seconds = {name: [] for name in runners}
        residency, evicted_by = [], set()
        order = []  # the methods of each round, as run
        for round_ in range(args.rounds):
            order.append(args.methods if round_ % 2 == 0 else args.methods[::-1])
            for name in order[-1]:  # every rank is past the last method's closing barrier
                if node_first:
                    evicted = evict_page_cache(args.checkpoint, args.evict)
                    residency.append(evicted["resident_fraction"])
                    evicted_by.add(evicted["how"])
                watch = Stopwatch()
                runners[name](watch)  # its "load" begins with a barrier, so after the eviction
                seconds[name].append(round(watch.seconds["load"], 4))
        checks = [None] * dist.get_world_size()  # every rank's, rank by rank
        dist.all_gather_object(checks, _verify(args.checkpoint, models, state_dict) if args.verify else {})
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump({"seconds": seconds, "residency": residency, "evicted_by": sorted(evicted_by),
                           "order": order, "checks": checks,
                           "threads": torch.get_num_threads(), "device": partition_device()}, f)
        dist.barrier()
        status = 0
    except BaseException:  # noqa: BLE001 - report, then leave with a failing status
        traceback.print_exc()
    exit_without_teardown(status)


def _label(point: dict) -> str:
    return f"{point['size']} W={point['world']}"


def markdown(data: dict) -> str:
    """The command, how it measured, seconds (GB/s) per method and point, the ratios, then round 1
    beside the later rounds."""
    points, methods = data["results"], list(data["results"][0]["median"])
    residency = [r for p in points for r in p["residency"] if r is not None]
    checked = ("every rank's loads checked against the checkpoint after the last round"
               if all(p["checks"] and all(c for c in p["checks"]) for p in points) else "not checked")
    evicted_by = sorted({how for p in points for how in p.get("evicted_by", [])}) or ["?"]
    warm = ("each method run once before the rounds, warm" if all(p.get("warm_up", True) for p in points)
            else "no warm-up run: round 1 carries each method's one-time costs")
    lines = [f"`{data['command']}`", "", *(f"Note: {note}\n" for note in data.get("notes", [])),
             f"One world per point, page cache emptied by {' and '.join(evicted_by)} before every measurement "
             f"(highest residency left: {max(residency, default=None)}); {warm}; median of "
             f"{len(points[0]['seconds'][methods[0]])} rounds, the order reversed every other round; the slowest "
             f"rank's seconds (GB/s: tensor bytes / seconds); {checked}.", "",
             "| method | what it times | " + " | ".join(map(_label, points)) + " |",
             "|---|---|" + "---:|" * len(points)]
    for name in methods:
        cells = [f"{p['median'][name]:.3f} ({p['bytes'] / p['median'][name] / 1e9:.2f})" for p in points]
        lines.append(f"| {name} | {METHODS[name]} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio of medians | " + " | ".join(map(_label, points)) + " |", "|---|" + "---:|" * len(points)]
    ratios = [(f"{a} / {b}", a, b) for a, b in (("zload+init", "dcp"), ("zload", "dcp"), ("zload", "zload+init"))]
    ratios += [(f"{a} / {c}", a, c) for a in ("zload+init", "zload", "dcp") for c in CEILINGS]
    for label, a, b in ratios:
        if a in methods and b in methods:
            lines.append(f"| {label} | " + " | ".join(f"{p['median'][a] / p['median'][b]:.2f}x" for p in points) + " |")
    if all(len(p["seconds"][methods[0]]) > 1 for p in points):
        lines += ["", "Round 1 apart: its seconds, then the median (min-max) of the later rounds.", "",
                  "| method | " + " | ".join(map(_label, points)) + " |", "|---|" + "---:|" * len(points)]
        for name in methods:
            lines.append(f"| {name} | " + " | ".join(
                f"{s[0]:.3f}; {statistics.median(s[1:]):.3f} ({min(s[1:]):.3f}-{max(s[1:]):.3f})"
                for s in (p["seconds"][name] for p in points)) + " |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: str) -> None:
    """GB/s of each method at each point, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, methods = data["results"], list(data["results"][0]["median"])
    fig, ax = plt.subplots(figsize=(2.2 * len(points) + 3, 4.2))
    width = 0.8 / len(methods)
    for i, name in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(points))]
        ax.bar(xs, [p["bytes"] / p["median"][name] / 1e9 for p in points], width, label=name)
    ax.set_xticks(range(len(points)), [_label(p) for p in points])
    ax.set(ylabel="GB/s (tensor bytes / median load s)",
           title=("PARTIAL: see the notes\n" if data.get("notes") else "") + "cold loads in one world, the page "
                 f"cache emptied before each\n({data['host']['cpu_cores_usable']} cores, {data['date']})")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cold_one_world", description=__doc__.split("\n")[0])
    p.add_argument("--size", nargs="+", type=parse_size_spec, default=None,
                   help="checkpoint sizes, as the load benchmark's --size (600MB@2: at world size 2 only), or "
                        "named shapes (issue43-1.1GB@2: its own shard size); default 300MB")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--evict", choices=EVICTIONS, default="fadvise",
                   help="how the page cache is emptied before each measurement: fadvise (default; the "
                        "checkpoint's pages, drop_caches only if they stay) or drop-caches (sync, then "
                        "3 > /proc/sys/vm/drop_caches: the whole machine's cache; needs root)")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="no warm run of each method before the rounds: round 1 carries its one-time costs")
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
    if args.rounds < 1 or len(set(args.methods)) < len(args.methods):
        p.error("--rounds must be at least 1 and --methods name each method once")
    if args.worker:
        return worker(args)
    if args.evict == "drop-caches" and (problem := drop_caches_problem()):
        p.error(problem)
    points, failures, notes = [], [], []  # notes: each point not measured, each measured after one
    after_failure = None  # the point that failed just before this one
    with scratch_folders() as (args.snapshot, logs), tempfile.TemporaryDirectory(prefix="zload-bench-") as results:
        for size, nbytes, worlds in args.size or [parse_size_spec("300MB")]:
            config, shard = checkpoint_shape(size, nbytes, args.shard_size)
            folder = checkpoint_dir(args.cache, config, shard)
            ensure_checkpoint(folder, config, shard)
            for world in worlds or args.world:
                what = f"{size} at world {world}"
                result = os.path.join(results, f"{size}-{world}.json")
                log(f"{what}: building, then {args.rounds} cold rounds of {', '.join(args.methods)}")
                try:
                    launch_local(["-m", "benchmarks.cold_one_world", "--worker", "--checkpoint", folder, "--result",
                                  result, "--rounds", str(args.rounds), "--evict", args.evict, "--methods",
                                  *args.methods] + ([] if args.verify else ["--no-verify"])
                                 + ([] if args.warm_up else ["--no-warm-up"]),
                                 world, args, os.path.join(logs, f"{size}-{world}.log"), f"the cold rounds of {what}")
                except RuntimeError as e:  # a point takes minutes: the others still run, and are saved
                    log(str(e))
                    failures.append(what)
                    reason = str(e).splitlines()[0].removeprefix(f"the cold rounds of {what} ").rstrip(":")
                    notes.append(f"{what}: not measured, its world {reason}")
                    after_failure = what
                    continue
                with open(result) as f:
                    got = json.load(f)
                failed = {f"{name} on rank {rank}": check for rank, checks in enumerate(got["checks"])
                          for name, check in checks.items() if not check["ok"]}
                if failed:
                    shutil.copy(result, logs)  # every rank's checks, kept with the logs
                    raise RuntimeError(f"{what}: a load differs from the checkpoint: {failed}")
                if after_failure:
                    notes.append(f"{what}: measured right after the failed world of {after_failure} (its numbers "
                                 "may carry what that failure left behind)")
                    after_failure = None
                points.append({"size": size, "bytes": checkpoint_bytes(folder), "world": world, "checkpoint": folder,
                               "warm_up": args.warm_up, **got,
                               "median": {name: statistics.median(s) for name, s in got["seconds"].items()}})
        if not points:
            raise RuntimeError("no point was measured, nothing saved: " + "; ".join(notes))
        command = "python -m benchmarks.cold_one_world " + shlex.join(sys.argv[1:])
        name = f"cold-one-world-{args.name}" + ("-partial" if failures else "")  # never in place of a whole run
        data = save_results(args.out, name, command, points, markdown, notes)
        if not failures and os.path.exists(os.path.join(args.out, f"{name}-partial.json")):
            log(f"{os.path.join(args.out, name)}-partial.* are left over from an earlier run that was not whole")
        try:
            plot(data, os.path.join(args.out, f"{name}.png"))
        except ImportError:
            log("no matplotlib here, so no plot (pip install -e '.[bench]')")
        if failures:  # raised here, so the worlds' logs are kept
            raise RuntimeError(f"{len(failures)} of {len(failures) + len(points)} points not measured, the others "
                               f"saved as {os.path.join(args.out, name)}.*: " + "; ".join(failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
