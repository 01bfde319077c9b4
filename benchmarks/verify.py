"""What zload's data checks cost: the sample every rank of a multi-rank load takes of every file,
the full digest of ``verify="full"`` and ``zload validate --full``, and the digest ``zload.save``
records in each file.

    python -m benchmarks.verify --size 300MB 1.2GB --runs 5

For each size it reuses (or writes) the Llama-shaped bf16 checkpoint of ``benchmarks.load`` and
measures, in one process (what one rank does):

- ``sample warm`` / ``sample cold``: ``digest.sample_digests`` of every file (64 windows of 512
  bytes each), the page cache warm, then emptied for the checkpoint's files (``posix_fadvise
  DONTNEED``) before each run, with the residency checked just before the timed region;
- ``full digest``: every byte hashed (16 MiB blocks, the reader threads a rank may use), warm;
- ``save``: ``zload.save`` of a plain (not ZeRO) model of that size into a fresh folder, and the
  part of it spent reading the files back for their digests.

Writes ``OUT/verify-<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks.load import HERE
from benchmarks.load.checkpoint import (
    bf16_llama,
    checkpoint_dir,
    checkpoint_files,
    ensure_checkpoint,
    evict_page_cache,
    llama_config,
    parse_size_spec,
    warm_page_cache,
)
from benchmarks.load.report import save_results


def _sample_all(files: list[str]) -> float:
    from zload.checkpoint.files import FileTable, open_regular
    from zload.checkpoint.digest import sample_digests
    from zload.checkpoint.index import parse_header

    with FileTable() as table:
        opened = [table.add(open_regular(f), f) for f in files]
        for path, f in zip(files, opened):
            parse_header(f, path)
        started = time.perf_counter()
        sample_digests([(f.fd, f.data_start, f.identity.size) for f in opened])
        return time.perf_counter() - started


def _full_digest(files: list[str]) -> float:
    from zload.checkpoint.digest import block_count, block_digests
    from zload.distributed import reader_count

    started = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            block_digests(fd, 0, size, range(block_count(0, size)), reader_count())
        finally:
            os.close(fd)
    return time.perf_counter() - started


def _save(folder: str, config) -> tuple[float, float]:
    """(seconds of zload.save, of which reading the files back for their digests)."""
    import zload

    import zload.saving.writer as writer_module
    real, spent = writer_module.record_digests, []

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    model = bf16_llama(config)
    writer_module.record_digests = timed
    try:
        with tempfile.TemporaryDirectory(prefix="zload-verify-save-") as out:
            started = time.perf_counter()
            zload.save(model, out, max_shard_size="100MB")
            return time.perf_counter() - started, sum(spent)
    finally:
        writer_module.record_digests = real


def measure(size_name: str, nbytes: int, args) -> dict:
    config = llama_config(nbytes)
    folder = checkpoint_dir(args.cache, config, "100MB")
    ensure_checkpoint(folder, config, "100MB")
    files = checkpoint_files(folder)
    total = sum(os.path.getsize(f) for f in files)
    warm_page_cache(folder)
    warm = [_sample_all(files) for _ in range(args.runs)]
    cold, residency = [], []
    for _ in range(args.runs):
        residency.append(evict_page_cache(folder)["resident_fraction"])
        cold.append(_sample_all(files))
    warm_page_cache(folder)
    full = [_full_digest(files) for _ in range(args.runs)]
    saves = [_save(folder, config) for _ in range(args.save_runs)]
    return {"size": size_name, "bytes": total, "files": len(files),
            "sample_warm_s": statistics.median(warm), "sample_cold_s": statistics.median(cold),
            "cold_residency_before": residency, "full_digest_s": statistics.median(full),
            "full_digest_gb_s": total / statistics.median(full) / 1e9,
            "save_s": statistics.median(s for s, _ in saves),
            "save_digest_s": statistics.median(d for _, d in saves), "runs": args.runs}


def markdown(data: dict) -> str:
    lines = [f"zload data checks, {data['host']['cpu']} ({data['host']['cpu_cores_usable']} CPUs usable), "
             f"{data['date']}, "
             f"zload source {data['zload_source']}", "",
             "| checkpoint | files | sample, warm ms | sample, cold ms | full digest s (GB/s) "
             "| save s | of which digest s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["results"]:
        lines.append(f"| {r['size']} ({r['bytes'] / 1e6:,.0f} MB) | {r['files']} | "
                     f"{r['sample_warm_s'] * 1e3:.2f} | {r['sample_cold_s'] * 1e3:.1f} | "
                     f"{r['full_digest_s']:.2f} ({r['full_digest_gb_s']:.2f}) | {r['save_s']:.2f} | "
                     f"{r['save_digest_s']:.2f} |")
    lines += ["", f"Command: `{data['command']}`; medians of {data['results'][0]['runs']} runs "
              "(save: of --save-runs). One process, i.e. one rank's share: every rank of a multi-rank "
              "load samples every file it sees; a node's ranks split the full digest."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", nargs="+", type=parse_size_spec, default=[parse_size_spec("300MB")])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--save-runs", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--name", default="cpu")
    p.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE",
                                                     os.path.expanduser("~/.cache/zload-bench")))
    args = p.parse_args(argv)
    results = []
    for name, nbytes, _ in args.size:
        results.append(measure(name, nbytes, args))
        print(json.dumps(results[-1]), flush=True)
    save_results(args.out, f"verify-{args.name}", "python -m benchmarks.verify " + " ".join(
        argv if argv is not None else sys.argv[1:]), results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
