"""Run a test body in W real processes joined by torch.distributed (gloo) and DeepSpeed.

Worlds are kept alive between tests (one per size): starting a process that imports torch and
DeepSpeed costs seconds, and the suite runs hundreds of rank bodies. A world whose body fails
stays usable; a world that hangs is killed, and the next test gets a fresh one. Each body starts
from zload's module state as a new process has it (``reset_process_state``).

Ranks receive a body by its name, so it is a module-level function; it sits just before the test
that runs it and returns what that test reads by name (a zload report, or a NamedTuple defined
next to the body).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback

DEFAULT_TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reset_process_state() -> None:
    """Undo what an earlier test left in zload's module state, and transformers' DeepSpeed config:
    worlds (and the pytest process) run many tests, each of which should see zload as a new
    process does."""
    from zload import kernels
    from zload.integrations import transformers_registry

    kernels.retry_triton()
    transformers_registry.forget_registry()
    # A Trainer's DeepSpeed config outlives it (accelerate's shared state holds it), and while it
    # lives transformers' from_pretrained takes its ZeRO-3 path in every later test of the world.
    transformers_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if transformers_deepspeed is not None:
        transformers_deepspeed.unset_hf_deepspeed_config()


def _worker(rank: int, size: int, port: int, tasks, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        job = tasks.get()
        if job is None:
            return
        fn, args, kwargs = job
        try:
            reset_process_state()
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))


class WorldError(AssertionError):
    """A rank body raised, or the world hung."""


class World:
    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        self.size = size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, size, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; returns the results in rank order."""
        for q in self.tasks:
            q.put((fn, args, kwargs))
        got, failures = {}, []
        while len(got) < self.size:
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                waiting = sorted(set(range(self.size)) - set(got))
                raise WorldError(f"{fn.__name__}: ranks {waiting} did not finish within {timeout} s "
                                 f"(hang?); finished: {sorted(got)}") from None
            got[rank] = value
            if not ok:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            raise WorldError(f"{fn.__name__} failed on {len(failures)} of {self.size} ranks:\n"
                             + "\n".join(failures))
        return [got[r] for r in range(self.size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def run_world_where_ranks_die(size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
    """``fn`` once in a fresh world of ``size`` processes in which some rank ends its process on
    purpose (``os._exit``); returns each rank's ``(ok, value or traceback)``, or None for a rank
    that died without reporting. The world is closed afterwards (its process group is broken)."""
    world = World(size)
    try:
        for q in world.tasks:
            q.put((fn, args, kwargs))
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < size:
            try:
                rank, ok, value = world.results.get(timeout=0.5)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            if all(not world.procs[r].is_alive() for r in range(size) if r not in got):
                break  # whoever has not reported is dead, and its queue is drained
            if time.monotonic() > deadline:
                waiting = sorted(set(range(size)) - set(got))
                raise WorldError(f"{fn.__name__}: ranks {waiting} neither finished nor died within "
                                 f"{timeout} s (hang?)")
        return [got.get(r) for r in range(size)]
    finally:
        world.close()


_worlds: dict[int, World] = {}


def run_world(size: int, fn, *args, **kwargs) -> list:
    """Run ``fn`` on each rank of a (cached) world of ``size`` processes."""
    world = _worlds.get(size)
    if world is None or not world.alive:
        world = _worlds[size] = World(size)
    return world.run(fn, *args, **kwargs)


def close_worlds() -> None:
    while _worlds:
        _worlds.popitem()[1].close()


def exit_aborting_hook(folder) -> str:
    """A folder for PYTHONPATH whose ``sitecustomize`` makes every torchrun worker (``LOCAL_RANK``
    set) abort at interpreter exit, as gloo sometimes does after the work is done; checked to be in
    force."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write("import atexit, os\nif 'LOCAL_RANK' in os.environ: atexit.register(os.abort)\n")
    control = subprocess.run([sys.executable, "-c", "pass"], timeout=60,
                             env={**os.environ, "PYTHONPATH": str(folder), "LOCAL_RANK": "0"})
    assert control.returncode == -signal.SIGABRT, control
    return str(folder)
