"""Seeded fuzzing through ``load_into`` at world size 2: a handful of the mutated headers of
tests/unit/test_fuzz.py, each refused on every rank with a ``ZloadError``, the model untouched, or
loaded as safetensors reads it."""

from __future__ import annotations

import random
from typing import NamedTuple

from safetensors import safe_open
from safetensors.torch import save_file

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import assert_unchanged, build_zero, check_against, snapshot
from tests.unit.test_fuzz import mutate_file


class LoadOutcome(NamedTuple):
    kind: str  # "loaded", or the class name of the error the load raised
    detail: int | str  # how many tensors were loaded, or the error's message


def _load_mutated(path):
    """strict=False, so that a renamed tensor is skipped rather than refused."""
    model = build_zero(models.Awkward)
    before = snapshot(model)
    try:
        report = zload.load_into(model, path, strict=False)
    except zload.ZloadError as e:
        assert_unchanged(model, before)
        return LoadOutcome(type(e).__name__, str(e))
    with safe_open(str(path), "pt") as f:
        expected = {name: f.get_tensor(name) for name in report.loaded}
    check_against(model, expected, names=report.loaded)
    return LoadOutcome("loaded", len(report.loaded))


def test_a_handful_of_mutations_at_world_size_2(tmp_path):
    """Through load_into: the same error on every rank and an untouched model, or a load whose
    every tensor is what safetensors reads from the mutated file."""
    source = tmp_path / "in.safetensors"
    save_file(models.state_with_seed(models.Awkward, seed=70), str(source), metadata={"format": "pt"})
    original = source.read_bytes()
    rng = random.Random(7)
    outcomes = []
    for case in range(8):
        path = tmp_path / f"case{case}.safetensors"
        path.write_bytes(mutate_file(rng, original))
        results = run_world(2, _load_mutated, str(path), timeout=60)
        assert len(set(results)) == 1, results
        outcomes.append(results[0].kind)
    assert "loaded" in outcomes and len(set(outcomes)) > 1, outcomes
