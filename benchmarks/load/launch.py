"""Starting measured worlds: plainly (``python -m torch.distributed.run`` per measurement) or, under
torchrun, one worker per torchrun rank.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager

from benchmarks.load import REPO, log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _worker_args(method: str, folder: str, result_dir: str, args) -> list[str]:
    """The worker's command line after the Python executable (``-m``, as ``torchrun -m`` takes it)."""
    cmd = ["-m", "benchmarks.load", "--worker", method, "--checkpoint", folder, "--result-dir", result_dir,
           "--staging-bytes", str(args.staging_bytes), "--model-dtype", args.model_dtype,
           "--load-verify", args.load_verify]
    return cmd + ([] if args.verify else ["--no-verify"]) + (["--cold"] if args.cold else [])


@contextmanager
def compiled_snapshot():
    """A copy of zload's sources, compiled to bytecode, in a temporary folder removed at the end:
    workers that import from it cannot mix two versions if the working tree (an editable install)
    is edited during a long run, and import compiled modules, as from ``pip install`` (which
    compiles an installed package, as transformers and DeepSpeed are here): otherwise every fresh
    world compiles zload's sources while it is timed, 60-90 ms a rank on this project's CPU machine,
    which no installed zload pays (benchmarks/README.md, the construct + load target)."""
    import compileall

    import zload

    snapshot = tempfile.mkdtemp(prefix="zload-bench-src-")
    try:
        shutil.copytree(os.path.dirname(os.path.abspath(zload.__file__)), os.path.join(snapshot, "zload"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        if not compileall.compile_dir(os.path.join(snapshot, "zload"), quiet=1):
            raise RuntimeError(f"could not compile zload's sources in {snapshot}")
        yield snapshot
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)


@contextmanager
def scratch_folders():
    """This process's temporary folders, ``(snapshot, logs)``: the ``compiled_snapshot`` every
    worker imports from, and the measured worlds' logs. Both are removed at the end, but for the
    logs of a run that failed: its error names the log of the world that failed."""
    with compiled_snapshot() as snapshot:
        logs = tempfile.mkdtemp(prefix="zload-bench-logs-")
        try:
            yield snapshot, logs
        except BaseException:
            log(f"the measured worlds' logs are kept in {logs}")
            raise
        shutil.rmtree(logs)


def _worker_env(world: int, snapshot: str) -> dict:
    """Workers run in ``snapshot`` (``python -m`` puts the working folder first on the path, so its
    zload is the one imported) and find ``benchmarks`` in the repository."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([snapshot, REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if not cuda_available():
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


def stop_torchrun(torchrun: subprocess.Popen) -> None:
    """SIGTERM first: torchrun then stops its workers, which run in sessions of their own and would
    outlive a SIGKILLed torchrun (and disturb the worlds measured after them)."""
    torchrun.terminate()
    try:
        torchrun.wait(timeout=60)
    except subprocess.TimeoutExpired:
        torchrun.kill()
        torchrun.wait()


def launch_local(worker_args: list[str], world: int, args, log_path: str, what: str) -> None:
    """Run one world of ``world`` ranks on this machine with torchrun, each rank ``python
    WORKER_ARGS`` in ``args.snapshot``; raise, with the end of its log, if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *worker_args]
    with open(log_path, "w") as out:
        torchrun = subprocess.Popen(cmd, env=_worker_env(world, args.snapshot), stdout=out, stderr=subprocess.STDOUT,
                                    cwd=args.snapshot)
        try:
            rc = torchrun.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = f"timeout after {args.timeout} s"
        finally:  # past the timeout, or interrupted (Ctrl-C) while waiting
            if torchrun.poll() is None:
                stop_torchrun(torchrun)
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{what} failed ({rc}); log {log_path}:\n{tail}")


def measure_local(method: str, world: int, folder: str, args, log_path: str) -> list[dict]:
    """Launch one world of ``world`` ranks on this machine with torchrun; per-rank results."""
    with tempfile.TemporaryDirectory(prefix="zload-bench-") as result_dir:
        launch_local(_worker_args(method, folder, result_dir, args), world, args, log_path,
                     f"{method} at world {world}")
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
        port = self.broadcast(free_port() if self.rank == 0 else None)
        record = None
        if self.rank < world:
            env = _worker_env(world, args.snapshot)
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
                                             timeout=args.timeout, cwd=args.snapshot)
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
