"""A transformers Llama checkpoint written by save_pretrained (sharded) into a ZeRO-3 rebuild."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import zload

from tests.support.harness import run_world
from tests.support.zero3 import build_zero, check_against

transformers = pytest.importorskip("transformers")


def _config():
    # Sizes chosen not to divide by 2, 3 or 4 where the architecture allows.
    return transformers.LlamaConfig(vocab_size=131, hidden_size=40, intermediate_size=77,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64, tie_word_embeddings=False)


class LlamaLoad(NamedTuple):
    report: zload.LoadReport
    compared: int  # tensors equal to the checkpoint's, gathered
    stored: int  # tensors in the checkpoint


def _load_llama(folder, dtype):
    from glob import glob

    from safetensors.torch import load_file

    llama, config = transformers.LlamaForCausalLM, _config()  # import outside zero.Init (it patches torch)
    model = build_zero(lambda: llama(config), dtype=getattr(torch, dtype))
    report = zload.load_into(model, folder)
    expected = {}
    for shard in sorted(glob(f"{folder}/model-*.safetensors")):
        expected.update(load_file(shard))
    compared = check_against(model, expected)
    return LlamaLoad(report, compared, len(expected))


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    torch.manual_seed(12)
    model = transformers.LlamaForCausalLM(_config())
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists(), "expected a sharded checkpoint"
    return folder


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "bfloat16"), (4, "float32")])
def test_llama_save_pretrained_sharded(llama_checkpoint, world, dtype):
    for load in run_world(world, _load_llama, llama_checkpoint, dtype):
        assert load.compared == load.stored > 10
        assert load.report.missing == [] and load.report.unexpected == []
        assert len(load.report.conversions) == (dtype != "float32")
