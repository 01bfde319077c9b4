"""load_into on models built under zero.Init, in real 1-4 process DeepSpeed worlds."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import build_zero, check_against, load_expected, load_recording_warnings

WORLD_SIZES = [1, 2, 3, 4]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _save(tmp_path, state, name="model.safetensors"):
    path = tmp_path / name
    save_file(state, str(path))
    return path


class Checked(NamedTuple):
    report: zload.LoadReport
    compared: int  # tensors equal to the checkpoint's, gathered


def _load_awkward(path):
    model = build_zero(models.Awkward)
    report = zload.load_into(model, path)
    return Checked(report, check_against(model, load_expected(path)))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_awkward_shapes_bit_exact(tmp_path, world):
    """numel < world, zero-size, scalar and odd shapes; int and float buffers; padding zeroed."""
    state = models.state_with_seed(models.Awkward, seed=1)
    state["position_ids"] = torch.arange(6) * 7  # a non-persistent buffer the checkpoint happens to hold
    path = _save(tmp_path, state)
    for checked in run_world(world, _load_awkward, path):
        assert checked.compared == len(state)
        assert sorted(checked.report.loaded) == sorted(state)
        assert checked.report.missing == [] and checked.report.unexpected == []


def _load_params_only(path):
    model = build_zero(models.ParamsOnly)
    report = zload.load_into(model, path)
    check_against(model, load_expected(path))
    return report


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_each_rank_reads_only_its_partitions(tmp_path, world):
    """Bytes read per rank are exactly its valid partition bytes; together, the checkpoint once."""
    state = models.state_with_seed(models.ParamsOnly, seed=2)
    path = _save(tmp_path, state)
    reports = run_world(world, _load_params_only, path)
    total = sum(t.numel() * t.element_size() for t in state.values())
    for rank, report in enumerate(reports):
        assert report.checkpoint_bytes == total
        expected = 0
        for t in state.values():
            per_rank = -(-t.numel() // world)
            expected += len(range(t.numel())[rank * per_rank:(rank + 1) * per_rank]) * t.element_size()
        assert report.bytes_read == expected, f"rank {rank} read {report.bytes_read} bytes, owns {expected}"
    assert sum(r.bytes_read for r in reports) == total


class DtypeLoad(NamedTuple):
    partition_dtypes: set[str]  # of the model's partitions, as built
    conversions: dict[str, list[str]]  # LoadReport.conversions


def _load_with_dtype(path, model_dtype):
    model = build_zero(models.ParamsOnly, dtype=DTYPES[model_dtype])
    partition_dtypes = {str(p.ds_tensor.dtype) for p in model.parameters()}
    report = zload.load_into(model, path)
    check_against(model, load_expected(path))
    return DtypeLoad(partition_dtypes, report.conversions)


@pytest.mark.parametrize("file_dtype", DTYPES)
@pytest.mark.parametrize("model_dtype", DTYPES)
def test_dtype_conversions_bit_exact(tmp_path, file_dtype, model_dtype):
    """Every fp32/fp16/bf16 pair, converted exactly as Tensor.to would (checked at world size 3)."""
    state = models.state_with_seed(models.ParamsOnly, seed=3, dtype=DTYPES[file_dtype])
    state["c"][:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    path = _save(tmp_path, state)
    for load in run_world(3, _load_with_dtype, path, model_dtype):
        assert load.partition_dtypes == {str(DTYPES[model_dtype])}
        if file_dtype == model_dtype:
            assert load.conversions == {}
        else:
            (pair,) = load.conversions
            assert pair.endswith(f"->{model_dtype}") and len(load.conversions[pair]) == len(state)


def _load_tied(path):
    model = build_zero(models.Tied)
    report = zload.load_into(model, path)
    expected = load_expected(path)
    (stored,) = expected.values()
    check_against(model, {"embed.weight": stored, "head.weight": stored})
    assert model.head.weight is model.embed.weight
    return report


@pytest.mark.parametrize("stored_name", ["embed.weight", "head.weight"])
@pytest.mark.parametrize("world", [2, 3])
def test_tied_weights_from_either_name(tmp_path, world, stored_name):
    state = models.state_with_seed(models.Tied, seed=4)
    path = _save(tmp_path, {stored_name: state[stored_name]})
    for report in run_world(world, _load_tied, path):
        assert report.loaded == ["embed.weight"] and report.missing == [] and report.unexpected == []


def _load_orphans(path):
    model = build_zero(models.TinyViT, dtype=torch.bfloat16)
    models.patch_layerscales(model)
    orphan = model.blocks[0].ls1.scale_factor
    assert orphan.shape == (0,) and not hasattr(orphan, "ds_id")  # the bug report's situation
    load = load_recording_warnings(model, path)
    check_against(model, load_expected(path))
    sibling = model.blocks[0].fc.weight
    for block in model.blocks:
        param = block.ls1.scale_factor
        assert hasattr(param, "ds_id"), "orphan was not converted to a ZeRO-3 parameter"
        assert param.ds_tensor.dtype == sibling.ds_tensor.dtype == torch.bfloat16
        assert param.ds_process_group is sibling.ds_process_group
    return load


@pytest.mark.parametrize("world", [1, 2, 3])
def test_orphan_layerscale_is_loaded_and_repaired(tmp_path, world):
    """OpenVLA's `scale_factor = nn.Parameter(gamma.clone())` after zero.Init: [0]-shaped, no ds_*."""
    state = models.state_with_seed(models.patched_tiny_vit, seed=5)
    assert "blocks.0.ls1.scale_factor" in state
    path = _save(tmp_path, state)
    for rank, load in enumerate(run_world(world, _load_orphans, path)):
        orphans = load.report.repaired_orphans
        assert orphans == ["blocks.0.ls1.scale_factor", "blocks.1.ls1.scale_factor"]
        for name in orphans:  # a warning the same on every rank: rank 0 gives it
            assert any(name in m and "ZeRO-3" in m for m in load.messages) == (rank == 0), load.messages


def _plain_module_rank_body(path):
    torch.manual_seed(dist.get_rank())  # every rank starts from different values
    model = models.Awkward()
    zload.load_into(model, path)
    return check_against(model, load_expected(path))


@pytest.mark.parametrize("world", [1, 2])
def test_plain_module_is_written_in_full_on_every_rank(tmp_path, world):
    state = models.state_with_seed(models.Awkward, seed=6)
    path = _save(tmp_path, state)
    assert run_world(world, _plain_module_rank_body, path) == [len(state)] * world
