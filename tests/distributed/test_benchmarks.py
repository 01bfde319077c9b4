"""The benchmark scripts, run small on CPU, so that the numbers the README quotes come from a script
that still works, and the GPU check works before a lent GPU machine is spent on it.

These check what each script reports (bytes, verification, outputs), never its timings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.load import run_order
from benchmarks.load.checkpoint import drop_caches_problem
from benchmarks.load.report import write_outputs

from tests.support import REPO
from tests.support.harness import exit_aborting_hook
from tests.unit import test_benchmarks as in_process
from tests.unit.test_benchmarks import SIZE

cache = in_process.cache  # the fixture, found here by pytest


def run_module(tmp_path: Path, module: str, *args, env=None) -> None:
    """``python -m module args`` from the repository root; it must succeed and leave none of its
    temporary folders behind (in ``tmp_path/tmp``, its TMPDIR)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-m", module, *map(str, args)], check=False, cwd=REPO, text=True,
                          capture_output=True, timeout=600, env={**os.environ, **(env or {}), "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(scratch.glob("zload-bench-*"))


def _load_smoke(cache, tmp_path, *launch) -> tuple[dict, dict, list[int]]:
    """A 20 MB checkpoint of several files at W=2, one run per method: the results, each method's
    run and the floor's bytes read per rank, after checking that each zload method read exactly
    those from the snapshot of zload's sources and left partitions equal to the files."""
    run_module(tmp_path, *launch, "--size", SIZE, "--shard-size", "8MB", "--runs", "1", "--cache", cache,
               "--out", tmp_path, "--name", "smoke")
    data = json.loads((tmp_path / "load-smoke.json").read_text())
    runs = {r["method"]: r["runs"][0] for r in data["results"] if r["world"] == 2}
    shares = runs["floor"]["bytes_read_by_rank"]
    assert sum(shares) == data["checkpoints"][0]["checkpoint_bytes"] and len(shares) == 2
    for method in {"zload", "zload+init"} & set(runs):
        assert "zload-bench-src-" in runs[method]["zload_file"]  # the snapshot, not the working tree
        assert runs[method]["verified"] is True
        assert runs[method]["bytes_read_by_rank"] == shares
        assert runs[method]["zload_sent_received"] == 0
    return data, runs, shares


@pytest.mark.slow
def test_load_benchmark_runs_under_torchrun(cache, tmp_path):
    """Under torchrun (as on a GPU node) the torchrun ranks start each measured world themselves."""
    _, runs, _ = _load_smoke(cache, tmp_path, "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "benchmarks.load", "--methods", "floor", "zload+init")
    assert set(runs) == {"floor", "zload+init"}


@pytest.mark.slow
def test_load_benchmark_reports_what_each_method_did(cache, tmp_path, monkeypatch):
    """Every method runs at W=2; the zload and transformers partitions are verified bit for bit;
    each zload rank reads exactly its share (the floor's), transformers reads everything on rank 0;
    zload.init's load exchanges only its agreement bytes, and the table says how long those
    exchanges took and how long a rank waited in them for the other; zload's loads are timed stage
    by stage, beside the floor; the JSON, table and plot are written, and
    without matplotlib (as on a GPU machine's image) the table still is; and what DCP and the
    ceiling read (``_check_dcp_and_ceiling``)."""
    data, runs, shares = _load_smoke(cache, tmp_path, "benchmarks.load", "--world", "2")
    total = data["checkpoints"][0]["checkpoint_bytes"]
    assert set(runs) == {"floor", "ceiling", "ceiling-1", "alloc-floor", "zload", "zload+init", "dcp", "dcp-after-zero.Init",
                         "dcp-after-zload.init", "transformers"}
    assert runs["zload+init"]["collective_received_load"] < 1000
    assert runs["zload+init"]["collective_received_total"] < 1000  # zload.init broadcasts nothing
    own, waited = runs["zload+init"]["collective_s_load_own"], runs["zload+init"]["collective_s_load_waited"]
    assert 0 < own and 0 <= waited and own + waited < runs["zload+init"]["load_s"]
    for method in ("zload", "zload+init"):
        *stages, rest = runs[method]["zload_stages_s"].items()
        assert [name for name, _ in stages] == ["headers + sample", "planning", "agreement", "reads", "end agreement"]
        assert min(s for _, s in stages) > 0 and rest[0] == "rest"
        assert 0 < rest[1] < runs[method]["load_s"] - sum(s for _, s in stages) + 0.001  # each rank's load <= the max
    assert runs["floor"]["zload_stages_s"] is None and runs["dcp"]["zload_stages_s"] is None
    assert runs["alloc-floor"]["partition_bytes"] == runs["zload+init"]["partition_bytes"] >= max(shares)
    assert runs["zload+init"]["construct_rss_growth"] is not None and runs["alloc-floor"]["construct_s"] > 0
    assert runs["transformers"]["verified"] is True
    assert runs["transformers"]["bytes_read_by_rank"] == [total, 0]
    assert runs["transformers"]["collective_received_load"] > total  # gather and broadcast
    _check_dcp_and_ceiling(data, runs)
    table = (tmp_path / "load-smoke.md").read_text()
    for method in runs:
        assert f"| {method} |" in table
    timed = r", \d+\.\d \+ \d+\.\d ms" if data["backend"].startswith("gloo") else ""  # not on NCCL
    assert re.search(rf"\| zload\+init \|.*\| \d+ B{timed}; \d+ B \|", table)
    # load, the five stages and the rest, then the floor's load
    assert re.search(rf"\| {SIZE} \| 2 \| zload\+init \|( -?\d+\.\d \|){{7}} \d+\.\d \|", table)
    assert "| ceiling | – |" in table and "| ceiling-1 | – |" in table and "| dcp | – |" in table  # nothing timed as construction
    # 3 of zload's load, 5 of zload.init's, and each of the two loads warm against DCP, alone and
    # after the same construction
    assert len(data["targets"]) == 12 and all(t.startswith(SIZE) for t in data["targets"])
    assert (tmp_path / "load-smoke.png").stat().st_size > 1000
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" raises ImportError
    assert write_outputs(data, str(tmp_path / "again")) == ".md"
    assert (tmp_path / "again.md").read_text() == table and not (tmp_path / "again.png").exists()


def _check_dcp_and_ceiling(data: dict, runs: dict) -> None:
    """DCP's Hugging Face reader leaves every rank's rows of every tensor, bit for bit, and reads
    (by estimate) just those rows; the ceiling reads the files once over the ranks, in equal shares,
    across file boundaries; DCP's plan exchange shows in the collectives. The controls do as DCP,
    after building the model as zload's methods do; every load's CPU seconds are recorded."""
    folder, total = Path(data["checkpoints"][0]["folder"]), data["checkpoints"][0]["checkpoint_bytes"]
    file_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert data["checkpoints"][0]["files"] > 1
    assert runs["dcp"]["verified"] is True
    assert sum(runs["dcp"]["bytes_read_by_rank"]) == data["checkpoints"][0]["checkpoint_bytes"]
    assert runs["dcp"]["collective_received_load"] > 1000
    for ceiling in ("ceiling", "ceiling-1"):  # four reader threads a rank, one
        shares = runs[ceiling]["bytes_read_by_rank"]
        assert sum(shares) == file_bytes and max(shares) - min(shares) <= 1
        assert runs[ceiling]["verified"] is None and runs[ceiling]["collective_received_load"] == 0
        assert runs[ceiling]["load_s"] > 0
    assert runs["dcp"]["load_s"] > 0
    for after in ("dcp-after-zero.Init", "dcp-after-zload.init"):  # DCP's load, after a construction
        assert runs[after]["verified"] is True and runs[after]["bytes_read_by_rank"] == runs["dcp"]["bytes_read_by_rank"]
        assert runs[after]["construct_rss_growth"] is not None and runs["dcp"]["construct_rss_growth"] is None
    # zero.Init's construction broadcast the weights; zload.init's did not
    assert runs["dcp-after-zero.Init"]["collective_received_total"] > total / 2
    assert runs["dcp-after-zload.init"]["collective_received_total"] < total / 10
    for run in runs.values():  # the load's CPU seconds (in clock ticks: a short load may show 0), where there is a load
        assert (run["load_cpu_user"] is None) == (run["load_cpu_system"] is None) == (run["load_s"] is None)


@pytest.mark.slow
def test_convert_benchmark_checks_and_reports_every_method(cache, tmp_path):
    """A native checkpoint written by 2 ranks; zload's output is zero_to_fp32's bit for bit and 2
    processes write the bytes 1 does (the script raises otherwise); the JSON and table name every
    method, with zload's own seconds where it reports them. gloo sometimes aborts at interpreter exit
    after the work is done; here every torchrun rank's exit aborts (an exit handler), and the 2-rank
    steps still succeed."""
    run_module(tmp_path, "benchmarks.convert", "--size", SIZE, "--runs", "1", "--cache", cache, "--out", tmp_path,
               "--name", "smoke", env={"PYTHONPATH": exit_aborting_hook(tmp_path / "hook")})
    data = json.loads((tmp_path / "convert-smoke.json").read_text())
    methods = data["results"][0]["methods"]
    assert list(methods) == ["zero_to_fp32", "zload", "zload, 2 processes", "import only"]
    assert all(m["seconds"] > 0 and m["peak_rss_bytes"] > 0 for m in methods.values())
    assert methods["zload"]["converting_seconds"] > 0 and methods["zero_to_fp32"]["converting_seconds"] is None
    assert data["results"][0]["checkpoint_file_bytes"] > 2 * data["results"][0]["masters_bytes"]  # AdamW's moments
    table = (tmp_path / "convert-smoke.md").read_text()
    assert all(f"| {method} |" in table for method in methods)


@pytest.mark.slow
def test_resume_benchmark_checks_and_reports_every_step(cache, tmp_path):
    """A run saved at W=2 both ways, resumed at W'=1 by DeepSpeed's universal checkpoint and by
    zload from both saves (the script raises unless the resumed optimizers are bit-identical):
    the JSON and table name every step, zload reads the same bytes from either save, and every
    step, DeepSpeed's too, records the untimed recycling of new memory its ranks did before it,
    and every run is kept with its ratio to its own floor. The ranks import zload compiled, as
    installed, each step's files are in the page cache right before it, and each floor runs once
    the resume's new states are freed again."""
    run_module(tmp_path, "benchmarks.resume", "--size", SIZE, "--worlds", "1", "--runs", "1", "--cache", cache,
               "--out", tmp_path, "--name", "smoke")
    result = json.loads((tmp_path / "resume-smoke.json").read_text())["results"][0]
    assert list(result["saves"]) == ["save_checkpoint", "zload.save"]
    resumed = result["resumes"]["1"]
    assert list(resumed) == ["load_universal", "zload (native)", "zload (zload.save)"]
    assert all(m["seconds"] > 0 for m in [*resumed.values(), result["ds_to_universal"]])
    assert all(len(m["recycle_seconds_ranks"]) == 1 and m["recycle_seconds_ranks"][0] > 0 for m in resumed.values())
    runs = result["each_run"]["1"]  # every run kept, not only the median one
    assert {m: len(r) for m, r in runs.items()} == dict.fromkeys(resumed, 1)
    # in the first row of the Williams design, each run recording the step measured just before it
    assert [runs[m][0]["after"] for m in run_order(list(resumed), 0)] == [
        "ds_to_universal", "W'=1 load_universal", "W'=1 zload (native)"]
    assert all(r[0]["over_floor"] == m["seconds"] / max(m["io_floor_new_memory_seconds_ranks"])
               for m, r in ((resumed[k], runs[k]) for k in ("zload (native)", "zload (zload.save)")))
    assert resumed["zload (native)"]["bytes_read_ranks"] == resumed["zload (zload.save)"]["bytes_read_ranks"]
    assert all(m["zload_compiled"] for m in resumed.values())
    states = resumed["zload (native)"]["new_state_bytes_ranks"]
    assert resumed["load_universal"]["recycle_bytes_ranks"] == [2 * new for new in states]  # it brings in twice
    for method in ("zload (native)", "zload (zload.save)"):  # an engine that has not stepped: 2 of 3 states new
        m = resumed[method]
        assert all(0.6 < new / read < 0.7 for new, read in zip(m["new_state_bytes_ranks"], m["bytes_read_ranks"]))
        assert all(new > old for new, old in zip(m["io_floor_new_memory_seconds_ranks"], m["io_floor_seconds_ranks"]))
        assert m["recycle_bytes_ranks"] == m["new_state_bytes_at_floor_ranks"] == m["new_state_bytes_ranks"]
        assert all(r is None or r >= 0.99 for r in m["resident_before_ranks"])  # its files, in the page cache
    table = (tmp_path / "resume-smoke.md").read_text()
    assert all(f"| {step} |" in table for step in [*resumed, "ds_to_universal", "zload.save"])
    assert "W'=1 zload (native): " in table and "Runs at most 1.3x the floor: W'=1 zload (native) " in table
    # the VM's setting that decides how fast freed pages fault in again, reported where the kernel has it
    assert (result["freed_pages_held_ms"] is None) == ("Free page reporting:" not in table)


def test_gpu_check_smoke_run_on_cpu(cache, tmp_path):
    """``--device cpu``: the Triton kernel (interpreted) agrees with torch for every dtype pair,
    and the one-rank load is verified against the files."""
    pytest.importorskip("triton")
    run_module(tmp_path, "benchmarks.gpu_check", "--device", "cpu", "--size", SIZE, "--cache", cache,
               "--out", tmp_path, env={"TRITON_INTERPRET": "1"})
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert len(results["kernel_bit_exact"]) == 9 and all(results["kernel_bit_exact"].values())
    assert results["load"]["verified"]["ok"] and results["load"]["verified"]["checked"] > 10
    assert results["load"]["checkpoint_bytes"] > 10e6 and "pinned_h2d_gbps" not in results


@pytest.mark.slow
def test_cold_load_benchmark_empties_the_page_cache_before_each_measurement(cache, tmp_path):
    """``--cold``: every measured method starts with (almost) none of the checkpoint cached, as
    checked by the worker itself just before it starts; a warm run starts with all of it. And
    since device time is scarce, a method whose world fails (dcp, in the warm run) is noted and not
    run again, while the command still measures and reports the others, then exits non-zero."""
    common = ["--world", "1", "--size", SIZE, "--runs", "2", "--cache", cache, "--out", tmp_path, "--no-verify"]
    run_module(tmp_path, "benchmarks.load", *common, "--methods", "floor", "zload", "--cold", "--name", "cold")
    hook = tmp_path / "hook"
    hook.mkdir()  # every dcp worker dies as it starts (the workers inherit PYTHONPATH)
    (hook / "sitecustomize.py").write_text("import os, sys\nif sys.argv[1:3] == ['--worker', 'dcp']: os._exit(3)\n")
    done = subprocess.run([sys.executable, "-m", "benchmarks.load", *map(str, common), "--methods", "floor", "dcp",
                           "zload", "--name", "warm"], cwd=REPO, text=True, capture_output=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(hook)})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    warm = json.loads((tmp_path / "load-warm.json").read_text())
    assert [(r["method"], len(r["runs"])) for r in warm["results"]] == [("floor", 2), ("zload", 2)]
    zload_runs = next(r["runs"] for r in warm["results"] if r["method"] == "zload")
    assert zload_runs[0]["after"] == "dcp (failed)"  # the failed world ran just before it
    assert warm["notes"] == [f"dcp at {SIZE} W=1 failed in run 1 (the end of its log is in this command's "
                             "output) and was not run again"]
    assert "dcp at world 1 failed (" in done.stdout and not list((tmp_path / "tmp").glob("zload-bench-*"))
    for name, fits in (("cold", lambda r: r <= 0.1), ("warm", lambda r: r >= 0.9)):
        data = json.loads((tmp_path / f"load-{name}.json").read_text())
        assert data["page_cache"] == name
        resident = [run["page_cache_resident"] for e in data["results"] for run in e["runs"]]
        assert len(resident) == 4 and all(fits(r) for r in resident), (name, resident)
        table = (tmp_path / f"load-{name}.md").read_text()
        assert ("emptied" in table) == (name == "cold") and f"page cache {name} (" in table


def test_a_cold_worker_empties_the_cache_again_as_its_timed_load_begins(tmp_path):
    """``--cold`` reaches each worker, whose meter calls its ``before_load`` (the eviction) as the
    "load" segment begins, before the ranks' barrier, and at no other segment: every method then
    reads the same time after the cache was emptied."""
    import argparse

    import torch.distributed as dist

    from benchmarks.load.launch import _worker_args
    from benchmarks.load.worker import CommCounter, Meter

    args = argparse.Namespace(staging_bytes=1, model_dtype="bfloat16", load_verify="sample", verify=False, cold=True)
    assert "--cold" in _worker_args("zload", "f", "r", args)
    assert "--cold" not in _worker_args("zload", "f", "r", argparse.Namespace(**{**vars(args), "cold": False}))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        meter, calls = Meter(CommCounter(), cuda=False), []
        meter.before_load = lambda: calls.append(sorted(meter.open))
        for segment in ("total", "construct", "load"):
            meter.begin(segment)
    finally:
        dist.destroy_process_group()
    assert calls == [["construct", "total"]]  # once, before "load" opened


@pytest.mark.parametrize("resettable", [True, False])
def test_the_meter_runs_no_thread_and_gives_each_segment_its_own_peak(tmp_path, monkeypatch, resettable):
    """No thread samples memory beside the measured work (one that did changed the times); a peak
    reached and left inside a segment counts for it and the segment around it, not for a segment
    begun after it; also where the high-water mark cannot be reset (gVisor), from the lifetime one."""
    import builtins
    import mmap
    import threading

    import torch.distributed as dist

    from benchmarks.load.worker import CommCounter, Meter

    if not resettable:
        real_open = builtins.open

        def no_clear_refs(path, *args, **kwargs):
            if str(path).endswith("clear_refs"):
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, *args, **kwargs)
        monkeypatch.setattr(builtins, "open", no_clear_refs)
    mib = 1 << 20
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rss, high_water = (int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
    peak = 64 * mib + (0 if resettable else high_water - rss)  # above the lifetime peak where it is all there is
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        threads = threading.active_count()
        meter = Meter(CommCounter(), cuda=False)
        assert threading.active_count() == threads
        meter.begin("total")
        meter.begin("first")
        mmap.mmap(-1, peak, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE).close()
        first = meter.end("first")
        meter.begin("second")
        second = meter.end("second")
        total = meter.end("total")
    finally:
        dist.destroy_process_group()
    assert first["rss_peak"] - first["rss_before"] >= peak - 4 * mib
    assert total["rss_peak"] >= first["rss_peak"]
    assert second["rss_peak"] - second["rss_before"] < 8 * mib
    assert meter.peaks.startswith("high-water mark reset" if resettable else "lifetime high-water mark")


def test_cold_reads_benchmark_times_each_strategy_from_an_empty_cache(cache, tmp_path):
    run_module(tmp_path, "benchmarks.cold_reads", "--size", SIZE, "--world", "1", "2", "--rounds", "1",
               "--cache", cache, "--strategies", "sequential", "hinted", "O_DIRECT", "mapped", "contiguous 1/W",
               "--out", tmp_path, "--name", "t")
    data = json.loads((tmp_path / "cold-reads-t.json").read_text())
    assert data["highest_residency_before"] is None or data["highest_residency_before"] <= 0.1
    assert {(r["world"], r["strategy"]) for r in data["rows"]} == {
        (w, s) for w in (1, 2) for s in ("sequential", "hinted", "O_DIRECT", "mapped", "contiguous 1/W")}
    assert all(r["median"] > 0 for r in data["rows"])
    assert "'contiguous 1/W'" in data["command"]  # the recorded command runs as written
    read = {(r["world"], r["strategy"]): r["bytes_read"] for r in data["rows"]}
    assert read[1, "contiguous 1/W"] == read[2, "contiguous 1/W"] == data["bytes"]  # every file byte once
    assert (read[1, "sequential"] == read[2, "sequential"] == read[2, "hinted"] == read[2, "O_DIRECT"]
            == read[2, "mapped"] < data["bytes"])
    assert "| O_DIRECT |" in (tmp_path / "cold-reads-t.md").read_text()


def test_plan_cost_benchmark_times_each_stage_of_this_tree_and_a_revision(cache, tmp_path):
    run_module(tmp_path, "benchmarks.plan_cost", "--size", SIZE, "--rounds", "1", "--against", "HEAD",
               "--cache", cache, "--out", tmp_path, "--name", "t")
    data = json.loads((tmp_path / "plan-cost-t.json").read_text())
    (result,) = data["results"]
    assert list(result["by"]) == ["this tree", "HEAD"]
    assert all(t["min_ms"] > 0 for by in result["by"].values() for t in by.values())
    assert "| HEAD |" in (tmp_path / "plan-cost-t.md").read_text()


@pytest.mark.slow
def test_one_world_benchmark_times_every_method_cold_and_checks_the_loads(cache, tmp_path):
    """World sizes 1 and 3 (which divides no tensor; ``SIZE@1,3`` overrides ``--world``), every
    rank's exit aborting as gloo's sometimes does after the work is done."""
    run_module(tmp_path, "benchmarks.cold_one_world", "--size", f"{SIZE}@1,3", "--world", "2", "--rounds", "2",
               "--cache", cache, "--out", tmp_path, "--name", "t",
               env={"PYTHONPATH": exit_aborting_hook(tmp_path / "hook")})
    data = json.loads((tmp_path / "cold-one-world-t.json").read_text())
    methods = ["zload+init", "zload", "dcp", "ceiling", "ceiling-1", "ceiling-one-reader"]
    assert [(p["size"], p["world"]) for p in data["results"]] == [(SIZE, 1), (SIZE, 3)]
    for point in data["results"]:
        assert list(point["seconds"]) == methods and all(len(s) == 2 and min(s) > 0 for s in point["seconds"].values())
        assert len(point["residency"]) == 2 * len(methods)  # one eviction before each measurement
        if shutil.which("fincore"):  # else residency cannot be measured
            assert all(r is not None and r <= 0.1 for r in point["residency"])
        assert point["order"] == [methods, methods[::-1]]  # the second round in reverse
        assert point["threads"] >= 1 and point["device"] == "cpu"
        assert len(point["checks"]) == point["world"]  # every rank's partitions and shards checked
        assert all(set(c) == {"zload+init", "zload", "dcp"} and all(v["ok"] for v in c.values())
                   for c in point["checks"])
    table = (tmp_path / "cold-one-world-t.md").read_text()
    assert "| zload+init / dcp |" in table and "| zload / zload+init |" in table and "| dcp / ceiling-1 |" in table
    assert f"| method | what it times | {SIZE} W=1 | {SIZE} W=3 |" in table and "checked against the checkpoint" in table
    assert (tmp_path / "cold-one-world-t.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(drop_caches_problem() is not None, reason="/proc/sys/vm/drop_caches is not writable here")
def test_one_world_benchmark_drops_every_cache_before_each_cold_round_with_no_warm_up(cache, tmp_path):
    """The issue's method at W=2: ``sync`` and ``drop_caches`` by node rank 0 before every
    measurement, no warm run first; round 1 reported apart. The one-reader ceiling reads every
    file once, on rank 0."""
    run_module(tmp_path, "benchmarks.cold_one_world", "--size", f"{SIZE}@2", "--rounds", "2", "--evict", "drop-caches",
               "--no-warm-up", "--methods", "zload+init", "dcp", "ceiling-one-reader", "--cache", cache,
               "--out", tmp_path, "--name", "t")
    (point,) = json.loads((tmp_path / "cold-one-world-t.json").read_text())["results"]
    assert point["world"] == 2 and point["evicted_by"] == ["drop_caches"] and point["warm_up"] is False
    assert len(point["residency"]) == 6 and all(len(s) == 2 and min(s) > 0 for s in point["seconds"].values())
    if shutil.which("fincore"):
        assert all(r is not None and r <= 0.1 for r in point["residency"])
    assert all(all(v["ok"] for v in c.values()) for c in point["checks"])
    table = (tmp_path / "cold-one-world-t.md").read_text()
    assert "emptied by drop_caches" in table and "no warm-up run" in table
    assert "| ceiling-one-reader |" in table.split("Round 1 apart")[1]


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["timeout", "interrupt"])
def test_a_world_stopped_early_leaves_no_worker_behind(tmp_path, monkeypatch, ending):
    """Past its timeout, or interrupted (Ctrl-C) while the launcher waits. torchrun starts each
    worker in a session of its own: killing torchrun alone would leave them running, to disturb
    every world measured after."""
    import time
    from types import SimpleNamespace

    from benchmarks.load.launch import launch_local

    marker = tmp_path / "sleeps-forever.py"  # its path names the workers in the process table
    marker.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    log_path = tmp_path / "world.log"
    if ending == "interrupt":
        wait = subprocess.Popen.wait

        def interrupted_wait(self, timeout=None):
            if timeout == 600:  # the launcher's wait for the world, not stop_torchrun's
                time.sleep(20)  # the workers are up
                raise KeyboardInterrupt
            return wait(self, timeout)

        monkeypatch.setattr(subprocess.Popen, "wait", interrupted_wait)
    expected = (RuntimeError, "timeout after 20 s") if ending == "timeout" else (KeyboardInterrupt, None)
    with pytest.raises(expected[0], match=expected[1]):
        launch_local([str(marker)], 2, SimpleNamespace(snapshot=str(tmp_path), timeout=20 if ending == "timeout" else 600),
                     str(log_path), "sleepers")
    assert log_path.read_text().count("started") == 2  # both workers had started
    left = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True).stdout.split()
    assert not left, f"workers still running: {left}"


@pytest.mark.slow
def test_fp8_benchmark_prints_one_line_per_world_size(tmp_path):
    """``benchmarks.fp8_load`` at 4 MB: the FP8 copy is made and both loads are timed."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.fp8_load", "--size", "4MB", "--world", "1",
                           "--runs", "1", "--cache", str(tmp_path)], check=False, cwd=REPO, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [text for text in done.stdout.splitlines() if text.startswith("W=")]
    assert "FP8->bf16" in line and "bf16->bf16" in line and "GB/s" in line
    assert any(p.name.endswith("-fp8-128x128") for p in tmp_path.iterdir())
