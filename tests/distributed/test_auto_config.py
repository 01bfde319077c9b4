"""The DeepSpeed template of transformers' guide, "auto" values and all, given to ``zload.init``
and ``zload.from_pretrained`` in a world of 2 ranks: built, loaded and read as DeepSpeed reads it.
How "auto" is filled in: tests/unit/test_auto_config.py."""

from __future__ import annotations

import json

import pytest
import torch

import zload

from tests.distributed.test_from_pretrained import _compare_with_transformers
from tests.support import models
from tests.support.harness import run_world
from tests.unit.test_auto_config import DOCS_ZERO3, HIDDEN, WITH_BF16, _resolved
from tests.unit.test_from_pretrained import _save_llama

pytest.importorskip("transformers")


def _built_from_the_template(path, folder) -> tuple[list, tuple]:
    """``zload.init`` and ``zload.from_pretrained`` with the template's file: the model built and
    loaded (from_pretrained's against transformers' own, bit for bit); and how DeepSpeed reads
    the config they built with."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import LlamaForCausalLM

    built = [_compare_with_transformers(folder, folder, "LlamaForCausalLM", path, None, torch.float16),
             _compare_with_transformers(folder, folder, "LlamaForCausalLM", WITH_BF16, torch.bfloat16, torch.bfloat16)]
    with zload.init(path, hidden_size=HIDDEN):
        model = LlamaForCausalLM(models.tiny_llama_config(tie=True))
    built.append(len(zload.load_into(model, folder).loaded))
    read = DeepSpeedConfig(_resolved(path).values)
    return built, (read.train_batch_size, read.train_micro_batch_size_per_gpu, read.gradient_accumulation_steps,
                   read.zero_config.param_persistence_threshold, read.gradient_clipping)


def test_the_docs_template_builds_and_loads(tmp_path):
    _save_llama(tmp_path / "llama")
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(DOCS_ZERO3))
    for built, read in run_world(2, _built_from_the_template, str(path), str(tmp_path / "llama")):
        assert [b.dtypes for b in built[:2]] == [{"torch.float16"}, {"torch.bfloat16"}] and built[2] == 20
        assert read == (2, 1, 1, 10 * HIDDEN, "auto")  # train batch = 1 x 1 x 2 ranks
