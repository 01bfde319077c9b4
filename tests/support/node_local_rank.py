"""One rank of the two-node test (tests/distributed/test_node_local.py), launched by torchrun.

Each "node" sees only its own directory (NODE_DIR); the load goes through the relative path
``ckpt`` there, which exists on node 0 only.
"""

import json
import os
import sys
import traceback

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, os.environ["PYTHONPATH"])

import zload  # noqa: E402
from tests.support import models  # noqa: E402
from tests.support.zero3 import build_zero, check_against  # noqa: E402


def main() -> int:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    result = {"rank": rank, "ok": False}
    try:
        model = build_zero(models.Awkward)
        os.chdir(os.environ["NODE_DIR"])
        report = zload.load_into(model, "ckpt")
        check_against(model, torch.load(os.environ["REFERENCE"]))
        result.update(ok=True, read=report.bytes_read, sent=report.bytes_sent, received=report.bytes_received)
    except Exception:
        result["error"] = traceback.format_exc()
    with open(os.path.join(os.environ["RESULTS"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    # gloo sometimes aborts while tearing down after DeepSpeed; the result is already written.
    os._exit(0)


if __name__ == "__main__":
    main()
