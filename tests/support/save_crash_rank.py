"""One rank of the crash-safety tests of ``zload.save`` (tests/distributed/test_save_crash.py), launched by torchrun.

The rank loads IN (a known checkpoint) into a ZeRO-3 ``models.Awkward`` and saves it to OUT. On
rank CRASH_RANK a point of the save, CRASH_AT, is patched to kill the process there
(``os._exit(9)``: no cleanup, no exception, like SIGKILL or a lost node), or, for
CRASH_AT=raise, to make a write fail with an OSError. Every rank that returns writes
RESULTS/rank<r>.json; the killed rank leaves RESULTS/killed-rank<r> just before it dies.

CRASH_AT (the names are those of ``zload/save_plan.py``, ``zload/writer.py`` and ``zload/savedir.py``):
  plan      after ``plan_writes`` (this rank planned, nothing created yet)
  create    after ``_create_files`` (rank 0: the staging folder and its empty shards exist)
  write     after the first ``_pwrite_all`` (one chunk of this rank's partitions written)
  send      after the first ``torch.distributed.send`` (streaming to rank 0, SHARED=0)
  publish   before ``_publish`` (rank 0: every file written and its digest recorded)
  moved     after the first ``SaveFolder._move_in`` (rank 0: the new shards are in OUT, unlisted)
  committed after ``SaveFolder._commit`` (rank 0: the new index has replaced the old one)
  finish    before ``SaveFolder.finish`` (rank 0: stale files removed, staging folder still there)
  raise     ``_pwrite_all`` raises OSError(EIO) (a failure, not a kill)
  raise-create  ``_create_files`` raises OSError(ENOSPC) after creating the first file (rank 0)
  raise-commit  ``SaveFolder._commit`` raises OSError(EACCES) (rank 0, the new shards moved in)
  raise-pack    ``_pack`` raises OSError(EIO) (a rank preparing the slices it streams, SHARED=0)
  raise-digest  ``data_digest`` raises OSError(EDQUOT) (rank 0, recording the digests)
"""

import importlib
import errno
import json
import os
import sys
import traceback

import deepspeed
import torch.distributed as dist

sys.path.insert(0, os.environ["PYTHONPATH"])

import zload  # noqa: E402
from tests.support import models  # noqa: E402
from tests.support.zero3 import build_zero  # noqa: E402

import zload.saving.writer as writer_module  # noqa: E402


def _die() -> None:
    """Die here, leaving only a note that this point was reached (RESULTS/killed-rank<r>)."""
    with open(os.path.join(os.environ["RESULTS"], f"killed-rank{dist.get_rank()}"), "w") as f:
        f.write(os.environ["CRASH_AT"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(9)


def _wrap(owner, name: str, before=None, after=None) -> None:
    original = getattr(owner, name)  # AttributeError: the function was renamed

    def wrapper(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after:
            after(*args, **kwargs)
        return result

    setattr(owner, name, wrapper)


def _fail(error: int, message: str):
    def fail(*args, **kwargs):
        raise OSError(error, message)
    return fail


def _owner(where: str):
    """``"zload.saving.folder:SaveFolder"`` -> that class; ``"zload.saving.writer"`` -> that module."""
    module, _, name = where.partition(":")
    owner = importlib.import_module(module) if module != "dist" else dist
    return getattr(owner, name) if name else owner


def install_crash(point: str) -> None:
    die = lambda *a, **k: _die()  # noqa: E731
    folder = "zload.saving.folder:SaveFolder"
    points = {  # kill point -> (owner, function, wrapper's before / after)
        "plan": ("zload.saving.plan", "plan_writes", {"after": die}),
        "create": ("zload.saving.writer", "create_files", {"after": die}),
        "write": ("zload.saving.writer", "_pwrite_all", {"after": die}),
        "send": ("dist", "send", {"after": die}),
        "publish": ("zload.saving.writer", "publish", {"before": die}),
        "moved": (folder, "_move_in", {"after": die}),
        "committed": (folder, "_commit", {"after": die}),
        "finish": (folder, "finish", {"before": die}),
        "raise": ("zload.saving.writer", "_pwrite_all", {"before": _fail(errno.EIO, "injected write failure")}),
        "raise-commit": (folder, "_commit", {"before": _fail(errno.EACCES, "injected: permission denied")}),
        "raise-pack": ("zload.saving.writer", "_pack", {"before": _fail(errno.EIO, "injected: cannot read")}),
        "raise-digest": ("zload.saving.writer", "data_digest", {"before": _fail(errno.EDQUOT, "injected: quota exceeded")}),
    }
    if point in points:
        owner, name, when = points[point]
        _wrap(_owner(owner), name, **when)
    elif point == "raise-create":
        original = writer_module.create_files

        def create_one_then_fail(files, folder):
            original(files[:1], folder)
            raise OSError(errno.ENOSPC, "injected: no space left")

        writer_module.create_files = create_one_then_fail
    else:
        raise ValueError(f"unknown CRASH_AT={point!r}")


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    out = os.environ["OUT"]
    if os.environ.get("CRASH_AT") and int(os.environ["CRASH_RANK"]) == rank:
        install_crash(os.environ["CRASH_AT"])
    shared = {"1": True, "0": False}.get(os.environ.get("SHARED", ""))
    result = {"rank": rank, "ok": False}
    rc = 0
    try:
        model = build_zero(models.Awkward)
        zload.load_into(model, os.environ["IN"])
        report = zload.save(model, out, max_shard_size=int(os.environ.get("MAX_SHARD", "200")),
                            shared_filesystem=shared, staging_bytes=64)
        result.update(ok=True, files=report.files, written=report.bytes_written)
    except zload.ZloadError as e:
        result.update(error_type=type(e).__name__, message=str(e))
        rc = 3
    except Exception as e:
        result.update(error_type=type(e).__name__, message=traceback.format_exc())
        rc = 4
    # Written whole or not at all: torchrun may tear this worker down at any moment once a peer died.
    path = os.path.join(os.environ["RESULTS"], f"rank{rank}.json")
    with open(path + ".partial", "w") as f:
        json.dump(result, f)
    os.replace(path + ".partial", path)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo sometimes aborts while tearing down after DeepSpeed; the result is already written.
    os._exit(rc)


if __name__ == "__main__":
    main()
