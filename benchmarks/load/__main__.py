"""``python -m benchmarks.load``: the command line and the measuring loop (see the package docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

from benchmarks.load import DEFAULT_STAGING, HERE, MB, METHODS, log, run_order
from benchmarks.load.checkpoint import (
    checkpoint_bytes, checkpoint_dir, checkpoint_files, checkpoint_shape, ensure_checkpoint, evict_page_cache,
    parse_bytes, parse_size_spec, warm_page_cache,
)
from benchmarks.load.launch import TorchrunWorld, cuda_available, measure_local, scratch_folders
from benchmarks.load.report import (
    default_name, fmt_mb, fmt_s, host_info, markdown, summarize, summarize_run, write_outputs,
    zload_source_hash,
)
from benchmarks.load.targets import evaluate_targets
from benchmarks.load.worker import worker_main


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.load",
                                description=sys.modules[__package__].__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", "--sizes", nargs="+", type=parse_size_spec, default=None, dest="sizes",
                   metavar="SIZE[@W,...]",
                   help="checkpoint sizes (bf16 bytes), e.g. 300MB 1GB, or named shapes (issue43-540MB; "
                        "benchmarks/load/checkpoint.py SHAPES); SIZE@2,4 runs that size only at those world "
                        "sizes (default 300MB)")
    p.add_argument("--world", nargs="+", type=int, default=None,
                   help="world sizes (default: 1 2 plainly; the torchrun world size under torchrun)")
    p.add_argument("--runs", type=int, default=3, help="runs per method, world and size (default 3)")
    p.add_argument("--transformers-runs", type=int, default=None,
                   help="runs for the (slow) transformers method (default: --runs)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                   help="default: all (zload+init and dcp-after-zload.init only if zload.init exists)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="output folder")
    p.add_argument("--name", default=None, help="output stem load-NAME (default: cpu, or the GPU name)")
    p.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE",
                                                     os.path.expanduser("~/.cache/zload-bench")),
                   help="where checkpoints are written and reused ($ZLOAD_BENCH_CACHE)")
    p.add_argument("--shard-size", default="100MB", help="save_pretrained max_shard_size (default 100MB)")
    p.add_argument("--staging-bytes", type=parse_bytes, default=DEFAULT_STAGING,
                   help="zload staging_bytes (default 64MiB, zload's default)")
    p.add_argument("--model-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the zload models' partitions (default bfloat16, as the checkpoint: read "
                        "straight into them; another dtype goes through staging and the cast kernel)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per launched world")
    p.add_argument("--load-verify", default="sample", choices=("sample", "full"),
                   help="load_into's verify= for the zload methods (default sample, as load_into's)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking every partition against the checkpoint after each load")
    p.add_argument("--cold", action="store_true",
                   help="empty the page cache of the checkpoint before every measurement and again as its "
                        "timed load begins (drop_caches as root, else posix_fadvise DONTNEED), instead of "
                        "reading it in")
    p.add_argument("--render", metavar="JSON",
                   help="only judge the targets again (kept in the JSON) and rewrite the .md and .png "
                        "of an existing results JSON")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runs < 1 or (args.transformers_runs is not None and args.transformers_runs < 1):
        p.error("--runs must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)  # does not return
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        judged = evaluate_targets(data)
        if judged != data.get("targets"):  # the rules changed since the run: say so, keep the file whole
            data["targets"] = judged
            data.setdefault("notes", []).append(
                f"targets judged again by --render (benchmarks of commit {host_info().get('zload_commit', '?')})")
            with open(args.render + ".tmp", "w") as f:
                json.dump(data, f, indent=1)
            os.replace(args.render + ".tmp", args.render)
        write_outputs(data, os.path.splitext(args.render)[0])
        return 0
    import zload

    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)
    coord = TorchrunWorld() if under_torchrun else None
    lead = coord is None or coord.rank == 0
    worlds = args.world or ([coord.size] if coord else [1, 2])
    if coord and max(worlds) > coord.size:
        raise SystemExit(f"--world {max(worlds)} is larger than the torchrun world ({coord.size})")
    methods = list(args.methods or METHODS)
    notes = []
    for needs_init in ("zload+init", "dcp-after-zload.init"):
        if needs_init in methods and not hasattr(zload, "init"):
            methods.remove(needs_init)
            notes.append(f"{needs_init} not measured: this zload has no zload.init")
    sizes = args.sizes or [parse_size_spec("300MB")]
    runs_for = {m: args.runs for m in methods}
    if "transformers" in methods and args.transformers_runs is not None:
        runs_for["transformers"] = args.transformers_runs
        if args.transformers_runs != args.runs:
            notes.append(f"transformers: {args.transformers_runs} runs per point (the others {args.runs}), "
                         "to fit the time budget")
    cuda = cuda_available()
    out_dir = os.path.abspath(args.out)
    if lead:
        os.makedirs(out_dir, exist_ok=True)

    with scratch_folders() as (args.snapshot, logs):
        started = time.perf_counter()
        source_hash = zload_source_hash(os.path.join(args.snapshot, "zload"))
        host = host_info()  # now: the commit the snapshot was taken from
        checkpoints = []
        plan = []  # (size label, folder, nbytes, world)
        for label, nbytes, only in sizes:
            config, shard = checkpoint_shape(label, nbytes, args.shard_size)
            folder = checkpoint_dir(args.cache, config, shard)
            if coord is None or coord.local_rank == 0:
                ensure_checkpoint(folder, config, shard)
                cache = warm_page_cache(folder)
            if coord:
                coord.barrier()
                cache = coord.broadcast(cache if coord.rank == 0 else None)
            total = checkpoint_bytes(folder)
            files = checkpoint_files(folder)
            checkpoints.append({"size": label, "folder": folder, "checkpoint_bytes": total, "files": len(files),
                                "config": {k: getattr(config, k) for k in (
                                    "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                    "num_attention_heads", "num_key_value_heads")},
                                "page_cache": cache})
            if lead:
                log(f"{label}: {total / MB:,.0f} MB bf16 in {len(files)} files ({folder}); page cache warmed "
                    f"({cache['bytes'] / MB:,.0f} MB read in {cache['seconds']:.1f} s, resident "
                    f"{cache['resident_fraction'] if cache['resident_fraction'] is not None else '?'})")
            for w in (only or worlds):
                if coord and w > coord.size:
                    raise SystemExit(f"world {w} for {label} is larger than the torchrun world ({coord.size})")
                plan.append((label, folder, total, w))

        results, failures = [], []
        for label, folder, total, w in plan:
            entries = {m: {"size": label, "checkpoint_bytes": total, "world": w, "method": m, "runs": []}
                       for m in methods}
            previous = None  # the method measured just before, in this size and world
            for run in range(max(runs_for.values())):
                for method in run_order(methods, run):
                    if run >= runs_for[method]:
                        continue
                    log_path = os.path.join(logs, f"{label}-w{w}-{method}-run{run}.log")
                    # Re-read the files before every measurement (the methods' own memory, transformers'
                    # rank 0 holding the whole model, can evict checkpoint pages), or empty the cache.
                    if coord is None or coord.local_rank == 0:
                        (evict_page_cache if args.cold else warm_page_cache)(folder)
                    if coord:
                        coord.barrier()
                    if coord:
                        ranks = coord.measure(method, w, folder, args, log_path)
                    else:
                        try:
                            ranks = measure_local(method, w, folder, args, log_path)
                        except RuntimeError as e:  # device time is scarce: the other methods still run
                            log(str(e))
                            failures.append(f"{method} at {label} W={w} failed in run {run + 1} (the end of its "
                                            "log is in this command's output) and was not run again")
                            runs_for[method] = run
                            previous = f"{method} (failed)"  # its world ran, part-way, just before the next
                            continue
                    if not lead:
                        continue
                    summary = summarize_run(ranks)
                    summary["after"], previous = previous, method
                    entries[method]["runs"].append(summary)
                    if summary["verified"] is False:
                        raise RuntimeError(f"{method} at world {w}: partitions differ from the checkpoint: "
                                           f"{summary.get('verify_problems')}")
                    log(f"{label} W={w} {method:<12} run {run + 1}: construct {fmt_s(summary['construct_s'])} s, "
                        f"load {fmt_s(summary['load_s'])} s, "
                        f"construct+load {summary['total_s']:.3f} s, peak RSS {summary['peak_rss'] / MB:,.0f} MB, "
                        f"growth in construct {fmt_mb(summary['construct_rss_growth'])} MB, "
                        f"growth in load {fmt_mb(summary['load_rss_growth'])} MB, "
                        f"read/rank {summary['bytes_read'] / MB:,.0f} MB, "
                        f"collectives/rank {summary['collective_received_total'] / MB:,.1f} MB"
                        + (f", GPU growth in construct {fmt_mb(summary['construct_gpu_growth'])} MB"
                           if "construct_gpu_growth" in summary else "")
                        + (", verified" if summary["verified"] else ""))
            for method in methods:
                if lead and entries[method]["runs"]:
                    summarize(entries[method])
                    results.append(entries[method])

        if not lead:
            coord.barrier()
            return 0
        order = {m: i for i, m in enumerate(METHODS)}
        results.sort(key=lambda e: ([c["size"] for c in checkpoints].index(e["size"]), e["world"], order[e["method"]]))
        cmd = " ".join(["python -m benchmarks.load", *sys.argv[1:]])
        if coord:
            cmd = f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', '?')} -m benchmarks.load " + \
                  " ".join(sys.argv[1:])
        data = {
            "command": cmd,
            "zload_source_sha256": source_hash,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": host,
            "backend": "nccl, partitions on the GPUs" if cuda else "gloo, partitions in CPU memory",
            "launch": "torchrun ranks start one worker each per measurement" if coord
                      else "python -m torch.distributed.run per measurement",
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "cores // W (set per launch)"),
            "staging_bytes": args.staging_bytes,
            "page_cache": "cold" if args.cold else "warm",
            "load_verify": args.load_verify,
            "checkpoints": checkpoints,
            "results": results,
            "seconds": round(time.perf_counter() - started, 1),
            "notes": notes + failures,
        }
        data["targets"] = evaluate_targets(data)
        name = args.name or default_name()
        stem = os.path.join(out_dir, f"load-{name}")
        with open(stem + ".json", "w") as f:
            json.dump(data, f, indent=1)
        written = write_outputs(data, stem)
        log(f"wrote {stem}.json, {written} in {data['seconds']:.0f} s")
        print()
        print(markdown(data))
        if coord:
            coord.barrier()
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
