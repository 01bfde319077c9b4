"""Errors: built-in bases where they mean one, the fields ``path``, ``tensor`` and ``ranks``, and
the same class and fields on every rank when one rank's problem is raised on all."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch.distributed as dist

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import DS_CONFIG, build_zero, refusal
from tests.unit.test_errors import SHARD, _checkpoint, _fields, _rewrite_header, _unknown_dtype


# ------------------------------------------------------------------------------------------------
# several ranks: one rank's error, the same class and fields on all


def _load_on_node(node_dirs, key_map=None):
    """Load ``ckpt`` in this rank's node folder; the error's class, fields and message."""
    model = build_zero(models.Awkward)
    cwd = os.getcwd()
    try:
        os.chdir(node_dirs[dist.get_rank()])
        zload.load_into(model, "ckpt", key_map=key_map)
    except zload.ZloadError as e:
        return _fields(e) + (isinstance(e, ValueError), str(e))
    finally:
        os.chdir(cwd)
    raise AssertionError("the load went ahead")


@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_header_only_rank_1_sees_is_the_same_error_on_every_rank(tmp_path, world):
    """Node-local copies: rank 1's node holds a shard with a bad header; every rank raises an
    InvalidCheckpointError naming rank 1's file, its tensor and rank 1."""
    good = _checkpoint(tmp_path / "node0" / "ckpt")
    bad = shutil.copytree(good, tmp_path / "node1" / "ckpt")
    _rewrite_header(bad / SHARD, _unknown_dtype("odd.bias"))
    nodes = [tmp_path / "node0", tmp_path / "node1"] + [tmp_path / "node0"] * (world - 2)
    results = run_world(world, _load_on_node, nodes, timeout=120)
    assert len(set(results)) == 1, results
    kind, path, tensor, ranks, is_value_error, message = results[0]
    assert (kind, path, tensor, ranks, is_value_error) == (
        "InvalidCheckpointError", str(bad / SHARD), "odd.bias", (1,), True), message
    assert "[rank 1]" in message and "unknown dtype 'F99'" in message


def _drops_on_rank_1(name):
    return None if dist.get_rank() == 1 and name == "odd.bias" else name


def test_a_plan_problem_on_one_rank_is_a_plan_error_naming_it_on_every_rank(tmp_path):
    _checkpoint(tmp_path / "node0" / "ckpt")
    results = run_world(3, _load_on_node, [tmp_path / "node0"] * 3, _drops_on_rank_1, timeout=120)
    assert len(set(results)) == 1, results
    kind, path, tensor, ranks, is_value_error, message = results[0]
    assert (kind, path, tensor, ranks, is_value_error) == ("PlanError", None, None, (1,), True), message


def _save_into_a_file(target):
    model = build_zero(models.Awkward)
    try:
        zload.save(model, target)
    except zload.ZloadError as e:
        return _fields(e)
    raise AssertionError("the save went ahead")


def test_a_problem_only_rank_0_meets_while_saving_names_the_path_on_every_rank(tmp_path):
    target = tmp_path / "out"
    target.write_bytes(b"someone's file")
    results = run_world(2, _save_into_a_file, str(target), timeout=120)
    assert results == [("ArgumentValueError", str(target), None, (0,))] * 2


def _from_pretrained_with_own_config(folder, configs):
    """``zload.from_pretrained`` of ``folder`` with this rank's DeepSpeed config (a node-local file)."""
    from transformers import LlamaForCausalLM

    return refusal(lambda: zload.from_pretrained(LlamaForCausalLM, folder, configs[dist.get_rank()]))


def test_a_ds_config_only_rank_1_cannot_read_is_the_same_error_on_every_rank(tmp_path):
    pytest.importorskip("transformers")
    from tests.unit.test_from_pretrained import _save_llama

    _save_llama(tmp_path / "llama")
    readable, missing = tmp_path / "node0" / "ds.json", tmp_path / "node1" / "ds.json"
    readable.parent.mkdir()
    readable.write_text(json.dumps(DS_CONFIG))
    results = run_world(2, _from_pretrained_with_own_config, str(tmp_path / "llama"), [str(readable), str(missing)],
                        timeout=60)
    for refused in results:
        assert refused is not None and (refused.kind, refused.path, refused.ranks) == (
            "ArgumentValueError", str(missing), (1,)), refused
        assert f"[rank 1] ds_config: cannot read this DeepSpeed config: {missing}" in refused.message
