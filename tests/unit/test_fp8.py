"""Issue 19: FP8 checkpoints (block-wise or per-tensor scales) dequantised into float32, bfloat16
and float16 partitions, bit for bit against the reference dequantisation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import zload
from zload import open_checkpoint
from zload.loading.execute import execute
from zload.checkpoint.index import CheckpointIndex, TensorEntry
from zload.model.names import match
from zload.loading.plan import make_plan
from zload.checkpoint.quantized import Quantization, read_quantization
from zload.model.targets import FULL, PARTITION, Target
from zload.checkpoint.partition import Partition

from tests.support.fp8_checkpoints import BAD_CONFIGS, dequantize, quantize

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the Triton interpreter: NaN, inf
DST_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _index(*entries) -> CheckpointIndex:
    """One file, tensors back to back after a 100-byte header: (name, dtype code, shape, itemsize)."""
    tensors, offset = {}, 100
    for name, dtype, shape, itemsize in entries:
        nbytes = itemsize * torch.Size(shape).numel()
        tensors[name] = TensorEntry(name, "f.safetensors", dtype, shape, offset, nbytes)
        offset += nbytes
    return CheckpointIndex("f.safetensors", ("f.safetensors",), tensors)


def _target(name, shape, world, rank, dtype=torch.bfloat16):
    numel = torch.Size(shape).numel()
    if world is None:
        return Target((name,), FULL, shape, dtype, True)
    return Target((name,), PARTITION, shape, dtype, True, Partition(numel, world, rank))


def _plan(index, targets, quantization=Quantization("fp8", (5, 7))):
    return make_plan(index, targets, matching=match(index, targets, quantization=quantization))


# a 13 x 11 weight in blocks of 5 x 7: the blocks divide neither dimension; scales 3 x 2
WEIGHT = ("w", "F8_E4M3", (13, 11), 1)
SCALE = ("w_scale_inv", "F32", (3, 2), 4)
SCALE_AT = 100 + 13 * 11


@pytest.mark.parametrize("world,expected", [
    (1, [(0, 6)]),
    # 48 elements a rank: rank 0 ends in row 4 (block row 0), rank 1 spans rows 4-8 (block rows
    # 0-1), rank 2 starts mid row 8 (block row 1) and ends in row 12 (block row 2)
    (3, [(0, 2), (0, 4), (2, 6)]),
    # 36 a rank: rows 0-3, 3-6 (block rows 0-1), 6-9, 9-12 (block rows 1-2)
    (4, [(0, 2), (0, 4), (2, 4), (2, 6)]),
])
def test_each_rank_reads_the_scale_rows_its_elements_need(world, expected):
    index = _index(WEIGHT, SCALE)
    for rank in range(world):
        plan = _plan(index, [_target("w", (13, 11), world, rank)])
        assert plan.problems == [] and plan.unexpected == [] and plan.missing == []
        (item,) = plan.items
        low, high = expected[rank]
        assert item.first_element == Partition(143, world, rank).owned[0]
        assert item.scale_span == ("f.safetensors", SCALE_AT + 4 * low, 4 * (high - low))
        assert plan.conversions == {"F8_E4M3->bfloat16": ["w"]}


def test_split_pieces_keep_their_elements_and_scale_rows():
    index = _index(WEIGHT, SCALE)
    (item,) = _plan(index, [_target("w", (13, 11), None, 0)]).items
    for max_bytes in (80, 100, 150, 400):
        parts = item.split(max_bytes)
        assert all(p.staged_nbytes <= max_bytes for p in parts)
        assert len(parts) > 1 or max_bytes == 400
        assert [p.first_element for p in parts] == [p.dst_offset for p in parts]
        assert sum(p.numel for p in parts) == 143
        for p in parts:
            rows = {(e // 11) // 5 for e in range(p.first_element, p.first_element + p.numel)}
            assert p.scale_rows == (min(rows), max(rows) + 1)
            assert p.offset == 100 + p.first_element


def test_per_tensor_scale_and_stacked_weights():
    per_tensor = _index(("a", "F8_E5M2", (4, 6), 1), ("a_scale", "BF16", (), 2))
    plan = _plan(per_tensor, [_target("a", (4, 6), 3, 2, torch.float32)], Quantization("fp8"))
    (item,) = plan.items
    assert plan.problems == [] and item.scale_rows == (0, 1) and item.scale_span[1:] == (124, 2)
    # (2, 13, 11) experts in blocks of 5 x 7: scales (2, 3, 2); expert 1 starts at block row 3
    stacked = _index(("e", "F8_E4M3", (2, 13, 11), 1), ("e_scale_inv", "F32", (2, 3, 2), 4))
    plan = _plan(stacked, [_target("e", (2, 13, 11), 2, 1)])
    (item,) = plan.items
    assert plan.problems == [] and item.first_element == 143 and item.scale_rows == (3, 6)


@pytest.mark.parametrize("entries,quantization,message", [
    ([WEIGHT], Quantization("fp8", (5, 7)), "F8_E4M3 weight without its scale"),
    ([WEIGHT, ("w_scale_inv", "F32", (2, 2), 4)], Quantization("fp8", (5, 7)),
     "has shape [2, 2]; a [13, 11] weight in blocks of [5, 7] needs [3, 2]"),
    ([WEIGHT, ("w_scale_inv", "I32", (3, 2), 4)], Quantization("fp8", (5, 7)), "is I32, not a float32"),
    ([WEIGHT, SCALE], Quantization("gptq", problem="config.json: quant_method 'gptq' is not supported"),
     "'gptq' is not supported"),
    ([WEIGHT, SCALE], Quantization("fp8"), "blocks of [128, 128] needs [1, 1]"),
    # both names, neither a single element beside the other: either could be the scale
    ([WEIGHT, SCALE, ("w_scale", "F32", (3, 2), 4)], Quantization("fp8", (5, 7)),
     "both 'w_scale_inv' (f.safetensors, shape [3, 2]) and 'w_scale' (f.safetensors, shape [3, 2]) are stored, "
     "and either could be its scale: with both, zload takes 'w_scale_inv' and expects 'w_scale' to be a single "
     "element; keep only the tensor that scales this weight"),
    ([WEIGHT, ("w_scale_inv", "F32", (), 4), ("w_scale", "F32", (3, 2), 4)], Quantization("fp8"),
     "both 'w_scale_inv' (f.safetensors, shape []) and 'w_scale' (f.safetensors, shape [3, 2]) are stored"),
])
def test_bad_scales_are_problems_naming_tensor_and_file(entries, quantization, message):
    plan = _plan(_index(*entries), [_target("w", (13, 11), 2, 0)], quantization)
    first = plan.problems[0]
    assert message in first and "'w'" in first and "f.safetensors" in first, plan.problems


@pytest.mark.parametrize("entries,quantization,scale", [
    ([WEIGHT, SCALE, ("w_scale", "F32", (), 4)], Quantization("fp8", (5, 7)), "w_scale_inv"),
    ([WEIGHT, SCALE, ("w_scale", "BF16", (1, 1), 2)], Quantization("fp8", (5, 7)), "w_scale_inv"),
    ([WEIGHT, ("w_scale_inv", "BF16", (), 2), ("w_scale", "F32", (), 4)], Quantization("fp8"), "w_scale_inv"),
])
def test_with_both_scale_names_the_inverse_scale_wins(entries, quantization, scale):
    """With both names stored, ``_scale_inv`` is the scale, and a one-element ``_scale`` beside it
    is consumed (neither unexpected nor read)."""
    plan = _plan(_index(*entries), [_target("w", (13, 11), 2, 1)], quantization)
    (item,) = plan.items
    assert plan.problems == [] and plan.unexpected == [] and plan.missing == []
    assert item.scale.entry.name == scale


def test_quantization_config_is_read_from_the_folder(tmp_path):
    assert read_quantization(str(tmp_path)) == Quantization()
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}}))
    assert read_quantization(str(tmp_path)) == Quantization("fp8", (64, 32))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    problem = read_quantization(str(tmp_path)).problem
    assert "config.json" in problem and "'awq' is not supported" in problem


@pytest.mark.parametrize("kind", sorted(BAD_CONFIGS))
def test_every_config_problem_names_config_json_and_no_path(tmp_path, kind):
    """Never raised (a load without FP8 weights must not fail for it); named as the checkpoint
    names its files, so that ranks with copies in different folders read the same problem."""
    make, says = BAD_CONFIGS[kind]
    make(tmp_path / "config.json")
    problem = read_quantization(str(tmp_path)).problem
    assert problem.startswith("config.json: ") and says in problem and str(tmp_path) not in problem, problem
    assert "fix config.json" in problem


def test_ranks_that_read_different_configs_agree_on_a_problem():
    from zload.checkpoint.quantized import agreed_quantization

    a, b = Quantization("fp8", (128, 128)), Quantization("fp8", (100, 100))
    assert agreed_quantization({0: a, 2: a}) == a and agreed_quantization({}) == Quantization()
    assert agreed_quantization({3: b, 0: a, 2: a, 1: Quantization()}).problem == (
        "config.json: the copies differ between ranks: ranks [0, 2] read quant_method 'fp8', weight_block_size "
        "[128, 128]; ranks [1] read no quantization_config (or no config.json); ranks [3] read quant_method "
        "'fp8', weight_block_size [100, 100]; every node must hold the same config.json")


def test_a_views_fingerprint_covers_its_quantization_config(tmp_path):
    """Ranks compare fingerprints to skip exchanging views: copies whose quantization configs
    differ must not compare equal; copies that differ elsewhere in config.json, or lie elsewhere,
    must."""
    from zload.checkpoint.views import local_view

    def config(name, block):
        return {"_name_or_path": name, "quantization_config": {"quant_method": "fp8", "weight_block_size": block}}

    configs = {"a": config("a", [128, 128]), "b": config("b", [128, 128]), "c": config("a", [100, 100]),
               "d": None, "e": None}  # d, e: nested too deep
    for name, content in configs.items():
        (tmp_path / name).mkdir()
        save_file({"w": torch.zeros(3)}, str(tmp_path / name / "model.safetensors"))
        if content is None:
            BAD_CONFIGS["nested 200,000 deep"][0](tmp_path / name / "config.json")
        else:
            (tmp_path / name / "config.json").write_text(json.dumps(content))
    views = {name: local_view(str(tmp_path / name)) for name in configs}
    try:
        assert views["a"].quantization == Quantization("fp8", (128, 128))
        assert views["a"].fingerprint == views["b"].fingerprint != views["c"].fingerprint
        assert views["d"].quantization.problem and views["d"].fingerprint == views["e"].fingerprint
        assert views["d"].fingerprint != views["a"].fingerprint
    finally:
        for view in views.values():
            view.close()


def _fp8_file(tmp_path, fp8_dtype, block):
    torch.manual_seed(0)
    weights = {"w": torch.randn(37, 29) * 5, "e": torch.randn(3, 13, 11)}
    stored, reference = {}, {}
    for name, w in weights.items():
        q, s = quantize(w, block, fp8_dtype)
        stored[name], stored[name + "_scale_inv"] = q, s
        reference[name] = dequantize(q, s, block)
    save_file(stored, str(tmp_path / "model.safetensors"))
    return reference


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dst_dtype", DST_DTYPES)
@pytest.mark.parametrize("block", [(5, 7), (16, 8), None])
def test_partitioned_reads_dequantise_bit_exact(tmp_path, fp8_dtype, dst_dtype, block):
    """Every rank's partition at W=1..4, read through small staging buffers (so reads split
    inside block rows), equals the reference dequantisation cast to the destination dtype."""
    reference = _fp8_file(tmp_path, fp8_dtype, block)
    quantization = Quantization("fp8", block)
    with open_checkpoint(str(tmp_path / "model.safetensors")) as index:
        for world in (1, 2, 3, 4):
            for rank in range(world):
                targets = [_target(n, tuple(r.shape), world, rank, dst_dtype) for n, r in reference.items()]
                plan = _plan(index, targets, quantization)
                assert plan.problems == [] and plan.unexpected == []
                dests = [torch.full((t.partition.size,), 7.0, dtype=dst_dtype) for t in targets]
                execute(index.opened, plan.items, dests, staging_bytes=512)
                for t, dest in zip(targets, dests):
                    low, high = t.partition.owned
                    expected = reference[t.name].reshape(-1)[low:high].to(dst_dtype)
                    assert torch.equal(dest[:high - low].reshape(-1).view(torch.uint8),
                                       expected.reshape(-1).view(torch.uint8)), (t.name, world, rank)


def test_staging_too_small_for_one_element_and_its_scales_is_a_problem(tmp_path):
    """Said while planning, with the size that works; it works (it was an IndexError mid-read)."""
    from zload.loading.plan import staging_problems

    reference = _fp8_file(tmp_path, torch.float8_e4m3fn, (5, 7))  # 'w' has 5 scales a row, 'e' 2
    with open_checkpoint(str(tmp_path / "model.safetensors")) as index:
        targets = [_target(n, tuple(r.shape), 2, 1, torch.float32) for n, r in reference.items()]
        plan = _plan(index, targets, Quantization("fp8", (5, 7)))
        (problem,) = staging_problems(plan, 64)
        assert problem == ("staging_bytes=64 is too small for the FP8 weights 'e', 'w': one element with its "
                           "row of scales takes up to 84 staging bytes, and reads are staged in halves of "
                           "staging_bytes less 64; pass staging_bytes=296 or more")
        assert staging_problems(plan, 295) and staging_problems(plan, 296) == []
        dests = [torch.full((t.partition.size,), 7.0) for t in targets]
        execute(index.opened, plan.items, dests, staging_bytes=296)
        for t, dest in zip(targets, dests):
            low, high = t.partition.owned
            assert torch.equal(dest[:high - low], reference[t.name].reshape(-1)[low:high]), t.name


def test_a_block_larger_than_the_weight_scales_like_one_of_its_size(tmp_path):
    """weight_block_size [1, 2**62]: one scale a row. Pieces that start or end inside a row widen
    their rows' scales, which took 2**62 elements a row (an overflow mid-read) before the block was
    cut to the weight."""
    torch.manual_seed(0)
    weight, scale = quantize(torch.randn(37, 29), (1, 29))
    save_file({"w": weight, "w_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    reference = dequantize(weight, scale, (1, 29)).reshape(-1)
    with open_checkpoint(str(tmp_path / "model.safetensors")) as index:
        for rank in range(3):
            target = _target("w", (37, 29), 3, rank, torch.float32)
            plan = _plan(index, [target], Quantization("fp8", (1, 2**62)))
            assert plan.problems == []
            dest = torch.full((target.partition.size,), 7.0)
            execute(index.opened, plan.items, [dest], staging_bytes=400)
            low, high = target.partition.owned
            assert torch.equal(dest[:high - low], reference[low:high]), rank


def _fp8_segments(fp8_dtype, scale_dtype, block, g):
    """A staging buffer holding a (2, 37, 29) FP8 weight of random bits (NaNs, subnormals and, for
    e5m2, infs included) and its scales, and segments that cut it at awkward places (mid block
    row, across matrices) the way partitioned reads do: (staging, segments, numel)."""
    from zload.kernels import Dequant, Segment
    from zload.checkpoint.quantized import Scale

    shape = (2, 37, 29)
    numel = torch.Size(shape).numel()
    weight = torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g)
    scale = Scale(TensorEntry("s", "f", "F32", (), 0, 0), 37, 29, block) if block else \
        Scale(TensorEntry("s", "f", "F32", (), 0, 0), numel, 1, (numel, 1))
    grid_rows = 2 * scale.grid[0] if block else 1
    scales = (torch.rand(grid_rows * scale.grid[1], generator=g) * 4).to(scale_dtype)
    scales[0] = torch.tensor(2.0 ** -130).to(scale_dtype)  # a subnormal float32 scale (bf16 too)
    staging = torch.zeros(numel + 64 + scales.numel() * 4 + 64, dtype=torch.uint8)
    staging[:numel] = weight
    at = -(-numel // 64) * 64
    staging[at:at + scales.numel() * scales.element_size()] = scales.view(torch.uint8)
    segments = []
    for first, count in [(0, 1), (1, 200), (201, 27), (228, 1500), (1728, numel - 1728)]:
        low, _ = scale.rows_for(first, count)
        d = Dequant(at + low * scale.grid[1] * scales.element_size(), scale_dtype,
                    scales.numel() - low * scale.grid[1], first, low, scale.rows, scale.columns,
                    scale.block, scale.grid)
        segments.append(Segment(first, fp8_dtype, count, 0, first, d))
    reference = dequantize(weight.view(fp8_dtype).reshape(shape),
                           scales.reshape(2, *scale.grid) if block else scales.reshape(()), block)
    return staging, segments, reference.reshape(-1)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dst_dtype", DST_DTYPES)
@pytest.mark.parametrize("scale_dtype,block", [(torch.float32, (8, 16)), (torch.bfloat16, (5, 7)),
                                               (torch.float32, (3, 29)), (torch.float16, None)])
def test_torch_and_triton_kernels_dequantise_like_the_reference(monkeypatch, fp8_dtype, dst_dtype,
                                                                scale_dtype, block):
    """The torch path equals the reference ``(w.to(float32) * scale expanded).to(dtype)`` bit for
    bit; the Triton kernel (interpreted) equals the torch path bit for bit, NaNs aside (only "is
    NaN" is comparable for converted values, as for every cast)."""
    from zload.kernels.torch_scatter import scatter_cast_torch

    g = torch.Generator().manual_seed(19)
    staging, segments, reference = _fp8_segments(fp8_dtype, scale_dtype, block, g)
    expected = reference.to(dst_dtype)
    torch_out = [torch.full((reference.numel(),), 7.0, dtype=dst_dtype)]
    scatter_cast_torch(staging, segments, torch_out)
    assert torch.equal(torch_out[0].view(torch.uint8), expected.view(torch.uint8))

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from zload.kernels import triton_scatter

    triton_out = [torch.full((reference.numel(),), 7.0, dtype=dst_dtype)]
    rest = triton_scatter.scatter_cast_triton(staging, segments, triton_out, block=64)
    assert rest == []
    nan = expected.isnan()
    assert torch.equal(triton_out[0].isnan(), nan)
    assert torch.equal(triton_out[0][~nan].view(torch.uint8), expected[~nan].view(torch.uint8))


def test_inspect_shows_the_quantisation(tmp_path, capsys):
    from zload.cli import main

    torch.manual_seed(0)
    q, s = quantize(torch.randn(37, 29), (16, 8))
    q2, s2 = quantize(torch.randn(5, 3), None, torch.float8_e5m2)
    save_file({"a.weight": q, "a.weight_scale_inv": s, "b.weight": q2, "b.weight_scale": s2,
               "c.weight": q2.clone(), "norm": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 8]}}))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "quantization: fp8, 3 FP8 weights (16x8; 1 scale paired), dequantised on load" in out
    assert "problem: tensor 'b.weight' (model.safetensors): scale 'b.weight_scale' (model.safetensors) " \
           "has shape []; a [5, 3] weight in blocks of [16, 8] needs [1, 1]" in out
    assert "problem: tensor 'c.weight' (model.safetensors): F8_E5M2 weight without its scale" in out
    assert "F8_E4M3 (16x8 blocks)" in out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["quantization"]["blocks"] == ["16x8"] and summary["quantization"]["scales"] == 1
    (a,) = [t for t in summary["tensors"] if t["name"] == "a.weight"]
    assert a["scale"] == {"name": "a.weight_scale_inv", "block": [16, 8]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out  # no block size: one-element scales are per tensor, others 128x128
    assert "quantization: fp8, 3 FP8 weights (per tensor; 1 scale paired)" in out
    assert "F8_E5M2 (per tensor)" in out and "in blocks of [128, 128] needs [1, 1]" in out
