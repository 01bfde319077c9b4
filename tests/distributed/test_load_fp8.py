"""Issue 19: FP8 checkpoints of a tiny Llama and a tiny Mixtral (experts stacked by transformers'
conversion), made with the reference block quantisation, loaded into ZeRO-3 models at world sizes
1-4 bit for bit against the reference dequantisation; bad scales refused on every rank with the
model untouched."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zload

from tests.support.fp8_checkpoints import BAD_CONFIGS, write_fp8, write_reference
from tests.support.harness import run_world
from tests.support.models import tiny_llama_config
from tests.support.zero3 import assert_unchanged, build_zero, check_against, snapshot

transformers = pytest.importorskip("transformers")


def _mixtral_config():
    return transformers.MixtralConfig(vocab_size=61, hidden_size=24, intermediate_size=20,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)


MODELS = {"llama": (transformers.LlamaForCausalLM, tiny_llama_config),
          "mixtral": (transformers.MixtralForCausalLM, _mixtral_config)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per model: its bf16 save_pretrained folder, FP8 copies in blocks of 8 x 16 (dividing no
    dimension of 19, 20, 53 or 12 rows) and per tensor, and the reference dequantisation."""
    folders = {}
    for kind, (cls, make_config) in MODELS.items():
        torch.manual_seed(19)
        base = tmp_path_factory.mktemp(kind)
        cls(make_config()).save_pretrained(base / "bf16")
        for variant, block, fp8 in [("block", (8, 16), torch.float8_e4m3fn),
                                    ("tensor", None, torch.float8_e5m2)]:
            reference = write_fp8(base / "bf16", base / variant, block, fp8)
            write_reference(base / "bf16", base / f"{variant}-reference", reference)
            folders[kind, variant] = base
    return folders


def _load_and_compare(kind, folder, variant, dtype):
    return _compare_load(kind, folder / variant, folder / f"{variant}-reference", dtype)


def _compare_load(kind, checkpoint, reference, dtype, **load_kwargs):
    """Load ``checkpoint`` and compare with ``reference`` (a folder ``from_pretrained`` reads)."""
    cls, make_config = MODELS[kind]
    reference = cls.from_pretrained(reference).state_dict()  # names as the model's
    model = build_zero(lambda: cls(make_config()), getattr(torch, dtype))
    report = zload.load_into(model, checkpoint, **load_kwargs)
    compared = check_against(model, reference, names=[n for n, _ in model.named_parameters()])
    return compared, report.missing, report.unexpected, report.slow_path, sorted(report.conversions)


@pytest.mark.parametrize("kind,variant,world,dtype", [
    ("llama", "block", 1, "bfloat16"),
    ("llama", "block", 2, "float32"),
    ("llama", "block", 3, "bfloat16"),
    ("llama", "tensor", 4, "float16"),
    ("mixtral", "block", 2, "bfloat16"),
    ("mixtral", "block", 3, "float32"),
    ("mixtral", "tensor", 4, "bfloat16"),
])
def test_fp8_checkpoint_loads_bit_exact(saved, kind, variant, world, dtype):
    results = run_world(world, _load_and_compare, kind, saved[kind, variant], variant, dtype)
    fp8 = "F8_E4M3" if variant == "block" else "F8_E5M2"
    for compared, missing, unexpected, slow_path, conversions in results:
        assert compared > 10 and missing == [] and unexpected == [] and slow_path == []
        assert f"{fp8}->{dtype}" in conversions


def _load_expecting_refusal(folder, kind, **load_kwargs):
    cls, make_config = MODELS[kind]
    model = build_zero(lambda: cls(make_config()), torch.bfloat16)
    before = snapshot(model)
    with pytest.raises(zload.ZloadError) as caught:
        zload.load_into(model, folder, **load_kwargs)
    assert_unchanged(model, before)
    return str(caught.value)


def _tampered(saved, tmp_path, change):
    """The Llama's block FP8 checkpoint with ``change(state, config)`` applied."""
    folder = saved["llama", "block"] / "block"
    state = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    change(state, config)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize("change,message", [
    (lambda state, config: state.pop(SCALE),
     "'model.layers.1.mlp.down_proj.weight' (model.safetensors): F8_E4M3 weight without its scale"),
    (lambda state, config: state.update({SCALE: state[SCALE][:, :1].contiguous()}),
     "scale 'model.layers.1.mlp.down_proj.weight_scale_inv' (model.safetensors) has shape [3, 1]; "
     "a [24, 19] weight in blocks of [8, 16] needs [3, 2]"),
    (lambda state, config: config["quantization_config"].update(quant_method="gptq"),
     "config.json: quantization_config quant_method 'gptq' is not supported"),
    (lambda state, config: config["quantization_config"].update(weight_block_size=[16, 16]),
     "in blocks of [16, 16] needs [2, 2]"),
])
def test_bad_fp8_checkpoints_are_refused_on_every_rank(saved, tmp_path, change, message):
    folder = _tampered(saved, tmp_path, change)
    for error in run_world(2, _load_expecting_refusal, folder, "llama"):
        assert message in error and "the model was not changed" in error, error


def _load_with_the_checkpoint_on_rank_zero_only(node_dirs):
    import os

    import torch.distributed as dist

    model = build_zero(lambda: transformers.LlamaForCausalLM(tiny_llama_config()), torch.bfloat16)
    before = snapshot(model)
    cwd = os.getcwd()
    os.chdir(node_dirs[dist.get_rank()])
    try:
        with pytest.raises(zload.ZloadError) as caught:
            zload.load_into(model, "checkpoint")
    finally:
        os.chdir(cwd)
    assert_unchanged(model, before)
    return str(caught.value)


def test_fp8_weights_in_files_a_rank_lacks_are_refused(saved, tmp_path):
    """Sending FP8 bytes to a rank without the files is not done: refused before any write."""
    import shutil

    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(saved["llama", "block"] / "block", node_dirs[0] / "checkpoint")
    node_dirs[1].mkdir()
    for error in run_world(2, _load_with_the_checkpoint_on_rank_zero_only, [str(d) for d in node_dirs]):
        assert "FP8 weights in files this rank lacks cannot be sent to it yet" in error, error


def _load_plain(folder, variant):
    reference = transformers.LlamaForCausalLM.from_pretrained(folder / f"{variant}-reference").state_dict()
    model = transformers.LlamaForCausalLM(tiny_llama_config()).to(torch.bfloat16)  # no ZeRO: whole tensors
    report = zload.load_into(model, folder / variant)
    compared = check_against(model, reference, names=[n for n, _ in model.named_parameters()])
    return compared, report.missing, report.unexpected


@pytest.mark.parametrize("variant", ["block", "tensor"])
def test_fp8_checkpoint_loads_into_plain_parameters(saved, variant):
    for compared, missing, unexpected in run_world(2, _load_plain, saved["llama", variant], variant):
        assert compared > 10 and missing == [] and unexpected == []


def _add_plain_scales(one_element):
    """A change for ``_tampered``: beside each ``X.weight_scale_inv`` an ``X.weight_scale``, of one
    element or of the block shape (twice the right scales)."""
    def change(state, config):
        for name in [n for n in state if n.endswith("_scale_inv")]:
            state[name.removesuffix("_inv")] = state[name].reshape(-1)[:1].reshape(()).clone() if one_element \
                else state[name] * 2
    return change


def _load_with_both_scale_names(ambiguous, beside, reference):
    return _load_expecting_refusal(ambiguous, "llama"), _compare_load("llama", beside, reference, "bfloat16")


def test_with_both_scale_names_the_inverse_scale_is_the_scale(saved, tmp_path):
    """Beside the block scales ``X.weight_scale_inv``, a one-element ``X.weight_scale`` is consumed
    and ignored; one of the block shape makes the scale ambiguous: refused, naming both."""
    ambiguous = _tampered(saved, tmp_path / "ambiguous", _add_plain_scales(one_element=False))
    beside = _tampered(saved, tmp_path / "beside", _add_plain_scales(one_element=True))
    reference = saved["llama", "block"] / "block-reference"
    for error, (compared, missing, unexpected, slow_path, conversions) in run_world(
            2, _load_with_both_scale_names, ambiguous, beside, reference):
        assert ("tensor 'model.layers.0.mlp.down_proj.weight' (model.safetensors): both "
                "'model.layers.0.mlp.down_proj.weight_scale_inv' (model.safetensors, shape [3, 2]) and "
                "'model.layers.0.mlp.down_proj.weight_scale' (model.safetensors, shape [3, 2]) are stored, and "
                "either could be its scale") in error and "the model was not changed" in error, error
        assert compared > 10 and missing == [] and unexpected == [] and slow_path == []
        assert "F8_E4M3->bfloat16" in conversions


def _load_from_this_nodes_copies(node_dirs, saved_folder):
    """Rank r loads the copies on its node (``node_dirs[r]``): 'differ' and 'bf16' hold a config.json
    whose quantization config is the node's; 'same' one that differs from the others' elsewhere."""
    cwd = os.getcwd()
    os.chdir(node_dirs[dist.get_rank()])
    try:
        return (_load_expecting_refusal("differ", "llama"),
                _compare_load("llama", "same", saved_folder / "block-reference", "bfloat16"),
                _compare_load("llama", "bf16", saved_folder / "bf16", "bfloat16"))
    finally:
        os.chdir(cwd)


def test_ranks_whose_configs_give_different_block_sizes_are_refused(saved, tmp_path):
    """Three nodes, each with its own copy of an FP8 checkpoint, the same but for config.json: a
    block size of 9 x 12 on node 1 (the same scale grids as 8 x 16, other values) is refused on
    every rank, naming config.json and who read what. Copies whose configs differ elsewhere load,
    and so does a bf16 checkpoint, whatever its config.json says."""
    folder = saved["llama", "block"]
    base = json.loads((folder / "block" / "config.json").read_text())
    node_dirs = [tmp_path / f"node{r}" for r in range(3)]
    for r, node in enumerate(node_dirs):
        for name, weights, block in [("differ", "block", [9, 12] if r == 1 else [8, 16]),
                                     ("same", "block", [8, 16]), ("bf16", "bf16", [9, 12] if r == 1 else [8, 16])]:
            (node / name).mkdir(parents=True)
            shutil.copy(folder / weights / "model.safetensors", node / name)
            config = dict(base, _name_or_path=f"node{r}")
            config["quantization_config"] = dict(base["quantization_config"], weight_block_size=block)
            (node / name / "config.json").write_text(json.dumps(config))
    for error, same, bf16 in run_world(3, _load_from_this_nodes_copies, node_dirs, folder):
        assert ("tensor 'model.layers.0.mlp.down_proj.weight' (model.safetensors): config.json: the copies "
                "differ between ranks: ranks [0, 2] read quant_method 'fp8', weight_block_size [8, 16]; ranks [1] "
                "read quant_method 'fp8', weight_block_size [9, 12]; every node must hold the same config.json"
                ) in error and "the model was not changed" in error, error
        for compared, missing, unexpected, slow_path, _ in (same, bf16):
            assert compared > 10 and missing == [] and unexpected == [] and slow_path == []


def _load_beside_bad_configs(folders, reference):
    return [(_load_expecting_refusal(fp8, "llama"), _compare_load("llama", bf16, reference, "bfloat16"))
            for fp8, bf16 in folders]


def test_a_bad_config_refuses_fp8_weights_and_nothing_else(saved, tmp_path):
    """Every kind of config.json zload cannot read a block size from (nested 200,000 deep, not
    JSON, a FIFO, ...): an FP8 checkpoint beside it is refused on every rank naming config.json and
    the problem; a bf16 checkpoint beside the same file loads bit for bit."""
    folder, folders = saved["llama", "block"], []
    for i, (make, _) in enumerate(BAD_CONFIGS.values()):
        pair = (tmp_path / f"{i}" / "fp8", tmp_path / f"{i}" / "bf16")
        for checkpoint, weights in zip(pair, ("block", "bf16")):
            checkpoint.mkdir(parents=True)
            shutil.copy(folder / weights / "model.safetensors", checkpoint)
            make(checkpoint / "config.json")
        folders.append(pair)
    for results in run_world(2, _load_beside_bad_configs, folders, folder / "bf16"):
        for (kind, (_, says)), (error, (compared, missing, unexpected, _, _)) in zip(BAD_CONFIGS.items(), results):
            assert "(model.safetensors): config.json: " in error and says in error, (kind, error)
            assert "the model was not changed" in error, (kind, error)
            assert compared > 10 and missing == [] and unexpected == [], kind


def _load_with_little_staging(folder, reference):
    error = _load_expecting_refusal(folder, "llama", staging_bytes=64)
    enough = max(int(n) for n in re.findall(r"pass staging_bytes=(\d+) or more", error))
    return error, _compare_load("llama", folder, reference, "bfloat16", staging_bytes=enough)


def test_too_little_staging_for_fp8_is_refused_before_anything_is_written(saved):
    """It was an IndexError part-way through the reads; now a plan problem that says what is
    enough, and what it says is enough is."""
    folder = saved["llama", "block"]
    for error, (compared, missing, unexpected, _, _) in run_world(
            2, _load_with_little_staging, folder / "block", folder / "block-reference"):
        assert "staging_bytes=64 is too small for the FP8 weights 'model.layers.0" in error, error
        assert "the model was not changed" in error, error
        assert compared > 10 and missing == [] and unexpected == []


def test_a_block_size_beyond_the_weights_loads(saved, tmp_path):
    """weight_block_size [1, 2**62]: one scale a row, as [1, 64] is for these weights (a raw
    overflow part-way through the reads before)."""
    bf16 = saved["llama", "block"] / "bf16"
    reference = write_fp8(bf16, tmp_path / "rows", (1, 64))
    write_reference(bf16, tmp_path / "rows-reference", reference)
    config = json.loads((tmp_path / "rows" / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [1, 2**62]
    (tmp_path / "rows" / "config.json").write_text(json.dumps(config))
    for compared, missing, unexpected, slow_path, _ in run_world(2, _load_and_compare, "llama", tmp_path, "rows",
                                                                 "float32"):
        assert compared > 10 and missing == [] and unexpected == [] and slow_path == []
