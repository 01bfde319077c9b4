"""Node-local checkpoints: ranks that cannot see a file receive their bytes from ranks that can."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zload

from tests.support import REPO, SUPPORT, models
from tests.support.checkpoints import save_sharded
from tests.support.harness import free_port, run_world
from tests.support.zero3 import build_zero, check_against
from tests.unit.test_node_local import _checkpoint

NODE_SCRIPT = SUPPORT / "node_local_rank.py"


def _load_on_node(node_dirs, reference, staging_bytes):
    """Rank r resolves the relative path ``ckpt`` inside ``node_dirs[r]`` (its node's disk)."""
    model = build_zero(models.Awkward)
    cwd = os.getcwd()
    try:
        os.chdir(node_dirs[dist.get_rank()])
        report = zload.load_into(model, "ckpt", staging_bytes=staging_bytes)
    finally:
        os.chdir(cwd)
    check_against(model, torch.load(reference))
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_a_node_without_the_files(tmp_path, world):
    """Only node 0 (rank 0) has the checkpoint; the others get exactly their bytes from it."""
    _, _, reference = _checkpoint(tmp_path, seed=31)
    (tmp_path / "node1").mkdir()
    nodes = [tmp_path / "node0"] + [tmp_path / "node1"] * (world - 1)
    reports = run_world(world, _load_on_node, nodes, reference, 256)
    assert all(r.bytes_read == r.bytes_sent == 0 and r.bytes_received > 0 for r in reports[1:])
    assert reports[0].bytes_sent == sum(r.bytes_received for r in reports[1:])  # what the others received


def test_a_whole_copy_on_every_node(tmp_path):
    """Each node holds its own full copy under its own path: every rank reads its own copy, and
    nothing is sent (the views' fingerprints match although the paths differ)."""
    _, folder, reference = _checkpoint(tmp_path, seed=32)
    shutil.copytree(folder, tmp_path / "node1" / "ckpt")
    shutil.copytree(folder, tmp_path / "node2" / "ckpt")
    nodes = [tmp_path / "node0", tmp_path / "node1", tmp_path / "node2"]
    reports = run_world(3, _load_on_node, nodes, reference, 256)
    assert all(r.bytes_read > 0 and r.bytes_sent == r.bytes_received == 0 for r in reports)


def _load_while_the_reader_fails(node_dirs):
    """Rank 0 serves the others; its second batch read fails (a disk error mid-transfer)."""
    reader = importlib.import_module("zload.loading.execute").RangeReader
    real, calls = reader.read, []

    def failing_on_the_second_batch(self, ranges):
        calls.append(1)
        if len(calls) == 2:
            raise zload.CheckpointError("model-00001.safetensors: read failed at byte 4096: Input/output error")
        return real(self, ranges)

    model = build_zero(models.Awkward)
    cwd = os.getcwd()
    reader.read = failing_on_the_second_batch
    try:
        os.chdir(node_dirs[dist.get_rank()])
        zload.load_into(model, "ckpt", staging_bytes=256)
    except zload.ZloadError as e:
        return type(e).__name__, str(e)
    finally:
        reader.read = real
        os.chdir(cwd)
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_a_reader_failing_mid_transfer_fails_every_rank(tmp_path, world):
    """No rank is left waiting for bytes that will not come: all raise the same error."""
    _checkpoint(tmp_path, seed=32)
    (tmp_path / "node1").mkdir()
    nodes = [tmp_path / "node0"] + [tmp_path / "node1"] * (world - 1)
    results = run_world(world, _load_while_the_reader_fails, nodes)
    assert all(r is not None for r in results), results
    assert len(set(results)) == 1  # the same error on every rank
    kind, message = results[0]
    assert kind == "CheckpointError" and "failed part-way" in message
    assert "[rank 0] model-00001.safetensors: read failed" in message
    requesters = ", ".join(str(r) for r in range(1, world))
    assert f"[rank {requesters}] rank 0 could not read" in message


def test_shards_split_across_nodes(tmp_path):
    """Each node holds one shard (and the index): every rank needs both."""
    _, folder, reference = _checkpoint(tmp_path, seed=32)
    other = tmp_path / "node1" / "ckpt"
    shutil.copytree(folder, other)
    (folder / "model-00002-of-00002.safetensors").unlink()
    (other / "model-00001-of-00002.safetensors").unlink()
    nodes = [tmp_path / "node0", tmp_path / "node1", tmp_path / "node0", tmp_path / "node1"]
    reports = run_world(4, _load_on_node, nodes, reference, 1 << 20)
    assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in reports)  # readers are spread
    assert sum(r.bytes_sent for r in reports) == sum(r.bytes_received for r in reports)


def test_two_torchrun_nodes(tmp_path):
    """Two torchrun agents (--nnodes 2) on this machine; only node 0 has the checkpoint."""
    _, _, reference = _checkpoint(tmp_path, seed=33)
    (tmp_path / "node1").mkdir()
    port, out = free_port(), tmp_path / "results"
    out.mkdir()
    agents = []
    for node in (0, 1):
        env = dict(os.environ, NODE_DIR=str(tmp_path / f"node{node}"), RESULTS=str(out),
                   REFERENCE=str(reference), PYTHONPATH=str(REPO))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(NODE_SCRIPT)]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True))
    logs = [a.communicate(timeout=300)[0] for a in agents]
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(results) == 4, "\n".join(log[-3000:] for log in logs)
    for r in results:
        assert r["ok"], r
        on_node0 = r["rank"] < 2
        assert (r["received"] == 0) == on_node0 and (r["read"] > 0) == on_node0, r


def _load_transposed_on_node(node_dirs, reference_folder):
    from tests.distributed.test_load_converted import MODELS

    cls, make_config = MODELS["transposed_llama"]
    reference = cls.from_pretrained(reference_folder).state_dict()
    model = build_zero(lambda: cls(make_config()))
    cwd = os.getcwd()
    try:
        os.chdir(node_dirs[dist.get_rank()])
        report = zload.load_into(model, "ckpt")
    finally:
        os.chdir(cwd)
    check_against(model, reference, names=[n for n, _ in model.named_parameters()])
    return report.slow_path


def test_conversion_slow_path_reads_on_the_node_with_the_files(tmp_path):
    """The rank that converts a transposed tensor must be one that can read it: here only rank 0."""
    pytest.importorskip("transformers")
    from tests.distributed.test_load_converted import MODELS

    cls, make_config = MODELS["transposed_llama"]
    torch.manual_seed(34)
    cls(make_config()).save_pretrained(tmp_path / "node0" / "ckpt", max_shard_size="30KB")
    (tmp_path / "node1").mkdir()
    nodes = [tmp_path / "node0", tmp_path / "node1", tmp_path / "node1"]
    for slow_path in run_world(3, _load_transposed_on_node, nodes, tmp_path / "node0" / "ckpt"):
        assert len(slow_path) == 2


def _stages_of_a_transposed_load(node_dirs, reference_folder):
    """``_load_transposed_on_node``, recording the stages the load goes through (the engine's update
    is staged by the DeepSpeed integration)."""
    modules = [importlib.import_module(f"zload.{name}") for name in ("loading.load_into", "integrations.deepspeed")]
    real, entered = modules[0].stage, []

    def recording(what, leaves):
        entered.append(what)
        return real(what, leaves)

    for module in modules:
        module.stage = recording
    try:
        _load_transposed_on_node(node_dirs, reference_folder)
    finally:
        for module in modules:
            module.stage = real
    return entered


def test_each_byte_source_is_delivered_in_a_stage_of_its_own_in_one_order(tmp_path):
    """This rank's files, then the ranges of the files some rank lacks, then the slow path's
    conversions: each in its own stage (which a peer lost meanwhile names), then the finishing
    touches and the engine's update, in the same order on every rank."""
    pytest.importorskip("transformers")
    from tests.distributed.test_load_converted import MODELS

    cls, make_config = MODELS["transposed_llama"]
    torch.manual_seed(35)
    cls(make_config()).save_pretrained(tmp_path / "node0" / "ckpt", max_shard_size="30KB")
    (tmp_path / "node1").mkdir()
    stages = run_world(2, _stages_of_a_transposed_load, [tmp_path / "node0", tmp_path / "node1"],
                       tmp_path / "node0" / "ckpt")
    assert stages == [["indexing and planning the load of ckpt", "reading ckpt",
                       "sending and receiving the parts of ckpt some ranks lack",
                       "converting the tensors of ckpt that one rank builds", "finishing the tensors of ckpt",
                       "updating the engine after the load"]] * 2


def test_shards_with_one_name_in_two_subfolders(tmp_path):
    """Files are named to other ranks by their path in the checkpoint folder, not their base name:
    a/x.safetensors and b/x.safetensors are two files."""
    state = models.state_with_seed(models.Awkward, seed=35)
    folder = tmp_path / "node0" / "ckpt"
    names = sorted(state)
    weight_map = {}
    for sub, part in (("a", names[::2]), ("b", names[1::2])):
        (folder / sub).mkdir(parents=True)
        save_file({n: state[n] for n in part}, str(folder / sub / "x.safetensors"))
        weight_map.update(dict.fromkeys(part, f"{sub}/x.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reference = tmp_path / "reference.pt"
    torch.save(state, reference)
    (tmp_path / "node1").mkdir()
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    reports = run_world(2, _load_on_node, nodes, reference, 256)
    assert reports[1].bytes_read == 0 and reports[1].bytes_received > 0


def _load_on_node_refused(node_dirs):
    """As ``_load_on_node``, but the load must be refused: the error, and whether the model stayed."""
    model = build_zero(models.Awkward)
    before = {n: p.ds_tensor.clone() for n, p in model.named_parameters()}
    cwd = os.getcwd()
    try:
        os.chdir(node_dirs[dist.get_rank()])
        zload.load_into(model, "ckpt", staging_bytes=256)
    except zload.ZloadError as e:
        unchanged = all(torch.equal(before[n], p.ds_tensor) for n, p in model.named_parameters())
        return type(e).__name__, str(e), unchanged
    finally:
        os.chdir(cwd)
    return None


def _file_of_its_own_name(folder, node):
    """Node 0 holds a.safetensors, node 1 b.safetensors (other values): no index on either."""
    save_file(models.state_with_seed(models.Awkward, seed=36 + node), str(folder / "ab"[node]) + ".safetensors")


def _one_shard_of_two(folder, node):
    """An index over a.safetensors and b.safetensors on each node, each node holding only one of
    them, which holds 'cube' in that node's index (with other values)."""
    state = models.state_with_seed(models.Awkward, seed=36 + node)
    names = sorted(n for n in state if n != "cube")
    weight_map = {n: "ab"[i % 2] + ".safetensors" for i, n in enumerate(names)}
    weight_map["cube"] = mine = "ab"[node] + ".safetensors"
    save_file({n: state[n] for n, f in weight_map.items() if f == mine}, str(folder / mine))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _index_or_lone_shard(folder, node):
    """Node 0 holds an index and its two shards, node 1 the first shard alone."""
    save_sharded(models.state_with_seed(models.Awkward, seed=36), folder, shards=2)
    if node:
        (folder / "model.safetensors.index.json").unlink()
        (folder / "model-00002-of-00002.safetensors").unlink()


@pytest.mark.parametrize("make, says", [(_file_of_its_own_name, "see files"),
                                        (_one_shard_of_two, "different weight maps"),
                                        (_index_or_lone_shard, "see files")])
def test_nodes_that_hold_different_checkpoints_are_refused(tmp_path, make, says):
    """Each rank takes the tensors of a file it lacks from another rank's view: two nodes that
    hold different files, or index the same files differently, would each load the other's values
    (and one ZeRO-3 tensor from both). Refused on every rank, the model unchanged."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node, folder in enumerate(nodes):
        (folder / "ckpt").mkdir(parents=True)
        make(folder / "ckpt", node)
    results = run_world(2, _load_on_node_refused, nodes)
    assert all(r is not None for r in results), results
    kinds, messages, unchanged = zip(*results)
    assert set(kinds) == {"InvalidCheckpointError"} and len(set(messages)) == 1 and all(unchanged)
    assert "ranks see different checkpoints" in messages[0] and says in messages[0]
