"""zload.save of a plain ``PeftModel`` (no DeepSpeed): names as peft names them, and an adapter
never sharded. Over ZeRO-3: tests/distributed/test_save_peft.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import zload

from tests.support.models import tiny_llama_config
from tests.unit.test_peft import _lora_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import get_peft_model, get_peft_model_state_dict  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402


def test_modules_to_save_are_named_as_peft_names_them(tmp_path):
    """A plain PeftModel (no DeepSpeed, no process group) with ``modules_to_save``."""
    torch.manual_seed(51)
    config = _lora_config()
    config.modules_to_save = ["lm_head"]
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), config)
    zload.save(model, tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(get_peft_model_state_dict(model))
    # peft loads zload's folder, and zload loads peft's own save (modules_to_save included)
    from peft import PeftModel

    torch.manual_seed(52)
    reloaded = PeftModel.from_pretrained(LlamaForCausalLM(tiny_llama_config()), tmp_path / "adapter")
    for name, tensor in get_peft_model_state_dict(reloaded).items():
        assert torch.equal(tensor, saved[name]), name
    model.save_pretrained(tmp_path / "by_peft")
    torch.manual_seed(53)
    fresh = get_peft_model(LlamaForCausalLM(tiny_llama_config()), config)
    report = zload.load_into(fresh, tmp_path / "by_peft")
    assert report.missing == [] and report.unexpected == []
    for name, tensor in get_peft_model_state_dict(fresh).items():
        assert torch.equal(tensor, saved[name]), name


def test_adapter_is_never_sharded(tmp_path):
    """peft reads a single adapter_model.safetensors, whatever max_shard_size says."""
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), _lora_config())
    report = zload.save(model, tmp_path / "adapter", max_shard_size=100)
    assert report.files == ["adapter_model.safetensors"]
