"""What tests/unit and tests/distributed share: checkpoints and models to test with, the
multi-process harness (``harness.run_world``), and the rank scripts that torchrun launches by
path (``SUPPORT / "node_local_rank.py"``)."""

import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]


def python(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` in a new interpreter (zload as a user's shell starts it), this checkout first
    on its path; ``env`` added to this process's environment."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
