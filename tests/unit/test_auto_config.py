"""DeepSpeed configs with transformers' "auto" values, as users have them for the Trainer: taken by
``zload.init`` and ``zload.from_pretrained`` (a dict or a JSON file), "auto" filled in as
transformers' Trainer fills it for what building reads (``HfTrainerDeepSpeedConfig``, compared
here with transformers' own), and the rest left to the Trainer."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import zload
import zload.model.ds_config as ds_config

from tests.support import models

pytest.importorskip("transformers")

# the ZeRO-3 config of transformers' DeepSpeed guide (docs/source/en/deepspeed.md, "Notebook"),
# as it gives it
DOCS_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
WITH_BF16 = {**DOCS_ZERO3, "bf16": {"enabled": "auto"}}  # as transformers' tests/deepspeed/ds_config_zero3.json
HIDDEN = models.tiny_llama_config().hidden_size
BUCKETS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def _resolved(config, dtype=None, hidden_size=HIDDEN) -> ds_config.DsConfig:
    return ds_config.resolve_auto(ds_config.read_ds_config(config, "ds_config"), dtype=dtype, hidden_size=hidden_size)


def _trainers_filling(config: dict, hidden_size: int, world: int) -> dict:
    """What transformers' Trainer makes of ``config`` for a model of ``hidden_size`` trained with
    batches of 1, no accumulation and no fp16/bf16 flags on ``world`` ranks."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    args = SimpleNamespace(world_size=world, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                           max_grad_norm=1.0, learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           weight_decay=0.0, save_on_each_node=False, fp16=False, fp16_full_eval=False, bf16=False,
                           bf16_full_eval=False, get_warmup_steps=lambda steps: 0)
    trainers = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    try:
        trainers.trainer_config_process(args)
        trainers.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size)), 10)
        return trainers.config
    finally:
        unset_hf_deepspeed_config()  # transformers would take every later model for a ZeRO-3 one


def test_auto_is_filled_in_as_transformers_trainer_fills_it():
    passed = copy.deepcopy(WITH_BF16)
    resolved = _resolved(passed, dtype=torch.bfloat16)
    assert passed == WITH_BF16  # copies: the caller's dict is not changed
    trainers = _trainers_filling(WITH_BF16, HIDDEN, world=2)
    assert {key: resolved.values["zero_optimization"][key] for key in BUCKETS} == {
        key: trainers["zero_optimization"][key] for key in BUCKETS} == {
        "reduce_bucket_size": 576, "stage3_prefetch_bucket_size": 518, "stage3_param_persistence_threshold": 240}
    assert (resolved.values["bf16"], resolved.values["fp16"]["enabled"], resolved.dtype) == (
        {"enabled": True}, False, "bfloat16")
    # the batch sizes: the micro batch 1 (the Trainer's is its argument), the others DeepSpeed derives
    assert resolved.values["train_micro_batch_size_per_gpu"] == trainers["train_micro_batch_size_per_gpu"] == 1
    assert "train_batch_size" not in resolved.values and "gradient_accumulation_steps" not in resolved.values
    # what building does not read is left as it is, for the Trainer
    assert {key: resolved.values[key] for key in ("optimizer", "scheduler", "gradient_clipping")} == {
        key: WITH_BF16[key] for key in ("optimizer", "scheduler", "gradient_clipping")}
    assert _resolved(WITH_BF16).values["bf16"]["enabled"] is False  # no dtype: the Trainer's default, off


@pytest.mark.parametrize(("config", "kept"), [
    ({**DOCS_ZERO3, "train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto"}, {"train_batch_size": 8}),
    ({**DOCS_ZERO3, "gradient_accumulation_steps": 4}, {"gradient_accumulation_steps": 4,
                                                        "train_micro_batch_size_per_gpu": 1}),
])
def test_batch_sizes_given_are_kept_and_auto_ones_left_for_deepspeed_to_derive(config, kept):
    values = _resolved(config).values
    assert {key: values[key] for key in ds_config._BATCH_SIZES if key in values} == kept


def test_a_bucket_size_given_is_kept():
    zero = {"stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": "auto"}
    assert _resolved({**DOCS_ZERO3, "zero_optimization": zero}).values["zero_optimization"] == {
        "stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 518}


def test_auto_bucket_sizes_without_a_hidden_size_are_left_to_deepspeed_while_building():
    """zero.Init reads none of them: without a hidden size they are left out while building (the
    engine takes them from the config given to deepspeed.initialize)."""
    assert not set(BUCKETS) & set(_resolved(DOCS_ZERO3, hidden_size=None).values["zero_optimization"])
    with pytest.raises(zload.ArgumentTypeError, match="hidden_size='24': expected the model's hidden size"):
        _resolved(DOCS_ZERO3, hidden_size="24")
    with pytest.raises(zload.ArgumentValueError, match="hidden_size=0: expected the model's hidden size"):
        _resolved(DOCS_ZERO3, hidden_size=0)
    for refused in ({**DOCS_ZERO3, "sequence_parallel_size": "auto"},
                    {**DOCS_ZERO3, "zero_optimization": {"stage": "auto"}}):
        with pytest.raises(zload.ArgumentValueError, match="Trainer does not fill"):
            ds_config.read_ds_config(refused, "ds_config", zero3=True)


def test_the_hidden_size_is_found_where_the_trainer_finds_it():
    from zload.integrations.transformers import hidden_size_of

    assert hidden_size_of(models.tiny_llama_config()) == HIDDEN
    assert hidden_size_of(SimpleNamespace(hidden_sizes=[8, 32, 16])) == 32
    assert hidden_size_of(SimpleNamespace(text_config=SimpleNamespace(hidden_size=12))) == 12
    assert hidden_size_of(SimpleNamespace(vocab_size=3)) is None
