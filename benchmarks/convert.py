"""``zload convert`` against DeepSpeed's ``zero_to_fp32.py`` on the same native checkpoints.

    python -m benchmarks.convert --size 300MB 1.2GB --runs 5

``--size`` is the checkpoint's fp32 master weights. For each size it writes once (into the cache
folder) a DeepSpeed ZeRO-3 checkpoint of a Llama-shaped model (``benchmarks.load``'s
``llama_config``, bf16 with fp32 masters): 2 ranks, ``deepspeed.zero.Init`` +
``deepspeed.initialize`` + one training step (so that AdamW's two moments are saved too, as in
any checkpoint of a training run) + ``engine.save_checkpoint``, with the model's ``config.json``
beside the tag folder as an HF Trainer writes it. Then, for each run, each method in turn (so slow
drift hits all alike), with the checkpoint's files read just before so that the page cache is warm,
is timed as one fresh command, wall clock, and its peak RSS is the kernel's high-water mark of its
largest process (``getrusage(RUSAGE_CHILDREN)`` of a fresh measuring process):

- ``zero_to_fp32``: the ``zero_to_fp32.py`` that ``save_checkpoint`` drops in the folder, with
  ``--safe_serialization`` (safetensors, shards of 5 GB);
- ``zload``: ``python -m zload convert CHECKPOINT OUT``;
- ``zload, 2 processes``: the same under ``torchrun --nproc_per_node 2``;
- ``import only``: ``python -c "import zload"``, what a process costs before it converts anything.

The first run of each size checks that zload's output holds the same tensors, bit for bit, as
``zero_to_fp32``'s, and that 2 processes write the same bytes as 1. Results:
``OUT/convert-<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.load import HERE, MB, REPO, exit_without_teardown, log
from benchmarks.load.checkpoint import llama_config, parse_size_spec, warm_page_cache
from benchmarks.load.report import save_results

METHODS = {  # name -> command, with CHECKPOINT and OUT filled in
    "zero_to_fp32": lambda ckpt, out: [sys.executable, os.path.join(ckpt, "zero_to_fp32.py"), ckpt, out,
                                       "--safe_serialization"],
    "zload": lambda ckpt, out: [sys.executable, "-m", "zload", "convert", ckpt, out],
    "zload, 2 processes": lambda ckpt, out: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             "--nproc_per_node", "2", "-m", "zload", "convert", ckpt, out],
    "import only": lambda ckpt, out: [sys.executable, "-c", "import zload"],
}


def build(folder: str, config_json: str) -> None:
    """One rank of the 2-rank world that writes the checkpoint (``--build``, under torchrun); ends
    the process."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # before zero.Init, which their import fails under

    ds_config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                 "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}}
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = LlamaConfig.from_json_file(config_json)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5))
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # AdamW's moments exist, as in every checkpoint of a training run
    engine.save_checkpoint(folder)
    # Every rank has written its files once all pass this barrier. Leave without the interpreter's
    # teardown, where gloo sometimes aborts (SIGABRT in one rank: torchrun fails a finished build).
    torch.distributed.barrier()
    exit_without_teardown(0)


def ensure_checkpoint(cache: str, masters: int) -> str:
    """The native checkpoint of ``masters`` bytes of fp32 weights, written unless complete."""
    config = llama_config(masters // 2)  # sized by its bf16 bytes
    c = config
    folder = os.path.join(cache, f"native-zero3-w2-h{c.hidden_size}-i{c.intermediate_size}-l{c.num_hidden_layers}"
                                 f"-v{c.vocab_size}")
    marker = os.path.join(folder, "zload-bench-complete")
    if os.path.exists(marker):
        return folder
    os.makedirs(cache, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".tmp-", dir=cache)
    started = time.perf_counter()
    config.to_json_file(os.path.join(tmp, "config.json"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "benchmarks.convert", "--build", tmp], check=True, cwd=REPO, env=env,
                   stdout=subprocess.DEVNULL)
    with open(os.path.join(tmp, "zload-bench-complete"), "w") as f:
        f.write("written by benchmarks/convert.py\n")
    os.rename(tmp, folder)
    log(f"wrote {folder} in {time.perf_counter() - started:.1f} s")
    return folder


def tag_folder(folder: str) -> str:
    with open(os.path.join(folder, "latest")) as f:
        return os.path.join(folder, f.read().strip())


def measure(command: list[str]) -> tuple[float, int, float | None]:
    """(seconds, peak RSS bytes of its largest process, the seconds zload's report gives, if it
    printed one: the conversion without the process's start) of ``command``, run by a fresh
    process so that the high-water mark is this command's alone (``--measure``)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.convert", "--measure", "--", *command],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    *printed, last = done.stdout.strip().splitlines()
    saved = re.compile(r"^(?:zload: )?saved .* in ([0-9.]+) s$")  # the SaveReport line (older ones began "zload: ")
    inner = [float(m.group(1)) for line in printed if (m := saved.search(line))]
    seconds, rss = last.split()
    return float(seconds), int(rss), max(inner, default=None)


def run_and_report(command: list[str]) -> int:
    """``--measure``: run ``command``, pass on what it prints, then print its seconds and the peak
    RSS of its largest process."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    print(done.stdout, end="")
    print(f"{seconds:.4f} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}")
    return 0


def same_tensors(a: str, b: str) -> None:
    """The safetensors files of folders ``a`` and ``b`` hold the same tensors, bit for bit."""
    import torch
    from safetensors import safe_open

    def where(folder):
        found = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(folder, name), "pt") as f:
                    found.update(dict.fromkeys(f.keys(), os.path.join(folder, name)))
        return found

    left, right = where(a), where(b)
    if sorted(left) != sorted(right):
        raise AssertionError(f"{a} and {b} hold different tensors: {sorted(set(left) ^ set(right))[:10]}")
    for key in left:
        with safe_open(left[key], "pt") as f, safe_open(right[key], "pt") as g:
            x, y = f.get_tensor(key), g.get_tensor(key)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                                          y.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{key}: differs between {a} and {b}")


def same_files(a: str, b: str) -> None:
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)) or filecmp.cmpfiles(a, b, names, shallow=False)[0] != names:
        raise AssertionError(f"{a} and {b} hold different files")


def measure_size(name: str, masters: int, args) -> dict:
    folder = ensure_checkpoint(args.cache, masters)
    tag = tag_folder(folder)
    files = sum(os.path.getsize(os.path.join(tag, f)) for f in os.listdir(tag))
    samples: dict[str, list[tuple[float, int, float | None]]] = {m: [] for m in args.methods}
    scratch = tempfile.mkdtemp(prefix="zload-bench-convert-", dir=args.scratch)
    try:
        for run in range(args.runs):
            for method in args.methods:
                out = os.path.join(scratch, method.replace(" ", "_").replace(",", ""))
                warm_page_cache(tag, suffix=".pt")
                samples[method].append(measure(METHODS[method](folder, out)))
                seconds, rss, _ = samples[method][-1]
                log(f"{name} run {run + 1} {method}: {seconds:.2f} s, {rss / MB:,.0f} MB")
            if run == 0:
                check(scratch, args.methods)
            for entry in os.listdir(scratch):
                shutil.rmtree(os.path.join(scratch, entry))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"size": name, "masters_bytes": masters, "checkpoint_file_bytes": files, "runs": args.runs,
            "methods": {m: {"seconds": statistics.median(s for s, _, _ in v), "seconds_all": [s for s, _, _ in v],
                            "peak_rss_bytes": statistics.median(r for _, r, _ in v), "rss_all": [r for _, r, _ in v],
                            "converting_seconds": statistics.median(c for *_, c in v) if v[0][2] else None}
                        for m, v in samples.items()}}


def check(scratch: str, methods: list[str]) -> None:
    """zload's output against zero_to_fp32's, and 2 processes against 1."""
    one, two = os.path.join(scratch, "zload"), os.path.join(scratch, "zload_2_processes")
    if "zero_to_fp32" in methods and "zload" in methods:
        same_tensors(one, os.path.join(scratch, "zero_to_fp32"))
    if "zload" in methods and "zload, 2 processes" in methods:
        same_files(one, two)
    log("checked: zload writes zero_to_fp32's tensors bit for bit; 2 processes write the same bytes as 1")


def markdown(data: dict) -> str:
    lines = [f"zload convert vs DeepSpeed's zero_to_fp32.py, {data['host']['cpu']} "
             f"({data['host']['cpu_cores_usable']} CPUs usable), {data['date']}, zload source {data['zload_source']}",
             "", "| checkpoint (fp32 masters; files) | method | seconds | of which converting s | peak RSS MB | runs |",
             "|---|---|---:|---:|---:|---:|"]
    for r in data["results"]:
        size = f"{r['size']} ({r['masters_bytes'] / MB:,.0f} MB; {r['checkpoint_file_bytes'] / MB:,.0f} MB)"
        for method, m in r["methods"].items():
            inner = "–" if m["converting_seconds"] is None else f"{m['converting_seconds']:.2f}"
            lines.append(f"| {size} | {method} | {m['seconds']:.2f} | {inner} | {m['peak_rss_bytes'] / MB:,.0f} "
                         f"| {r['runs']} |")
    lines += ["", f"Command: `{data['command']}`. Medians; seconds: wall clock of the whole command, process "
              "start included; converting: what zload's report says (the slowest process), without the start; "
              "peak RSS of the command's largest process. zload fsyncs what it writes (its commit is atomic); "
              "zero_to_fp32 does not."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure"]:
        return run_and_report(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", nargs="+", type=parse_size_spec, default=[parse_size_spec("300MB")],
                   help="fp32 master weights of each checkpoint")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="cpu")
    p.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE", os.path.expanduser("~/.cache/zload-bench")))
    p.add_argument("--scratch", default=None, help="where outputs are written (default: the temp folder)")
    p.add_argument("--build", metavar="FOLDER", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.build:
        build(args.build, os.path.join(args.build, "config.json"))  # does not return
    results = [measure_size(name, nbytes, args) for name, nbytes, _ in args.size]
    save_results(args.out, f"convert-{args.name}", "python -m benchmarks.convert " + " ".join(argv), results,
                 markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
