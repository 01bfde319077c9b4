"""What a load does besides reading: one rank's Python work, stage by stage, in one process.

    python -m benchmarks.plan_cost --size 300MB 1.2GB 2.4GB --rounds 30 --against e94060f

A warm load at world size 2 reads at about the I/O floor's speed; what it takes beyond the floor is
mostly this work, the same at every world size, and two small all-reduces. For each size this
reuses (or writes) the Llama-shaped bf16 checkpoint of ``benchmarks.load``, builds its model under
``zload.init`` in a one-rank gloo world, and times each stage of ``load_into`` before the reads:

- ``headers``: ``open_checkpoint`` (open, read and check every file's header);
- ``sample``: ``sample_digests`` of every file (what each rank of a multi-rank load takes);
- ``targets``: ``collect_targets`` (every parameter and buffer, and this rank's partition);
- ``match``: ``names.match`` (with transformers' conversion mapping, as for a ``PreTrainedModel``);
- ``plan``: ``make_plan``;
- ``queue``: a reader built and the executor's ``add`` of every read (nothing is read: bf16 into
  bf16 partitions in CPU memory goes straight to the destinations, with no staging).

With ``--against REV`` the same stages of zload at git revision ``REV`` (its ``zload/`` folder,
imported under another name) run in the same process, the two alternating round by round (which
goes first alternates too), so a
change in the machine's speed (this VM's varies by up to 2x within minutes) falls on both. The
cyclic garbage collector is paused as ``load_into`` pauses it. Reports the minimum and the median
milliseconds; writes ``OUT/plan-cost-<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from benchmarks.load import HERE, REPO
from benchmarks.load.checkpoint import checkpoint_dir, ensure_checkpoint, llama_config, parse_size_spec
from benchmarks.load.launch import free_port
from benchmarks.load.report import save_results

STAGES = ("headers", "sample", "targets", "match", "plan", "queue")


def import_revision(revision: str, into: str) -> str:
    """Import ``zload/`` as it is at git ``revision`` as the package ``zload_at_<revision>``
    (zload's imports are relative, so it runs under any name); returns that name."""
    name = "zload_at_" + "".join(c if c.isalnum() else "_" for c in revision)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", "--end-of-options", f"{revision}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    archive = os.path.join(into, "zload.tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", REPO, "archive", commit, "zload"], stdout=f, check=True)
    with tarfile.open(archive) as tar:  # our own repository's files; the filter where Python has it
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    os.rename(os.path.join(into, "zload"), os.path.join(into, name))
    sys.path.insert(0, into)
    importlib.import_module(name)
    return name


def stage_seconds(package: str, folder: str, model) -> dict[str, float]:
    """Each stage's seconds for one run of ``package``'s zload on ``folder`` and ``model``."""
    def part(module):  # older revisions kept every module at the top
        try:
            return importlib.import_module(f"{package}.{module}")
        except ModuleNotFoundError:
            return importlib.import_module(f"{package}.{module.rpartition('.')[2]}")

    checkpoint, digest, execute = part("checkpoint.open"), part("checkpoint.digest"), part("loading.execute")
    seconds, clock = {}, time.perf_counter

    started = clock()
    index = checkpoint.open_checkpoint(folder)
    seconds["headers"] = clock() - started
    try:
        opened = list(index.opened.files.values())
        started = clock()
        digest.sample_digests([(f.fd, f.data_start, f.identity.size) for f in opened])
        seconds["sample"] = clock() - started
        started = clock()
        targets = part("model.targets").collect_targets(model)
        seconds["targets"] = clock() - started
        started = clock()
        matching = part("model.names").match(index, targets, model, None, part("checkpoint.quantized").read_quantization(index.root))
        seconds["match"] = clock() - started
        started = clock()
        plan = part("loading.plan").make_plan(index, targets, strict=True, matching=matching)
        seconds["plan"] = clock() - started
        destinations = part("loading.load_into")._destinations(plan)
        started = clock()
        reader = execute._Reader(index.opened, destinations, execute.DEFAULT_STAGING_BYTES, 1 << 20)
        for item in sorted(plan.items, key=lambda i: (i.file, i.offset)):
            reader.add(item)
        seconds["queue"] = clock() - started
        reader.runs = []  # nothing is read
        reader.close()
    finally:
        index.close()
    return seconds


def measure(size_name: str, nbytes: int, packages: dict[str, str], args) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    import zload

    config = llama_config(nbytes)
    folder = checkpoint_dir(args.cache, config, "100MB")
    ensure_checkpoint(folder, config, "100MB")
    with zload.init({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
                    dtype=torch.bfloat16):
        model = LlamaForCausalLM(config)
    runs: dict[str, list[dict]] = {label: [] for label in packages}
    for round_ in range(args.rounds + 1):  # the first round warms up and is not counted
        for label, package in list(packages.items())[::1 if round_ % 2 else -1]:
            gc.collect()
            gc.disable()
            try:
                runs[label].append(stage_seconds(package, folder, model))
            finally:
                gc.enable()
    result = {"size": size_name, "bytes": nbytes, "tensors": len(list(model.parameters())),
              "rounds": args.rounds, "by": {}}
    for label, measured in runs.items():
        measured = measured[1:]
        result["by"][label] = {s: {"min_ms": min(r[s] for r in measured) * 1e3,
                                   "median_ms": statistics.median(r[s] for r in measured) * 1e3}
                               for s in STAGES}
    return result


def markdown(data: dict) -> str:
    labels = list(data["results"][0]["by"])
    lines = [f"zload's Python work before the reads, one process, {data['host']['cpu']} "
             f"({data['host']['cpu_cores_usable']} CPUs usable), {data['date']}, zload source "
             f"{data['zload_source']}", "",
             "| checkpoint | parameters | zload | " + " | ".join(STAGES) + " | all |",
             "|---|---:|---|" + "---:|" * (len(STAGES) + 1)]
    for r in data["results"]:
        for label in labels:
            by = r["by"][label]
            cells = [f"{by[s]['min_ms']:.2f} / {by[s]['median_ms']:.2f}" for s in STAGES]
            total = (f"{sum(by[s]['min_ms'] for s in STAGES):.1f} / "
                     f"{sum(by[s]['median_ms'] for s in STAGES):.1f}")
            lines.append(f"| {r['size']} | {r['tensors']} | {label} | " + " | ".join(cells) + f" | {total} |")
    lines += ["", f"Command: `{data['command']}`. Milliseconds, minimum / median of "
              f"{data['results'][0]['rounds']} rounds (the versions alternating round by round); "
              "*all* sums the stages' minima and medians."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", nargs="+", type=parse_size_spec, default=[parse_size_spec("300MB")])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--against", metavar="REV", help="also time zload as it is at this git revision")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="cpu")
    p.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE",
                                                     os.path.expanduser("~/.cache/zload-bench")))
    args = p.parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    import deepspeed

    deepspeed.init_distributed("gloo", verbose=False)
    with tempfile.TemporaryDirectory(prefix="zload-bench-plan-") as scratch:
        packages = {"this tree": "zload"}
        if args.against:
            packages[args.against] = import_revision(args.against, scratch)
        results = [measure(name, nbytes, packages, args) for name, nbytes, _ in args.size]
    save_results(args.out, f"plan-cost-{args.name}", "python -m benchmarks.plan_cost " + " ".join(
        argv if argv is not None else sys.argv[1:]), results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
