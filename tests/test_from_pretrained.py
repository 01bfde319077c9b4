"""zload.from_pretrained: transformers' from_pretrained as a ZeRO-3 model, in one call, compared
bit for bit with transformers' own from_pretrained (no DeepSpeed) of the same folder or repo."""

from __future__ import annotations

import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

import zload

from . import models
from .harness import run_world
from .test_hub import hub_cache, populate
from .zero3 import DS_CONFIG, assert_bit_equal, dtype_config, gathered

pytest.importorskip("transformers")

TEMPERATURE = 0.25  # in the saved generation config, unlike the default a model's config gives


def _save_llama(folder) -> None:
    """A tiny Llama with tied embeddings, saved by transformers in float16 (its config says so)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(71)
    model = LlamaForCausalLM(models.tiny_llama_config(tie=True)).to(torch.float16)
    model.generation_config.do_sample, model.generation_config.temperature = True, TEMPERATURE
    model.save_pretrained(folder)


class Built(NamedTuple):
    dtypes: set[str]  # of the parameters
    training: bool
    temperature: float  # of the generation config
    loaded: int  # tensors the load report lists


# (class, dtype the DeepSpeed config enables, dtype argument, dtype expected)
CASES = [("LlamaForCausalLM", torch.bfloat16, None, torch.bfloat16),  # the DeepSpeed config's
         ("AutoModelForCausalLM", torch.bfloat16, torch.float32, torch.float32),  # the argument beats it
         ("AutoModelForCausalLM", torch.float32, "auto", torch.float16),  # the checkpoint config's
         ("LlamaForCausalLM", None, None, torch.float16)]  # neither: the checkpoint config's


def _compare_with_transformers(source, folder, cls_name, ds_dtype, dtype, expected) -> Built:
    """``zload.from_pretrained(source)`` against ``LlamaForCausalLM.from_pretrained(folder)``."""
    import transformers

    config = DS_CONFIG if ds_dtype is None else dtype_config(ds_dtype)
    model, report = zload.from_pretrained(getattr(transformers, cls_name), source, config, dtype=dtype,
                                          output_loading_info=True)
    reference = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=expected)
    ours = gathered(dict(model.named_parameters(remove_duplicate=False)))
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert_bit_equal(ours[name], tensor.data, name)
    for (name, buffer), (_, expected_buffer) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert_bit_equal(buffer, expected_buffer, name)
    assert all(hasattr(p, "ds_id") for p in model.parameters())
    return Built({str(p.dtype) for p in model.parameters()}, model.training,
                 model.generation_config.temperature, len(report.loaded))


def _all_cases(folder) -> list[Built]:
    return [_compare_with_transformers(folder, folder, *case) for case in CASES]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_call_matches_transformers(tmp_path, world):
    _save_llama(tmp_path / "llama")
    for rank in run_world(world, _all_cases, str(tmp_path / "llama")):
        assert [built.dtypes for built in rank] == [{str(case[-1])} for case in CASES]
        assert all(not built.training and built.temperature == TEMPERATURE for built in rank)


REPO = "some-org/tiny-llama"


def _from_repo(cache, folder) -> Built:
    with hub_cache(cache):
        return _compare_with_transformers(REPO, folder, *CASES[0])


def test_a_hub_repo_id(tmp_path):
    """Resolved once per node from the (offline) Hugging Face cache; config and weights read there."""
    snapshot = populate(tmp_path / "hub", REPO, fill=_save_llama)
    for built in run_world(2, _from_repo, tmp_path / "hub", str(snapshot)):
        assert built.dtypes == {"torch.bfloat16"} and built.temperature == TEMPERATURE


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
