"""Elastic resume: ``zload.load_into(engine, path, optimizer=True)`` against DeepSpeed's own
``ds_to_universal`` + ``load_universal``, and ``zload.save(engine, path, optimizer=True)`` against
``engine.save_checkpoint``.

    python -m benchmarks.resume --size 1GB --worlds 1 3 --runs 6 --hold-freed-pages 300000 --name cpu-1GB

``--size`` is the model's bf16 weights. For each size it writes once (into the cache folder),
at world size 2, a Llama-shaped model (``benchmarks.load``'s ``llama_config``) under
``deepspeed.zero.Init`` with ZeRO-3, bf16 and AdamW after one training step, saved twice from the
same engine: ``engine.save_checkpoint`` (``native/``) and ``zload.save(optimizer=True)``
(``zload/``), each rank timing its own call (the save comparison). Then, for each run and each
world size W' of ``--worlds``, each method in turn, the files it reads (and only those: they may
not all fit in the page cache) read by its ranks once their engines are built, just before the
call (read earlier, the engines' memory may push them out):

- ``ds_to_universal``: DeepSpeed's conversion (``python -m deepspeed.checkpoint.ds_to_universal``,
  its default workers), once per run (it does not depend on W'), one fresh command: wall clock
  and the peak RSS of its largest process;
- ``load_universal``: W' ranks (torchrun) each build the engine, then time
  ``engine.load_checkpoint`` of the converted checkpoint (``checkpoint.load_universal``);
- ``zload (native)``: the same engine, ``zload.load_into(engine, native/, optimizer=True)``;
- ``zload (zload.save)``: ``zload.load_into(engine, zload/, optimizer=True)``.

Per rank, each step apart: the seconds of the call alone (not the engine's build), the RSS
before it and its high-water mark after (``ru_maxrss``), and, for zload, the bytes it read; its
I/O floors are those bytes at the speed one process alone reads the checkpoint's files from the
page cache into a reused buffer (a bound no resume reaches), and the time the rank itself takes,
after its resume (whose new states it frees first) and with all ranks at once, to read as many
bytes of the same files with zload's reader threads, those of the Adam states the engine held no
memory for (an engine that has not stepped: any resume brings them into being) into memory
allocated then (``_floor_in_rank``). Each resume, and each floor, comes right after faulting in
that much new memory and freeing it, untimed (``_recycle``), so that both fault in the same kind
of pages; ``--hold-freed-pages`` keeps the kernel from handing those back to the host meanwhile.
Each step first drops from the page cache the files it does not read. The ranks import a
compiled copy of zload, as installed: its imports are part of the resume. The first run checks
that every rank's fp32 masters, exp_avg, exp_avg_sq and step counts are bit-identical between
DeepSpeed's resume and zload's two. A resume that fails (DeepSpeed's universal load can run out
of memory) is recorded as failed. Results: ``OUT/resume-<name>.{json,md}``, the median run of
each step, and every run's seconds and ratio to its own floor (``each_run``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

from benchmarks.load import HERE, MB, REPO, exit_without_teardown, log, run_order
from benchmarks.load.checkpoint import (
    checkpoint_files,
    files_residency,
    llama_config,
    parse_size_spec,
    warm_page_cache,
)
from benchmarks.load.launch import compiled_snapshot
from benchmarks.load.report import save_results

SAVE_WORLD = 2
NATIVE, ZLOAD = "native", "zload"
CHUNK = 16 << 20  # the floors' reads
ZLOAD_RESUMES = ("zload (native)", "zload (zload.save)")
RESUMES = ("load_universal", *ZLOAD_RESUMES)  # the methods run in W' ranks
FLOOR_TARGET = 1.3  # issue 42: a resume takes at most this times the I/O floor in the rank
# this VM's kernel: how long a freed page stays in the guest before free page reporting hands it back
MIN_FREE_MS = "/sys/module/page_reporting/parameters/min_free_ms"


def ds_config(universal: bool = False) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3}}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def _engine(config_json: str, universal: bool = False):
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # before zero.Init, which their import fails under

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = LlamaConfig.from_json_file(config_json)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config(universal)):
        model = LlamaForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(universal),
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5))
    return engine, config


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(call) -> dict:
    """``call()``'s seconds, with the RSS before and the high-water mark after, the minor page
    faults and the kernel's CPU seconds (every thread's) on this rank."""
    import torch.distributed as dist

    dist.barrier()
    before, usage = _rss(), resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "rss_before": before, "peak_rss": after.ru_maxrss * 1024, "result": result,
            "minor_faults": after.ru_minflt - usage.ru_minflt, "kernel_seconds": after.ru_stime - usage.ru_stime}


def _write(out: str, record: dict) -> None:
    import torch.distributed as dist

    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()  # every rank has written once all pass it
    exit_without_teardown(0)


def build(folder: str, out: str) -> None:
    """One rank of the world that trains one step and saves twice (``--build``, under torchrun)."""
    import zload

    engine, config = _engine(os.path.join(folder, "config.json"))
    import torch

    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # AdamW's moments exist
    native = _timed(lambda: engine.save_checkpoint(os.path.join(folder, NATIVE)))
    ours = _timed(lambda: zload.save(engine, os.path.join(folder, ZLOAD), optimizer=True).bytes_written)
    _write(out, {"save_checkpoint": native, "zload.save": ours})


def _digest(engine) -> str:
    """This rank's fp32 masters, optimizer states and step counts, digested."""
    import torch

    optimizer = engine.optimizer
    digest = hashlib.sha256()
    for flat in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state.get(flat, {})
        for tensor in (flat, state.get("exp_avg"), state.get("exp_avg_sq")):
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
        digest.update(repr(float(state["step"])).encode())
    return digest.hexdigest()


def resume(method: str, folder: str, out: str) -> None:
    """One rank of the world that resumes (``--resume METHOD``, under torchrun)."""
    import zload

    engine, _ = _engine(os.path.join(folder, "config.json"), universal=method == "load_universal")
    existing, new = _state_bytes(engine)
    if method == "load_universal":
        files = _files_under(_tag(folder) + "_universal")

        def call():
            engine.load_checkpoint(os.path.join(folder, NATIVE))
    else:
        where = os.path.join(folder, NATIVE if method == "zload (native)" else ZLOAD)
        files = checkpoint_files(_tag(folder), ".pt") if method == "zload (native)" else [
            p for p in checkpoint_files(where) if os.path.basename(p).startswith("optimizer-")]

        def call():
            return zload.load_into(engine, where, optimizer=True).bytes_read
    _evict_others(folder, files)
    _warm_in_ranks(files)
    recycled = new * (2 if method == "load_universal" else 1)  # its RSS rises by about twice the states
    record = dict(recycle_seconds=_recycle(recycled), recycle_bytes=recycled, new_state_bytes=new,
                  zload_compiled=os.path.exists(zload.__cached__), resident_before=files_residency(files))
    record.update(_timed(call), digest=_digest(engine))
    if method != "load_universal":
        _drop_new_states(engine)
        record["new_state_bytes_at_floor"] = _state_bytes(engine)[1]
        record["floor_seconds"] = _floor_in_rank(files, existing, new)
        record["floor_resident"] = files_residency(files)  # below 1: the floor read some from the disk
    _write(out, record)


def _recycle(nbytes: int) -> float:
    """Fault in ``nbytes`` of new memory and free it, untimed, right before a timed step that
    brings that much into being (the Adam states; DeepSpeed's universal load, about twice as much);
    returns its seconds. On this VM a page the guest freed moments ago faults in several times
    faster than one it has handed back to the host, and a step would pay whichever kind it
    happened to get (benchmarks/README.md): so each resume and its floor fault in pages just freed."""
    import torch

    started = time.perf_counter()
    torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    return time.perf_counter() - started


def _drop_new_states(engine) -> None:
    """Free the Adam states the resume brought into being (after their digest), so that the floor
    faults its new memory in beside as much memory in use as the resume had, not beside the
    resume's states as well: on this 24 GB machine, at W'=1, those 4 GB more pushed the floor into
    reclaiming the page cache, which slowed it (ad hoc, medians 2.35 s against 1.57 s) and
    favoured the resume."""
    import gc

    optimizer = engine.optimizer
    for flat in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state.get(flat, {})
        state.pop("exp_avg", None)
        state.pop("exp_avg_sq", None)
    gc.collect()


def _state_bytes(engine) -> tuple[int, int]:
    """(the bytes of this rank's fp32 masters and Adam states that the engine holds memory for, the
    bytes of those it does not yet): before its first step, the two Adam states are new memory
    that a resume brings into being."""
    optimizer = engine.optimizer
    flats = optimizer.fp32_partitioned_groups_flat
    new = sum(2 * flat.numel() * flat.element_size() for flat in flats
              if "exp_avg" not in optimizer.optimizer.state.get(flat, {}))
    return sum(3 * flat.numel() * flat.element_size() for flat in flats) - new, new


def _floor_in_rank(paths: list[str], existing: int, new: int) -> float:
    """The seconds this rank takes, all ranks at once, to read ``existing`` bytes of ``paths`` (from
    the page cache) into a reused buffer per thread and then ``new`` bytes into memory allocated
    now, with as many threads as zload reads with: the I/O floor of the resume just timed, on the
    same cores, beside the same peers and faulting in the same kind of memory: like the resume, it
    first faults in as much new memory and frees it (``_recycle``, untimed)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed as dist

    from zload.distributed import reader_count

    chunks = [(p, at, min(CHUNK, size - at)) for p in paths for size in [os.path.getsize(p)]
              for at in range(0, size, CHUNK)]
    first = dist.get_rank() * len(chunks) // dist.get_world_size()  # the ranks start apart, as they read
    chunks = chunks[first:] + chunks[:first]
    _recycle(new)
    fresh = memoryview(torch.empty(new, dtype=torch.uint8).numpy()).cast("B")
    local = threading.local()
    jobs, done, k = [], 0, 0  # (file, offset, where in ``fresh`` or None: a reused buffer, bytes)
    while done < existing + new:
        path, offset, length = chunks[k % len(chunks)]
        length = min(length, existing - done if done < existing else existing + new - done)
        jobs.append((path, offset, None if done < existing else done - existing, length))
        done, k = done + length, k + 1

    def read(job) -> None:
        path, offset, at, length = job
        if at is None and not hasattr(local, "buffer"):
            local.buffer = memoryview(bytearray(CHUNK))
        target = local.buffer[:length] if at is None else fresh[at:at + length]
        with open(path, "rb", buffering=0) as f:
            os.preadv(f.fileno(), [target], offset)

    dist.barrier()
    started = time.perf_counter()
    with ThreadPoolExecutor(reader_count()) as pool:
        list(pool.map(read, jobs))
    seconds = time.perf_counter() - started
    dist.barrier()
    return seconds


def _torchrun(world: int, snapshot: str, *arguments: str) -> list[dict]:
    """``python -m benchmarks.resume ARGUMENTS OUT`` in ``world`` ranks, importing zload from the
    folder ``snapshot`` (``compiled_snapshot``; ``REPO``: the sources); each rank's record."""
    out = tempfile.mkdtemp(prefix="zload-bench-resume-")
    try:
        path = [snapshot, REPO, os.environ.get("PYTHONPATH")]  # python -m puts the working folder first
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)), OMP_NUM_THREADS="1",
                   PYTHONDONTWRITEBYTECODE="1")  # compiled only if the snapshot was: ``zload_compiled`` says
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               str(world), "-m", "benchmarks.resume", *arguments, out], cwd=snapshot, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            why = "a rank was killed (SIGKILL: out of memory?)" if "exitcode: -9" in done.stderr \
                else f"exit status {done.returncode}"
            raise RuntimeError(f"{' '.join(arguments[:2])} at {world} ranks: {why}\n{done.stderr[-4000:]}")
        records = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                records.append(json.load(f))
        return records
    finally:
        shutil.rmtree(out, ignore_errors=True)


def ensure_checkpoint(cache: str, weights: int, snapshot: str = REPO) -> tuple[str, list[dict]]:
    """The saved run of ``weights`` bytes of bf16 weights, written unless complete (zload imported
    from ``snapshot``), and each saving rank's timings."""
    c = llama_config(weights)
    folder = os.path.join(cache, f"resume-zero3-w{SAVE_WORLD}-h{c.hidden_size}-i{c.intermediate_size}"
                                 f"-l{c.num_hidden_layers}-v{c.vocab_size}")
    marker = os.path.join(folder, "zload-bench-complete")
    if not os.path.exists(marker):
        os.makedirs(cache, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".tmp-", dir=cache)
        started = time.perf_counter()
        c.to_json_file(os.path.join(tmp, "config.json"))
        saves = _torchrun(SAVE_WORLD, snapshot, "--build", tmp)
        with open(os.path.join(tmp, "saves.json"), "w") as f:
            json.dump(saves, f)
        with open(os.path.join(tmp, "zload-bench-complete"), "w") as f:
            f.write("written by benchmarks/resume.py\n")
        os.rename(tmp, folder)
        log(f"wrote {folder} in {time.perf_counter() - started:.1f} s")
    with open(os.path.join(folder, "saves.json")) as f:
        return folder, json.load(f)


def _tag(folder: str) -> str:
    with open(os.path.join(folder, NATIVE, "latest")) as f:
        return os.path.join(folder, NATIVE, f.read().strip())


def convert(tag: str) -> dict:
    """``ds_to_universal`` of ``tag`` into ``<tag>_universal`` (``latest_universal`` beside it),
    as one fresh command: its seconds and the peak RSS of its largest process. What it wrote is
    then synced, untimed: left dirty (2 GB here, for more than 30 s), its writeback and the
    reclaim that waits on it would fall into the steps timed after it."""
    shutil.rmtree(tag + "_universal", ignore_errors=True)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag,
               "--output_folder", tag + "_universal", "--inject_missing_state"]
    done = subprocess.run([sys.executable, "-m", "benchmarks.resume", "--measure", "--", *command],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    os.sync()  # its GBs written back now, untimed, not during the resumes timed next
    seconds, rss = done.stdout.strip().splitlines()[-1].split()
    return {"seconds": float(seconds), "peak_rss": int(rss)}


def _min_free_ms() -> int | None:
    """How long the kernel keeps a freed page before it reports it to the host (None: this kernel
    does not say)."""
    try:
        with open(MIN_FREE_MS) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


@contextmanager
def freed_pages_held(ms: int | None):
    """``--hold-freed-pages MS``: while the benchmark runs, this VM's kernel reports a freed page
    to the host only once it has been free ``MS`` ms (its setting restored at the end). Reported as
    soon as freed (``0``), the pages a step's recycle freed are handed back while the step
    faults them in, a race each run loses by another amount (benchmarks/README.md)."""
    before = _min_free_ms() if ms is not None else None
    if ms is not None:
        if before is None:
            raise SystemExit(f"--hold-freed-pages: {MIN_FREE_MS} is missing or unreadable: this kernel has no "
                             "such setting; run without the option")
        try:
            with open(MIN_FREE_MS, "w") as f:
                f.write(str(ms))
        except OSError as e:
            raise SystemExit(f"--hold-freed-pages: cannot write {MIN_FREE_MS} ({e}); run as root, or "
                             "without the option") from e
    try:
        yield
    finally:
        if before is not None:
            with open(MIN_FREE_MS, "w") as f:
                f.write(str(before))


def run_and_report(command: list[str]) -> int:
    """``--measure``: run ``command``, then print its seconds and its largest process's peak RSS."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    print(f"{time.perf_counter() - started:.4f} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}")
    return 0


def _files_under(folder: str) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names)


def _evict_others(folder: str, keep: list[str]) -> None:
    """Drop from the page cache the data files under ``folder`` (the benchmark's own, written back
    already; of ``CHUNK`` bytes or more, so that small ones such as ``latest`` stay) that this step
    does not read (rank 0; ``_warm_in_ranks``'s barrier comes after). Left in, the
    other methods' files fill this 24 GB machine, and the recycle and the step bring in their new
    memory by reclaiming page cache, which may be the very files the step is about to read."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return
    for path in sorted(set(_files_under(folder)) - set(keep)):
        if os.path.getsize(path) < CHUNK:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm_in_ranks(paths: list[str]) -> None:
    """Read the files ``paths`` into the page cache, the ranks sharing the reads, right
    before the timed call (and its ``_recycle``, which comes after: the page cache would take the
    pages it frees): read before the engines were built, a file may have been pushed out
    while they took their memory (the kernel reclaims first what was read once), and the call
    would read it from the disk."""
    import torch.distributed as dist

    buffer = bytearray(CHUNK)
    chunks = [(p, at) for p in paths for at in range(0, os.path.getsize(p), CHUNK)]
    for path, at in chunks[dist.get_rank()::dist.get_world_size()]:
        with open(path, "rb", buffering=0) as f:
            os.preadv(f.fileno(), [buffer], at)
    dist.barrier()


def _read_speed(folder: str) -> float:
    """Bytes per second one process reads the checkpoint's files from the (warm) page cache."""
    speeds = []
    for sub, suffix in ((_tag(folder), ".pt"), (os.path.join(folder, ZLOAD), ".safetensors")):
        warm_page_cache(sub, suffix)
        again = warm_page_cache(sub, suffix)
        speeds.append(again["bytes"] / again["seconds"])
    return min(speeds)


def _per_rank(records: list[dict], speed: float | None = None) -> dict:
    """The slowest rank's seconds, and each rank's figures; with ``speed`` (one process reading the
    files into a reused buffer), each rank's bytes read (what zload reports) and their I/O floors:
    every byte at that speed, and the floor the rank measured after its resume (``_floor_in_rank``)."""
    out = {"seconds": max(r["seconds"] for r in records), "seconds_ranks": [r["seconds"] for r in records],
           "peak_rss_ranks": [r["peak_rss"] for r in records], "rss_before_ranks": [r["rss_before"] for r in records]}
    if speed and records[0].get("result") is not None:
        out["bytes_read_ranks"] = [r["result"] for r in records]
        out["new_state_bytes_ranks"] = [r["new_state_bytes"] for r in records]
        out["io_floor_seconds_ranks"] = [r["result"] / speed for r in records]
        out["io_floor_new_memory_seconds_ranks"] = [r["floor_seconds"] for r in records]
        out["floor_resident_ranks"] = [r["floor_resident"] for r in records]
        out["resident_before_ranks"] = [r["resident_before"] for r in records]
        out["new_state_bytes_at_floor_ranks"] = [r["new_state_bytes_at_floor"] for r in records]
    if "recycle_seconds" in records[0]:
        out["recycle_seconds_ranks"] = [r["recycle_seconds"] for r in records]
        out["recycle_bytes_ranks"] = [r["recycle_bytes"] for r in records]
        out["zload_compiled"] = all(r["zload_compiled"] for r in records)
    if "minor_faults" in records[0]:
        out["minor_faults_ranks"] = [r["minor_faults"] for r in records]
        out["kernel_seconds_ranks"] = [r["kernel_seconds"] for r in records]
    return out


def measure_size(name: str, weights: int, args) -> dict:
    folder, saves = ensure_checkpoint(args.cache, weights, args.snapshot)
    tag = _tag(folder)
    speed = _read_speed(folder)
    files = {NATIVE: sum(os.path.getsize(p) for p in checkpoint_files(tag, ".pt")),
             ZLOAD: sum(os.path.getsize(p) for p in checkpoint_files(os.path.join(folder, ZLOAD), ""))}
    converts: list[dict] = []
    samples: dict[int, dict[str, list[dict]]] = {w: {m: [] for m in RESUMES} for w in args.worlds}
    for run in range(args.runs):
        warm_page_cache(tag, ".pt")
        converts.append(convert(tag))  # the same for every W'
        log(f"{name} run {run + 1} ds_to_universal: {converts[-1]['seconds']:.2f} s")
        after = "ds_to_universal"  # the step measured just before
        for world in args.worlds:
            digests = {}
            for method in run_order(list(RESUMES), run):
                try:
                    records = _torchrun(world, args.snapshot, "--resume", method, folder)
                except RuntimeError as e:  # DeepSpeed's universal load can run out of memory
                    samples[world][method].append({"failed": str(e).splitlines()[0], "after": after})
                    log(f"{name} run {run + 1} W'={world} {method}: failed: {e}")
                    after = f"W'={world} {method} (failed)"
                    continue
                digests[method] = [r["digest"] for r in records]
                samples[world][method].append({**_per_rank(records, speed), "after": after})
                log(f"{name} run {run + 1} W'={world} {method}: {samples[world][method][-1]['seconds']:.2f} s")
                after = f"W'={world} {method}"
            if run == 0 and len({tuple(d) for d in digests.values()}) > 1:
                raise AssertionError(f"W'={world}: the resumed optimizers differ between {list(digests)}")
    return {"size": name, "weights_bytes": weights, "files_bytes": files, "read_bytes_per_second": speed,
            "runs": args.runs, "freed_pages_held_ms": _min_free_ms(),
            "saves": {m: _per_rank([s[m] for s in saves]) for m in saves[0]},
            "ds_to_universal": _median(converts),
            "resumes": {str(w): {m: _median(v) for m, v in by.items()} for w, by in samples.items()},
            "each_run": {str(w): {m: [_in_brief(s) for s in v] for m, v in by.items()} for w, by in samples.items()}}


def _over_floor(sample: dict) -> float | None:
    """A zload step's seconds over its floor in the rank (slowest ranks); None where it has no
    floor, or where the page cache lacked part of the files right before the step or lost part
    before the floor ended (one of them read some from the disk)."""
    if "io_floor_new_memory_seconds_ranks" not in sample:
        return None
    resident = sample["floor_resident_ranks"] + sample.get("resident_before_ranks", [])
    if min(r if r is not None else 1.0 for r in resident) < 0.99:
        return None
    return sample["seconds"] / max(sample["io_floor_new_memory_seconds_ranks"])


def _in_brief(sample: dict) -> dict:
    """One run of a step, so that a reader sees every run, not only the median one."""
    if "failed" in sample:
        return {"failed": True, "after": sample["after"]}
    ratio = _over_floor(sample)
    brief = {"seconds": sample["seconds"], "after": sample["after"]}
    return {**brief, "over_floor": ratio} if ratio is not None else brief


def _median(samples: list[dict]) -> dict:
    """The run of median seconds (its per-rank figures with it); a failure if any run failed."""
    failed = [s for s in samples if "failed" in s]
    return failed[0] if failed else sorted(samples, key=lambda s: s["seconds"])[len(samples) // 2]


def markdown(data: dict) -> str:
    lines = [f"Elastic resume from a ZeRO-3 bf16 AdamW checkpoint saved at W={SAVE_WORLD}, {data['host']['cpu']} "
             f"({data['host']['cpu_cores_usable']} CPUs usable), {data['date']}, zload source {data['zload_source']}",
             "", "| weights (files: native; zload) | W' | step | seconds (slowest rank) | I/O floor s: into "
             "existing / new memory (slowest rank) | minor faults, kernel s (slowest rank) | peak RSS MB per rank "
             "| rise MB per rank |", "|---|---:|---|---:|---:|---:|---|---|"]

    def row(size, world, step, m):
        if "failed" in m:
            lines.append(f"| {size} | {world} | {step} | failed: {m['failed']} | | | | |")
            return
        floors, faults = "–", "–"
        if "io_floor_seconds_ranks" in m:
            existing, new = max(m["io_floor_seconds_ranks"]), max(m["io_floor_new_memory_seconds_ranks"])
            ratio = _over_floor(m)
            floors = (f"{existing:.2f} / {new:.2f} ({m['seconds'] / existing:.1f}x / "
                      + ("files partly evicted: no ratio)" if ratio is None else f"{ratio:.2f}x)"))
        if "minor_faults_ranks" in m:
            faults = f"{max(m['minor_faults_ranks']):,}, {max(m['kernel_seconds_ranks']):.1f}"
        peaks = ", ".join(f"{p / MB:,.0f}" for p in m.get("peak_rss_ranks", [m.get("peak_rss", 0)]))
        rises = ", ".join(f"{(p - b) / MB:,.0f}" for p, b in zip(m.get("peak_rss_ranks", []),
                                                                   m.get("rss_before_ranks", [])))
        lines.append(f"| {size} | {world} | {step} | {m['seconds']:.2f} | {floors} | {faults} "
                     f"| {peaks} | {rises or '–'} |")

    for r in data["results"]:
        size = (f"{r['size']} ({r['files_bytes'][NATIVE] / MB:,.0f} MB; {r['files_bytes'][ZLOAD] / MB:,.0f} MB)")
        for step, m in r["saves"].items():
            row(size, SAVE_WORLD, step, m)
        row(size, "any", "ds_to_universal", r["ds_to_universal"])
        for world, by in r["resumes"].items():
            for step, m in by.items():
                row(size, world, step, m)
            if "failed" in by["load_universal"]:
                continue
            ds = r["ds_to_universal"]["seconds"] + by["load_universal"]["seconds"]
            for method in ZLOAD_RESUMES:
                if "failed" not in by[method]:
                    lines.append(f"| {size} | {world} | {method} / (ds_to_universal + load_universal) | "
                                 f"{by[method]['seconds'] / ds:.3f} | | | | |")
    def run_text(run: dict) -> str:
        if "failed" in run:
            return "failed"
        return f"{run['seconds']:.2f}" + (f" ({run['over_floor']:.2f}x)" if "over_floor" in run else "")

    for r in data["results"]:
        each_run = r.get("each_run", {})
        runs = [f"W'={world} {step}: " + ", ".join(map(run_text, each))
                for world, by in each_run.items() for step, each in by.items()]
        met = [f"W'={world} {step} {sum(run.get('over_floor', math.inf) <= FLOOR_TARGET for run in each)} of "
               f"{len(each)}" for world, by in each_run.items() for step, each in by.items() if step in ZLOAD_RESUMES]
        if runs:
            lines += ["", f"{r['size']}, each run in order, seconds (over the floor in the rank): "
                      + "; ".join(runs) + f". Runs at most {FLOOR_TARGET}x the floor: " + "; ".join(met) + "."]
        if r.get("freed_pages_held_ms") is not None:
            lines += ["", f"Free page reporting: the kernel reported a freed page to the host once it had been free "
                          f"{r['freed_pages_held_ms']:,} ms (`{MIN_FREE_MS}`)."]
    lines += ["", f"Command: `{data['command']}`. Median run. Seconds: the call alone on each rank (the engine "
              "built before it), the slowest rank; ds_to_universal: the whole command (one process and its "
              "workers). I/O floors: the rank's bytes read at the speed one process alone reads the files from "
              "the page cache into one reused buffer (a bound no resume reaches), and the time the rank takes, "
              "after its resume, whose new states it frees first, with all ranks at once and as many reader "
              "threads, to read as many bytes of "
              "the same files, those of the Adam states the engine had no memory for (it has taken no step) into "
              "memory allocated then, its pages faulted in as it goes (in brackets, the step's time over each "
              "floor; no ratio where the page cache lacked part of the files before the step or by the "
              "floor's end). The files a step does not read are dropped from the page cache before it. Before each "
              "resume and each in-rank floor, untimed, each rank faulted in and freed as many bytes as the Adam "
              "states it brings in, so that both fault in pages just freed (DeepSpeed's universal load brings in "
              "twice that, and its recycle is sized so). The ranks import zload compiled, as installed. Minor faults "
              "and kernel s: the call's page faults and its threads' kernel CPU seconds. The methods run in "
              "the rows of a Williams design: over six runs each follows every other equally often (each run "
              "records the step before it, `after`). The save rows: timed once, when the cache's "
              "checkpoint was written. Peak RSS: the high-water mark after the step; rise: that minus the RSS "
              "before it. The first run checks that every rank's masters, exp_avg, exp_avg_sq and steps are "
              "bit-identical across the three resumes."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure"]:
        return run_and_report(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    if argv[:1] == ["--build"]:
        build(*argv[1:3])  # does not return
    if argv[:1] == ["--resume"]:
        resume(*argv[1:4])  # does not return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", nargs="+", type=parse_size_spec, default=[parse_size_spec("1GB")],
                   help="bf16 weights of each model")
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 3], help="the world sizes to resume at")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="cpu")
    p.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE", os.path.expanduser("~/.cache/zload-bench")))
    p.add_argument("--hold-freed-pages", type=int, metavar="MS",
                   help=f"for the run, set {MIN_FREE_MS} (how long a freed page stays before the kernel reports "
                        "it to the host; root only), restored after")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run restores the setting too
    # compiled as installed: zload's imports are part of a resume
    with freed_pages_held(args.hold_freed_pages), compiled_snapshot() as args.snapshot:
        results = [measure_size(name, nbytes, args) for name, nbytes, _ in args.size]
    save_results(args.out, f"resume-{args.name}", "python -m benchmarks.resume " + " ".join(argv), results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
