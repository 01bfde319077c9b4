"""zload.save of a ``PeftModel`` over ZeRO-3: the adapter alone, in peft's own format.

The references are peft itself: ``get_peft_model_state_dict`` on a plain (no DeepSpeed) copy with
the same weights gives the names and values the file must hold, and ``PeftModel.from_pretrained``
on a plain base model must load the folder zload wrote. The saved values are also compared bit for
bit with the gathered ZeRO-3 LoRA parameters, and loaded back with zload into a fresh ZeRO-3
PeftModel at another world size.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import deepspeed
import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

import zload

from tests.distributed.test_peft import _build, _file_name, _logits, _lora_params
from tests.support.checkpoints import metadata_with_digest
from tests.support.harness import run_world
from tests.support.models import tiny_llama_config
from tests.support.zero3 import assert_bit_equal, gathered
from tests.unit.test_peft import _lora_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base checkpoint (transformers' save_pretrained) and token ids for forward passes."""
    torch.manual_seed(13)
    folder = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder)
    input_ids = torch.randint(0, 53, (2, 7), generator=torch.Generator().manual_seed(14))
    return {"dir": folder, "input_ids": input_ids}


def _gathered_lora(model) -> dict[str, torch.Tensor]:
    return gathered(_lora_params(model))


def _set_lora(model, seed: int) -> None:
    """Known LoRA values, the same on every rank (partitioned ones written from rank 0)."""
    lora = _lora_params(model)
    with deepspeed.zero.GatheredParameters(list(lora.values()), modifier_rank=0), torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name in sorted(lora):
            lora[name].copy_(torch.randn(lora[name].shape, generator=g))


class SavedAdapter(NamedTuple):
    gathered: dict[str, torch.Tensor]  # the LoRA weights saved, whole, by model name
    logits: torch.Tensor  # of the ZeRO-3 model on base["input_ids"]
    bytes_written: int  # by this rank


def _save_body(base, out, lora_partitioned, adapter):
    model = _build(lora_partitioned, adapter, seed=31)
    zload.load_into(model, base["dir"])
    _set_lora(model, seed=32)
    gathered = _gathered_lora(model)
    logits = _logits(model, base["input_ids"])

    report = zload.save(model, out)
    assert report.files == ["adapter_model.safetensors"], report.files
    assert sorted(os.listdir(out)) == ADAPTER_FILES  # every rank sees the published folder
    saved = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert sorted(saved) == sorted(_file_name(n, adapter) for n in gathered)
    for name, value in gathered.items():  # bit for bit, against DeepSpeed's own gather
        assert_bit_equal(saved[_file_name(name, adapter)], value, f"rank {dist.get_rank()}: {name}")
    return SavedAdapter(gathered, logits, report.bytes_written)


def _load_body(base, out, lora_partitioned, adapter, expected):
    """A fresh ZeRO-3 PeftModel (other LoRA values) at another world size: zload loads the folder."""
    model = _build(lora_partitioned, adapter, seed=41)
    zload.load_into(model, base["dir"])
    assert any(not torch.equal(v, expected[n]) for n, v in _gathered_lora(model).items())
    report = zload.load_into(model, out)
    assert sorted(report.loaded) == sorted(expected)
    assert report.missing == [] and report.unexpected == []
    for name, value in _gathered_lora(model).items():
        assert_bit_equal(value, expected[name], f"rank {dist.get_rank()}: {name} (loaded back)")
    return sorted(report.loaded)


def _plain_peft(base_dir, adapter, lora=None):
    """The same model without DeepSpeed: base from its checkpoint, LoRA set to ``lora``."""
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir), _lora_config(), adapter_name=adapter)
    if lora is not None:
        params = _lora_params(model)
        assert sorted(params) == sorted(lora)
        with torch.no_grad():
            for name, value in lora.items():
                params[name].copy_(value)
    return model


CASES = [  # (world that saves, world that loads back, LoRA partitioned when saving, adapter name)
    (2, 3, True, "default"),
    (2, 3, False, "default"),
    (3, 2, True, "default"),
    (3, 2, False, "default"),
    (2, 3, True, "mine"),
    (3, 2, False, "mine"),
]


@pytest.mark.parametrize("world,other_world,lora_partitioned,adapter", CASES,
                         ids=[f"{c[3]}-lora-{'zero3' if c[2] else 'plain'}-{c[0]}to{c[1]}" for c in CASES])
def test_peft_model_saves_its_adapter_as_peft_does(tmp_path, base, world, other_world, lora_partitioned,
                                                   adapter):
    out = tmp_path / "adapter"
    ranks = run_world(world, _save_body, base, str(out), lora_partitioned, adapter)
    gathered, logits = ranks[0].gathered, ranks[0].logits
    for rank in ranks:  # the same weights gathered on every rank
        assert sorted(rank.gathered) == sorted(gathered)
        assert all(torch.equal(rank.gathered[n], gathered[n]) for n in gathered)
    assert len(gathered) == 8 and all(f".{adapter}." in n for n in gathered)
    # every LoRA element was written once, by the rank that owns it (or, plain, by one rank)
    assert sum(r.bytes_written for r in ranks) == sum(v.numel() * v.element_size() for v in gathered.values())

    # 1. only the adapter, in peft's files; names without the adapter name
    assert sorted(p.name for p in out.iterdir()) == ADAPTER_FILES
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert metadata_with_digest(out / "adapter_model.safetensors") == {"format": "pt"}
    assert all(adapter not in n.split(".") and ".base_layer." not in n for n in names)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]

    # 2. exactly what peft's own state dict gives for a plain copy with the same weights
    saved = load_file(str(out / "adapter_model.safetensors"))
    reference = get_peft_model_state_dict(_plain_peft(base["dir"], adapter, gathered), adapter_name=adapter)
    assert sorted(saved) == sorted(reference)
    for name in reference:
        assert_bit_equal(saved[name], reference[name], f"{name} vs get_peft_model_state_dict")

    # 3. peft's from_pretrained on a plain base model loads it: same LoRA weights, same logits
    plain_base = LlamaForCausalLM.from_pretrained(base["dir"])
    loaded = PeftModel.from_pretrained(plain_base, out, adapter_name=adapter)
    assert loaded.active_adapter == adapter
    loaded_lora = _lora_params(loaded)
    assert sorted(loaded_lora) == sorted(gathered)
    for name, value in gathered.items():
        assert_bit_equal(loaded_lora[name].data, value, f"{name} after PeftModel.from_pretrained")
    with torch.no_grad():
        assert_bit_equal(loaded(input_ids=base["input_ids"]).logits, logits, "logits (peft vs ZeRO-3)")

    # 4. zload loads it back into a fresh ZeRO-3 PeftModel at another world size
    loaded_names = run_world(other_world, _load_body, base, str(out), not lora_partitioned, adapter, gathered)
    assert all(r == sorted(gathered) for r in loaded_names)
