"""The benchmarks' own logic, in this process: targets, reports and plots, scratch folders, stage
timing and the collective counter. The scripts themselves, run small on CPU so that the numbers
the README quotes come from scripts that still work: tests/distributed/test_benchmarks.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.load import run_order
from benchmarks.load.launch import scratch_folders
from benchmarks.load.targets import evaluate_targets
from zload.kernels.torch_scatter import scatter_cast_torch

from tests.support import REPO

SIZE = "20MB"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """Checkpoints the scripts write, shared by this module's tests."""
    return tmp_path_factory.mktemp("bench-cache")


def test_scratch_folders_go_but_for_the_logs_of_a_failed_run(tmp_path, monkeypatch):
    """The zload snapshot always goes; the worlds' logs stay when the run fails, since its error
    names them."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with scratch_folders() as (snapshot, logs):
        assert os.path.isfile(os.path.join(snapshot, "zload", "__init__.py")) and os.path.isdir(logs)
    assert not list(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="a world failed"):
        with scratch_folders() as (snapshot, logs):
            Path(logs, "w2.log").write_text("what the world printed")
            raise RuntimeError("a world failed")
    assert list(tmp_path.iterdir()) == [Path(logs)] and Path(logs, "w2.log").exists()


def test_scratch_folders_snapshot_is_compiled_as_an_install_is(tmp_path, monkeypatch):
    """Every module of the snapshot has current bytecode beside it, so that a measured world does
    not compile zload's sources in its timed load (``PYTHONDONTWRITEBYTECODE`` or not)."""
    import importlib.util

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with scratch_folders() as (snapshot, _):
        sources = list(Path(snapshot, "zload").rglob("*.py"))
        assert sources and all(Path(importlib.util.cache_from_source(str(s))).is_file() for s in sources)


def test_timed_stages_puts_back_what_it_timed():
    """The load benchmark times zload's stages by wrapping its functions for one load; after it
    they are zload's own again, and each call was counted to its stage."""
    import importlib

    from benchmarks.load.stages import ZLOAD_STAGES, timed_stages

    def functions():
        return [getattr(importlib.import_module(f"zload.{module}"), name) for module, name, _ in ZLOAD_STAGES]

    before = functions()
    with timed_stages() as seconds:
        assert all(wrapped is not own for wrapped, own in zip(functions(), before))
        import zload.loading.agree

        assert zload.loading.agree.reduce_max([3, 4]) == [3, 4]  # one process: no collective
    assert all(now is own for now, own in zip(functions(), before))
    assert list(seconds) == ["agreement"] and seconds["agreement"] > 0


@pytest.mark.parametrize("methods", [["floor", "ceiling", "zload", "zload+init", "dcp"],
                                     ["floor", "ceiling", "ceiling-1", "zload", "zload+init", "dcp"]])
def test_no_method_mostly_follows_the_same_one(methods):
    """A method's cold load may depend on what ran just before it (a world that built a zero.Init model
    slowed the next on this project's VM): over five rounds each method follows at least three
    others and none in more than two rounds; each round is every method once."""
    rounds = [run_order(methods, run) for run in range(5)]
    assert all(sorted(order) == sorted(methods) for order in rounds)
    sequence = [m for order in rounds for m in order]
    for method in methods:
        before = [sequence[i - 1] for i in range(1, len(sequence)) if sequence[i] == method != sequence[i - 1]]
        assert len(set(before)) >= 3 and max(map(before.count, before)) <= 2, (method, before)


def _entry(method: str, world: int, load_s: float) -> dict:
    return {"size": "1GB", "world": world, "method": method,
            "median": {"load_s": load_s, "max_load_rss_growth": 0, "max_total_rss_growth": 0, "partition_bytes": 0}}


@pytest.mark.parametrize("page_cache", ["cold", "warm"])
def test_dcp_and_ceiling_targets_at_every_world_size(page_cache):
    """Cold: zload's load within 0.9x DCP's and at >= 85% of the ceiling's speed; warm: zload ahead of
    DCP; each judged at every world size where the methods ran, for the load into a zero.Init model
    and, where it ran, into a zload.init one. The ceiling is the faster of its two ways measured."""
    loads = {1: {"zload": 1.0, "dcp": 1.0, "ceiling": 0.9},
             2: {"zload": 0.5, "zload+init": 0.95, "dcp": 1.0, "ceiling": 0.6, "ceiling-1": 0.4,
                 "dcp-after-zero.Init": 0.5, "dcp-after-zload.init": 1.1}}
    data = {"checkpoints": [{"size": "1GB"}], "staging_bytes": 64 << 20, "page_cache": page_cache,
            "results": [_entry(m, w, s) for w, by_method in loads.items() for m, s in by_method.items()]}
    verdicts = dict(re.match(r"(.*): (MET|NOT MET) \(", t).groups() for t in evaluate_targets(data) if " W=" in t)
    if page_cache == "cold":
        assert verdicts == {"1GB W=1, cold: zload load <= 0.9x DCP's": "NOT MET",
                            "1GB W=1, cold: zload load at >= 85% of the device ceiling's speed": "MET",
                            "1GB W=2, cold: zload load <= 0.9x DCP's": "MET",
                            "1GB W=2, cold: zload load at >= 85% of the device ceiling's speed": "NOT MET",
                            "1GB W=2, cold: zload load into a zload.init model <= 0.9x DCP's": "NOT MET",
                            "1GB W=2, cold: zload load into a zload.init model at >= 85% of the device "
                            "ceiling's speed": "NOT MET",
                            "1GB W=2, cold, a control, not a target: zload load <= 0.9x DCP's after the "
                            "same construction (zero.Init)": "NOT MET",
                            "1GB W=2, cold, a control, not a target: zload load into a zload.init model <= 0.9x DCP's "
                            "after the same construction (zload.init)": "MET"}
        assert "(ceiling-1 0.40 s / zload 0.50 s = 80%; ceiling 0.60 s)" in " ".join(evaluate_targets(data))
        one_reader = next(e for e in data["results"] if e["method"] == "ceiling-1")
        del one_reader["median"]["load_s"]  # a ceiling without a load time is left out
        assert "(ceiling 0.60 s / zload 0.50 s = 120%)" in " ".join(evaluate_targets(data))
    else:
        assert verdicts == {"1GB W=1, warm: zload load ahead of DCP's": "NOT MET",
                            "1GB W=2, warm: zload load ahead of DCP's": "MET",
                            "1GB W=2, warm: zload load into a zload.init model ahead of DCP's": "MET",
                            "1GB W=2, warm, a control, not a target: zload load ahead of DCP's after the "
                            "same construction (zero.Init)": "NOT MET",
                            "1GB W=2, warm, a control, not a target: zload load into a zload.init model ahead of DCP's "
                            "after the same construction (zload.init)": "MET"}


def test_gpu_check_catches_a_kernel_that_differs(monkeypatch):
    """A kernel that gets one element wrong fails its dtype pair; one that hands segments back
    to torch (as on CPU without the interpreter) is an error, not a pass."""
    def one_wrong(staging, segments, destinations):
        scatter_cast_torch(staging, segments, destinations)
        if segments[0].src_dtype == torch.float16:
            destinations[-1][-1] += 1
        return []

    triton_scatter = pytest.importorskip("zload.kernels.triton_scatter")
    monkeypatch.setattr(triton_scatter, "scatter_cast_triton", one_wrong)
    results = gpu_check.kernel_check(torch.device("cpu"))
    assert {pair for pair, same in results.items() if not same} == {
        "float16->float32", "float16->float16", "float16->bfloat16"}

    monkeypatch.setattr(triton_scatter, "scatter_cast_triton", lambda staging, segments, dests: segments)
    with pytest.raises(RuntimeError, match="did not take 4 of 4 segments"):
        gpu_check.kernel_check(torch.device("cpu"))


def test_plot_shows_seconds_and_throughput_against_size_with_the_speed_up(tmp_path, monkeypatch):
    """Per world size: a log-log seconds panel with a line per method and zload's speed-up over
    transformers written at each size, and a throughput panel with the floor."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from benchmarks.load.report import plot

    def entry(method, world, nbytes, load_s, total_s):
        return {"size": f"{nbytes // 10**6}MB", "checkpoint_bytes": nbytes, "world": world, "method": method,
                "median": {"load_s": load_s, "total_s": total_s}}

    results = [entry(m, w, n, load * n / 1e9, total and total * n / 1e9) for w in (1, 2) for n in (3 * 10**8, 12 * 10**8)
               for m, load, total in (("floor", 0.1, None), ("zload", 0.2, 1.0), ("zload+init", 0.2, 0.5),
                                      ("dcp-after-zero.Init", 0.3, None), ("transformers", 2.0, 4.0))]
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **k: saved.append(fig))
    plot({"results": results, "backend": "gloo", "host": {"cpu": "x", "cpu_cores_usable": 2}}, str(tmp_path / "p.png"))
    (fig,) = saved
    seconds, throughput = fig.axes[0], fig.axes[1]
    assert len(fig.axes) == 4 and seconds.get_xscale() == seconds.get_yscale() == "log"
    assert sorted(t.get_text() for t in seconds.texts) == ["10.0x", "10.0x", "8.0x", "8.0x"]
    # both zload loads have a load line, and so does a DCP control
    assert {line.get_label() for line in throughput.lines} == {"floor", "zload", "zload+init", "dcp-after-zero.Init",
                                                               "transformers"}
    assert "speed-up over transformers" in seconds.get_title()
    # without transformers there is no speed-up to label, and the title does not promise one
    saved.clear()
    plot({"results": [e for e in results if e["method"] != "transformers"], "backend": "gloo",
          "host": {"cpu": "x", "cpu_cores_usable": 2}}, str(tmp_path / "p.png"))
    assert "transformers" not in saved[0].axes[0].get_title() and not saved[0].axes[0].texts


def _one_world_run(cache, tmp_path, monkeypatch, failing=(), wrong=(), options=(), launched=None) -> tuple:
    """``benchmarks.cold_one_world`` at 20 MB, worlds 1, 2 and 3 (and ``options``), launching
    nothing: a world in ``failing`` raises as a failed launch does, the others write a made-up
    result (whose checks fail in a world in ``wrong``) and add their worker's arguments to
    ``launched``. Returns the error main raised and the folder of logs it kept, or (None, None)
    where nothing fails."""
    from benchmarks import cold_one_world

    methods = list(cold_one_world.METHODS)

    def launch(worker_args, world, args, log_path, what):
        Path(log_path).write_text(f"the log of {what}")
        if launched is not None:
            launched.append(worker_args)
        if world in failing:
            raise RuntimeError(f"{what} failed (1); log {log_path}:\nits last lines")
        checks = [{m: {"ok": world not in wrong} for m in methods[:3]}] * world
        result = {"seconds": {m: [0.5, 0.25] for m in methods}, "residency": [0.0] * 2 * len(methods),
                  "order": [methods, methods[::-1]], "checks": checks, "threads": 1, "device": "cpu"}
        Path(worker_args[worker_args.index("--result") + 1]).write_text(json.dumps(result))

    monkeypatch.setattr(cold_one_world, "launch_local", launch)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(sys, "argv", ["cold_one_world", "--size", SIZE, "--world", "1", "2", "3", "--cache",
                                      str(cache), "--out", str(tmp_path / "out"), "--name", "t", *options])
    if not failing and not wrong:
        assert cold_one_world.main() == 0
        return None, None
    with pytest.raises(RuntimeError) as raised:
        cold_one_world.main()
    (logs,) = (tmp_path / "tmp").glob("zload-bench-*")  # the snapshot of zload's sources goes, the logs stay
    assert logs.name.startswith("zload-bench-logs-")
    return str(raised.value), logs


@pytest.mark.parametrize("failing", [{2}, {1}, {1, 3}, {1, 2, 3}])
def test_one_world_benchmark_keeps_the_points_measured_beside_a_failed_one(cache, tmp_path, monkeypatch, failing):
    """A point's world that fails (a crash, a timeout) is named in the results and the command
    fails, but the points before and after it are still measured and saved, apart from a whole
    run's files, with a note on each point measured right after a failure; with no point measured
    nothing is saved. The worlds' logs are kept."""
    error, logs = _one_world_run(cache, tmp_path, monkeypatch, failing=failing)
    assert sorted(f.name for f in logs.iterdir()) == [f"{SIZE}-{w}.log" for w in (1, 2, 3)]
    if len(failing) == 3:
        assert error.startswith("no point was measured, nothing saved")
        assert not (tmp_path / "out").exists()
        return
    assert error.startswith(f"{len(failing)} of 3 points not measured, the others saved as "
                            f"{tmp_path / 'out' / 'cold-one-world-t-partial'}.*")
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == [f"cold-one-world-t-partial.{e}" for e in
                                                                    ("json", "md", "png")]
    data = json.loads((tmp_path / "out" / "cold-one-world-t-partial.json").read_text())
    assert [p["world"] for p in data["results"]] == sorted({1, 2, 3} - failing)
    expected = []
    for w in (1, 2, 3):
        if w in failing:
            expected.append(f"{SIZE} at world {w}: not measured, its world failed (1); log {logs / f'{SIZE}-{w}.log'}")
        elif w - 1 in failing:
            expected.append(f"{SIZE} at world {w}: measured right after the failed world of {SIZE} at world {w - 1} "
                            "(its numbers may carry what that failure left behind)")
    assert data["notes"] == expected
    table = (tmp_path / "out" / "cold-one-world-t-partial.md").read_text()
    assert all(f"Note: {note}" in table.split("| method |")[0] for note in expected)  # above the tables


def test_one_world_benchmark_stops_at_a_load_that_differs_from_the_checkpoint(cache, tmp_path, monkeypatch):
    """Nothing is saved, not even the points measured before it; the ranks' checks stay with the logs."""
    error, logs = _one_world_run(cache, tmp_path, monkeypatch, wrong={2})
    assert error.startswith(f"{SIZE} at world 2: a load differs from the checkpoint")
    assert not (tmp_path / "out").exists()
    assert sorted(f.name for f in logs.iterdir()) == [f"{SIZE}-1.log", f"{SIZE}-2.json", f"{SIZE}-2.log"]
    assert not json.loads((logs / f"{SIZE}-2.json").read_text())["checks"][0]["zload"]["ok"]


def test_one_world_benchmark_empties_the_cache_as_asked_and_shows_round_one_apart(cache, tmp_path, monkeypatch):
    """``--evict`` and ``--no-warm-up`` reach every world; round 1 is shown beside the median and
    range of the later rounds (where one-time costs show when nothing ran before the rounds)."""
    from benchmarks.load import checkpoint

    monkeypatch.setattr(checkpoint, "DROP_CACHES", str(tmp_path / "drop_caches"))  # writable: allowed
    launched = []
    _one_world_run(cache, tmp_path, monkeypatch, options=["--evict", "drop-caches", "--no-warm-up"], launched=launched)
    assert len(launched) == 3
    assert all(args[args.index("--evict") + 1] == "drop-caches" and "--no-warm-up" in args for args in launched)
    data = json.loads((tmp_path / "out" / "cold-one-world-t.json").read_text())
    assert [p["warm_up"] for p in data["results"]] == [False] * 3
    table = (tmp_path / "out" / "cold-one-world-t.md").read_text()
    assert "no warm-up run: round 1 carries each method's one-time costs" in table
    after = table.split("Round 1 apart")[1]
    assert f"| zload+init | {' | '.join(['0.500; 0.250 (0.250-0.250)'] * 3)} |" in after
    assert "| ceiling-one-reader |" in after and "| zload+init / ceiling-one-reader |" in table
    launched.clear()
    (tmp_path / "again").mkdir()
    _one_world_run(cache, tmp_path / "again", monkeypatch, launched=launched)  # the defaults
    assert all(args[args.index("--evict") + 1] == "fadvise" and "--no-warm-up" not in args for args in launched)


def test_drop_caches_eviction_says_when_it_is_not_allowed(cache, tmp_path, monkeypatch):
    """``--evict drop-caches`` where /proc/sys/vm/drop_caches cannot be written: the command refuses
    before building or launching anything, naming the file and the way that works; an eviction
    that fails all the same raises with that message. Where it can be written, "3" is written."""
    from benchmarks import cold_one_world
    from benchmarks.load import checkpoint

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 4096)
    monkeypatch.setattr(checkpoint, "DROP_CACHES", str(tmp_path / "drop_caches"))
    assert checkpoint.drop_caches_problem() is None
    assert checkpoint.evict_page_cache(str(folder), "drop-caches")["how"] == "drop_caches"
    assert (tmp_path / "drop_caches").read_text() == "3\n"
    monkeypatch.setattr(checkpoint, "DROP_CACHES", str(tmp_path / "no such folder" / "drop_caches"))
    problem = checkpoint.drop_caches_problem()
    assert "no such folder/drop_caches is not writable here" in problem and "--evict fadvise" in problem
    with pytest.raises(RuntimeError, match="is not writable here"):
        checkpoint.evict_page_cache(str(folder), "drop-caches")
    monkeypatch.setattr(cold_one_world, "launch_local", lambda *a: pytest.fail("launched"))
    monkeypatch.setattr(sys, "argv", ["cold_one_world", "--size", "1TB", "--evict", "drop-caches", "--cache",
                                      str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as refused:
        cold_one_world.main()
    assert refused.value.code == 2 and not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_named_checkpoint_shapes_stand_where_a_size_does():
    """The issue-43 shapes by name, with a world-size suffix as a size takes; the 1.1 GB one in its
    own 200 MB shards, the 540 MB one the same Llama as 600MB's; sizes are built as before."""
    import argparse

    from benchmarks.load.checkpoint import checkpoint_dir, checkpoint_shape, parse_size_spec

    name, nbytes, worlds = parse_size_spec("issue43-1.1GB@1,2")
    assert (name, worlds) == ("issue43-1.1GB", [1, 2]) and 1.05e9 < nbytes < 1.15e9
    config, shard = checkpoint_shape(name, nbytes, "100MB")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size, shard) == (2048, 8, 32000, "200MB")
    assert not config.tie_word_embeddings
    config, shard = checkpoint_shape(*parse_size_spec("issue43-540MB")[:2], "100MB")
    same = checkpoint_shape(*parse_size_spec("600MB")[:2], "100MB")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (1024, 2816, 18)
    assert checkpoint_dir("c", config, shard) == checkpoint_dir("c", *same)
    config, shard = checkpoint_shape(*parse_size_spec("300MB")[:2], "100MB")
    assert checkpoint_dir("c", config, shard) == "c/llama-bf16-h1024-i2816-l7-v32000-shard100MB"  # as before
    with pytest.raises(argparse.ArgumentTypeError, match="or a named shape: issue43-1.1GB, issue43-540MB"):
        parse_size_spec("issue43-2GB")


def test_results_say_whose_uncommitted_changes_measured(tmp_path, monkeypatch):
    """A result's commit is only true of the code measured if neither zload/ nor the benchmark
    itself had changes on top of it; results written since (benchmarks/results) are not code."""
    from benchmarks.load import report

    for folder in ("zload", "benchmarks"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "code.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    for step in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"]):
        subprocess.run(git + step, check=True)
    monkeypatch.setattr(report, "REPO", str(tmp_path))
    (tmp_path / "benchmarks" / "results").mkdir()
    (tmp_path / "benchmarks" / "results" / "load-earlier.md").write_text("a result\n")
    assert "uncommitted" not in report.host_info()["zload_commit"]
    (tmp_path / "benchmarks" / "code.py").write_text("x = 2\n")
    assert report.host_info()["zload_commit"].endswith("+uncommitted benchmarks/ changes")


def test_load_benchmark_modules_stay_small():
    """One concern per module: the benchmark is a package, no module of it over 400 lines."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (REPO / "benchmarks" / "load").glob("*.py")}
    assert len(sizes) > 3 and max(sizes.values()) <= 400, sizes


def test_gpu_construction_targets_at_every_world_size():
    """With partitions on the GPU (one GPU runs W=1 only): zload.init's GPU memory growth during
    construction within its partitions + 64 MB in the worst run, and construct + load against
    from_pretrained's whole call."""
    init = {"total_s": 1.0, "partition_bytes": 1e9, "max_construct_gpu_growth": 1.05e9}
    data = {"checkpoints": [{"size": "1GB"}], "staging_bytes": 64 << 20, "page_cache": "warm",
            "results": [{"size": "1GB", "world": 1, "method": "zload+init", "median": init},
                        {"size": "1GB", "world": 1, "method": "transformers", "median": {"total_s": 9.0}}]}
    verdicts = dict(re.match(r"(.*): (MET|NOT MET) \(", t).groups() for t in evaluate_targets(data))
    assert verdicts == {
        "1GB W=1, GPU: zload.init GPU memory growth during construction <= this rank's partitions "
        "(1,000 MB) + 64 MB": "MET",
        "1GB W=1, GPU: zload.init + load_into >= 8x faster than from_pretrained under ZeRO-3": "MET"}
    init["max_construct_gpu_growth"], data["results"][1]["median"]["total_s"] = 1.07e9, 7.0
    assert set(dict(re.match(r"(.*): (MET|NOT MET) \(", t).groups()
                    for t in evaluate_targets(data)).values()) == {"NOT MET"}


def test_construction_targets_without_the_zero_init_method():
    """A run of zload.init against the floors and from_pretrained alone (no zero.Init + zload)
    is judged on every construction target."""
    init = {"construct_s": 1.4, "total_s": 2.0, "partition_bytes": 1e9, "max_construct_rss_growth": 1.05e9,
            "max_total_rss_growth": 1.06e9}
    medians = {"zload+init": init, "alloc-floor": {"construct_s": 1.0}, "floor": {"load_s": 0.5},
               "transformers": {"total_s": 17.0}}
    data = {"checkpoints": [{"size": "1GB"}], "staging_bytes": 64 << 20, "page_cache": "warm",
            "results": [{"size": "1GB", "world": 2, "method": m, "median": v} for m, v in medians.items()]}
    verdicts = dict(re.match(r"(.*): (MET|NOT MET) \(", t).groups() for t in evaluate_targets(data))
    assert verdicts == {
        "1GB: zload.init construction <= 1.5x the allocation floor": "MET",
        "1GB: zload.init + load_into <= 2.5x (I/O floor + allocation floor)": "MET",
        "1GB: zload.init + load_into >= 8x faster than from_pretrained under ZeRO-3": "MET",
        "1GB: zload.init RSS growth during construction <= this rank's partitions (1,000 MB) + 64 MB": "MET",
        "1GB: zload+init RSS growth over construct + load <= this rank's partitions (1,000 MB) + staging "
        "+ 64 MB = 1,131 MB": "MET"}
    init["construct_s"] = 1.6
    assert "1GB: zload.init construction <= 1.5x the allocation floor: NOT MET (1.60 s vs 1.00 s = 1.60x)" \
        in evaluate_targets(data)
    medians["transformers"]["total_s"] = 15.98  # 7.99x: not met, so not printed as 8.0x either
    line = next(t for t in evaluate_targets(data) if ">= 8x faster" in t)
    assert "NOT MET" in line and line.endswith("= 7.99x)"), line


def test_construction_target_counts_the_rounds_that_met_it():
    """Beside the verdict on the medians, the 8x line says in how many rounds (run i of each
    method) from_pretrained took 8x zload.init + load_into or more, and the range of the ratios."""
    init = {"construct_s": 0.1, "total_s": 0.2, "partition_bytes": 1e9, "max_construct_rss_growth": 1e9,
            "max_total_rss_growth": 1e9}
    runs = {"zload+init": [0.2, 0.25, 0.2], "transformers": [1.7, 1.9, 1.5]}  # 8.5x, 7.6x, 7.5x
    data = {"checkpoints": [{"size": "1GB"}], "staging_bytes": 64 << 20, "page_cache": "warm",
            "results": [{"size": "1GB", "world": 2, "method": "alloc-floor", "median": {"construct_s": 0.1}}]
            + [{"size": "1GB", "world": 2, "method": m, "median": init if m == "zload+init" else {"total_s": 1.7},
                "runs": [{"total_s": s} for s in seconds]} for m, seconds in runs.items()]}
    line = next(t for t in evaluate_targets(data) if ">= 8x faster" in t)
    assert line.endswith("= 8.50x; rounds at 8x or more: 1 of 3, 7.50-8.50x)"), line
    data["results"][1]["runs"] = data["results"][2]["runs"] = []  # a result of one run shows no rounds
    assert next(t for t in evaluate_targets(data) if ">= 8x faster" in t).endswith("= 8.50x)")


def test_time_in_collectives_is_split_into_their_own_and_the_waits_before_the_last():
    """A collective's own time runs from the last rank's arrival to the last return; a rank's wait
    from its arrival to the last rank's, counted before the last collective only (the wait at the
    last is the end barrier every method has); none where the ranks' collectives differ, or on
    NCCL (its calls return before the GPU is done)."""
    from benchmarks.load.report import _in_collectives

    def ranks(*spans, backend="gloo"):
        return [{"backend": backend, "segments": {"load": {"comm_spans": s}}} for s in spans]

    two = [("all_reduce", 0.0, 1.5), ("all_reduce", 5.0, 6.2)], [("all_reduce", 1.0, 1.5), ("all_reduce", 6.0, 6.1)]
    own, waited = _in_collectives(ranks(*two))
    assert own == pytest.approx(0.5 + 0.2) and waited == pytest.approx(1.0)
    assert _in_collectives(ranks(*two, backend="nccl")) == (None, None)
    assert _in_collectives(ranks([("all_reduce", 0.0, 1.0)], [("broadcast", 0.0, 1.0)])) == (None, None)
    assert _in_collectives(ranks([("all_reduce", 0.0, 1.0)], [])) == (None, None)
    assert _in_collectives(ranks([], [])) == (None, None)


def test_comm_counter_counts_an_op_inside_another_once_and_times_only_collectives(monkeypatch):
    """torch's recv calls irecv: its bytes count once; point-to-point ops get no span (not every
    rank makes them), collectives one each."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from benchmarks.load.worker import CommCounter

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        return None

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        return c10d.irecv(tensor, src)

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    for module in (c10d, dist):  # install wraps many ops: every one is put back after the test
        for name, value in list(vars(module).items()):
            if callable(value):
                monkeypatch.setattr(module, name, value)
    for name, fake in (("irecv", irecv), ("recv", recv), ("all_reduce", all_reduce)):
        monkeypatch.setattr(c10d, name, fake)
        monkeypatch.setattr(dist, name, fake)
    counter = CommCounter()
    counter.install()
    dist.recv(torch.zeros(4, dtype=torch.int64), 0)
    dist.all_reduce(torch.zeros(2, dtype=torch.int64))
    assert counter.received == 32 + 16 and counter.calls == 2
    assert [op for op, _, _ in counter.spans] == ["all_reduce"]
