"""Bad checkpoints: the same clear zload error on every rank, no hang, and an untouched model."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zload

from tests.support import models
from tests.support.checkpoints import bin_weights_folder, save_sharded
from tests.support.harness import run_world
from tests.support.zero3 import (
    assert_unchanged,
    build_zero,
    check_against,
    load_expected,
    load_recording_warnings,
    refused_load,
    snapshot,
)


def load_on_nodes(path, node_dirs=None, **load_kwargs):
    """Load ``path``; return the error each rank raised (after proving the model untouched), or
    None when the load succeeded.

    With ``node_dirs``, rank r resolves ``path`` (relative) inside ``node_dirs[r]``: the same
    path names different files on different ranks, as with node-local copies of a checkpoint.
    """
    cwd = os.getcwd()
    try:
        if node_dirs:
            os.chdir(node_dirs[dist.get_rank()])
        return refused_load(build_zero(models.Awkward), path, **load_kwargs)
    finally:
        os.chdir(cwd)


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
    for rank, load in enumerate(run_world(2, _load_awkward_recording_warnings, folder, strict=False)):
        assert load.report.missing == ["odd.bias"] and load.report.unexpected == ["extra.weight"]
        warned = any("extra.weight" in m for m in load.messages) and any("odd.bias" in m for m in load.messages)
        assert warned == (rank == 0), load.messages  # the warnings every rank would give: rank 0 gives them


def test_strict_load_only_warns_about_unexpected_tensors(tmp_path):
    state = models.state_with_seed(models.Awkward, seed=11)
    state["extra.weight"] = torch.ones(2)
    folder = save_sharded(state, tmp_path / "ckpt", shards=2)
    for rank, load in enumerate(run_world(2, _load_awkward_recording_warnings, folder)):
        assert load.report.unexpected == ["extra.weight"]
        assert any("extra.weight" in m for m in load.messages) == (rank == 0), load.messages


# --------------------------------------------------------------------------------------------
# Ranks that call load_into differently: a collective one rank makes and another never reaches
# would leave it waiting. Every rank raises the same error before anything is written.


def _same(results):
    assert all(r is not None for r in results), f"a rank loaded: {results}"
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    return results[0]


def _load_with_arguments_of_rank(path, node_dirs, arguments):
    """``load_on_nodes`` with each rank's own keyword arguments: rank 0 passes ``arguments[0]``,
    the others ``arguments[1]``."""
    return load_on_nodes(path, node_dirs, **arguments[min(dist.get_rank(), 1)])


DIFFERING_ARGUMENTS = {  # name: (rank 0's keyword arguments, the other ranks', node-local, what the error says)
    "verify": ({"verify": "full"}, {}, False, "verify: 'full' on rank 0, 'sample' on rank"),
    "verify_node_local": ({}, {"verify": "full"}, True, "verify: 'sample' on rank 0, 'full' on rank"),
    "staging_bytes": ({"staging_bytes": 256}, {"staging_bytes": 512}, True,
                      "staging_bytes: 256 on rank 0, 512 on rank"),
    "strict": ({"strict": False}, {}, False, "strict: False on rank 0, True on rank"),
    "revision": ({}, {"revision": "main"}, False, "revision: None on rank 0, 'main' on rank"),
    "verify_invalid_on_one": ({}, {"verify": "all"}, False, "verify: 'sample' on rank 0, 'all' on rank"),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("argument", DIFFERING_ARGUMENTS)
def test_ranks_passing_different_arguments_all_raise(tmp_path, world, argument):
    """verify="full" on one rank and "sample" on another took different first collectives; a
    staging_bytes that differs cut the node-local transfer into batches of different sizes; a
    revision or a verify only one rank refused left the others waiting. Now one error, naming
    the argument and what each rank passed, on every rank, the model unchanged."""
    first, others, node_local, says = DIFFERING_ARGUMENTS[argument]
    state = models.state_with_seed(models.Awkward, seed=13)
    folder = save_sharded(state, tmp_path / "node0" / "ckpt", shards=2)
    path, nodes = folder, None
    if node_local:  # only rank 0 has the checkpoint: the others receive their bytes from it
        (tmp_path / "node1").mkdir()
        path, nodes = "ckpt", [tmp_path / "node0"] + [tmp_path / "node1"] * (world - 1)
    results = run_world(world, _load_with_arguments_of_rank, path, nodes, (first, others), timeout=60)
    kind, message = _same(results)
    assert kind == "ArgumentValueError", message
    assert "the ranks passed load_into different arguments" in message and says in message, message
    assert "every rank must call load_into with the same arguments and the same model" in message


def _load_verifying_fully_as_member_or_string(path):
    """Rank 0 passes verify as the enum member, the others as its string: the same argument."""
    from zload.checkpoint.views import Verify

    model = build_zero(models.Awkward)
    zload.load_into(model, path, verify=Verify.FULL if dist.get_rank() == 0 else "full")
    return check_against(model, load_expected(path))


def test_a_mode_passed_as_its_member_or_its_string_is_the_same_argument(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(models.state_with_seed(models.Awkward, seed=17), str(path))
    assert len(set(run_world(2, _load_verifying_fully_as_member_or_string, path, timeout=60))) == 1


def _load_passing_a_list_on_rank_1(path):
    """Rank 1 passes a list holding the model where the model belongs (which it alone refuses)."""
    model = build_zero(models.Awkward)
    return refused_load(model, path, [model] if dist.get_rank() == 1 else model)


def test_a_model_only_one_rank_refuses_fails_every_rank(tmp_path):
    folder = save_sharded(models.state_with_seed(models.Awkward, seed=13), tmp_path / "ckpt", shards=2)
    kind, message = _same(run_world(2, _load_passing_a_list_on_rank_1, folder, timeout=60))
    assert kind == "ArgumentValueError" and "model: 'an nn.Module' on rank 0, 'a list' on rank 1" in message


def _load_with_an_orphan_on_rank_1(path):
    """Rank 1 re-creates each LayerScale's parameter after zero.Init (an orphan that zload turns
    into a ZeRO-3 parameter, a broadcast); the other ranks give the ZeRO-3 parameter the same name."""
    model = build_zero(models.TinyViT)
    for module in model.modules():
        if isinstance(module, models.LayerScale):
            if dist.get_rank() == 1:
                models.ls_apply_patch(module)
            else:
                module.scale_factor = module.gamma
                del module.gamma
    return refused_load(model, path)


@pytest.mark.parametrize("world", [2, 3])
def test_an_orphan_on_one_rank_only_fails_every_rank(tmp_path, world):
    """Rank 1 alone waited in the orphan's broadcast while the others returned success."""
    path = tmp_path / "model.safetensors"
    save_file(models.state_with_seed(models.patched_tiny_vit, seed=14), str(path))
    results = run_world(world, _load_with_an_orphan_on_rank_1, path, timeout=60)
    kind, message = _same(results)
    lacking = "rank 0's" if world == 2 else "those of ranks 0, 2"
    assert kind == "PlanError", message
    assert "rank 1's model has the orphan 'blocks.0.ls1.scale_factor' (float32 [10])" in message, message
    assert f"that {lacking} lack" in message and "the same model" in message, message


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
               "scatter", "gather", "isend", "irecv", "send", "recv", "barrier")


def _collectives_of_loads(path, verifies):
    """The torch.distributed calls each load (one per ``verify``) makes, in order."""
    calls, real = [], {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)
        return call

    made = []
    for verify in verifies:
        model = build_zero(models.Awkward)
        calls.clear()
        for name in COLLECTIVES:
            setattr(dist, name, counted(name))
        try:
            zload.load_into(model, path, verify=verify)
        finally:
            for name in COLLECTIVES:
                setattr(dist, name, real[name])
        made.append(list(calls))
    return made


def test_agreeing_on_the_call_adds_no_collective(tmp_path):
    """The common load makes two all-reduces (after planning, after reading), whatever it agrees
    on; a full verification starts with the same all-reduce as a sampled one, so that ranks that
    passed different verify values meet in it."""
    folder = save_sharded(models.state_with_seed(models.Awkward, seed=16), tmp_path / "ckpt", shards=2)
    for sample, full in run_world(2, _collectives_of_loads, folder, ["sample", "full"]):
        assert sample == ["all_reduce", "all_reduce"], sample
        assert full[0] == "all_reduce" and full[-1] == "all_reduce", full


def _load_bin_folder(folder):
    with pytest.raises(zload.CheckpointNotFoundError) as info:
        zload.load_into(torch.nn.Linear(3, 2), folder)
    return str(info.value)


def test_load_into_says_to_convert_bin_weights_on_every_rank(tmp_path):
    folder = bin_weights_folder(tmp_path / "single", "single")
    messages = run_world(2, _load_bin_folder, str(folder))
    assert messages[0] == messages[1] and "it holds PyTorch .bin weights (pytorch_model.bin)" in messages[0]
