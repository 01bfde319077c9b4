"""What tests/unit and tests/distributed share: the environment of the suite's processes (and of
every rank they start), and zload's module state made fresh before each test."""

import os
import sys

import pytest

from tests.support.harness import reset_process_state

# Rank processes inherit this; DeepSpeed's CPU accelerator is chosen without probing for GPUs.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# DeepSpeed's CPU comm op is built into this venv's own cache (as ./dev sets it), never into the
# ~/.cache one that another checkout's runs build and lock too.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """In-process tests, like rank bodies (see ``harness``), start from zload's state as a new
    process has it."""
    reset_process_state()
