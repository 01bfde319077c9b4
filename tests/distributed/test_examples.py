"""The recipes in examples/ run as a user runs them: each launches its own world of 2 CPU ranks
(the Trainer recipe as 2 simulated nodes of 1 rank), checks its own results, and says so in one
line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import REPO

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

EXAMPLES = REPO / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script,success", [
    ("trainer_recipe.py", "trainer recipe: OK"),
    ("accelerate_recipe.py", "accelerate recipe: OK"),
    ("custom_loop.py", "custom loop recipe: OK"),
])
def test_recipe_runs_at_world_size_2(tmp_path, script, success):
    env = dict(os.environ, PYTHONPATH=str(EXAMPLES.parent), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(EXAMPLES / script), "--out", str(tmp_path / "out")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:]
    assert [line for line in run.stdout.splitlines() if line.startswith(success)], run.stdout[-6000:]
