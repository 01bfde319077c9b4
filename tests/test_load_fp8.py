"""Issue 19: FP8 checkpoints of a tiny Llama and a tiny Mixtral (experts stacked by transformers'
conversion), made with the reference block quantisation, loaded into ZeRO-3 models at world sizes
1-4 bit for bit against the reference dequantisation; bad scales refused on every rank with the
model untouched."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import zload

from .fp8_checkpoints import write_fp8, write_reference
from .harness import run_world
from .models import tiny_llama_config
from .zero3 import assert_unchanged, build_zero, check_against, snapshot

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
    cls, make_config = MODELS[kind]
    reference = cls.from_pretrained(folder / f"{variant}-reference").state_dict()  # names as the model's
    model = build_zero(lambda: cls(make_config()), getattr(torch, dtype))
    report = zload.load_into(model, folder / variant)
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


def _load_expecting_refusal(folder, kind):
    cls, make_config = MODELS[kind]
    model = build_zero(lambda: cls(make_config()), torch.bfloat16)
    before = snapshot(model)
    with pytest.raises(zload.ZloadError) as caught:
        zload.load_into(model, folder)
    assert_unchanged(model, before)
    return str(caught.value)


def _tampered(saved, tmp_path, change):
    """The Llama's block FP8 checkpoint with ``change(state, config)`` applied."""
    folder = saved["llama", "block"] / "block"
    state = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    change(state, config)
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
