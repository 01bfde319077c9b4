import os
import subprocess
import sys

import pytest

from tests.support.harness import close_worlds, reset_process_state

# Rank processes inherit this; DeepSpeed's CPU accelerator is chosen without probing for GPUs.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# DeepSpeed's CPU comm op is built into this venv's own cache (as ./dev sets it), never into the
# ~/.cache one that another checkout's runs build and lock too.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


@pytest.fixture(scope="session", autouse=True)
def _close_worlds_at_exit():
    yield
    close_worlds()


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """In-process tests, like rank bodies (see ``harness``), start from zload's state as a new
    process has it."""
    reset_process_state()


@pytest.fixture(scope="session")
def native_checkpoint(tmp_path_factory):
    """``make_native_checkpoint(**options)``, made once per distinct options in a session: each
    costs a training step in a world of ranks, and several test files read the same cases."""
    import inspect

    from tests.support.native_checkpoints import make_native_checkpoint

    signature, cases = inspect.signature(make_native_checkpoint), {}

    def get(**options):
        bound = signature.bind(None, **options)
        bound.apply_defaults()
        key = tuple((k, v) for k, v in bound.arguments.items() if k != "root")
        if key not in cases:
            folder = tmp_path_factory.mktemp("native-" + "-".join(f"{k}{v}" for k, v in options.items()))
            cases[key] = make_native_checkpoint(folder / "checkpoint", **options)
        return cases[key]

    return get


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(nbytes)``: an empty folder on a filesystem of its own that holds ``nbytes`` (a
    tmpfs mounted for the test, unmounted after it), where a write really meets a full disk.
    Skips where this process may not mount one (not root): the ``RLIMIT_FSIZE`` tests still make
    a write fail for real there."""
    mounted = []

    def mount(nbytes: int):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(folder)],
                                  capture_output=True, text=True, timeout=60)
        except OSError as e:
            pytest.skip(f"cannot run mount to make a small filesystem to fill: {e}")
        if done.returncode:
            pytest.skip(f"cannot mount a small tmpfs to fill: {done.stderr.strip() or done.returncode}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "--lazy", str(folder)], check=True, timeout=60)  # even if a rank kept a file open
