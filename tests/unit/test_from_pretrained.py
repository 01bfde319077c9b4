"""zload.from_pretrained in one process: what it refuses before building anything, and an
``import zload`` that imports no transformers. The loads: tests/distributed/test_from_pretrained.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import zload

from tests.support import models
from tests.support.zero3 import DS_CONFIG

pytest.importorskip("transformers")

TEMPERATURE = 0.25  # in the saved generation config, unlike the default a model's config gives


def _save_llama(folder) -> None:
    """A tiny Llama with tied embeddings, saved by transformers in float16 (its config says so)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(71)
    model = LlamaForCausalLM(models.tiny_llama_config(tie=True)).to(torch.float16)
    model.generation_config.do_sample, model.generation_config.temperature = True, TEMPERATURE
    model.save_pretrained(folder)


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"ds_config": {"zero_optimization": {"stage": 2}}}, zload.ArgumentValueError, "ZeRO stage 2"),
    ({"ds_config": {}}, zload.ArgumentValueError, "ZeRO stage 0"),
    ({"path": "./no-such-folder"}, zload.CheckpointNotFoundError, "no such local file or folder"),
    ({"revision": "main"}, zload.ArgumentValueError, "applies to Hub repo ids only"),
    ({"dtype": torch.float64}, zload.ArgumentValueError, "float32, bfloat16 or float16"),
    ({"hidden_sise": 8}, zload.ArgumentTypeError, "hidden_sise: not attributes of LlamaConfig"),
    ({"model_class": "LlamaForCausalLM"}, zload.ArgumentTypeError, "expected a transformers PreTrainedModel"),
])
def test_refused_before_building(tmp_path, arguments, error, message):
    from transformers import LlamaForCausalLM

    _save_llama(tmp_path / "llama")
    call = {"model_class": LlamaForCausalLM, "path": tmp_path / "llama", "ds_config": DS_CONFIG, **arguments}
    with pytest.raises(error, match=message):
        zload.from_pretrained(call.pop("model_class"), call.pop("path"), call.pop("ds_config"), **call)


def test_import_zload_imports_no_transformers():
    code = ("import sys, zload; assert callable(zload.from_pretrained); "
            "assert 'transformers' not in sys.modules, 'imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True)
