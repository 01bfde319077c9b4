"""Ways to read a rank's ZeRO-3 byte ranges from a cold page cache, side by side.

    python -m benchmarks.cold_reads --size 300MB --world 1 2 --rounds 10

For each world size W it starts W processes (no torch.distributed: only the reads are measured),
empties the checkpoint's page cache (``posix_fadvise(DONTNEED)``, or ``drop_caches`` as root when
pages stay), and times, barrier to the last rank's end, each strategy reading what zload reads: every
tensor's partition ``[r*ps, min((r+1)*ps, numel))`` with ``ps = ceil(numel / W)``, in file order,
into one reused buffer. Strategies alternate within each round. The checkpoint is the load
benchmark's (same cache). Results: ``OUT/cold-reads-<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.load import MB, REPO, log
from benchmarks.load.checkpoint import (
    checkpoint_dir, checkpoint_files, ensure_checkpoint, evict_page_cache, llama_config, parse_bytes,
)
from benchmarks.load.methods import contiguous_share, rank_partitions

RUN = 16 << 20  # bytes per request, as zload's runs
AHEAD = 64 << 20  # hinted ahead of the reader (zload's READ_AHEAD_BYTES)
GAP = 4 << 20  # "merged": read through gaps up to this
# name -> (what it does, options)
STRATEGIES = {
    "sequential": ("one thread, one request at a time (the load benchmark's floor)", {}),
    "2 threads": ("two threads taking requests in order", {"threads": 2}),
    "4 threads": ("four threads taking requests in order", {"threads": 4}),
    "hinted": ("one thread, the next 64 MB hinted with posix_fadvise(WILLNEED) (zload's choice for "
               "one reader thread)", {"ahead": AHEAD}),
    "2 threads + hinted": ("both", {"threads": 2, "ahead": AHEAD}),
    "merged gaps": ("one thread, ranges closer than 4 MB read as one (other ranks' bytes read "
                    "and thrown away)", {"gap": GAP}),
    "O_DIRECT": ("two threads, O_DIRECT on page-aligned spans (no page cache)",
                 {"threads": 2, "direct": True}),
    "mapped": ("a stand-in for DCP's reader: one thread copying each range out of a memory map of its "
               "file (page faults, with the kernel's read-around)", {"mapped": True}),
    "contiguous 1/W": ("not zload's ranges: rank r reads the r-th contiguous 1/W of the files, "
                       "four threads (the load benchmark's ceiling)", {"threads": 4, "contiguous": True}),
    "contiguous 1/W, 1 thread": ("the same, one thread", {"contiguous": True}),
    "contiguous 1/W, 2 threads": ("the same, two threads", {"threads": 2, "contiguous": True}),
    "contiguous 1/W, 8 threads": ("the same, eight threads", {"threads": 8, "contiguous": True}),
    "contiguous 1/W, mapped": ("the same, one thread copying out of a memory map",
                               {"mapped": True, "contiguous": True}),
}


def partition_ranges(folder: str, rank: int, world: int) -> list[tuple[str, int, int]]:
    """(path, offset, length) of each tensor's ZeRO-3 partition on ``rank``: what zload reads."""
    return [(path, e.start + first * e.itemsize, count * e.itemsize)
            for path, e, _, first, count in rank_partitions(folder, rank, world) if count]


def requests(ranges, gap: int) -> list[tuple[str, int, int]]:
    """Ranges cut into requests of at most ``RUN`` bytes, neighbours closer than ``gap`` joined."""
    out = []
    for path, offset, length in ranges:
        if out and out[-1][0] == path and 0 <= offset - sum(out[-1][1:]) <= gap:
            last = out.pop()
            length, offset = offset + length - last[1], last[1]
        out += [(path, at, min(RUN, offset + length - at)) for at in range(offset, offset + length, RUN)]
    return out


def read_all(fds: dict, todo: list, threads: int, ahead: int, direct: bool) -> int:
    lock, state = threading.Lock(), {"next": 0, "hinted": 0}
    starts = [0]
    for _, _, length in todo:
        starts.append(starts[-1] + length)

    def reader() -> int:
        buffer = memoryview(mmap.mmap(-1, RUN + 2 * mmap.PAGESIZE))  # page-aligned, for O_DIRECT
        done = 0
        while True:
            with lock:
                i = state["next"]
                if i == len(todo):
                    return done
                state["next"] += 1
                first = end = max(i, state["hinted"])  # never what a reader has reached
                while ahead and end < len(todo) and starts[end] < starts[i] + ahead:
                    end += 1
                state["hinted"] = max(end, state["hinted"])
                hint = todo[first:end]
            for path, offset, length in hint:
                os.posix_fadvise(fds[path], offset, length, os.POSIX_FADV_WILLNEED)
            path, offset, length = todo[i]
            if direct:
                low = offset - offset % mmap.PAGESIZE
                high = -(-(offset + length) // mmap.PAGESIZE) * mmap.PAGESIZE
                at, end = low, high
            else:
                at, end = offset, offset + length
            while at < end:
                got = os.preadv(fds[path], [buffer[:end - at]], at)
                if got <= 0:
                    break  # O_DIRECT at the end of a file
                at += got
            done += length

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda _: reader(), range(threads)))


def copy_mapped(fds: dict, todo: list) -> int:
    """DCP's reader's way: each copy faults its pages in, and the kernel reads around each fault."""
    maps = {path: memoryview(mmap.mmap(fd, 0, prot=mmap.PROT_READ)) for path, fd in fds.items()}
    buffer = memoryview(bytearray(RUN))
    for path, offset, length in todo:
        buffer[:length] = maps[path][offset:offset + length]
    return sum(length for _, _, length in todo)


def rank_main(folder: str, rank: int, world: int, options: dict, barrier, results) -> None:
    ranges = (contiguous_share if options.get("contiguous") else partition_ranges)(folder, rank, world)
    todo = requests(ranges, options.get("gap", 0))
    flags = os.O_RDONLY | (os.O_DIRECT if options.get("direct") else 0)
    fds = {path: os.open(path, flags) for path in {r[0] for r in todo}}
    barrier.wait()
    started = time.perf_counter()
    if options.get("mapped"):
        read = copy_mapped(fds, todo)
    else:
        read = read_all(fds, todo, options.get("threads", 1), options.get("ahead", 0), options.get("direct", False))
    results.put((time.perf_counter() - started, read))


def measure(folder: str, world: int, options: dict) -> tuple[float, float | None, int]:
    """Seconds (slowest rank), residency before, bytes read, of one cold read by W processes."""
    evicted = evict_page_cache(folder)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(world), context.Queue()
    ranks = [context.Process(target=rank_main, args=(folder, r, world, options, barrier, results))
             for r in range(world)]
    for p in ranks:
        p.start()
    got = [results.get(timeout=600) for _ in ranks]
    for p in ranks:
        p.join()
    return max(s for s, _ in got), evicted["resident_fraction"], sum(n for _, n in got)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cold_reads", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="300MB", help="checkpoint size, as the load benchmark's --size")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    p.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE", os.path.expanduser("~/.cache/zload-bench")))
    p.add_argument("--shard-size", default="100MB")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--name", default="cpu")
    args = p.parse_args()
    config = llama_config(parse_bytes(args.size))
    folder = checkpoint_dir(args.cache, config, args.shard_size)
    ensure_checkpoint(folder, config, args.shard_size)
    total = sum(os.path.getsize(f) for f in checkpoint_files(folder))
    seconds = {(w, s): [] for w in args.world for s in args.strategies}
    read = {}  # bytes the ranks read together, per (world, strategy)
    residency = []
    for round_ in range(args.rounds):
        for world in args.world:
            for name in args.strategies:
                s, resident, read[world, name] = measure(folder, world, STRATEGIES[name][1])
                seconds[world, name].append(s)
                residency.append(resident)
        log(f"round {round_ + 1}/{args.rounds} done")
    rows = [{"world": w, "strategy": s, "seconds": v, "median": statistics.median(v), "bytes_read": read[w, s]}
            for (w, s), v in seconds.items()]
    data = {"command": "python -m benchmarks.cold_reads " + shlex.join(sys.argv[1:]), "checkpoint": folder,
            "bytes": total, "highest_residency_before": max((r for r in residency if r is not None), default=None),
            "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"cold-reads-{args.name}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    lines = [f"`{data['command']}`", "",
             f"{total / MB:,.0f} MB in {len(checkpoint_files(folder))} files; page cache emptied before every "
             f"measurement (highest residency left: {data['highest_residency_before']}); median of "
             f"{args.rounds} rounds, strategies interleaved; the slowest rank's seconds.", "",
             "| strategy | what it does | " + " | ".join(f"W={w} s (GB/s)" for w in args.world) + " |",
             "|---|---|" + "---:|" * len(args.world)]
    for name in args.strategies:
        cells = [f"{statistics.median(seconds[w, name]):.3f} ({total / statistics.median(seconds[w, name]) / 1e9:.2f})"
                 for w in args.world]
        lines.append(f"| {name} | {STRATEGIES[name][0]} | " + " | ".join(cells) + " |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
