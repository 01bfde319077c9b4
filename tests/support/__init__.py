"""What tests/unit and tests/distributed share: checkpoints and models to test with, the
multi-process harness (``harness.run_world``), and the rank scripts that torchrun launches by
path (``SUPPORT / "node_local_rank.py"``)."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
