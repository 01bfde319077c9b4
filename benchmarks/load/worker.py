"""One rank of a measured world: counting collectives, metering time and memory, running a method
and writing its result.
"""

from __future__ import annotations

import json
import os
import threading
import time

from benchmarks.load import exit_without_teardown
from benchmarks.load.checkpoint import evict_page_cache, page_cache_residency
from benchmarks.load.methods import RUNNERS, partition_bytes


POINT_TO_POINT = ("recv", "irecv")


class CommCounter:
    """Bytes this rank receives through torch.distributed collectives and point-to-point ops, and
    when it entered and left each (``time.monotonic``, one clock for every process of a machine,
    so the report can tell a collective's own time from a rank's wait for the others).

    Installed before DeepSpeed is imported, so the functions DeepSpeed captures are the counted ones.
    An all-gather counts output - input, a broadcast the tensor on every rank but the source, an
    all-reduce the tensor once (nominal), a reduce-scatter input - output, a recv its tensor, a
    gather its list less the destination's own tensor (on the destination), a scatter the tensor on
    every rank but the source (DCP exchanges its plans by gather and scatter).
    """

    def __init__(self):
        self.received = 0
        self.calls = 0
        self.spans: list[tuple[str, float, float]] = []  # (op, entered, left) of each outermost collective
        self.depth = threading.local()  # an op that calls another (recv calls irecv) counts once

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
            "gather": lambda a: sum(nbytes(t) for t in a.get("gather_list") or []) - (
                nbytes(a["tensor"]) if a.get("gather_list") else 0),
            "scatter": lambda a: 0 if a.get("scatter_list") else nbytes(a["tensor"]),
            "recv": lambda a: nbytes(a["tensor"]),
            "irecv": lambda a: nbytes(a["tensor"]),
        }
        for name, rule in rules.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            signature = inspect.signature(original)

            def counted(*args, __original=original, __signature=signature, __rule=rule, __name=name, **kwargs):
                outermost = not getattr(self.depth, "value", 0)
                if outermost:
                    try:
                        bound = __signature.bind(*args, **kwargs)
                        self.received += max(0, __rule(bound.arguments))
                        self.calls += 1
                    except Exception:  # noqa: BLE001, S110 - never let counting break a collective
                        pass
                self.depth.value = getattr(self.depth, "value", 0) + 1
                entered = time.monotonic()
                try:
                    return __original(*args, **kwargs)
                finally:
                    self.depth.value -= 1
                    if outermost and __name not in POINT_TO_POINT:  # a recv is not every rank's op
                        self.spans.append((__name, entered, time.monotonic()))

            counted.__name__ = original.__name__
            counted.__qualname__ = original.__qualname__
            counted.__doc__ = original.__doc__
            setattr(c10d, name, counted)
            if getattr(dist, name, None) is original:
                setattr(dist, name, counted)

    def snapshot(self) -> tuple[int, int, int]:
        """Bytes received, ops and spans so far."""
        return self.received, self.calls, len(self.spans)


class Meter:
    """Timed segments and their peak RSS; begin/end synchronise all ranks (barriers).

    Peaks come from the kernel's high-water mark (``VmHWM``), read at every segment boundary and
    reset there (``clear_refs`` 5), so each peak goes to the segments open when it happened, missing
    only pages the kernel reclaims in between. No thread samples memory: one that did, every 5 ms,
    took turns with a rank's work on its one core and changed the times it was there to measure
    (benchmarks/README.md, construct + load). Where ``clear_refs`` cannot be written (gVisor, a
    kernel without ``CONFIG_PROC_PAGE_MONITOR``) the mark is the process's lifetime peak, counted
    for a segment only if it rose during it (``peaks``)."""

    def __init__(self, counter: CommCounter, cuda: bool):
        self.counter = counter
        self.cuda = cuda
        self.open: dict[str, dict] = {}
        self.done: dict[str, dict] = {}
        self.before_load = None  # where set, called as the "load" segment begins, before its barrier
        self.reset_refused = None  # why clear_refs could not be written, once it could not
        self._boundary()  # peaks count from here

    @property
    def peaks(self) -> str:
        """How the peaks were measured, for the result."""
        if self.reset_refused is None:
            return "high-water mark reset at each boundary"
        return f"lifetime high-water mark (clear_refs: {self.reset_refused})"

    def _boundary(self) -> tuple[int, int]:
        """(the RSS now, the high-water mark a segment begun now starts from). The mark goes to
        every open segment it rose above, then is reset to the RSS now where the kernel lets us."""
        status = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    status[key] = int(value.split()[0]) * 1024  # kB
        rss, high_water = status["VmRSS"], status.get("VmHWM", status["VmRSS"])
        for seg in self.open.values():
            if high_water > seg["high_water_before"]:
                seg["rss_peak"] = max(seg["rss_peak"], high_water)
        if self.reset_refused is None:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                return rss, rss
            except OSError as e:
                self.reset_refused = str(e.strerror or e)
        return rss, high_water

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
            for seg in self.open.values():
                seg["gpu_peak"] = max(seg["gpu_peak"], peak)

    def begin(self, name: str) -> None:
        import torch
        import torch.distributed as dist

        self._fold_gpu()
        if name == "load" and self.before_load:
            self.before_load()
        dist.barrier()
        rss, high_water = self._boundary()
        seg = {"rss_before": rss, "rss_peak": rss, "high_water_before": high_water, "comm_before": self.counter.snapshot(),
               "rchar_before": self._rchar(), "cpu_before": os.times(), "gpu_before": 0, "gpu_peak": 0}
        if self.cuda:
            seg["gpu_before"] = seg["gpu_peak"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        seg["t0"] = time.perf_counter()
        self.open[name] = seg

    def end(self, name: str) -> dict:
        import torch.distributed as dist

        self._fold_gpu()
        dist.barrier()
        seconds = time.perf_counter() - self.open[name]["t0"]
        rss_after, _ = self._boundary()
        seg = self.open.pop(name)
        received, calls, spans = self.counter.snapshot()
        cpu_after = os.times()
        out = {
            "seconds": seconds,
            "rss_before": seg["rss_before"], "rss_peak": seg["rss_peak"], "rss_after": rss_after,
            "comm_received": received - seg["comm_before"][0], "comm_calls": calls - seg["comm_before"][1],
            "comm_spans": self.counter.spans[seg["comm_before"][2]:spans],
            "rchar": self._rchar() - seg["rchar_before"],
            # the process's CPU seconds, all threads: where a copy is slow, user or kernel side
            "cpu_user": cpu_after.user - seg["cpu_before"].user,
            "cpu_system": cpu_after.system - seg["cpu_before"].system,
        }
        if self.cuda:
            out.update(gpu_before=seg["gpu_before"], gpu_peak=seg["gpu_peak"])
        self.done[name] = out
        return out


def join_world() -> bool:
    """Join the measured world as torchrun set it up, DeepSpeed and transformers quiet: NCCL and
    this rank's GPU where CUDA is (the partitions go there), else gloo. Returns whether CUDA is used."""
    import contextlib
    import io
    import logging
    import warnings

    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import deepspeed
    import transformers

    deepspeed.utils.logger.setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stdout(io.StringIO()):
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    return cuda


def worker_main(args) -> None:
    """One rank of a measured world; writes RESULT_DIR/rank<R>.json, then leaves without teardown."""
    import traceback

    counter = CommCounter()
    counter.install()  # before DeepSpeed captures torch.distributed's functions
    import torch
    import torch.distributed as dist

    cuda = join_world()
    rank, world = dist.get_rank(), dist.get_world_size()
    rc = 0
    try:
        meter = Meter(counter, cuda)
        method = args.worker
        # how much of the checkpoint the page cache holds as the method starts (this VM evicts idle
        # pages within a minute, so a warm run is checked as much as a cold one)
        node_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
        resident = {"fraction": page_cache_residency(args.checkpoint) if node_first else None}
        if args.cold and node_first:
            # Cold, empty the cache again as the timed load begins, so that every method reads the
            # same time after it: on this project's VM a load that reads seconds after the cache
            # was emptied copied out of it several times slower (benchmarks/README.md, cold).
            meter.before_load = lambda: resident.update(fraction=evict_page_cache(args.checkpoint)["resident_fraction"])
        result = RUNNERS[method](args.checkpoint, meter, args)
        result["page_cache_resident"] = resident["fraction"]
        segments = dict(meter.done)
        if "construct" not in segments and "load" in segments:
            segments["construct"] = {"seconds": segments["total"]["seconds"] - segments["load"]["seconds"]}
        result.update(method=method, rank=rank, world=world, segments=segments, peaks=meter.peaks,
                      partition_bytes=partition_bytes(args.checkpoint, getattr(torch, args.model_dtype)),
                      device=f"cuda:{torch.cuda.current_device()}" if cuda else "cpu",
                      backend=dist.get_backend(), omp_threads=torch.get_num_threads())
        with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - report, then leave with a failing status
        traceback.print_exc()
        rc = 1
    exit_without_teardown(rc)
