"""transformers checkpoints whose names (or layouts) differ from the model's.

The reference is transformers itself: the same folder loaded with ``from_pretrained`` without
DeepSpeed, compared bit for bit with the ZeRO-3 model after ``zload.load_into``.
"""

from __future__ import annotations

import gc

import pytest
import torch

import zload

from tests.support.harness import run_world
from tests.support.models import tiny_llama_config
from tests.support.zero3 import build_zero, check_against, refused_load

transformers = pytest.importorskip("transformers")
from transformers.conversion_mapping import register_checkpoint_conversion_mapping  # noqa: E402
from transformers.core_model_loading import Chunk, Transpose, WeightConverter  # noqa: E402

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _vision_encoder_decoder_config():
    encoder = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=37, image_size=16, patch_size=8)
    decoder = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=20,
                                      add_cross_attention=True, is_decoder=True, tie_word_embeddings=True,
                                      bos_token_id=0, eos_token_id=1)
    return transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)


def _mixtral_config():
    """11 experts: names sort as experts.0, .1, .10, .2, but transformers stacks them in number order."""
    return transformers.MixtralConfig(vocab_size=61, hidden_size=24, intermediate_size=20,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_local_experts=11, num_experts_per_tok=2, max_position_embeddings=32,
                                      tie_word_embeddings=False)


class LlamaWithTransposedMLP(transformers.LlamaForCausalLM):
    """A model whose checkpoint stores up_proj transposed: a conversion no byte range expresses."""


register_checkpoint_conversion_mapping(
    "LlamaWithTransposedMLP",
    [WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight", operations=[Transpose(0, 1)])],
    overwrite=True)


class LlamaWithFusedTransposedMLP(transformers.LlamaForCausalLM):
    """A model whose checkpoint stores gate and up fused and transposed: one conversion, two outputs."""


register_checkpoint_conversion_mapping(
    "LlamaWithFusedTransposedMLP",
    [WeightConverter("mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                     operations=[Transpose(0, 1), Chunk(dim=0)])],
    overwrite=True)


MODELS = {
    "vision_encoder_decoder": (transformers.VisionEncoderDecoderModel, _vision_encoder_decoder_config),
    "mixtral": (transformers.MixtralForCausalLM, _mixtral_config),
    "transposed_llama": (LlamaWithTransposedMLP, tiny_llama_config),
    "fused_transposed_llama": (LlamaWithFusedTransposedMLP, tiny_llama_config),
}
SLOW_PATH = {
    "transposed_llama": [f"model.layers.{k}.mlp.up_proj.weight" for k in range(2)],
    "fused_transposed_llama": [f"model.layers.{k}.mlp.{p}_proj.weight"
                               for k in range(2) for p in ("gate", "up")],
}


def _build_nested_zero3(cls, config, dtype):
    """Construct as a trainer using HF's DeepSpeed integration does: transformers opens its own
    zero.Init for sub-models (nested inside ours, so only the outer one is active)."""
    from transformers.integrations import HfDeepSpeedConfig

    hf_ds_config = HfDeepSpeedConfig(DS_CONFIG)  # makes transformers see ZeRO-3 while it lives
    try:
        return build_zero(lambda: cls(config), dtype=dtype)
    finally:
        del hf_ds_config
        gc.collect()


def _load_and_compare(kind, folder, dtype):
    cls, make_config = MODELS[kind]
    reference = cls.from_pretrained(folder).state_dict()  # transformers alone, no DeepSpeed
    model = _build_nested_zero3(cls, make_config(), getattr(torch, dtype))
    assert all(hasattr(p, "ds_id") for p in model.parameters())
    report = zload.load_into(model, folder)
    compared = check_against(model, reference, names=[n for n, _ in model.named_parameters()])
    tied = (kind != "vision_encoder_decoder"
            or model.decoder.lm_head.weight is model.decoder.transformer.wte.weight)
    return compared, report.missing, report.unexpected, report.slow_path, tied


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folders = {}
    for kind, (cls, make_config) in MODELS.items():
        torch.manual_seed(13)
        folder = tmp_path_factory.mktemp(kind)
        cls(make_config()).save_pretrained(folder, max_shard_size="30KB")
        assert (folder / "model.safetensors.index.json").exists()
        folders[kind] = folder
    return folders


@pytest.mark.parametrize("kind,world,dtype", [
    ("vision_encoder_decoder", 2, "float32"),
    ("vision_encoder_decoder", 3, "bfloat16"),
    ("mixtral", 3, "float32"),
    ("mixtral", 4, "bfloat16"),
    ("transposed_llama", 3, "float32"),
    ("fused_transposed_llama", 3, "bfloat16"),
])
def test_converted_checkpoint_bit_exact(saved, kind, world, dtype):
    results = run_world(world, _load_and_compare, kind, saved[kind], dtype)
    for compared, missing, unexpected, slow_path, tied in results:
        assert compared > 10 and missing == [] and unexpected == [] and tied
        # only conversions that are no byte layout take the slow path; renames, stacking and
        # concatenation stay partition-aware
        assert slow_path == SLOW_PATH.get(kind, [])


def _bytes_read(kind, folder):
    cls, make_config = MODELS[kind]
    model = build_zero(lambda: cls(make_config()))
    report = zload.load_into(model, folder)
    return report.bytes_read, report.checkpoint_bytes


@pytest.mark.parametrize("kind", ["mixtral", "fused_transposed_llama"])
def test_every_checkpoint_byte_is_read_once_across_ranks(saved, kind):
    """Per-expert tensors feeding one stacked parameter are read by partition; a slow-path
    conversion with two outputs reads its input once, on one rank, for both."""
    results = run_world(3, _bytes_read, kind, saved[kind])
    assert sum(r[0] for r in results) == results[0][1]


def _load_transposed_on_rank_1_only(folder):
    """Rank 1 builds the model whose checkpoint stores up_proj transposed (a conversion one rank
    makes and sends), the others plain Llama; square MLPs, so that every rank's plan fits."""
    cls = LlamaWithTransposedMLP if torch.distributed.get_rank() == 1 else transformers.LlamaForCausalLM
    return refused_load(build_zero(lambda: cls(_square_llama_config())), folder)


def _square_llama_config():
    config = tiny_llama_config()
    config.intermediate_size = config.hidden_size
    return config


@pytest.mark.parametrize("world", [2, 3])
def test_a_conversion_planned_on_one_rank_only_fails_every_rank(tmp_path, world):
    """Rank 1 alone waited for the converted tensors it expected to be sent (and would have loaded
    up_proj transposed where the others load it as stored)."""
    torch.manual_seed(15)
    transformers.LlamaForCausalLM(_square_llama_config()).save_pretrained(tmp_path)
    results = run_world(world, _load_transposed_on_rank_1_only, tmp_path, timeout=60)
    assert all(r is not None for r in results), results
    assert len(set(results)) == 1, results
    kind, message = results[0]
    assert kind == "PlanError", message
    assert "rank 1's model has the conversion of 'model.layers.0.mlp.up_proj.weight'" in message, message
    assert "the same model" in message
