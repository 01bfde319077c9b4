"""Hostile checkpoints and files that change under a multi-rank load: every rank raises the same
error or every rank loads the same validated bytes; no rank waits forever, no silent mix."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zload

from tests.distributed.test_bad_inputs import _load_expecting_error, load_on_nodes
from tests.support import models
from tests.support.checkpoints import save_sharded
from tests.support.harness import run_world, run_world_where_ranks_die
from tests.support.zero3 import assert_unchanged, build_zero, check_against, snapshot

SHARD = "model-00001-of-00002.safetensors"


def _checkpoint(folder, seed=1):
    state = models.state_with_seed(models.Awkward, seed=seed)
    return state, save_sharded(state, folder, shards=2)


def _same_error(results):
    assert len(set(results)) == 1, f"ranks disagree: {results}"
    return results[0]


# --------------------------------------------------------------------------------------------
# 5. outside the folder; 6. nesting and any exception on one rank; 7. FIFOs


def test_an_index_entry_outside_the_folder_fails_every_rank(tmp_path):
    _, folder = _checkpoint(tmp_path / "ckpt")
    outside = tmp_path / "other.safetensors"
    save_file(models.state_with_seed(models.Awkward, seed=5), str(outside))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["cube"] = "../other.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    kind, message = _same_error(run_world(2, _load_expecting_error, folder, timeout=60))
    assert kind == "InvalidCheckpointError" and "'../other.safetensors'" in message and "'cube'" in message


def _node_copies(tmp_path, world, change_node1=None):
    """node0/ckpt and node1/ckpt (rank 0 on node 0, the others on node 1); ``change_node1(folder)``
    alters node 1's copy."""
    _, folder = _checkpoint(tmp_path / "node0" / "ckpt")
    other = shutil.copytree(folder, tmp_path / "node1" / "ckpt")
    if change_node1:
        change_node1(other)
    return [tmp_path / "node0"] + [tmp_path / "node1"] * (world - 1)


def test_deep_nesting_in_one_ranks_copy_fails_every_rank(tmp_path):
    """Only rank 1's index nests deeply: it must not raise alone while rank 0 waits for it."""
    def nest(folder):
        index = folder / "model.safetensors.index.json"
        index.write_bytes(index.read_bytes()[:-1] + b', "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")

    nodes = _node_copies(tmp_path, 2, nest)
    kind, message = _same_error(run_world(2, _load_expecting_error, "ckpt", nodes, timeout=60))
    assert kind == "InvalidCheckpointError" and "[rank 1]" in message and "nested too deeply" in message
    assert "model.safetensors.index.json" in message


def _load_failing_oddly_on(rank, path):
    """Indexing raises something no code expects, on one rank only."""
    checkpoint = importlib.import_module("zload.checkpoint.views")
    real = checkpoint.open_checkpoint

    def odd(*args, **kwargs):
        if dist.get_rank() == rank:
            raise KeyError("a bug nobody foresaw")
        return real(*args, **kwargs)

    checkpoint.open_checkpoint = odd
    try:
        return _load_expecting_error(path)
    finally:
        checkpoint.open_checkpoint = real


def test_any_exception_on_one_rank_while_indexing_fails_every_rank(tmp_path):
    _, folder = _checkpoint(tmp_path / "ckpt")
    kind, message = _same_error(run_world(3, _load_failing_oddly_on, 2, folder, timeout=60))
    assert kind == "ZloadError" and "[rank 2]" in message and "KeyError" in message
    assert "a bug nobody foresaw" in message


@pytest.mark.parametrize("fifo", ["adapter.safetensors.index.json", SHARD])
def test_a_fifo_fails_every_rank_without_blocking(tmp_path, fifo):
    folder = tmp_path / "ckpt"
    if fifo == SHARD:
        _checkpoint(folder)
        (folder / SHARD).unlink()
    else:
        folder.mkdir()
    os.mkfifo(folder / fifo)
    kind, message = _same_error(run_world(2, _load_expecting_error, folder, timeout=60))
    assert kind == "InvalidCheckpointError" and fifo in message and "is a FIFO" in message


# --------------------------------------------------------------------------------------------
# 8, 10. files that change during the load


def _load_while_rank0_changes(folder, how, reference):
    """Rank 0 changes a shard just before it starts reading (after every rank planned)."""
    load = importlib.import_module("zload.loading.load_into")
    real = load.execute
    shard = os.path.join(folder, SHARD)
    other = os.path.join(os.path.dirname(folder), "other", SHARD)

    def change_then_read(*args, **kwargs):
        if how == "renamed_over":  # a concurrent save renaming its new shard into place
            shutil.copy(other, shard + ".new")
            os.replace(shard + ".new", shard)
        elif how == "fifo":
            os.mkfifo(shard + ".fifo")
            os.replace(shard + ".fifo", shard)
        else:  # the same bytes count, other values, written into the same file
            mtime = os.stat(shard).st_mtime_ns
            with open(other, "rb") as src, open(shard, "r+b") as dst:
                dst.write(src.read())
            os.utime(shard, ns=(mtime + 10**6, mtime + 10**6))  # whatever the mtime granularity
        return real(*args, **kwargs)

    model = build_zero(models.Awkward)
    if dist.get_rank() == 0:
        load.execute = change_then_read
    try:
        zload.load_into(model, folder)
    except zload.ZloadError as e:
        return type(e).__name__, str(e)
    finally:
        load.execute = real
    check_against(model, torch.load(reference))
    return None


@pytest.mark.parametrize("how", ["renamed_over", "fifo", "changed_in_place"])
def test_a_shard_that_changes_during_the_load(tmp_path, how):
    """Renamed over or replaced by a FIFO: every rank still reads the file whose header it checked,
    and the load is bit-exact. Changed in place: every rank raises the same error."""
    state, folder = _checkpoint(tmp_path / "ckpt", seed=1)
    other = {name: -t if t.is_floating_point() else t + 1 for name, t in state.items()}
    save_sharded(other, tmp_path / "other", shards=2)
    reference = tmp_path / "reference.pt"
    torch.save(state, reference)
    results = run_world(2, _load_while_rank0_changes, str(folder), how, reference, timeout=60)
    if how != "changed_in_place":
        assert results == [None, None]
        return
    kind, message = _same_error(results)
    assert kind == "CheckpointError" and "partly written" in message
    assert f"{folder / SHARD}: changed while it was being read" in message  # rank 0 saw it, maybe 1 too


# --------------------------------------------------------------------------------------------
# 9. copies on different nodes that differ


def _flip_data(folder, tensor="cube", element=0):
    """Negate one element of ``tensor`` in place: same header, other data."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    path = folder / index["weight_map"][tensor]
    state = load_file(str(path))
    state[tensor].view(-1)[element] *= -1
    save_file(state, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("world", [2, 3])
def test_node_copies_with_the_same_headers_but_other_data_are_refused(tmp_path, world):
    nodes = _node_copies(tmp_path, world, _flip_data)
    kind, message = _same_error(run_world(world, _load_expecting_error, "ckpt", nodes, timeout=60))
    assert kind == "InvalidCheckpointError" and "differ in their data (same headers)" in message
    assert f"ranks [0]; ranks {list(range(1, world))}" in message


def _save_plain(folder, seed):
    model = models.Awkward()
    model.load_state_dict(models.state_with_seed(models.Awkward, seed=seed))
    zload.save(model, folder, max_shard_size=600)


def test_two_zload_saves_never_share_a_header(tmp_path):
    """zload.save records a digest of each file's data in its header: copies of two different saves
    differ in their headers, whatever a sample of their data would show."""
    _save_plain(tmp_path / "node0" / "ckpt", seed=3)
    _save_plain(tmp_path / "node1" / "ckpt", seed=4)
    files = sorted(p.name for p in (tmp_path / "node0" / "ckpt").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "node1" / "ckpt").glob("*.safetensors"))
    for name in files:
        raw = [(tmp_path / node / "ckpt" / name).read_bytes() for node in ("node0", "node1")]
        assert raw[0][:8] == raw[1][:8] and raw[0][8:int.from_bytes(raw[0][:8], "little")] != \
            raw[1][8:int.from_bytes(raw[1][:8], "little")]
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    kind, message = _same_error(run_world(2, _load_expecting_error, "ckpt", nodes, timeout=60))
    assert kind == "InvalidCheckpointError" and "differ in their headers" in message


def test_full_verification_catches_what_the_sample_does_not_look_at(tmp_path):
    """One element differs between the nodes' copies, in a region no sample window covers."""
    state = models.state_with_seed(models.Awkward, seed=1)
    state["cube"] = torch.randn(200, 17, 30)  # 408,000 bytes: the 64 windows cover a fraction
    folder = save_sharded(state, tmp_path / "node0" / "ckpt", shards=1)
    other = shutil.copytree(folder, tmp_path / "node1" / "ckpt")
    _flip_data(other, "cube", element=50_000)  # byte 200,000 of cube: between two windows
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    kind, message = _same_error(run_world(2, load_on_nodes, "ckpt", nodes, verify="full", timeout=60))
    assert kind == "InvalidCheckpointError" and "differ in their data (same headers)" in message


@pytest.mark.parametrize("world", [1, 2])
def test_full_verification_checks_the_digest_zload_save_recorded(tmp_path, world):
    """A bit flipped in a file zload.save wrote (a corrupt copy, one node or all)."""
    _save_plain(tmp_path / "ckpt", seed=5)
    shard = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01
    shard.write_bytes(raw)
    assert _same_error(run_world(world, load_on_nodes, tmp_path / "ckpt")) is None
    kind, message = _same_error(run_world(world, load_on_nodes, tmp_path / "ckpt", verify="full"))
    assert kind == "InvalidCheckpointError" and f"{shard}: its data do not match the digest recorded" in message


# --------------------------------------------------------------------------------------------
# 12. a peer process that dies mid-load


class Survived(NamedTuple):
    kind: str  # the class name of the error the load raised
    message: str
    cause: str  # the class name of its __cause__
    stage: str | None  # its stage attribute


def _load_while_a_rank_dies(folder, dying, where):
    model = build_zero(models.Awkward)
    before = snapshot(model)
    if dist.get_rank() == dying:
        def die(*args, **kwargs):
            os._exit(9)

        module, name = {"indexing": ("zload.loading.agree", "local_view"), "reading": ("zload.loading.load_into", "execute")}[where]
        getattr(importlib.import_module(module), name)  # AttributeError if the name moved: the patch below must take
        setattr(importlib.import_module(module), name, die)
    try:
        zload.load_into(model, folder)
    except zload.ZloadError as e:
        if where == "indexing":
            assert_unchanged(model, before)
        return Survived(type(e).__name__, str(e), type(e.__cause__).__name__, getattr(e, "stage", None))
    return None


@pytest.mark.parametrize("where", ["indexing", "reading"])
def test_a_peer_that_dies_mid_load_is_named_by_the_survivors(tmp_path, where):
    _, folder = _checkpoint(tmp_path / "ckpt")
    results = run_world_where_ranks_die(3, _load_while_a_rank_dies, str(folder), 1, where, timeout=120)
    assert results[1] is None, results  # it died
    for ok, survived in (results[0], results[2]):
        assert ok, survived
        assert survived.kind == "PeerLostError" and survived.cause == "RuntimeError", survived
        assert "another rank's process has probably died" in survived.message
        if where == "indexing":
            assert survived.stage.startswith("indexing and planning")
            assert "The model was not changed" in survived.message
        else:
            assert survived.stage.startswith("reading") and "The model is partly written" in survived.message
