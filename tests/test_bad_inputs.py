"""Bad checkpoints: the same clear zload error on every rank, no hang, and an untouched model."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
import torch.distributed as dist

import zload

from . import models
from .checkpoints import save_sharded
from .harness import run_world
from .zero3 import assert_unchanged, build_zero, load_recording_warnings, snapshot


def load_on_nodes(path, node_dirs=None, **load_kwargs):
    """Load ``path``; return the error each rank raised (after proving the model untouched), or
    None when the load succeeded.

    With ``node_dirs``, rank r resolves ``path`` (relative) inside ``node_dirs[r]``: the same
    path names different files on different ranks, as with node-local copies of a checkpoint.
    """
    model = build_zero(models.Awkward)
    before = snapshot(model)
    cwd = os.getcwd()
    try:
        if node_dirs:
            os.chdir(node_dirs[dist.get_rank()])
        zload.load_into(model, path, **load_kwargs)
    except zload.ZloadError as e:
        assert_unchanged(model, before)
        return type(e).__name__, str(e)
    finally:
        os.chdir(cwd)
    return None


def _load_expecting_error(path, node_dirs=None):
    error = load_on_nodes(path, node_dirs)
    assert error is not None, "load_into accepted a bad checkpoint"
    return error


def _shard_holding(folder, tensor):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][tensor]


def _truncate(folder):
    shard = _shard_holding(folder, "cube")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 5)
    return shard.name, "truncated"


def _lie_about_offsets(folder):
    """Rewrite one header entry so its data_offsets overlap its neighbour's (same header length)."""
    shard = _shard_holding(folder, "cube")
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8:8 + n].decode()
    parsed = json.loads(header)
    begin, end = parsed["cube"]["data_offsets"]
    lie = json.dumps({**parsed, "cube": {**parsed["cube"], "data_offsets": [begin + 4, end + 4]}},
                     separators=(",", ":"))
    lie = lie.encode().ljust(n)
    assert len(lie) == n
    shard.write_bytes(raw[:8] + lie + raw[8 + n:])
    return shard.name, "'cube'"


def _wrong_shape(folder, state):
    state = dict(state, cube=torch.randn(13, 17, 4))
    shutil.rmtree(folder)
    save_sharded(state, folder, shards=2)
    return "cube", "checkpoint shape [13, 17, 4] != model shape [13, 17, 3]"


def _wrong_kind(folder, state):
    state = dict(state, cube=torch.ones(13, 17, 3, dtype=torch.int32))
    shutil.rmtree(folder)
    save_sharded(state, folder, shards=2)
    return "cube", "I32 cannot be cast"


def _missing_tensor(folder, state):
    state = {k: v for k, v in state.items() if k != "odd.bias"}
    shutil.rmtree(folder)
    save_sharded(state, folder, shards=2)
    return "odd.bias", "not in the checkpoint"


CORRUPTIONS = {
    "truncated": lambda folder, state: _truncate(folder),
    "lying_header": lambda folder, state: _lie_about_offsets(folder),
    "shape_mismatch": _wrong_shape,
    "int_into_float": _wrong_kind,
    "missing_tensor": _missing_tensor,
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_bad_checkpoint_same_error_everywhere(tmp_path, world, corruption):
    state = models.state_with_seed(models.Awkward, seed=8)
    folder = save_sharded(state, tmp_path / "ckpt", shards=2)
    culprit, detail = CORRUPTIONS[corruption](folder, state)
    results = run_world(world, _load_expecting_error, folder, timeout=120)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, message = results[0]
    assert culprit in message and detail in message, message
    assert kind == ("InvalidCheckpointError" if corruption in ("truncated", "lying_header") else "PlanError")


def test_shard_no_rank_can_read(tmp_path):
    """Node-local copies where every node lacks the same shard: the same error, naming it."""
    state = models.state_with_seed(models.Awkward, seed=9)
    good = save_sharded(state, tmp_path / "node0" / "ckpt", shards=2)
    gone = _shard_holding(good, "cube")
    gone.unlink()
    shutil.copytree(good, tmp_path / "node1" / "ckpt")
    nodes = [tmp_path / "node0", tmp_path / "node1", tmp_path / "node0"]
    results = run_world(3, _load_expecting_error, "ckpt", nodes, timeout=120)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, message = results[0]
    assert kind == "CheckpointNotFoundError" and gone.name in message and "no rank can read" in message, message


def test_node_copies_that_differ_are_refused(tmp_path):
    state = models.state_with_seed(models.Awkward, seed=9)
    save_sharded(state, tmp_path / "node0" / "ckpt", shards=2)
    save_sharded(dict(state, cube=torch.zeros(13, 17, 3, dtype=torch.float16)), tmp_path / "node1" / "ckpt",
                 shards=2)
    results = run_world(2, _load_expecting_error, "ckpt", [tmp_path / "node0", tmp_path / "node1"],
                        timeout=120)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, message = results[0]
    assert kind == "InvalidCheckpointError" and "differ" in message, message


def _load_with_a_key_map_failing_on(failing_rank, how, path):
    """A load whose planning fails on one rank only: every rank must raise, the model untouched."""
    model = build_zero(models.Awkward)
    before = snapshot(model)

    def key_map(name):
        if dist.get_rank() != failing_rank:
            return name
        if how == "raises":
            raise ValueError(f"no name for {name}")
        return None if name == "odd.bias" else name  # drops a tensor the model needs

    try:
        zload.load_into(model, path, key_map=key_map)
    except zload.ZloadError as e:
        assert_unchanged(model, before)
        return type(e).__name__, str(e)
    raise AssertionError("load_into went ahead although one rank could not plan")


@pytest.mark.parametrize("how", ["raises", "drops"])
def test_a_planning_problem_on_one_rank_stops_every_rank(tmp_path, how):
    state = models.state_with_seed(models.Awkward, seed=12)
    folder = save_sharded(state, tmp_path / "ckpt", shards=2)
    results = run_world(3, _load_with_a_key_map_failing_on, 1, how, folder, timeout=120)
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    kind, message = results[0]
    expected = ["no name for cube"] if how == "raises" else ["not in the checkpoint", "odd.bias"]
    assert "[rank 1]" in message and all(e in message for e in expected), message
    assert kind == ("ZloadError" if how == "raises" else "PlanError")


def _load_awkward_recording_warnings(path, **load_kwargs):
    return load_recording_warnings(build_zero(models.Awkward), path, **load_kwargs)


def test_non_strict_reports_missing_and_unexpected(tmp_path):
    state = models.state_with_seed(models.Awkward, seed=10)
    del state["odd.bias"]
    state["extra.weight"] = torch.ones(2)
    folder = save_sharded(state, tmp_path / "ckpt", shards=2)
    for load in run_world(2, _load_awkward_recording_warnings, folder, strict=False):
        assert load.report.missing == ["odd.bias"] and load.report.unexpected == ["extra.weight"]
        assert any("extra.weight" in m for m in load.messages) and any("odd.bias" in m for m in load.messages)


def test_strict_load_only_warns_about_unexpected_tensors(tmp_path):
    state = models.state_with_seed(models.Awkward, seed=11)
    state["extra.weight"] = torch.ones(2)
    folder = save_sharded(state, tmp_path / "ckpt", shards=2)
    for load in run_world(2, _load_awkward_recording_warnings, folder):
        assert load.report.unexpected == ["extra.weight"]
        assert any("extra.weight" in m for m in load.messages)


def test_load_warnings_point_at_the_callers_line(tmp_path):
    import warnings

    from safetensors.torch import save_file

    save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2), "extra": torch.ones(1)},
              str(tmp_path / "model.safetensors"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zload.load_into(torch.nn.Linear(3, 2), tmp_path)
    (warning,) = [w for w in caught if issubclass(w.category, zload.ZloadWarning)]
    assert "extra" in str(warning.message) and warning.filename == __file__
