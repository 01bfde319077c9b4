"""``./dev setup`` says what it is doing while it builds .venv, and nothing once .venv is current.

Run in a copy of ``dev`` and ``pyproject.toml`` whose Python is a stub: ``-m venv`` makes a stub
venv whose python records its arguments and does nothing, so no package is installed.
"""

from __future__ import annotations

import shutil
import subprocess

from tests.support import REPO

STUB_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "{calls}"
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin"
    cp "$0" "$3/bin/python"
fi
"""


def _checkout_with_stub_python(tmp_path, extra: str = ""):
    """A copy of ``dev`` and ``pyproject.toml`` and a stub ``python3`` that records its calls:
    (the copy's folder, the stub, the file of calls)."""
    work = tmp_path / "repo"
    work.mkdir()
    for name in ("dev", "pyproject.toml"):
        shutil.copy2(REPO / name, work / name)
    calls = tmp_path / "calls"
    python = tmp_path / "python3"
    python.write_text(STUB_PYTHON.format(calls=calls) + extra)
    python.chmod(0o755)
    return work, python, calls


def _dev_setup(work, python, *level: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(work / "dev"), "setup", *level], env={"PATH": "/usr/bin:/bin",
                          "PYTHON": str(python)}, capture_output=True, text=True, timeout=60)


def test_dev_setup_names_each_step_then_stays_quiet(tmp_path):
    work, python, calls = _checkout_with_stub_python(tmp_path)

    def setup() -> subprocess.CompletedProcess:
        return _dev_setup(work, python)

    first = setup()
    assert first.returncode == 0, first.stderr
    assert first.stdout == "" and first.stderr  # it says what it does while it builds
    assert calls.read_text().splitlines()[0] == "-m venv .venv"
    assert (work / ".venv" / ".zload-install-stamp").exists()

    made = calls.read_text()
    again = setup()
    assert again.returncode == 0 and again.stdout == again.stderr == "" and calls.read_text() == made

    (work / ".venv" / ".zload-install-stamp").write_text("stale\n")
    stale = setup()
    assert stale.returncode == 0 and stale.stderr  # set up again, in the venv that is there:
    assert "-m venv" not in calls.read_text()[len(made):]


def test_dev_builds_deepspeeds_op_into_a_cache_of_its_own_venv(tmp_path):
    """Two checkouts on one machine must not share DeepSpeed's extension cache: each rebuilt the
    other's CPU comm op, or waited on its stale lock."""
    seen = tmp_path / "seen"
    work, python, _ = _checkout_with_stub_python(tmp_path, f'echo "$1 $TORCH_EXTENSIONS_DIR" >> "{seen}"\n')
    done = _dev_setup(work, python)
    assert done.returncode == 0, done.stderr
    build = [line for line in seen.read_text().splitlines() if line.startswith("-c ")]
    assert build == [f"-c {work}/.venv/torch_extensions"]


def test_the_demo_installs_no_test_extras_and_the_tests_add_only_them(tmp_path):
    """``./dev demo`` sets up the runtime dependencies alone; ``./dev test`` then adds the test
    extras and nothing else; a venv set up for the tests serves the demo as it is."""
    work, python, calls = _checkout_with_stub_python(tmp_path)

    def setup(level: str) -> list[str]:
        before = calls.read_text().splitlines() if calls.exists() else []
        done = _dev_setup(work, python, level)
        assert done.returncode == 0, done.stderr
        return [c for c in calls.read_text().splitlines()[len(before):] if "pip install" in c]

    assert setup("demo")[-1] == "-m pip install -q -e ."
    assert setup("test") == ["-m pip install -q -e .[test]"]
    assert setup("demo") == [] and setup("test") == []
