"""PEFT in one process: the merged weights of a LoRA ``MultiheadAttention`` are targets. Adapters
loaded into a ``PeftModel`` over ZeRO-3: tests/distributed/test_peft.py."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402


def _lora_config():
    # init_lora_weights=False: lora_B is not zero, so a LoRA tensor loaded wrong changes the output
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def test_merged_lora_attention_weights_are_targets():
    """PEFT's LoRA ``MultiheadAttention`` keeps its merged weights as plain attributes and puts
    them back as parameters in its own ``named_modules``: zload must walk the model through it, or
    those weights are silently neither loaded nor saved."""
    from zload.model.targets import collect_targets

    class Attending(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(4, 2)

    model = get_peft_model(Attending(), LoraConfig(target_modules=["attn"], r=2))
    model.merge_adapter()
    names = {n for t in collect_targets(model) for n in t.names}
    assert {"base_model.model.attn.base_layer.in_proj_weight",
            "base_model.model.attn.base_layer.out_proj.base_layer.weight"} <= names
