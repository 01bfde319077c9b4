"""zload.from_pretrained answers to transformers' names: ``torch_dtype=`` (the old name of
``dtype=``, with transformers' deprecation warning) and ``output_loading_info=True``'s dict, the
same as transformers' own from_pretrained (no DeepSpeed) returns for the same folder, with zload's
``LoadReport`` kept as its ``report``."""

from __future__ import annotations

import warnings

import pytest
import torch

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import DS_CONFIG, Refused, refusal
from tests.unit.test_from_pretrained import _save_llama

pytest.importorskip("transformers")


def _save_folders(folder) -> dict[str, str]:
    """A tied Llama (every tensor the model has), a LlamaModel (no head) and an untied
    LlamaForCausalLM (a head a LlamaModel lacks)."""
    from transformers import LlamaForCausalLM, LlamaModel

    _save_llama(folder / "tied")
    torch.manual_seed(5)
    LlamaModel(models.tiny_llama_config()).save_pretrained(folder / "base")
    LlamaForCausalLM(models.tiny_llama_config()).save_pretrained(folder / "untied")
    return {"tied": str(folder / "tied"), "base": str(folder / "base"), "untied": str(folder / "untied")}


# (folder, the class loaded from it)
LOADS = [("tied", "LlamaForCausalLM"), ("base", "LlamaForSequenceClassification"), ("untied", "LlamaModel")]


def _loading_infos(folders) -> list[tuple[dict, dict, bool]]:
    """(zload's info, transformers' info, whether zload's is a dict holding its LoadReport) per load."""
    import transformers

    answers = []
    for folder, cls_name in LOADS:
        cls = getattr(transformers, cls_name)
        _, ours = zload.from_pretrained(cls, folders[folder], DS_CONFIG, output_loading_info=True)
        _, theirs = cls.from_pretrained(folders[folder], output_loading_info=True)
        answers.append((dict(ours), theirs, isinstance(ours, dict) and isinstance(ours.report, zload.LoadReport)))
    return answers


def test_output_loading_info_is_transformers_dict_with_the_report(tmp_path):
    folders = _save_folders(tmp_path)
    for answers in run_world(2, _loading_infos, folders):
        for (ours, theirs, holds_report), load in zip(answers, LOADS, strict=True):
            assert holds_report, load
            assert ours == theirs, load
            assert {key: type(value) for key, value in ours.items()} == {
                key: type(value) for key, value in theirs.items()}, load
        assert answers[1][0]["missing_keys"] == {"score.weight"}
        assert answers[2][0]["unexpected_keys"] == {"lm_head.weight"}


def _old_dtype_name(folder) -> tuple[set, list[tuple[str, str]], Refused | None]:
    """The dtypes of a model loaded with ``torch_dtype=``, the warnings it raised, and what passing
    both names raised."""
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = zload.from_pretrained(LlamaForCausalLM, folder, DS_CONFIG, torch_dtype=torch.bfloat16)
    said = [(w.category.__name__, str(w.message)) for w in caught if "dtype" in str(w.message)]
    both = refusal(lambda: zload.from_pretrained(LlamaForCausalLM, folder, DS_CONFIG, dtype=torch.float32,
                                                 torch_dtype=torch.bfloat16))
    return {p.dtype for p in model.parameters()}, said, both


def test_torch_dtype_is_the_old_name_of_dtype(tmp_path):
    _save_llama(tmp_path / "llama")
    for rank, (dtypes, said, both) in enumerate(run_world(2, _old_dtype_name, str(tmp_path / "llama"))):
        assert dtypes == {torch.bfloat16}
        # the same on every rank: rank 0 says it
        assert said == [("FutureWarning", "`torch_dtype` is deprecated! Use `dtype` instead!")] * (rank == 0)
        assert both is not None and both.kind == "ArgumentTypeError", both
        assert "torch_dtype is the old name of dtype; pass dtype only" in both.message, both
