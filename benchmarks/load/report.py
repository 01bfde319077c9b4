"""From per-rank results to medians, targets, the markdown table and the plot."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import time

from benchmarks.load import MB, REPO, log
from benchmarks.load.stages import stage_medians, stage_table, stages_of_run

CEILINGS = ("ceiling", "ceiling-1")  # the device ceiling with four reader threads a rank, with one
UNTIMED_CONSTRUCT = ("floor", *CEILINGS, "dcp")  # their buffers or partitions are made before timing
DCP_AFTER = {"zload": "dcp-after-zero.Init", "zload+init": "dcp-after-zload.init"}  # DCP after zload's construction
NO_CONSTRUCT_PLUS_LOAD = ("floor", "alloc-floor", *CEILINGS, "dcp", *DCP_AFTER.values())  # no sum to show
NO_COLLECTIVES = ("floor", "alloc-floor", *CEILINGS)
READ_NOTES = {"transformers": " (rank 0 only)", **{m: " (its rows, estimated)" for m in ("dcp", *DCP_AFTER.values())}}


def _max(ranks, segment, key, default=None):
    values = [r["segments"][segment][key] for r in ranks if key in r["segments"].get(segment, {})]
    return max(values) if values else default


def _in_collectives(ranks) -> tuple[float | None, float | None]:
    """(their own time, the most a rank waited) in the load's collectives, on gloo, from when each
    rank entered and left each: a collective's own time runs from the last rank's arrival to the
    last rank's return; a rank waits from its arrival to the last rank's, summed over the
    collectives before the last (the wait at the last is what every method, the floor too, spends
    in the barrier that ends a timed segment; a method that ends with more than one collective, as
    DCP does, has its end-of-reads wait counted). None on NCCL, whose calls return before the GPU
    is done, and where the ranks' collectives differ."""
    if any(r.get("backend") != "gloo" for r in ranks):
        return None, None
    spans = [r["segments"].get("load", {}).get("comm_spans") for r in ranks]
    if any(s is None for s in spans) or not spans[0] or \
            len({tuple(op for op, _, _ in s) for s in spans}) != 1:
        return None, None
    calls = list(zip(*spans))  # each: every rank's (op, entered, left)
    last_in = [max(entered for _, entered, _ in call) for call in calls]
    own = sum(max(left for _, _, left in call) - last for call, last in zip(calls, last_in))
    waited = max(sum(last - call[rank][1] for call, last in zip(calls[:-1], last_in[:-1]))
                 for rank in range(len(ranks)))
    return own, waited


def _growth(ranks, segment, key="rss") -> float | None:
    """The largest rise over ranks of ``key`` (rss, gpu) within ``segment``, if measured."""
    values = [r["segments"][segment][f"{key}_peak"] - r["segments"][segment][f"{key}_before"]
              for r in ranks if f"{key}_peak" in r["segments"].get(segment, {})]
    return max(values) if values else None


def summarize_run(ranks: list[dict]) -> dict:
    """One measurement: the max over ranks of every quantity."""
    run = {
        "load_s": _max(ranks, "load", "seconds"),
        "construct_s": _max(ranks, "construct", "seconds"),
        "total_s": _max(ranks, "total", "seconds"),
        "peak_rss": _max(ranks, "total", "rss_peak"),
        "rss_before_load": _max(ranks, "load", "rss_before"),
        "load_rss_growth": _growth(ranks, "load"),
        "construct_rss_growth": _growth(ranks, "construct"),
        "total_rss_growth": _growth(ranks, "total"),
        "partition_bytes": max(r.get("partition_bytes", 0) for r in ranks),
        "bytes_read": max(r.get("bytes_read", 0) for r in ranks),
        "bytes_read_by_rank": [r.get("bytes_read", 0) for r in ranks],
        "collective_received_load": _max(ranks, "load", "comm_received"),
        "collective_received_total": _max(ranks, "total", "comm_received"),
        **dict(zip(("collective_s_load_own", "collective_s_load_waited"), _in_collectives(ranks))),
        "zload_sent_received": max((r.get("bytes_sent", 0) + r.get("bytes_received", 0) for r in ranks),
                                   default=0),
        "rchar_load": _max(ranks, "load", "rchar"),
        "load_cpu_user": _max(ranks, "load", "cpu_user"),
        "load_cpu_system": _max(ranks, "load", "cpu_system"),
        "reload_s": _max(ranks, "reload", "seconds"),
        "zload_stages_s": stages_of_run(ranks),
        "zload_file": ranks[0].get("zload_file"),
        "peaks": ", ".join(sorted({r["peaks"] for r in ranks if "peaks" in r})) or None,
        "page_cache_resident": min((r["page_cache_resident"] for r in ranks
                                    if r.get("page_cache_resident") is not None), default=None),
        "verified": (None if any(r.get("verified") is None for r in ranks)
                     else all(r["verified"]["ok"] for r in ranks)),
    }
    if "gpu_peak" in ranks[0]["segments"]["total"]:
        run["gpu_peak"] = _max(ranks, "total", "gpu_peak")
        run["load_gpu_growth"] = _growth(ranks, "load", "gpu")
        run["construct_gpu_growth"] = _growth(ranks, "construct", "gpu")
    bad = [r["verified"]["problems"] for r in ranks if r.get("verified") and not r["verified"]["ok"]]
    if bad:
        run["verify_problems"] = bad
    return run


_MEDIAN_KEYS = ("load_s", "construct_s", "total_s", "peak_rss", "load_rss_growth",
                "construct_rss_growth", "total_rss_growth", "partition_bytes", "bytes_read",
                "collective_received_load", "collective_received_total", "collective_s_load_own",
                "collective_s_load_waited", "zload_sent_received", "rchar_load", "load_cpu_user", "load_cpu_system",
                "reload_s", "gpu_peak", "load_gpu_growth", "construct_gpu_growth")


def summarize(entry: dict) -> None:
    runs = entry["runs"]
    med = {}
    for key in _MEDIAN_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            med[key] = statistics.median(values)
    for key in ("load_rss_growth", "construct_rss_growth", "total_rss_growth", "construct_gpu_growth"):  # worst run
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            med[f"max_{key}"] = max(values)
    med.update(stage_medians(runs))
    if "load_s" in med:
        med["load_gb_s"] = entry["checkpoint_bytes"] / med["load_s"] / 1e9
        med["load_s_min"] = min(r["load_s"] for r in runs)
        med["load_s_max"] = max(r["load_s"] for r in runs)
    entry["median"] = med
    entry["verified"] = None if any(r["verified"] is None for r in runs) else all(r["verified"] for r in runs)


def zload_source_hash(root: str) -> str:
    """A hash of the zload sources under ``root`` (the snapshot the workers import)."""
    import hashlib

    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()[:12]


def save_results(out: str, name: str, command: str, results: list, markdown, notes: list[str] | None = None) -> dict:
    """``OUT/NAME.json`` (the command, date, host, the zload source's hash, ``results``, any ``notes``)
    and ``OUT/NAME.md`` (``markdown`` of it, also printed), as the single-file benchmarks write them."""
    data = {"command": command, "date": time.strftime("%Y-%m-%d"), "host": host_info(),
            "zload_source": zload_source_hash(os.path.join(REPO, "zload")), "results": results, "notes": notes or []}
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, name)
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(markdown(data))
    print(markdown(data))
    return data


def host_info() -> dict:
    import psutil
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"hostname": socket.gethostname(), "cpu": cpu, "cpu_cores": os.cpu_count(),
            "cpu_cores_usable": len(os.sched_getaffinity(0)),
            "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}
    from importlib.metadata import PackageNotFoundError, version

    for name in ("deepspeed", "transformers", "zload"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            pass
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=False).stdout.strip()
        dirty = [folder for folder in ("zload", "benchmarks")
                 if subprocess.run(["git", "status", "--porcelain", "--", folder, ":(exclude)benchmarks/results"], cwd=REPO, capture_output=True,
                                   text=True, timeout=10, check=False).stdout.strip()]
        info["zload_commit"] = head + "".join(f"+uncommitted {folder}/ changes" for folder in dirty)
    except (OSError, subprocess.SubprocessError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def fmt_mb(value) -> str:
    if value is None:
        return "–"
    return f"{value / MB:,.1f}" if abs(value) < 100 * MB else f"{value / MB:,.0f}"


def _waited(median: dict) -> str:
    """The load's collectives' own milliseconds and the most a rank waited in them, as ", 1.2 + 4.0 ms"."""
    own, waited = median.get("collective_s_load_own"), median.get("collective_s_load_waited")
    return "" if own is None else f", {own * 1e3:.1f} + {waited * 1e3:.1f} ms"


def _bytes(value) -> str:
    """With a unit: 0, 522 B, 12.3 kB, 1.5 MB, 311 MB."""
    if value is None:
        return "–"
    if value == 0:
        return "0"
    if value < 1e3:
        return f"{value:.0f} B"
    if value < 1e6:
        return f"{value / 1e3:.1f} kB"
    return f"{fmt_mb(value)} MB"


def _cpu(median: dict) -> str:
    if median.get("load_cpu_user") is None:  # results from before CPU time was recorded
        return "–"
    return f"{median['load_cpu_user']:.2f}; {median['load_cpu_system']:.2f}"


def fmt_s(value) -> str:
    return "–" if value is None else f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def _residency(data: dict) -> str:
    """How warm (or cold) the page cache was as each measured method started: the lowest (highest
    when cold) residency seen for a size."""
    cold = data.get("page_cache") == "cold"
    pick = max if cold else min
    before_each = {}
    for e in data["results"]:
        for run in e["runs"]:
            if run.get("page_cache_resident") is not None:
                size = e["size"]
                before_each[size] = pick(before_each.get(size, run["page_cache_resident"]),
                                         run["page_cache_resident"])
    if before_each:
        done = ("page cache emptied before each measurement and again as its timed load began; "
                "highest residency then" if cold
                else "every file re-read before each measurement; lowest residency as the method started")
        return f"{done}: " + ", ".join(
            f"{size}: {fraction:.0%}" for size, fraction in before_each.items())
    return "every file read once before the runs; " + ", ".join(
        f"{s['size']}: {s['page_cache']['resident_fraction']:.0%} resident"
        if s["page_cache"].get("resident_fraction") is not None else f"{s['size']}: read once"
        for s in data["checkpoints"])


def markdown(data: dict) -> str:
    host = data["host"]
    gpu = any("gpu_peak" in e["median"] for e in data["results"])
    lines = [
        f"Host: {host['cpu']}, {host['cpu_cores_usable']} cores usable, {host['memory_gb']} GB RAM"
        + (f", {host.get('gpu_count')}x {host['gpu']}" if host.get("gpu") else "")
        + f"; torch {host['torch']}, deepspeed {host.get('deepspeed')}, transformers "
        f"{host.get('transformers')}, zload {host.get('zload')} ({host.get('zload_commit', '?')}).",
        f"Backend {data['backend']}; load_into(verify={data.get('load_verify', 'sample')!r}); "
        f"page cache {data.get('page_cache', 'warm')} ({_residency(data)}). Median of the runs shown; each run is a fresh world; every number is the max over ranks.",
        "",
        ("| checkpoint | W | method | construct s | load s | construct + load s | load GB/s "
         "| peak RSS / rank MB | RSS growth in construct MB | RSS growth in load MB | "
         + ("peak GPU / rank MB | GPU growth in construct MB | " if gpu else "")
         + "read / rank MB | load CPU s (user; system) | collectives / rank (load; construct + load) | runs |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else "") + "---:|---:|---:|---:|",
    ]
    for e in data["results"]:
        m = e["median"]
        read = fmt_mb(m.get("bytes_read")) + READ_NOTES.get(e["method"], "")
        if e["method"] in NO_COLLECTIVES:
            coll = "0"
        else:
            coll = f"{_bytes(m.get('collective_received_load'))}{_waited(m)}; {_bytes(m.get('collective_received_total'))}"
        construct_load = "–" if e["method"] in NO_CONSTRUCT_PLUS_LOAD else fmt_s(m.get("total_s"))
        gb_s = f"{m['load_gb_s']:.2f}" if "load_gb_s" in m else "–"
        lines.append(
            f"| {e['size']} ({e['checkpoint_bytes'] / MB:,.0f} MB) | {e['world']} | {e['method']} "
            f"| {fmt_s(None if e['method'] in UNTIMED_CONSTRUCT else m.get('construct_s'))} | {fmt_s(m.get('load_s'))} "
            f"| {construct_load} | {gb_s} | {fmt_mb(m.get('peak_rss'))} | {fmt_mb(m.get('construct_rss_growth'))} "
            f"| {fmt_mb(m.get('load_rss_growth'))} | "
            + (f"{fmt_mb(m.get('gpu_peak'))} | {fmt_mb(m.get('construct_gpu_growth'))} | " if gpu else "")
            + f"{read} | {_cpu(m)} | {coll} | {len(e['runs'])} |")
    lines += ["", ("Columns: *construct s* is building the model (zero.Init or zload.init; for "
              "transformers the whole `from_pretrained` but its load step) or the allocation floor's "
              "allocate-and-touch; *load s* is zload's `load_into`, transformers' load step "
              "(`_load_pretrained_model`, inside `from_pretrained`), DCP's `dcp.load`, or the floor's or the "
              "ceiling's reads; "
              "*construct + load s* is zero.Init / zload.init construction plus `load_into`, or the whole "
              "`from_pretrained`; *GB/s* is checkpoint bytes / load s. *Peak RSS* covers construct + load; "
              "*growth* is the peak during construction or the load minus the RSS when it began (for "
              "transformers' load it "
              "includes the checkpoint pages rank 0 memory-maps). *collectives* counts bytes each rank "
              "receives through torch.distributed collectives (wrapped and counted, not estimated), during "
              "the load and during construct + load, and (on gloo) the load's collectives' own milliseconds (each "
              "from the last rank's arrival to the last rank's return, summed) + the most any rank waited in "
              "all of them but the last for a later rank (the wait at the last is the end barrier every "
              "method has; DCP ends with two, so its wait for its slowest reader counts); medians of the "
              "runs taken apart; for zload the bytes are its small agreement exchanges "
              "(its `bytes_sent + bytes_received`, for ranks lacking a file, is 0 on one machine). "
              "*load CPU s* is the process's user and system CPU seconds during the load, all its "
              "threads (`os.times`), each the largest over ranks on its own (they may be two ranks'). "
              "zload's reads (`pread`) copy out of the page cache in the kernel, as system time; DCP "
              "copies out of a memory map in user space, as user time (its page faults are system time)."),
              ""]
    lines += stage_table(data)
    if data.get("notes"):
        lines += [f"- {note}" for note in data["notes"]] + [""]
    lines += ["Targets (at world size 2 where no W is named):", ""] + [f"- {t}" for t in data.get("targets", [])]
    return "\n".join(lines).rstrip() + "\n"


LOAD_LINES = ("floor", *CEILINGS, "zload", "zload+init", "dcp", *DCP_AFTER.values(), "transformers")  # their load step, solid
TOTAL_LINES = ("zload+init", "transformers")  # construct + load, dashed
COLORS = {"floor": "tab:gray", "ceiling": "black", "ceiling-1": "tab:brown", "zload": "tab:blue", "zload+init": "tab:green",
          "dcp": "tab:purple", "dcp-after-zero.Init": "tab:pink", "dcp-after-zload.init": "tab:olive",
          "transformers": "tab:red"}


def plot(data: dict, path: str) -> None:
    """Per world size: seconds against checkpoint size (log-log, a line per method; zload+init and
    transformers also as construct + load), and load throughput against the I/O floor's, with
    zload's speed-up over transformers written at each size where both ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    worlds = sorted({e["world"] for e in data["results"]})
    fig, axes = plt.subplots(len(worlds), 2, figsize=(12, 4.2 * len(worlds)), squeeze=False)
    for (seconds, throughput), world in zip(axes, worlds):
        by_method = {}
        for e in sorted((e for e in data["results"] if e["world"] == world), key=lambda e: e["checkpoint_bytes"]):
            by_method.setdefault(e["method"], []).append(e)
        for method, key, style in ([(m, "load_s", "o-") for m in LOAD_LINES]
                                   + [(m, "total_s", "s--") for m in TOTAL_LINES]):
            points = [(e["checkpoint_bytes"] / 1e9, e["median"].get(key)) for e in by_method.get(method, [])]
            points = [(gb, s) for gb, s in points if s]
            if not points:
                continue
            what = "construct + load" if key == "total_s" else ("load step" if method == "transformers" else "load")
            gbs, secs = zip(*points)
            seconds.plot(gbs, secs, style, color=COLORS[method], label=f"{method}: {what}")
            if key == "load_s":
                throughput.plot(gbs, [gb / s for gb, s in points], style, color=COLORS[method],
                                linewidth=3 if method == "floor" else 1.5, label=method)
        for zload, slow, key in (("zload", "transformers", "load_s"), ("zload+init", "transformers", "total_s")):
            fast = {e["size"]: e for e in by_method.get(zload, [])}
            for e in by_method.get(slow, []):
                mine = fast.get(e["size"])
                if mine and mine["median"].get(key) and e["median"].get(key):
                    seconds.annotate(f"{e['median'][key] / mine['median'][key]:.1f}x", (e["checkpoint_bytes"] / 1e9,
                                     mine["median"][key]), textcoords="offset points", xytext=(6, -12),
                                     fontsize=8, color=COLORS[zload])
        seconds.set(xscale="log", yscale="log", xlabel="checkpoint GB", ylabel="seconds (median, slowest rank)",
                    title=f"W={world}: seconds" + (" (labels: zload's speed-up over transformers)"
                                                   if seconds.texts else ""))
        throughput.set(xscale="log", xlabel="checkpoint GB", ylabel="GB/s (checkpoint bytes / load s)",
                       title=f"W={world}: load throughput; thick grey: the I/O floor")
        sizes = sorted({e["checkpoint_bytes"] / 1e9 for es in by_method.values() for e in es})
        for ax in (seconds, throughput):
            ax.set_xticks(sizes, [f"{gb:.2g}" for gb in sizes])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    host = data["host"]
    fig.suptitle(f"zload load benchmark: {host['cpu']}, {host['cpu_cores_usable']} cores"
                 + (f", {host.get('gpu_count')}x {host['gpu']}" if host.get("gpu") else "")
                 + f", {data['backend']}, {data.get('page_cache', 'warm')} page cache", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(data: dict, stem: str) -> str:
    """STEM.md (the command, then the table) and STEM.png from a results dict; returns what it
    wrote. Without matplotlib (a GPU machine's image may lack it) there is no plot, rather than a
    failure after the measurements: ``--render STEM.json`` draws it elsewhere."""
    with open(stem + ".md", "w") as f:
        f.write(f"`{data['command']}`\n\n" + markdown(data))
    if not data["results"]:  # every method failed: the notes say why
        return ".md"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log(f"no matplotlib here, so no plot: `python -m benchmarks.load --render {stem}.json` "
            "draws it where matplotlib is installed (pip install -e '.[bench]')")
        return ".md"
    plot(data, stem + ".png")
    return ".md, .png"


def default_name() -> str:
    import torch

    if torch.cuda.is_available():
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    return "cpu"
