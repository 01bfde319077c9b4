"""The worlds: every test under tests/distributed starts ranks (``harness.run_world``, torchrun, a
script that initialises torch.distributed), so each is marked ``distributed`` here and
``pytest -m "not distributed"`` runs what tests/unit holds. The worlds the harness keeps alive
between tests (one per size) close when the session ends."""

import subprocess
from pathlib import Path

import pytest

from tests.support.harness import close_worlds

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(scope="session", autouse=True)
def _close_worlds_at_exit():
    yield
    close_worlds()


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
