"""zload.from_pretrained of a task model from its base model's checkpoint: the head the checkpoint
lacks is initialised as transformers' own from_pretrained (no DeepSpeed) initialises it, under the
same seed, bit for bit, and the same on every rank; the base weights are loaded bit for bit."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import pytest
import torch

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import DS_CONFIG, check_against, dtype_config, gathered

pytest.importorskip("transformers")

SEED = 1234


def tiny_bert_config():
    """A Bert with the sizes of ``models.tiny_llama_config``: its head has a bias, which
    ``_init_weights`` zeroes, and its checkpoint names lack the task model's "bert." prefix."""
    from transformers import BertConfig

    return BertConfig(vocab_size=53, hidden_size=24, intermediate_size=19, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=32)


def _save_bases(folder) -> dict[str, str]:
    """A LlamaModel and a BertModel (no head), saved by transformers."""
    from transformers import BertModel, LlamaModel

    torch.manual_seed(3)
    LlamaModel(models.tiny_llama_config()).save_pretrained(folder / "llama")
    BertModel(tiny_bert_config()).save_pretrained(folder / "bert")
    return {"llama": str(folder / "llama"), "bert": str(folder / "bert")}


class Head(NamedTuple):
    names: list[str]  # the report's newly_initialized
    missing: set[str]  # info["missing_keys"]
    values: dict[str, torch.Tensor]  # the head's parameters, whole
    warned: list[str]  # the ZloadWarnings raised


# (base, task class, DeepSpeed config, dtype of the reference, head parameters)
CASES = [("llama", "LlamaForSequenceClassification", DS_CONFIG, torch.float32, ["score.weight"]),
         ("llama", "LlamaForSequenceClassification", dtype_config(torch.bfloat16), torch.bfloat16, ["score.weight"]),
         ("bert", "BertForSequenceClassification", DS_CONFIG, torch.float32, ["classifier.weight", "classifier.bias"])]


def _head(folder, ds_config, seed) -> tuple[object, Head]:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = zload.from_pretrained(AutoModelForSequenceClassification, folder, ds_config, num_labels=3,
                                            output_loading_info=True)
    head = gathered({name: model.get_parameter(name) for name in info.report.newly_initialized})
    return model, Head(info.report.newly_initialized, info["missing_keys"], head,
                       [str(w.message) for w in caught if issubclass(w.category, zload.ZloadWarning)])


def _strict_refusals(folder) -> list[str]:
    """from_pretrained(strict=True) and a plain load_into of a model built by zload.init: both
    refuse the checkpoint that lacks the head, as load_into always has."""
    from transformers import LlamaForSequenceClassification

    refused = []
    with pytest.raises(zload.PlanError) as info:
        zload.from_pretrained(LlamaForSequenceClassification, folder, DS_CONFIG, num_labels=3, strict=True)
    refused.append(str(info.value))
    with zload.init(DS_CONFIG):
        model = LlamaForSequenceClassification(models.tiny_llama_config())
    with pytest.raises(zload.PlanError) as info:
        zload.load_into(model, folder)
    refused.append(str(info.value))
    return refused


def _new_heads(folders) -> tuple[list[Head], list[str]]:
    """Each case: zload's model against transformers' own under the same seed, every tensor bit for
    bit (the padding of each partition zero); then zload's again (the same head) and under another
    seed (another head). And the refusals of ``strict``."""
    import transformers

    heads = []
    for base, cls_name, ds_config, dtype, _ in CASES:
        model, head = _head(folders[base], ds_config, SEED)
        torch.manual_seed(SEED)
        reference = getattr(transformers, cls_name).from_pretrained(folders[base], num_labels=3, dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}
        check_against(model, reference.state_dict())
        again = _head(folders[base], ds_config, SEED)[1]
        other = _head(folders[base], ds_config, SEED + 1)[1]
        for name, value in head.values.items():
            assert torch.equal(again.values[name], value), f"{name}: another value under the same seed"
            assert name.endswith("bias") or not torch.equal(other.values[name], value), f"{name}: seed ignored"
        heads.append(head)
    return heads, _strict_refusals(folders["llama"])


def test_a_new_head_is_initialised_as_transformers_does(tmp_path):
    folders = _save_bases(tmp_path)
    ranks = run_world(2, _new_heads, folders)
    for _, refused in ranks:  # strict=True, and load_into, refuse what from_pretrained fills in
        assert len(refused) == 2 and all("score.weight" in message for message in refused), refused
    for case, *per_rank in zip(CASES, *[heads for heads, _ in ranks], strict=True):
        base, cls_name, _, _, names = case
        for rank, head in enumerate(per_rank):
            assert head.names == names and head.missing == set(names), head
            assert [w for w in head.warned if "newly initialized" in w] == [
                f"Some weights of {cls_name} were not initialized from the model checkpoint at {folders[base]} and "
                f"are newly initialized: [{', '.join(map(repr, names))}]\nYou should probably TRAIN this model on a "
                f"down-stream task to be able to use it for predictions and inference."] * (rank == 0), head.warned
            assert not [w for w in head.warned if "left as they were" in w or "never loaded" in w], head.warned
        for name in names:  # the same bits on both ranks, and no zeros where transformers draws
            assert torch.equal(per_rank[0].values[name].view(-1).view(torch.uint8),
                               per_rank[1].values[name].view(-1).view(torch.uint8)), name
            assert name.endswith("bias") or per_rank[0].values[name].count_nonzero() > 0, name


def _one_rank_fails_to_initialise(folder):
    """A head whose ``_init_weights`` raises on rank 1 only: every rank raises, none hangs."""
    import torch.distributed as dist
    from transformers import LlamaForSequenceClassification

    class FailingOnRank1(LlamaForSequenceClassification):
        def _init_weights(self, module):
            if dist.get_rank() == 1 and module is self.score:
                raise RuntimeError("no values for you")
            super()._init_weights(module)

    with pytest.raises(zload.ZloadError) as info:
        zload.from_pretrained(FailingOnRank1, folder, DS_CONFIG, num_labels=3)
    return str(info.value), info.value.ranks


def test_a_rank_that_fails_to_initialise_fails_every_rank(tmp_path):
    folders = _save_bases(tmp_path)
    for message, ranks in run_world(2, _one_rank_fails_to_initialise, folders["llama"]):
        assert ranks == (1,) and "RuntimeError: no values for you" in message, message
        assert f"cannot initialise the weights of FailingOnRank1 that {folders['llama']} lacks" in message, message
