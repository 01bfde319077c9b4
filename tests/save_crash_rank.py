"""One rank of the crash-safety tests of ``zload.save`` (tests/test_save_crash.py), launched by torchrun.

The rank loads IN (a known checkpoint) into a ZeRO-3 ``models.Awkward`` and saves it to OUT. On
rank CRASH_RANK a point of the save, CRASH_AT, is patched to kill the process there
(``os._exit(9)``: no cleanup, no exception, like SIGKILL or a lost node), or, for
CRASH_AT=raise, to make a write fail with an OSError. Every rank that returns writes
RESULTS/rank<r>.json; the killed rank leaves RESULTS/killed-rank<r> just before it dies.

CRASH_AT (the names are those of ``zload/save.py``):
  plan      after ``plan_writes`` (this rank planned, nothing created yet)
  create    after ``_create_files`` (rank 0: the temporary folder and empty shards exist)
  write     after the first ``_pwrite_all`` (one chunk of this rank's partitions written)
  send      after the first ``torch.distributed.send`` (streaming to rank 0, SHARED=0)
  metadata  before ``_write_metadata`` (rank 0: all ranks agreed the writes succeeded)
  swap      before ``_swap_into_place`` (rank 0: metadata written, folder fsynced)
  swapped   right after the new folder took the place of OUT (rank 0, before the old one is
            removed or the parent folder fsynced)
  raise     ``_pwrite_all`` raises OSError(EIO) (a failure, not a kill)
  raise-create  ``_create_files`` raises OSError(ENOSPC) after creating the first file (rank 0)
"""

import errno
import json
import os
import shutil
import sys
import traceback

import deepspeed
import torch.distributed as dist

sys.path.insert(0, os.environ["PYTHONPATH"])

import zload  # noqa: E402
from tests import models  # noqa: E402
from tests.zero3 import build_zero  # noqa: E402

save_module = sys.modules["zload.save"]  # ``zload.save`` is the function


def _die() -> None:
    """Die here, leaving only a note that this point was reached (RESULTS/killed-rank<r>)."""
    with open(os.path.join(os.environ["RESULTS"], f"killed-rank{dist.get_rank()}"), "w") as f:
        f.write(os.environ["CRASH_AT"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(9)


def _wrap(owner, name: str, before=None, after=None) -> None:
    original = getattr(owner, name)  # AttributeError: zload/save.py renamed the function

    def wrapper(*args, **kwargs):
        if before:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after:
            after(*args, **kwargs)
        return result

    setattr(owner, name, wrapper)


def install_crash(point: str, out: str) -> None:
    die = lambda *a, **k: _die()  # noqa: E731
    simple = {  # kill point -> (module, function, die before or after it runs)
        "plan": (save_module, "plan_writes", "after"), "create": (save_module, "_create_files", "after"),
        "write": (save_module, "_pwrite_all", "after"), "send": (dist, "send", "after"),
        "metadata": (save_module, "_write_metadata", "before"),
        "swap": (save_module, "_swap_into_place", "before"),
    }
    if point in simple:
        owner, name, when = simple[point]
        _wrap(owner, name, **{when: die})
    elif point == "swapped":
        parent = os.path.dirname(os.path.abspath(out))

        def parent_synced(folder):  # the last step of a swap, new OUT in place
            if os.path.abspath(folder) == parent:
                _die()

        _wrap(save_module, "_fsync_dir", before=parent_synced)
        # with an old OUT, the old folder (now at the temporary name) is removed first
        class DyingRmtree:  # zload.save's own ``shutil``, whose rmtree dies first
            def __getattr__(self, name):
                return getattr(shutil, name)

            @staticmethod
            def rmtree(*args, **kwargs):
                _die()

        save_module.shutil = DyingRmtree()
    elif point == "raise":
        def fail(*args, **kwargs):
            raise OSError(errno.EIO, "injected write failure")

        _wrap(save_module, "_pwrite_all", before=fail)
    elif point == "raise-create":
        original = save_module._create_files

        def create_one_then_fail(files, folder):
            original(files[:1], folder)
            raise OSError(errno.ENOSPC, "injected: no space left")

        save_module._create_files = create_one_then_fail
    else:
        raise ValueError(f"unknown CRASH_AT={point!r}")


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    out = os.environ["OUT"]
    if os.environ.get("CRASH_AT") and int(os.environ["CRASH_RANK"]) == rank:
        install_crash(os.environ["CRASH_AT"], out)
    shared = {"1": True, "0": False}.get(os.environ.get("SHARED", ""))
    result = {"rank": rank, "ok": False}
    rc = 0
    try:
        model = build_zero(models.Awkward)
        zload.load_into(model, os.environ["IN"])
        report = zload.save(model, out, max_shard_size=int(os.environ.get("MAX_SHARD", "200")),
                            shared_filesystem=shared, buffer_bytes=64)
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
