"""The targets: each a line saying what is asked, MET or NOT MET, and the numbers behind it.
"""

from __future__ import annotations

from benchmarks.load import MB, SLACK
from benchmarks.load.report import CEILINGS, DCP_AFTER, fmt_s


def met(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def evaluate_targets(data: dict) -> list[str]:
    out = []
    limit = data["staging_bytes"] + SLACK
    by_key = {(e["size"], e["world"], e["method"]): e for e in data["results"]}
    for size in [s["size"] for s in data["checkpoints"]]:
        z, zi, t, f, a = (by_key.get((size, 2, method)) for method in
                          ("zload", "zload+init", "transformers", "floor", "alloc-floor"))
        if z:
            out += _load_targets(size, z["median"], zi and zi["median"], t and t["median"], f and f["median"])
        if zi and a:  # judged whether or not zero.Init + zload ran beside them
            out += _construction_targets(size, zi["median"], a["median"], f and f["median"], t and t["median"],
                                         _rounds_faster(t, zi))
        if z:
            worst = z["median"]["max_load_rss_growth"]
            out.append(f"{size}: zload RSS growth during the load <= staging "
                       f"({data['staging_bytes'] / 2**20:.0f} MiB) + 64 MB = {limit / MB:.0f} MB: "
                       f"{met(worst <= limit)} (worst rank of the worst run {worst / MB:.1f} MB)")
        if zi:  # zload.init's partitions are first touched by the load's writes: count them once
            worst, parts = zi["median"]["max_total_rss_growth"], zi["median"]["partition_bytes"]
            out.append(f"{size}: zload+init RSS growth over construct + load <= this rank's partitions "
                       f"({parts / MB:,.0f} MB) + staging + 64 MB = {(parts + limit) / MB:,.0f} MB: "
                       f"{met(worst <= parts + limit)} (worst rank of the worst run "
                       f"{worst / MB:,.1f} MB)")
    return out + _gpu_construction_targets(by_key) + _dcp_and_ceiling_targets(data, by_key)


def _load_targets(size, z, init, transformers, floor) -> list[str]:
    """zload's load (into a zero.Init model) against transformers' load step and the I/O floor."""
    out = []
    zl = z["load_s"]
    if transformers:
        ratio = transformers["load_s"] / zl
        ratio_total = transformers["total_s"] / z["total_s"]
        extra = ""
        if init:
            extra = (f"; from_pretrained {fmt_s(transformers['total_s'])} s vs zload.init + load_into "
                     f"{fmt_s(init['total_s'])} s = {transformers['total_s'] / init['total_s']:.1f}x")
        out.append(f"{size}: zload load >= 5x faster than transformers' load step: "
                   f"{met(ratio >= 5)} ({fmt_s(transformers['load_s'])} s vs {fmt_s(zl)} s = "
                   f"{ratio:.1f}x; construct + load: from_pretrained vs zero.Init + load_into "
                   f"{ratio_total:.1f}x{extra})")
    if floor:
        ratio = zl / floor["load_s"]
        again = z.get("reload_s")
        again = (f"; diagnostic: a second load_into in the same process {fmt_s(again)} s = "
                 f"{again / floor['load_s']:.2f}x the floor") if again else ""
        out.append(f"{size}: zload load within 1.3x of the I/O floor: "
                   f"{met(ratio <= 1.3)} ({fmt_s(zl)} s vs {fmt_s(floor['load_s'])} s = {ratio:.2f}x{again})")
    return out


def _rounds_faster(transformers: dict | None, init: dict | None, factor: float = 8) -> str:
    """How many rounds met ``factor``, each round's from_pretrained over its own construct + load
    (the methods' runs are interleaved: run i of each is round i), and the range of those ratios;
    "" where either has no runs."""
    pairs = zip((transformers or {}).get("runs") or [], (init or {}).get("runs") or [])
    ratios = [t["total_s"] / i["total_s"] for t, i in pairs if t.get("total_s") and i.get("total_s")]
    if not ratios:
        return ""
    return (f"; rounds at {factor:g}x or more: {sum(r >= factor for r in ratios)} of {len(ratios)}, "
            f"{min(ratios):.2f}-{max(ratios):.2f}x")


def _construction_targets(size, init, alloc, floor, transformers, rounds: str = "") -> list[str]:
    """zload.init's targets: construction near the allocation floor, construct + load near both
    floors, far ahead of from_pretrained (judged on the medians; ``rounds`` says how each round
    fared), and no more memory than this rank's partitions."""
    out = []
    ratio = init["construct_s"] / alloc["construct_s"]
    out.append(f"{size}: zload.init construction <= 1.5x the allocation floor: {met(ratio <= 1.5)} "
               f"({fmt_s(init['construct_s'])} s vs {fmt_s(alloc['construct_s'])} s = {ratio:.2f}x)")
    if floor:
        both = floor["load_s"] + alloc["construct_s"]
        ratio = init["total_s"] / both
        out.append(f"{size}: zload.init + load_into <= 2.5x (I/O floor + allocation floor): "
                   f"{met(ratio <= 2.5)} ({fmt_s(init['total_s'])} s vs {fmt_s(both)} s = {ratio:.2f}x)")
    if transformers:
        ratio = transformers["total_s"] / init["total_s"]
        out.append(f"{size}: zload.init + load_into >= 8x faster than from_pretrained under ZeRO-3: "
                   f"{met(ratio >= 8)} ({fmt_s(transformers['total_s'])} s vs {fmt_s(init['total_s'])} s = "
                   f"{ratio:.2f}x{rounds})")
    worst, limit = init["max_construct_rss_growth"], init["partition_bytes"] + SLACK
    out.append(f"{size}: zload.init RSS growth during construction <= this rank's partitions "
               f"({init['partition_bytes'] / MB:,.0f} MB) + 64 MB: {met(worst <= limit)} (worst rank of "
               f"the worst run {worst / MB:,.1f} MB)")
    return out


def _gpu_construction_targets(by_key: dict) -> list[str]:
    """zload.init with partitions on the GPU, at every world size measured (one GPU runs W=1 only):
    GPU memory allocated during construction within this rank's partitions + 64 MB, and construct +
    load against from_pretrained's whole call."""
    out = []
    for (size, world, method), entry in by_key.items():
        init = entry["median"]
        if method != "zload+init" or "max_construct_gpu_growth" not in init:
            continue
        label = f"{size} W={world}, GPU"
        worst, parts = init["max_construct_gpu_growth"], init["partition_bytes"]
        out.append(f"{label}: zload.init GPU memory growth during construction <= this rank's partitions "
                   f"({parts / MB:,.0f} MB) + 64 MB: {met(worst <= parts + SLACK)} (worst run "
                   f"{worst / MB:,.1f} MB)")
        transformers = by_key.get((size, world, "transformers"))
        if transformers:
            ratio = transformers["median"]["total_s"] / init["total_s"]
            out.append(f"{label}: zload.init + load_into >= 8x faster than from_pretrained under ZeRO-3: "
                       f"{met(ratio >= 8)} ({fmt_s(transformers['median']['total_s'])} s vs "
                       f"{fmt_s(init['total_s'])} s = {ratio:.2f}x{_rounds_faster(transformers, entry)})")
    return out


_LOADERS = {"zload": "zload load", "zload+init": "zload load into a zload.init model"}
_CONSTRUCTIONS = {"zload": "zero.Init", "zload+init": "zload.init"}  # what built the model each loads into


def _dcp_and_ceiling_targets(data: dict, by_key: dict) -> list[str]:
    """zload against DCP and the device's ceiling, at every world size measured: from a cold page
    cache, zload's load within 0.9x DCP's and at >= 85% of the ceiling's speed; warm, ahead of DCP.
    Judged for the load into a zero.Init model and into a zload.init one alike: the same
    ``load_into``, but cold it was not the same speed after each construction (benchmarks/README.md);
    and, where it ran, against DCP after that same construction too."""
    cold = data.get("page_cache") == "cold"
    out = []
    for (size, world, method), entry in by_key.items():
        if method not in _LOADERS:
            continue
        label, what, zl = f"{size} W={world}", _LOADERS[method], entry["median"].get("load_s")
        if zl is None:  # some results have no load time
            continue
        control = f"DCP's after the same construction ({_CONSTRUCTIONS[method]})"
        for peer, whose, kind in (("dcp", "DCP's", ""), (DCP_AFTER[method], control, ", a control, not a target")):
            dcp = by_key.get((size, world, peer))
            dl = dcp and dcp["median"].get("load_s")
            if dl and cold:
                out.append(f"{label}, cold{kind}: {what} <= 0.9x {whose}: {met(zl <= 0.9 * dl)} ({fmt_s(zl)} s "
                           f"vs {fmt_s(dl)} s = {zl / dl:.2f}x)")
            elif dl:
                out.append(f"{label}, warm{kind}: {what} ahead of {whose}: {met(zl < dl)} ({fmt_s(zl)} s vs "
                           f"{fmt_s(dl)} s = {zl / dl:.2f}x)")
        ceilings = {m: seconds for m in CEILINGS
                    if (seconds := by_key.get((size, world, m), {}).get("median", {}).get("load_s"))}
        if ceilings and cold:
            best = min(ceilings, key=ceilings.get)  # the device's ceiling is the faster way measured
            cl = ceilings[best]
            out.append(f"{label}, cold: {what} at >= 85% of the device ceiling's speed: "
                       f"{met(cl / zl >= 0.85)} ({best} {fmt_s(cl)} s / zload {fmt_s(zl)} s = {cl / zl:.0%}"
                       + "".join(f"; {m} {fmt_s(s)} s" for m, s in ceilings.items() if m != best) + ")")
    return out
