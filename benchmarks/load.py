"""Load benchmark: transformers ``from_pretrained`` under ZeRO-3 vs ``zload.load_into`` vs the I/O floor.

    python -m benchmarks.load --size 300MB 600MB@2 --world 1 2 --runs 3
    torchrun --nproc_per_node 8 -m benchmarks.load --size 16GB --world 1 2 4 8

For each size it writes (once, into a cache directory) a Llama-shaped bf16 checkpoint with
transformers' ``save_pretrained`` (sharded), reads it once so the page cache is warm, and then, for
each world size, method and run, starts a fresh world of W ranks (so peak RSS is that method's):

- ``floor``: each rank ``os.preadv``s exactly its ZeRO-3 byte ranges (the ones zload reads) into a
  preallocated buffer. Only the reads are timed: the I/O floor for a partitioned load.
- ``alloc-floor``: each rank allocates (``torch.empty``) and touches (``fill_``) exactly its ZeRO-3
  partitions, one tensor each, in the models' dtype: the floor for building a partitioned model.
- ``zload``: build the model under ``deepspeed.zero.Init`` (timed as construct), then
  ``zload.load_into`` (timed as load).
- ``zload+init``: build under ``zload.init`` (no weight init, no broadcast), then ``load_into``.
- ``transformers``: ``LlamaForCausalLM.from_pretrained`` with a live ``HfDeepSpeedConfig`` (ZeRO-3):
  construct + load is the whole call, the load step is its ``_load_pretrained_model``.

Run plainly, the script launches each world itself (``python -m torch.distributed.run``). Run under
``torchrun`` (any number of nodes), the torchrun ranks only coordinate: for each measurement every
rank below W starts one fresh worker process, and those workers form the measured world (NCCL and
partitions on the GPUs when CUDA is available, else gloo on CPU).

Each worker reports per rank: seconds (barrier to barrier, so the slowest rank's time), RSS
(sampled every 5 ms by a thread, plus the kernel's high-water mark), bytes read and the bytes
received through collectives (counted by wrapping torch.distributed's collectives). The parent
takes the max over ranks of each run and the median over runs, and writes
``OUT/load-<name>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.abspath(__file__)
METHODS = ("floor", "alloc-floor", "zload", "zload+init", "transformers")
DEFAULT_STAGING = 64 << 20  # zload's default staging_bytes (zload.execute.DEFAULT_STAGING_BYTES)
SLACK = 64_000_000  # the memory target: growth <= staging + 64 MB
MB = 1e6

# ---------------------------------------------------------------------------------------------
# Sizes and the checkpoint

def parse_bytes(text: str) -> int:
    """A size as ``zload.save(max_shard_size=...)`` reads it (``300MB``, ``64MiB``, bytes)."""
    from zload.errors import ZloadError
    from zload.saving import parse_size  # imported here: the launcher itself does not load torch

    try:
        return parse_size(text)
    except ZloadError as e:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 300MB, 1GB, 64MiB)") from e


def parse_size_spec(text: str) -> tuple[str, int, list[int] | None]:
    """``300MB`` -> every --world; ``600MB@2`` or ``600MB@2,4`` -> only those world sizes."""
    size, _, worlds = text.partition("@")
    nbytes = parse_bytes(size)
    ws = [int(w) for w in worlds.split(",")] if worlds else None
    if ws is not None and any(w < 1 for w in ws):
        raise argparse.ArgumentTypeError(f"bad world sizes in {text!r}")
    return size.strip(), nbytes, ws


def llama_config(nbytes: int):
    """A LlamaConfig whose bf16 parameters take about ``nbytes``."""
    from transformers import LlamaConfig

    params = nbytes / 2
    if params < 1e8:
        hidden, inter = 512, 1408
    elif params < 1.5e9:
        hidden, inter = 1024, 2816
    elif params < 8e9:
        hidden, inter = 2048, 5632
    elif params < 4e10:
        hidden, inter = 4096, 11008
    else:
        hidden, inter = 8192, 28672
    vocab = 32000
    if 2 * vocab * hidden > params / 2:  # small checkpoints: keep most of the bytes in the layers
        vocab = max(256, int(params / 4 / hidden) // 64 * 64)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden - hidden) / per_layer))
    heads = max(1, hidden // 128)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def checkpoint_dir(cache: str, config, shard: str) -> str:
    c = config
    return os.path.join(cache, f"llama-bf16-h{c.hidden_size}-i{c.intermediate_size}-l{c.num_hidden_layers}"
                               f"-v{c.vocab_size}-shard{shard}")


def bf16_llama(config):
    """A plain ``LlamaForCausalLM`` built directly in bf16 (no fp32 copy on the way)."""
    import torch
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LlamaForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)


def ensure_checkpoint(folder: str, config, shard: str) -> None:
    """Write the checkpoint unless a complete one is there (safe if several nodes share the cache)."""
    marker = os.path.join(folder, "zload-bench-complete")
    if os.path.exists(marker):
        return
    import torch

    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".tmp-", dir=os.path.dirname(folder))
    started = time.perf_counter()
    torch.manual_seed(0)
    model = bf16_llama(config)
    model.save_pretrained(tmp, max_shard_size=shard)
    del model
    with open(os.path.join(tmp, "zload-bench-complete"), "w") as f:
        f.write("written by benchmarks/load.py\n")
    try:
        os.rename(tmp, folder)
    except OSError:  # another node (shared cache) or a stale partial directory
        if os.path.exists(marker):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(tmp, folder)
    log(f"wrote {folder} in {time.perf_counter() - started:.1f} s")


def checkpoint_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def warm_page_cache(folder: str) -> dict:
    """Read every file once (like ``cat`` to /dev/null); report how much of it is then cached."""
    started = time.perf_counter()
    total = 0
    buf = bytearray(16 << 20)
    for path in checkpoint_files(folder):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    info = {"bytes": total, "seconds": round(time.perf_counter() - started, 3)}
    info["resident_fraction"] = page_cache_residency(folder)
    return info


def page_cache_residency(folder: str) -> float | None:
    """Fraction of the checkpoint's bytes in the page cache (util-linux ``fincore``), if available."""
    if not shutil.which("fincore"):
        return None
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE",
                              *checkpoint_files(folder)], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    res = size = 0
    for line in out.split("\n"):
        parts = line.split()
        if len(parts) == 2:
            res, size = res + int(parts[0]), size + int(parts[1])
    return round(res / size, 4) if size else None


def checkpoint_bytes(folder: str) -> int:
    from zload.index import open_checkpoint

    with open_checkpoint(folder) as index:
        return index.total_bytes


# ---------------------------------------------------------------------------------------------
# Worker side: one rank of a measured world


class CommCounter:
    """Bytes this rank receives through torch.distributed collectives and point-to-point ops.

    Installed before DeepSpeed is imported, so the functions DeepSpeed captures are the counted ones.
    An all-gather counts output - input, a broadcast the tensor on every rank but the source, an
    all-reduce the tensor once (nominal), a reduce-scatter input - output, a recv its tensor.
    """

    def __init__(self):
        self.received = 0
        self.calls = 0

    def install(self):
        import inspect

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        def nbytes(t):
            return t.numel() * t.element_size()

        def broadcast(a):
            group = a.get("group")
            if a.get("group_src") is not None:
                is_src = a["group_src"] == dist.get_rank(group)
            else:
                is_src = a.get("src") == dist.get_rank()
            return 0 if is_src else nbytes(a["tensor"])

        rules = {
            "broadcast": broadcast,
            "all_gather_into_tensor": lambda a: nbytes(a["output_tensor"]) - nbytes(a["input_tensor"]),
            "all_gather": lambda a: sum(nbytes(t) for t in a["tensor_list"]) - nbytes(a["tensor"]),
            "all_reduce": lambda a: nbytes(a["tensor"]),
            "reduce_scatter_tensor": lambda a: nbytes(a["input"]) - nbytes(a["output"]),
            "all_to_all_single": lambda a: nbytes(a["output"]),
            "recv": lambda a: nbytes(a["tensor"]),
            "irecv": lambda a: nbytes(a["tensor"]),
        }
        for name, rule in rules.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            signature = inspect.signature(original)

            def counted(*args, __original=original, __signature=signature, __rule=rule, **kwargs):
                try:
                    bound = __signature.bind(*args, **kwargs)
                    self.received += max(0, __rule(bound.arguments))
                    self.calls += 1
                except Exception:  # noqa: BLE001, S110 - never let counting break a collective
                    pass
                return __original(*args, **kwargs)

            counted.__name__ = original.__name__
            counted.__qualname__ = original.__qualname__
            counted.__doc__ = original.__doc__
            setattr(c10d, name, counted)
            if getattr(dist, name, None) is original:
                setattr(dist, name, counted)

    def snapshot(self) -> tuple[int, int]:
        return self.received, self.calls


class Meter:
    """Timed, memory-sampled segments; begin/end synchronise all ranks (barriers)."""

    def __init__(self, counter: CommCounter, cuda: bool):
        import psutil

        self.process = psutil.Process()
        self.counter = counter
        self.cuda = cuda
        self.open: dict[str, dict] = {}
        self.done: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.samples = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _memory(self) -> tuple[int, int]:
        m = self.process.memory_info()  # /proc/self/statm: rss and its file-backed (shared) part
        return m.rss, m.rss - m.shared

    def _sample(self) -> tuple[int, int]:
        rss, anon = self._memory()
        with self.lock:
            self.samples += 1
            for seg in self.open.values():
                seg["rss_peak"] = max(seg["rss_peak"], rss)
                seg["anon_peak"] = max(seg["anon_peak"], anon)
        return rss, anon

    def _loop(self):
        while not self.stop.wait(0.005):
            self._sample()

    @staticmethod
    def _high_water() -> int:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    @staticmethod
    def _rchar() -> int:
        try:
            with open("/proc/self/io") as f:
                for line in f:
                    if line.startswith("rchar:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def _fold_gpu(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            with self.lock:
                for seg in self.open.values():
                    seg["gpu_peak"] = max(seg["gpu_peak"], peak)

    def begin(self, name: str) -> None:
        import torch
        import torch.distributed as dist

        self._fold_gpu()
        dist.barrier()
        rss, anon = self._sample()
        seg = {"rss_before": rss, "rss_peak": rss, "anon_before": anon, "anon_peak": anon,
               "high_water_before": self._high_water(), "comm_before": self.counter.snapshot(),
               "rchar_before": self._rchar(), "gpu_before": 0, "gpu_peak": 0}
        if self.cuda:
            seg["gpu_before"] = seg["gpu_peak"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        seg["t0"] = time.perf_counter()
        with self.lock:
            self.open[name] = seg

    def end(self, name: str) -> dict:
        import torch.distributed as dist

        self._fold_gpu()
        dist.barrier()
        seconds = time.perf_counter() - self.open[name]["t0"]
        rss_after, anon_after = self._sample()
        with self.lock:
            seg = self.open.pop(name)
        high_water = self._high_water()
        if high_water > seg["high_water_before"]:  # a new lifetime peak, so it was reached in here
            seg["rss_peak"] = max(seg["rss_peak"], high_water)
        received, calls = self.counter.snapshot()
        out = {
            "seconds": seconds,
            "rss_before": seg["rss_before"], "rss_peak": seg["rss_peak"], "rss_after": rss_after,
            "anon_before": seg["anon_before"], "anon_peak": seg["anon_peak"], "anon_after": anon_after,
            "comm_received": received - seg["comm_before"][0], "comm_calls": calls - seg["comm_before"][1],
            "rchar": self._rchar() - seg["rchar_before"],
        }
        if self.cuda:
            out.update(gpu_before=seg["gpu_before"], gpu_peak=seg["gpu_peak"])
        self.done[name] = out
        return out

    def close(self):
        self.stop.set()
        self.thread.join()


def ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3}}


def verify_partitions(model, folder: str) -> dict:
    """Every parameter is a ZeRO-3 parameter whose partition holds the checkpoint's bytes."""
    import torch
    import torch.distributed as dist

    from zload.index import DTYPES, open_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    with open_checkpoint(folder) as index:
        entries = index.tensors
    problems, checked, fds = [], 0, {}
    try:
        for name, p in model.named_parameters():
            if not hasattr(p, "ds_id") or not hasattr(p, "ds_tensor"):
                problems.append(f"{name}: not a ZeRO-3 parameter")
                continue
            e = entries.get(name)
            if e is None:
                problems.append(f"{name}: not in the checkpoint")
                continue
            ps = p.ds_tensor.ds_numel
            lo = rank * ps
            valid = max(0, min(ps, e.numel - lo))
            if e.numel != p.ds_numel or ps != -(-e.numel // world):
                problems.append(f"{name}: unexpected partition geometry")
                continue
            if e.file not in fds:
                fds[e.file] = os.open(e.file, os.O_RDONLY)
            want = os.pread(fds[e.file], valid * e.itemsize, e.start + lo * e.itemsize)
            stored = getattr(torch, DTYPES[e.dtype][0])
            if stored != p.ds_tensor.dtype:  # a cast load: compare with Tensor.to of the file bytes
                raw = torch.frombuffer(bytearray(want), dtype=torch.uint8) if want else \
                    torch.empty(0, dtype=torch.uint8)
                want = raw.view(stored).to(p.ds_tensor.dtype).view(torch.uint8).numpy().tobytes()
            got = p.ds_tensor.detach().reshape(-1)[:valid].cpu().contiguous().view(torch.uint8)
            if bytes(got.numpy().tobytes()) != want:
                problems.append(f"{name}: partition differs from the checkpoint")
            checked += 1
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"checked": checked, "problems": problems[:10], "ok": not problems and checked > 0}


def rank_partitions(folder: str) -> list[tuple]:
    """For each checkpoint tensor (in file order): its index entry, this rank's ZeRO-3 partition
    size ``ceil(numel / W)`` and the first and count of the elements that partition holds."""
    import torch.distributed as dist

    from zload.index import open_checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    with open_checkpoint(folder) as index:
        entries = sorted(index.tensors.values(), key=lambda e: (e.file, e.start))
    out = []
    for e in entries:
        ps = -(-e.numel // world)
        lo = rank * ps
        out.append((e, ps, lo, max(0, min(ps, e.numel - lo))))
    return out


def partition_bytes(folder: str, dtype) -> int:
    """The bytes of this rank's partitions of every checkpoint tensor in ``dtype``."""
    import torch

    return sum(ps for _, ps, _, _ in rank_partitions(folder)) * torch.empty(0, dtype=dtype).element_size()


def _method_alloc_floor(folder: str, meter: Meter, args) -> dict:
    import torch

    dtype = getattr(torch, args.model_dtype)
    sizes = [ps for _, ps, _, _ in rank_partitions(folder)]
    meter.begin("total")
    meter.begin("construct")
    partitions = [torch.empty(ps, dtype=dtype).fill_(0) for ps in sizes]
    meter.end("construct")
    meter.end("total")
    return {"bytes_read": 0, "verified": None, "tensors": len(partitions)}


def _method_floor(folder: str, meter: Meter, args) -> dict:
    import torch

    ranges = [(e.file, e.start + lo * e.itemsize, n * e.itemsize)
              for e, _, lo, n in rank_partitions(folder) if n]
    total = sum(n for _, _, n in ranges)
    buffer = torch.empty(total, dtype=torch.uint8)
    buffer.fill_(0)  # touched now, like the partitions zload writes into (allocated at construction)
    view = memoryview(buffer.numpy()).cast("B")

    meter.begin("total")
    meter.begin("load")
    fds, position, read = {}, 0, 0
    try:
        for file, offset, n in ranges:
            fd = fds.get(file)
            if fd is None:
                fd = fds[file] = os.open(file, os.O_RDONLY)
            part = view[position:position + n]
            while len(part):
                got = os.preadv(fd, [part], offset)
                if got <= 0:
                    raise OSError(f"{file}: unexpected end of file at {offset}")
                part, offset, read = part[got:], offset + got, read + got
            position += n
    finally:
        for fd in fds.values():
            os.close(fd)
    meter.end("load")
    meter.end("total")
    return {"bytes_read": read, "verified": None}


def _method_zload(folder: str, meter: Meter, args, use_init: bool) -> dict:
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zload

    config = LlamaConfig.from_pretrained(folder)
    meter.begin("total")
    meter.begin("construct")
    dtype = getattr(torch, args.model_dtype)
    if use_init:
        context = zload.init(ds_config(), dtype=dtype)
    else:
        context = deepspeed.zero.Init(config_dict_or_path=ds_config(), dtype=dtype)
    with context:
        model = LlamaForCausalLM(config)
    meter.end("construct")
    meter.begin("load")
    report = zload.load_into(model, folder, progress=False, staging_bytes=args.staging_bytes,
                             verify=args.load_verify)
    meter.end("load")
    meter.end("total")
    verified = verify_partitions(model, folder) if args.verify else None
    # Diagnostic, not a headline number: the same load again in this process, where one-time costs
    # (lazy imports, transformers' conversion mapping, thread start-up) are already paid.
    meter.begin("reload")
    zload.load_into(model, folder, progress=False, staging_bytes=args.staging_bytes,
                    verify=args.load_verify)
    meter.end("reload")
    return {"bytes_read": report.bytes_read, "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received, "report_seconds": report.seconds,
            "loaded": len(report.loaded), "verified": verified, "zload_file": zload.__file__}


def _method_transformers(folder: str, meter: Meter, args) -> dict:
    import torch
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.modeling_utils import PreTrainedModel

    keep_alive = HfDeepSpeedConfig(ds_config())  # from_pretrained takes the ZeRO-3 path while it lives
    load_step = PreTrainedModel._load_pretrained_model  # a staticmethod: the load after construction

    def timed_load_step(*a, **k):
        meter.begin("load")
        try:
            return load_step(*a, **k)
        finally:
            meter.end("load")

    PreTrainedModel._load_pretrained_model = staticmethod(timed_load_step)
    try:
        meter.begin("total")
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        meter.end("total")
    finally:
        PreTrainedModel._load_pretrained_model = staticmethod(load_step)
    if "load" not in meter.done:
        raise RuntimeError("transformers never called _load_pretrained_model; cannot time its load step")
    verified = verify_partitions(model, folder) if args.verify else None
    del keep_alive
    # Rank 0 reads (memory-maps) the whole checkpoint; the other ranks read none of it.
    import torch.distributed as dist

    return {"bytes_read": checkpoint_bytes(folder) if dist.get_rank() == 0 else 0,
            "bytes_read_estimated": True, "verified": verified}


def worker_main(args) -> None:
    """One rank of a measured world; writes RESULT_DIR/rank<R>.json, then leaves without teardown."""
    import contextlib
    import io
    import logging
    import traceback
    import warnings

    counter = CommCounter()
    counter.install()  # before DeepSpeed captures torch.distributed's functions
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import deepspeed
    import torch.distributed as dist
    import transformers

    deepspeed.utils.logger.setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    meter = Meter(counter, cuda)
    rc = 0
    try:
        method = args.worker
        if method == "floor":
            result = _method_floor(args.checkpoint, meter, args)
        elif method == "alloc-floor":
            result = _method_alloc_floor(args.checkpoint, meter, args)
        elif method == "zload":
            result = _method_zload(args.checkpoint, meter, args, use_init=False)
        elif method == "zload+init":
            result = _method_zload(args.checkpoint, meter, args, use_init=True)
        elif method == "transformers":
            result = _method_transformers(args.checkpoint, meter, args)
        else:
            raise ValueError(f"unknown method {method}")
        meter.close()
        segments = dict(meter.done)
        if "construct" not in segments and "load" in segments:
            segments["construct"] = {"seconds": segments["total"]["seconds"] - segments["load"]["seconds"]}
        result.update(method=method, rank=rank, world=world, segments=segments, samples=meter.samples,
                      partition_bytes=partition_bytes(args.checkpoint, getattr(torch, args.model_dtype)),
                      device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu",
                      backend=dist.get_backend(), omp_threads=torch.get_num_threads())
        with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - report, then leave with a failing status
        traceback.print_exc()
        rc = 1
    # Leave without tearing down the process group: gloo sometimes aborts at interpreter exit after
    # DeepSpeed (see examples/demo.py), which would fail a measurement that has already finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ---------------------------------------------------------------------------------------------
# Parent side: launching worlds


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _worker_args(method: str, folder: str, result_dir: str, args) -> list[str]:
    cmd = [WORKER, "--worker", method, "--checkpoint", folder, "--result-dir", result_dir,
           "--staging-bytes", str(args.staging_bytes), "--model-dtype", args.model_dtype,
           "--load-verify", args.load_verify]
    return cmd + ([] if args.verify else ["--no-verify"])


def snapshot_zload() -> str:
    """Copy zload's sources to a temporary folder that every worker imports from, so that an edit of
    the working tree (an editable install) during a long run cannot mix two versions."""
    import zload

    root = tempfile.mkdtemp(prefix="zload-bench-src-")
    shutil.copytree(os.path.dirname(os.path.abspath(zload.__file__)), os.path.join(root, "zload"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


_SNAPSHOT: str | None = None


def _worker_env(world: int) -> dict:
    env = dict(os.environ)
    if _SNAPSHOT:
        env["PYTHONPATH"] = _SNAPSHOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not _cuda_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // world)))
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _read_ranks(result_dir: str, world: int) -> list[dict]:
    ranks = []
    for r in range(world):
        with open(os.path.join(result_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def measure_local(method: str, world: int, folder: str, args, log_path: str) -> list[dict]:
    """Launch one world of ``world`` ranks on this machine with torchrun; per-rank results."""
    with tempfile.TemporaryDirectory(prefix="zload-bench-") as result_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               *_worker_args(method, folder, result_dir, args)]
        with open(log_path, "w") as out:
            try:
                rc = subprocess.call(cmd, env=_worker_env(world), stdout=out, stderr=subprocess.STDOUT,
                                     timeout=args.timeout, cwd=REPO)
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0:
            with open(log_path) as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"{method} at world {world} failed ({rc}); log {log_path}:\n{tail}")
        return _read_ranks(result_dir, world)


class TorchrunWorld:
    """Under torchrun: the torchrun ranks coordinate; each measurement is a fresh worker world."""

    def __init__(self):
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(hours=3))
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def barrier(self):
        self.dist.barrier()

    def broadcast(self, value):
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def measure(self, method: str, world: int, folder: str, args, log_path: str) -> list[dict] | None:
        port = self.broadcast(_free_port() if self.rank == 0 else None)
        record = None
        if self.rank < world:
            env = _worker_env(world)
            node_first = self.rank - self.local_rank  # torchrun numbers ranks node by node
            on_this_node = min(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), world - node_first)
            env.update(RANK=str(self.rank), WORLD_SIZE=str(world), MASTER_PORT=str(port),
                       LOCAL_WORLD_SIZE=str(on_this_node),  # zload sizes its reader threads by it
                       TORCHELASTIC_USE_AGENT_STORE="False")  # the worker world hosts its own store
            with tempfile.TemporaryDirectory(prefix="zload-bench-") as result_dir:
                path = f"{log_path}.rank{self.rank}"
                with open(path, "w") as out:
                    try:
                        rc = subprocess.call([sys.executable, *_worker_args(method, folder, result_dir, args)],
                                             env=env, stdout=out, stderr=subprocess.STDOUT,
                                             timeout=args.timeout, cwd=REPO)
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                if rc == 0:
                    with open(os.path.join(result_dir, f"rank{self.rank}.json")) as f:
                        record = json.load(f)
                else:
                    with open(path) as f:
                        record = {"error": f"rank {self.rank} exited {rc}; log {path}:\n{f.read()[-4000:]}"}
        gathered = [None] * self.size
        self.dist.all_gather_object(gathered, record)
        ranks = gathered[:world]
        errors = [r["error"] for r in ranks if r and "error" in r]
        if errors:
            raise RuntimeError(f"{method} at world {world} failed:\n" + "\n".join(errors))
        return ranks


# ---------------------------------------------------------------------------------------------
# Aggregation and output


def _max(ranks, segment, key, default=None):
    values = [r["segments"][segment][key] for r in ranks if key in r["segments"].get(segment, {})]
    return max(values) if values else default


def _growth(ranks, segment, key="rss") -> float | None:
    """The largest rise over ranks of ``key`` (rss, anon) within ``segment``, if measured."""
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
        "load_anon_growth": _growth(ranks, "load", "anon"),
        "construct_rss_growth": _growth(ranks, "construct"),
        "total_rss_growth": _growth(ranks, "total"),
        "partition_bytes": max(r.get("partition_bytes", 0) for r in ranks),
        "peak_anon": _max(ranks, "total", "anon_peak"),
        "bytes_read": max(r.get("bytes_read", 0) for r in ranks),
        "bytes_read_by_rank": [r.get("bytes_read", 0) for r in ranks],
        "collective_received_load": _max(ranks, "load", "comm_received"),
        "collective_received_total": _max(ranks, "total", "comm_received"),
        "zload_sent_received": max((r.get("bytes_sent", 0) + r.get("bytes_received", 0) for r in ranks),
                                   default=0),
        "rchar_load": _max(ranks, "load", "rchar"),
        "reload_s": _max(ranks, "reload", "seconds"),
        "zload_file": ranks[0].get("zload_file"),
        "samples": min(r.get("samples", 0) for r in ranks),
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


_MEDIAN_KEYS = ("load_s", "construct_s", "total_s", "peak_rss", "load_rss_growth", "load_anon_growth",
                "construct_rss_growth", "total_rss_growth", "partition_bytes", "peak_anon", "bytes_read",
                "collective_received_load", "collective_received_total", "zload_sent_received",
                "rchar_load", "reload_s", "gpu_peak", "load_gpu_growth", "construct_gpu_growth")


def summarize(entry: dict) -> None:
    runs = entry["runs"]
    med = {}
    for key in _MEDIAN_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            med[key] = statistics.median(values)
    for key in ("load_rss_growth", "construct_rss_growth", "total_rss_growth"):  # worst run, for targets
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            med[f"max_{key}"] = max(values)
    if "load_s" in med:
        med["load_gb_s"] = entry["checkpoint_bytes"] / med["load_s"] / 1e9
        med["load_s_min"] = min(r["load_s"] for r in runs)
        med["load_s_max"] = max(r["load_s"] for r in runs)
    entry["median"] = med
    entry["verified"] = (None if any(r["verified"] is None for r in runs)
                         else all(r["verified"] for r in runs))


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
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "zload"], cwd=REPO,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        info["zload_commit"] = head + ("+uncommitted zload/ changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _mb(value) -> str:
    if value is None:
        return "–"
    return f"{value / MB:,.1f}" if abs(value) < 100 * MB else f"{value / MB:,.0f}"


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
    return f"{_mb(value)} MB"


def _s(value) -> str:
    return "–" if value is None else f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def _residency(data: dict) -> str:
    """How warm the page cache was: the lowest residency seen before any measurement of a size."""
    before_each = {}
    for e in data["results"]:
        for run in e["runs"]:
            if run.get("page_cache_resident") is not None:
                size = e["size"]
                before_each[size] = min(before_each.get(size, 1.0), run["page_cache_resident"])
    if before_each:
        return "every file re-read before each measurement; lowest residency then: " + ", ".join(
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
        f"page cache warm ({_residency(data)}). Median of the runs shown; each run is a fresh world; every number is the max over ranks.",
        "",
        ("| checkpoint | W | method | construct s | load s | construct + load s | load GB/s "
         "| peak RSS / rank MB | RSS growth in construct MB | RSS growth in load MB | "
         + ("peak GPU / rank MB | GPU growth in construct MB | " if gpu else "")
         + "read / rank MB | collectives / rank (load; construct + load) | runs |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else "") + "---:|---:|---:|",
    ]
    for e in data["results"]:
        m = e["median"]
        read = _mb(m.get("bytes_read")) + (" (rank 0 only)" if e["method"] == "transformers" else "")
        floor = e["method"] in ("floor", "alloc-floor")
        if floor:
            coll = "0"
        else:
            coll = f"{_bytes(m.get('collective_received_load'))}; {_bytes(m.get('collective_received_total'))}"
        construct_load = "–" if floor else _s(m.get("total_s"))
        gb_s = f"{m['load_gb_s']:.2f}" if "load_gb_s" in m else "–"
        lines.append(
            f"| {e['size']} ({e['checkpoint_bytes'] / MB:,.0f} MB) | {e['world']} | {e['method']} "
            f"| {_s(m.get('construct_s') if e['method'] != 'floor' else None)} | {_s(m.get('load_s'))} "
            f"| {construct_load} | {gb_s} | {_mb(m.get('peak_rss'))} | {_mb(m.get('construct_rss_growth'))} "
            f"| {_mb(m.get('load_rss_growth'))} | "
            + (f"{_mb(m.get('gpu_peak'))} | {_mb(m.get('construct_gpu_growth'))} | " if gpu else "")
            + f"{read} | {coll} | {len(e['runs'])} |")
    lines += ["", ("Columns: *construct s* is building the model (zero.Init or zload.init; for "
              "transformers the whole `from_pretrained` but its load step) or the allocation floor's "
              "allocate-and-touch; *load s* is zload's `load_into`, transformers' load step "
              "(`_load_pretrained_model`, inside `from_pretrained`), or the floor's reads; "
              "*construct + load s* is zero.Init / zload.init construction plus `load_into`, or the whole "
              "`from_pretrained`; *GB/s* is checkpoint bytes / load s. *Peak RSS* covers construct + load; "
              "*growth* is the peak during construction or the load minus the RSS when it began (for "
              "transformers' load it "
              "includes the checkpoint pages rank 0 memory-maps). *collectives* counts bytes each rank "
              "receives through torch.distributed collectives (wrapped and counted, not estimated), during "
              "the load and during construct + load; for zload that is its small agreement exchanges "
              "(its `bytes_sent + bytes_received`, for ranks lacking a file, is 0 on one machine)."),
              ""]
    if data.get("notes"):
        lines += [f"- {note}" for note in data["notes"]] + [""]
    lines += ["Targets (world size 2):", ""] + [f"- {t}" for t in data.get("targets", [])]
    return "\n".join(lines).rstrip() + "\n"


def evaluate_targets(data: dict) -> list[str]:
    out = []
    limit = data["staging_bytes"] + SLACK
    by_key = {(e["size"], e["world"], e["method"]): e for e in data["results"]}
    for size in [s["size"] for s in data["checkpoints"]]:
        z = by_key.get((size, 2, "zload"))
        if not z:
            continue
        zi = by_key.get((size, 2, "zload+init"))
        t = by_key.get((size, 2, "transformers"))
        f = by_key.get((size, 2, "floor"))
        zl = z["median"]["load_s"]
        if t:
            ratio = t["median"]["load_s"] / zl
            ratio_total = t["median"]["total_s"] / z["median"]["total_s"]
            extra = ""
            if zi:
                extra = (f"; from_pretrained {_s(t['median']['total_s'])} s vs zload.init + load_into "
                         f"{_s(zi['median']['total_s'])} s = "
                         f"{t['median']['total_s'] / zi['median']['total_s']:.1f}x")
            out.append(f"{size}: zload load >= 5x faster than transformers' load step: "
                       f"{'MET' if ratio >= 5 else 'NOT MET'} ({_s(t['median']['load_s'])} s vs {_s(zl)} s = "
                       f"{ratio:.1f}x; construct + load: from_pretrained vs zero.Init + load_into "
                       f"{ratio_total:.1f}x{extra})")
        if f:
            ratio = zl / f["median"]["load_s"]
            again = z["median"].get("reload_s")
            again = (f"; diagnostic: a second load_into in the same process {_s(again)} s = "
                     f"{again / f['median']['load_s']:.2f}x the floor") if again else ""
            out.append(f"{size}: zload load within 1.3x of the I/O floor: "
                       f"{'MET' if ratio <= 1.3 else 'NOT MET'} ({_s(zl)} s vs {_s(f['median']['load_s'])} s"
                       f" = {ratio:.2f}x{again})")
        a = by_key.get((size, 2, "alloc-floor"))
        if zi and a:
            out += _construction_targets(size, zi["median"], a["median"], f and f["median"], t and t["median"])
        worst = z["median"]["max_load_rss_growth"]
        out.append(f"{size}: zload RSS growth during the load <= staging "
                   f"({data['staging_bytes'] / 2**20:.0f} MiB) + 64 MB = {limit / MB:.0f} MB: "
                   f"{'MET' if worst <= limit else 'NOT MET'} (worst rank of the worst run {worst / MB:.1f} MB)")
        if zi:  # zload.init's partitions are first touched by the load's writes: count them once
            worst, parts = zi["median"]["max_total_rss_growth"], zi["median"]["partition_bytes"]
            out.append(f"{size}: zload+init RSS growth over construct + load <= this rank's partitions "
                       f"({parts / MB:,.0f} MB) + staging + 64 MB = {(parts + limit) / MB:,.0f} MB: "
                       f"{'MET' if worst <= parts + limit else 'NOT MET'} (worst rank of the worst run "
                       f"{worst / MB:,.1f} MB)")
    return out


def _construction_targets(size, init, alloc, floor, transformers) -> list[str]:
    """zload.init's targets: construction near the allocation floor, construct + load near both
    floors, far ahead of from_pretrained, and no more memory than this rank's partitions."""
    def verdict(ok):
        return "MET" if ok else "NOT MET"

    out = []
    ratio = init["construct_s"] / alloc["construct_s"]
    out.append(f"{size}: zload.init construction <= 1.5x the allocation floor: {verdict(ratio <= 1.5)} "
               f"({_s(init['construct_s'])} s vs {_s(alloc['construct_s'])} s = {ratio:.2f}x)")
    if floor:
        both = floor["load_s"] + alloc["construct_s"]
        ratio = init["total_s"] / both
        out.append(f"{size}: zload.init + load_into <= 2.5x (I/O floor + allocation floor): "
                   f"{verdict(ratio <= 2.5)} ({_s(init['total_s'])} s vs {_s(both)} s = {ratio:.2f}x)")
    if transformers:
        ratio = transformers["total_s"] / init["total_s"]
        out.append(f"{size}: zload.init + load_into >= 8x faster than from_pretrained under ZeRO-3: "
                   f"{verdict(ratio >= 8)} ({_s(transformers['total_s'])} s vs {_s(init['total_s'])} s = "
                   f"{ratio:.1f}x)")
    worst, limit = init["max_construct_rss_growth"], init["partition_bytes"] + SLACK
    out.append(f"{size}: zload.init RSS growth during construction <= this rank's partitions "
               f"({init['partition_bytes'] / MB:,.0f} MB) + 64 MB: {verdict(worst <= limit)} (worst rank of "
               f"the worst run {worst / MB:,.1f} MB)")
    return out


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [s["size"] for s in data["checkpoints"]]
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 3.8 * len(sizes)), squeeze=False)
    colors = {"floor": "tab:gray", "alloc-floor": "tab:olive", "zload": "tab:blue", "zload+init": "tab:green",
              "transformers": "tab:red"}
    for row, size in zip(axes, sizes):
        entries = [e for e in data["results"] if e["size"] == size]
        for method in METHODS:
            es = sorted((e for e in entries if e["method"] == method), key=lambda e: e["world"])
            if not es:
                continue
            ws = [e["world"] for e in es]
            if method == "alloc-floor":
                row[0].plot(ws, [e["median"]["construct_s"] for e in es], "^-", color=colors[method],
                            label=f"{method}: construct")
            else:
                row[0].plot(ws, [e["median"]["load_s"] for e in es], "o-", color=colors[method],
                            label=f"{method}: load" + (" step" if method == "transformers" else ""))
            if method not in ("floor", "alloc-floor"):
                row[0].plot(ws, [e["median"]["total_s"] for e in es], "s--", color=colors[method],
                            alpha=0.6, label=f"{method}: construct + load")
            row[1].plot(ws, [e["median"]["peak_rss"] / MB for e in es], "o-", color=colors[method],
                        label=f"{method}: peak")
            if method != "alloc-floor":
                row[1].plot(ws, [e["median"]["load_rss_growth"] / MB for e in es], "v:", color=colors[method],
                            alpha=0.7, label=f"{method}: growth in load")
        nbytes = entries[0]["checkpoint_bytes"] if entries else 0
        row[0].set_title(f"{size} bf16 checkpoint ({nbytes / MB:,.0f} MB): seconds")
        row[0].set_yscale("log")
        row[0].set_ylabel("seconds (median, slowest rank)")
        row[1].set_title(f"{size}: RSS per rank (max over ranks)")
        row[1].set_ylabel("MB")
        for ax in row:
            ax.set_xlabel("world size")
            ax.set_xticks(sorted({e["world"] for e in entries}))
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    host = data["host"]
    fig.suptitle(f"zload load benchmark: {host['cpu']}, {host['cpu_cores_usable']} cores"
                 + (f", {host.get('gpu_count')}x {host['gpu']}" if host.get("gpu") else "")
                 + f", {data['backend']}, warm page cache", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(data: dict, stem: str) -> str:
    """STEM.md (the command, then the table) and STEM.png from a results dict; returns what it
    wrote. Without matplotlib (a GPU machine's image may lack it) there is no plot, rather than a
    failure after the measurements: ``--render STEM.json`` draws it elsewhere."""
    with open(stem + ".md", "w") as f:
        f.write(f"`{data['command']}`\n\n" + markdown(data))
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


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", "--sizes", nargs="+", type=parse_size_spec, default=None, dest="sizes",
                   metavar="SIZE[@W,...]",
                   help="checkpoint sizes (bf16 bytes), e.g. 300MB 1GB; SIZE@2,4 runs that size only at "
                        "those world sizes (default 300MB)")
    p.add_argument("--world", nargs="+", type=int, default=None,
                   help="world sizes (default: 1 2 plainly; the torchrun world size under torchrun)")
    p.add_argument("--runs", type=int, default=3, help="runs per method, world and size (default 3)")
    p.add_argument("--transformers-runs", type=int, default=None,
                   help="runs for the (slow) transformers method (default: --runs)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                   help="default: all (zload+init only if zload.init exists)")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="output folder")
    p.add_argument("--name", default=None, help="output stem load-NAME (default: cpu, or the GPU name)")
    p.add_argument("--cache", default=os.environ.get("ZLOAD_BENCH_CACHE",
                                                     os.path.expanduser("~/.cache/zload-bench")),
                   help="where checkpoints are written and reused ($ZLOAD_BENCH_CACHE)")
    p.add_argument("--shard-size", default="100MB", help="save_pretrained max_shard_size (default 100MB)")
    p.add_argument("--staging-bytes", type=parse_bytes, default=DEFAULT_STAGING,
                   help="zload staging_bytes (default 64MiB, zload's default)")
    p.add_argument("--model-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the zload models' partitions (default bfloat16, as the checkpoint: read "
                        "straight into them; another dtype goes through staging and the cast kernel)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per launched world")
    p.add_argument("--load-verify", default="sample", choices=("sample", "full"),
                   help="load_into's verify= for the zload methods (default sample, as load_into's)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking every partition against the checkpoint after each load")
    p.add_argument("--render", metavar="JSON",
                   help="only rewrite the .md and .png next to an existing results JSON")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runs < 1 or (args.transformers_runs is not None and args.transformers_runs < 1):
        p.error("--runs must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)  # does not return
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        write_outputs(data, os.path.splitext(args.render)[0])
        return 0
    import zload

    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)
    coord = TorchrunWorld() if under_torchrun else None
    lead = coord is None or coord.rank == 0
    worlds = args.world or ([coord.size] if coord else [1, 2])
    if coord and max(worlds) > coord.size:
        raise SystemExit(f"--world {max(worlds)} is larger than the torchrun world ({coord.size})")
    methods = list(args.methods or METHODS)
    notes = []
    if "zload+init" in methods and not hasattr(zload, "init"):
        methods.remove("zload+init")
        notes.append("zload+init not measured: this zload has no zload.init")
    sizes = args.sizes or [parse_size_spec("300MB")]
    runs_for = {m: args.runs for m in methods}
    if "transformers" in methods and args.transformers_runs is not None:
        runs_for["transformers"] = args.transformers_runs
        if args.transformers_runs != args.runs:
            notes.append(f"transformers: {args.transformers_runs} runs per point (the others {args.runs}), "
                         "to fit the time budget")
    cuda = _cuda_available()
    out_dir = os.path.abspath(args.out)
    logs = os.path.join(tempfile.gettempdir(), f"zload-bench-logs-{os.getpid() if lead else 'x'}")
    os.makedirs(logs, exist_ok=True)
    if lead:
        os.makedirs(out_dir, exist_ok=True)

    started = time.perf_counter()
    global _SNAPSHOT
    _SNAPSHOT = snapshot_zload()
    source_hash = zload_source_hash(os.path.join(_SNAPSHOT, "zload"))
    host = host_info()  # now: the commit the snapshot was taken from
    checkpoints = []
    plan = []  # (size label, folder, nbytes, world)
    for label, nbytes, only in sizes:
        config = llama_config(nbytes)
        folder = checkpoint_dir(args.cache, config, args.shard_size)
        if coord is None or coord.local_rank == 0:
            ensure_checkpoint(folder, config, args.shard_size)
            cache = warm_page_cache(folder)
        if coord:
            coord.barrier()
            cache = coord.broadcast(cache if coord.rank == 0 else None)
        total = checkpoint_bytes(folder)
        files = checkpoint_files(folder)
        checkpoints.append({"size": label, "folder": folder, "checkpoint_bytes": total, "files": len(files),
                            "config": {k: getattr(config, k) for k in (
                                "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                "num_attention_heads", "num_key_value_heads")},
                            "page_cache": cache})
        if lead:
            log(f"{label}: {total / MB:,.0f} MB bf16 in {len(files)} files ({folder}); page cache warmed "
                f"({cache['bytes'] / MB:,.0f} MB read in {cache['seconds']:.1f} s, resident "
                f"{cache['resident_fraction'] if cache['resident_fraction'] is not None else '?'})")
        for w in (only or worlds):
            if coord and w > coord.size:
                raise SystemExit(f"world {w} for {label} is larger than the torchrun world ({coord.size})")
            plan.append((label, folder, total, w))

    results = []
    for label, folder, total, w in plan:
        entries = {m: {"size": label, "checkpoint_bytes": total, "world": w, "method": m, "runs": []}
                   for m in methods}
        for run in range(max(runs_for.values())):
            for method in methods:  # interleaved, so drift affects every method alike
                if run >= runs_for[method]:
                    continue
                log_path = os.path.join(logs, f"{label}-w{w}-{method}-run{run}.log")
                # Re-read the files before every measurement: the methods' own memory (transformers'
                # rank 0 holds the whole model) can evict checkpoint pages between runs.
                resident = warm_page_cache(folder)["resident_fraction"] \
                    if coord is None or coord.local_rank == 0 else None
                if coord:
                    coord.barrier()
                ranks = (coord.measure(method, w, folder, args, log_path) if coord
                         else measure_local(method, w, folder, args, log_path))
                if not lead:
                    continue
                summary = summarize_run(ranks)
                summary["page_cache_resident"] = resident
                entries[method]["runs"].append(summary)
                if summary["verified"] is False:
                    raise RuntimeError(f"{method} at world {w}: partitions differ from the checkpoint: "
                                       f"{summary.get('verify_problems')}")
                log(f"{label} W={w} {method:<12} run {run + 1}: construct {_s(summary['construct_s'])} s, "
                    f"load {_s(summary['load_s'])} s, "
                    f"construct+load {summary['total_s']:.3f} s, peak RSS {summary['peak_rss'] / MB:,.0f} MB, "
                    f"growth in construct {_mb(summary['construct_rss_growth'])} MB, "
                    f"growth in load {_mb(summary['load_rss_growth'])} MB, "
                    f"read/rank {summary['bytes_read'] / MB:,.0f} MB, "
                    f"collectives/rank {summary['collective_received_total'] / MB:,.1f} MB"
                    + (", verified" if summary["verified"] else ""))
        for method in methods:
            if lead and entries[method]["runs"]:
                summarize(entries[method])
                results.append(entries[method])

    if not lead:
        coord.barrier()
        return 0
    order = {m: i for i, m in enumerate(METHODS)}
    results.sort(key=lambda e: ([c["size"] for c in checkpoints].index(e["size"]), e["world"], order[e["method"]]))
    cmd = " ".join(["python -m benchmarks.load", *sys.argv[1:]])
    if coord:
        cmd = f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', '?')} -m benchmarks.load " + \
              " ".join(sys.argv[1:])
    shutil.rmtree(_SNAPSHOT, ignore_errors=True)
    data = {
        "command": cmd,
        "zload_source_sha256": source_hash,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host,
        "backend": "nccl, partitions on the GPUs" if cuda else "gloo, partitions in CPU memory",
        "launch": "torchrun ranks start one worker each per measurement" if coord
                  else "python -m torch.distributed.run per measurement",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "cores // W (set per launch)"),
        "staging_bytes": args.staging_bytes,
        "load_verify": args.load_verify,
        "checkpoints": checkpoints,
        "results": results,
        "seconds": round(time.perf_counter() - started, 1),
        "notes": notes,
    }
    data["targets"] = evaluate_targets(data)
    name = args.name or default_name()
    stem = os.path.join(out_dir, f"load-{name}")
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    written = write_outputs(data, stem)
    log(f"wrote {stem}.json, {written} in {data['seconds']:.0f} s")
    print()
    print(markdown(data))
    if coord:
        coord.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
