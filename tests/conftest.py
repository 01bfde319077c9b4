import os

import pytest

from .harness import close_worlds, reset_process_state

# Rank processes inherit this; DeepSpeed's CPU accelerator is chosen without probing for GPUs.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _close_worlds_at_exit():
    yield
    close_worlds()


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """In-process tests, like rank bodies (see ``harness``), start from zload's state as a new
    process has it."""
    reset_process_state()
