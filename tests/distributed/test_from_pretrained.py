"""zload.from_pretrained: transformers' from_pretrained as a ZeRO-3 model, in one call, compared
bit for bit with transformers' own from_pretrained (no DeepSpeed) of the same folder or repo."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import zload

from tests.support.harness import run_world
from tests.support.zero3 import DS_CONFIG, Refused, assert_bit_equal, bad_ds_configs, dtype_config, gathered, refusal
from tests.unit.test_from_pretrained import TEMPERATURE, _save_llama
from tests.unit.test_hub import hub_cache, populate

pytest.importorskip("transformers")


class Built(NamedTuple):
    dtypes: set[str]  # of the parameters
    training: bool
    temperature: float  # of the generation config
    loaded: int  # tensors the load report lists


# (class, DeepSpeed config, dtype argument, dtype expected)
CASES = [("LlamaForCausalLM", dtype_config(torch.bfloat16), None, torch.bfloat16),  # the DeepSpeed config's
         ("AutoModelForCausalLM", dtype_config(torch.bfloat16), torch.float32, torch.float32),  # the argument beats it
         ("AutoModelForCausalLM", dtype_config(torch.float32), "auto", torch.float16),  # the checkpoint config's
         ("LlamaForCausalLM", DS_CONFIG, None, torch.float16)]  # neither: the checkpoint config's


def _compare_with_transformers(source, folder, cls_name, ds_config, dtype, expected) -> Built:
    """``zload.from_pretrained(source)`` against ``LlamaForCausalLM.from_pretrained(folder)``."""
    import transformers

    model, info = zload.from_pretrained(getattr(transformers, cls_name), source, ds_config, dtype=dtype,
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
                 model.generation_config.temperature, len(info.report.loaded))


def _all_cases(folder, cases=CASES) -> list[Built]:
    return [_compare_with_transformers(folder, folder, *case) for case in cases]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_call_matches_transformers(tmp_path, world):
    _save_llama(tmp_path / "llama")
    for rank in run_world(world, _all_cases, str(tmp_path / "llama")):
        assert [built.dtypes for built in rank] == [{str(case[-1])} for case in CASES]
        assert all(not built.training and built.temperature == TEMPERATURE for built in rank)


# configs DeepSpeed reads otherwise than as they look: lax values, and "bf16" null, which it reads
# as absent, taking the section's older name "bfloat16"
READ_AS_DEEPSPEED_READS = [
    ("LlamaForCausalLM", {**DS_CONFIG, "zero_optimization": {"stage": "3"}, "bf16": {"enabled": "true"}}, None,
     torch.bfloat16),
    ("LlamaForCausalLM", {**DS_CONFIG, "bf16": None, "bfloat16": {"enabled": True}}, None, torch.bfloat16),
    ("LlamaForCausalLM", {**DS_CONFIG, "bf16": {"enabled": 1}, "fp16": {"enabled": "auto"}}, None, torch.bfloat16),
]


def test_the_config_is_read_as_deepspeed_reads_it(tmp_path):
    _save_llama(tmp_path / "llama")
    for rank in run_world(2, _all_cases, str(tmp_path / "llama"), READ_AS_DEEPSPEED_READS):
        assert [built.dtypes for built in rank] == [{str(case[-1])} for case in READ_AS_DEEPSPEED_READS]


def _refusals_of(folder, configs) -> list[Refused | None]:
    """What ``zload.from_pretrained(LlamaForCausalLM, folder, config)`` raised, for each of ``configs``."""
    from transformers import LlamaForCausalLM

    return [refusal(lambda: zload.from_pretrained(LlamaForCausalLM, folder, config)) for config in configs]


def test_a_bad_config_is_refused_naming_the_key_before_deepspeed_reads_it(tmp_path):
    """As for ``zload.init``; the ranks agree on the refusal."""
    _save_llama(tmp_path / "llama")
    bad = bad_ds_configs(tmp_path, "ds_config")
    for refusals in run_world(2, _refusals_of, str(tmp_path / "llama"), [case.config for case in bad]):
        for case, refused in zip(bad, refusals, strict=True):
            assert refused is not None and (refused.kind, refused.path, refused.ranks) == (
                case.kind, case.path, (0, 1)), (case, refused)
            assert case.says in refused.message, (case, refused)


REPO = "some-org/tiny-llama"


def _from_repo(cache, folder) -> Built:
    with hub_cache(cache):
        return _compare_with_transformers(REPO, folder, *CASES[0])


def test_a_hub_repo_id(tmp_path):
    """Resolved once per node from the (offline) Hugging Face cache; config and weights read there."""
    snapshot = populate(tmp_path / "hub", REPO, fill=_save_llama)
    for built in run_world(2, _from_repo, tmp_path / "hub", str(snapshot)):
        assert built.dtypes == {"torch.bfloat16"} and built.temperature == TEMPERATURE
