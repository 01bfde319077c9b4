"""zload's load, stage by stage: the stages timed in a measured load, summarised per run and
over runs, and shown beside the floor's load."""

from __future__ import annotations

import contextlib
import functools
import importlib
import statistics
import time

# The stages of a load_into, timed in the measured load: (zload module, function, stage). On the
# usual path (one whole checkpoint that every rank sees) each function runs once per load;
# "agreement" also waits for the slowest rank's planning, "end agreement" for its reads.
ZLOAD_STAGES = (("loading.agree", "local_view", "headers + sample"),
                ("loading.load_into", "collect_targets", "planning"), ("loading.load_into", "match", "planning"),
                ("loading.load_into", "make_plan", "planning"), ("loading.agree", "reduce_max", "agreement"),
                ("loading.load_into", "execute", "reads"), ("loading.load_into", "agree", "end agreement"))


@contextlib.contextmanager
def timed_stages():
    """While the block runs, zload's ``ZLOAD_STAGES`` functions are timed: yields {stage: seconds,
    summed over its calls}; the functions are put back after. Where the rest of a load goes once
    the planning, the waits and the reads are set apart."""
    seconds: dict[str, float] = {}

    def timed(function, stage):
        @functools.wraps(function)
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started
        return run

    saved = []
    try:
        for module_name, name, stage in ZLOAD_STAGES:
            module = importlib.import_module(f"zload.{module_name}")
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, timed(saved[-1][2], stage))
        yield seconds
    finally:
        for module, name, function in saved:
            setattr(module, name, function)


def stages_of_run(ranks: list[dict]) -> dict | None:
    """zload's stages of the load (``ZLOAD_STAGES``) and "rest", each rank's load less
    its stages: each the mean over ranks, in seconds."""
    if any("stages_s" not in r or "load" not in r["segments"] for r in ranks):
        return None
    names = dict.fromkeys(stage for r in ranks for stage in r["stages_s"])
    stages = {stage: statistics.mean(r["stages_s"].get(stage, 0.0) for r in ranks) for stage in names}
    rest = statistics.mean(r["segments"]["load"]["seconds"] - sum(r["stages_s"].values()) for r in ranks)
    return {**stages, "rest": rest}


def stage_medians(runs: list[dict]) -> dict:
    """``{"zload_stages_s": each stage's median over the runs that timed stages}``, or ``{}`` where
    none did."""
    stages = [r["zload_stages_s"] for r in runs if r.get("zload_stages_s")]
    if not stages:
        return {}
    return {"zload_stages_s": {name: statistics.median(s.get(name, 0.0) for s in stages)
                               for name in dict.fromkeys(n for s in stages for n in s)}}


def stage_table(data: dict) -> list[str]:
    """zload's load stage by stage, beside the floor's load, where the stages were timed."""
    rows = [e for e in data["results"] if e["median"].get("zload_stages_s")]
    if not rows:
        return []
    floors = {(e["size"], e["world"]): e["median"].get("load_s") for e in data["results"] if e["method"] == "floor"}
    names = list(dict.fromkeys(n for e in rows for n in e["median"]["zload_stages_s"]))
    lines = ["| checkpoint | W | method | load | " + " | ".join(names) + " | floor |",
             "|---|---:|---|---:|" + "---:|" * (len(names) + 1)]
    for e in rows:
        stages, load = e["median"]["zload_stages_s"], e["median"]["load_s"]
        floor = floors.get((e["size"], e["world"]))
        lines.append(f"| {e['size']} | {e['world']} | {e['method']} | {load * 1e3:.1f} | "
                     + " | ".join(f"{stages.get(n, 0.0) * 1e3:.1f}" for n in names) + " | "
                     + ("–" if floor is None else f"{floor * 1e3:.1f}") + " |")
    return ["Where zload's load goes (milliseconds, medians of the runs; each stage the mean over ranks): "
            "*headers + sample* opens the files, checks their headers and digests a sample of each; "
            "*planning* matches names and plans the reads (`collect_targets`, `match`, `make_plan`); "
            "*agreement* is the all-reduce that settles that every rank planned the same checkpoint "
            "without a problem, a rank waiting there for the slowest rank's planning; *reads* is the "
            "executor; *end agreement* settles that every rank read without a problem, a rank waiting "
            "there for the slowest rank's reads; *rest* is each rank's load less its stages; *floor* is the "
            "floor's load at the same size and world size.", "", *lines, ""]
