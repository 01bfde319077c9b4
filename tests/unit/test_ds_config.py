"""zload.ds_config: a DeepSpeed config checked before DeepSpeed reads it. The configs of the two
tables are also given to DeepSpeed's own parser: what zload refuses, DeepSpeed refuses too (with an
error naming no key); what zload takes, DeepSpeed takes, and reads the same way."""

from __future__ import annotations

import json
import os

import pytest

import zload
from zload.model.ds_config import read_ds_config

from tests.support.zero3 import DS_CONFIG

ZERO3 = DS_CONFIG["zero_optimization"]


# (config, error zload raises, what its message says)
REFUSED = [
    ({**DS_CONFIG, "zero_optimization": "stage3"}, zload.ArgumentTypeError,
     'config["zero_optimization"] is \'stage3\' (a str): DeepSpeed reads this section as an object, such as '
     '{"stage": 3}'),
    ({**DS_CONFIG, "zero_optimization": [3]}, zload.ArgumentTypeError, 'config["zero_optimization"] is [3] (a list)'),
    ({**DS_CONFIG, "zero_optimization": None}, zload.ArgumentTypeError, 'config["zero_optimization"] is None (null)'),
    ({**DS_CONFIG, "bf16": True}, zload.ArgumentTypeError,
     'config["bf16"] is True (a bool): DeepSpeed reads this section as an object, such as {"enabled": true}'),
    ({**DS_CONFIG, "bfloat16": 1}, zload.ArgumentTypeError, 'config["bfloat16"] is 1 (an int)'),
    ({**DS_CONFIG, "bf16": None, "bfloat16": None}, zload.ArgumentTypeError, 'config["bfloat16"] is None (null)'),
    ({**DS_CONFIG, "fp16": "on"}, zload.ArgumentTypeError, 'config["fp16"] is \'on\' (a str)'),
    ({**DS_CONFIG, "optimizer": "adamw"}, zload.ArgumentTypeError, 'config["optimizer"] is \'adamw\' (a str)'),
    ({**DS_CONFIG, "data_types": None}, zload.ArgumentTypeError, 'config["data_types"] is None (null)'),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "offload_param": {"device": "gpu"}}}, zload.ArgumentValueError,
     'config["zero_optimization"]["offload_param"]["device"] is \'gpu\': Input should be \'none\', \'cpu\' or '
     '\'nvme\': refused by DeepSpeed\'s check of config["zero_optimization"]'),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "offload_param": "cpu"}}, zload.ArgumentTypeError,
     'config["zero_optimization"]["offload_param"] is \'cpu\': Input should be a valid dictionary'),
    ({**DS_CONFIG, "zero_optimization": {"stage": "three"}}, zload.ArgumentValueError,
     'config["zero_optimization"]["stage"] is \'three\': Input should be 0, 1, 2, 3'),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "zero_hpz_partition_size": -1}}, zload.ArgumentValueError,
     'config["zero_optimization"]["zero_hpz_partition_size"] is -1: Input should be greater than or equal to 0'),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "stage3_param_persistence_threshold": "many"}},
     zload.ArgumentTypeError, 'config["zero_optimization"]["stage3_param_persistence_threshold"] is \'many\''),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "stage_3": True}}, zload.ArgumentValueError,
     'config["zero_optimization"]["stage_3"] is True: Extra inputs are not permitted'),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "offload_param": {
        "device": "disk", "pin_memory": "x", "buffer_count": [], "buffer_size": "big", "max_in_cpu": {}}}},
     zload.ArgumentValueError, '["device"] is \'disk\': Input should be \'none\', \'cpu\' or \'nvme\'; '
     'config["zero_optimization"]["offload_param"]["buffer_count"] is []: Input should be a valid integer; '
     'config["zero_optimization"]["offload_param"]["buffer_size"] is \'big\': Input should be a valid integer, '
     'unable to parse string as an integer (and 2 more): refused by'),
    ({**DS_CONFIG, "bf16": {"enabled": "maybe"}}, zload.ArgumentTypeError,
     'config["bf16"]["enabled"] is \'maybe\': Input should be a valid boolean'),
    ({**DS_CONFIG, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, zload.ArgumentValueError,
     'config["bf16"]["enabled"] and config["fp16"]["enabled"] are both on'),
    ({**DS_CONFIG, "weight_quantization": {"quantized_initialization": "yes"}}, zload.ArgumentTypeError,
     'config["weight_quantization"]["quantized_initialization"] is \'yes\': Input should be a valid dictionary'),
    ({**DS_CONFIG, "sequence_parallel_size": "auto"}, zload.ArgumentValueError,
     'config["sequence_parallel_size"] is "auto", which transformers\' Trainer does not fill in: give a number'),
    ({**DS_CONFIG, "train_batch_size": "16"}, zload.ArgumentTypeError,
     'config["train_batch_size"] is \'16\' (a str): DeepSpeed needs a number'),
    ({**DS_CONFIG, "train_micro_batch_size_per_gpu": 0}, zload.ArgumentValueError,
     'config["train_micro_batch_size_per_gpu"] is 0: DeepSpeed needs a number above 0'),
    ({**DS_CONFIG, "gradient_accumulation_steps": [2]}, zload.ArgumentTypeError,
     'config["gradient_accumulation_steps"] is [2] (a list)'),
    ({**DS_CONFIG, "sequence_parallel_size": None}, zload.ArgumentTypeError,
     'config["sequence_parallel_size"] is None (null)'),
    ({"zero_optimization": ZERO3}, zload.ArgumentValueError,
     'config names no batch size: DeepSpeed needs "train_micro_batch_size_per_gpu" or "train_batch_size"'),
    (3, zload.ArgumentTypeError, "config is 3 (an int): expected a DeepSpeed config, as a dict or the path of a JSON file"),
    ([DS_CONFIG], zload.ArgumentTypeError, "(a list): expected a DeepSpeed config"),
]


@pytest.mark.parametrize(("config", "error", "says"), REFUSED)
def test_refused_naming_the_key_where_deepspeed_refuses_too(config, error, says):
    with pytest.raises(error) as info:
        read_ds_config(config, "config")
    assert says in str(info.value) and info.value.path is None, str(info.value)


# (config, its ZeRO stage, the dtype it enables, the weight-quantization options it turns on): as
# DeepSpeed reads them ("auto" in its sections is their default; "bf16" null is absent)
TAKEN = [
    (DS_CONFIG, 3, None, ()),
    ({**DS_CONFIG, "zero_optimization": {"stage": "3"}, "bf16": {"enabled": "true"}}, 3, "bfloat16", ()),
    ({**DS_CONFIG, "bf16": None, "bfloat16": {"enabled": True}}, 3, "bfloat16", ()),
    ({**DS_CONFIG, "bf16": {"enabled": "auto"}, "fp16": {"enabled": 1}}, 3, "float16", ()),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "gradient_clipping": "auto", "aio": None}, 3, None, ()),
    ({**DS_CONFIG, "zero_optimization": True}, 1, None, ()),
    ({"train_batch_size": 4, "train_micro_batch_size_per_gpu": None, "zero_optimization": ZERO3}, 3, None, ()),
    ({**DS_CONFIG, "weight_quantization": {"quantized_initialization": {}}}, 3, None, ()),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "zero_quantized_weights": True}}, 3, None, ()),
    ({**DS_CONFIG, "zero_optimization": {**ZERO3, "zero_quantized_nontrainable_weights": "yes"},
      "weight_quantization": {"quantized_initialization": {"num_bits": 8}}}, 3, None,
     ('config["weight_quantization"]["quantized_initialization"]',
      'config["zero_optimization"]["zero_quantized_nontrainable_weights"]')),
]


@pytest.mark.parametrize(("config", "stage", "dtype", "quantized"), TAKEN)
def test_taken_and_read_as_deepspeed_reads_it(config, stage, dtype, quantized):
    checked = read_ds_config(config, "config")
    assert (checked.values, checked.stage, checked.dtype, checked.quantized) == (config, stage, dtype, quantized)


def test_bfloat16_is_read_under_its_older_name_where_deepspeed_reads_it():
    checked = read_ds_config({**DS_CONFIG, "bf16": None, "bfloat16": {"enabled": True, "immediate_grad_update": True}},
                             "config")
    assert checked.precision == {"bf16": {"enabled": True, "immediate_grad_update": True}, "fp16": {}}


@pytest.mark.parametrize(("zero", "says"), [
    ({"stage": 2}, 'ds_config["zero_optimization"]["stage"] is 2, which asks for ZeRO stage 2: zload builds and loads '
                   'ZeRO-3 models'),
    ({}, 'ds_config["zero_optimization"]["stage"] is not set, which asks for ZeRO stage 0'),
    (True, 'ds_config["zero_optimization"] is true, DeepSpeed\'s old form, which asks for ZeRO stage 1'),
    ({"stage": "auto"}, 'ds_config["zero_optimization"]["stage"] is "auto", which transformers\' Trainer does not '
                        'fill in either (DeepSpeed reads it as stage 0): set it to 3'),
])
def test_zero3_asks_for_stage_3(zero, says):
    with pytest.raises(zload.ArgumentValueError) as info:
        read_ds_config({**DS_CONFIG, "zero_optimization": zero}, "ds_config", zero3=True)
    assert says in str(info.value), str(info.value)
    assert read_ds_config({**DS_CONFIG, "zero_optimization": zero}, "ds_config").stage != 3  # taken otherwise


def test_a_file_is_named_with_the_key_at_fault(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS_CONFIG, "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}))
    with pytest.raises(zload.ArgumentValueError) as info:
        read_ds_config(path, "ds_config")  # a PathLike
    assert info.value.path == str(path)
    assert f'ds_config["zero_optimization"]["offload_param"]["device"] (in {path}) is \'gpu\'' in str(info.value)
    path.write_text(json.dumps(dtype := {**DS_CONFIG, "fp16": {"enabled": True}}))
    checked = read_ds_config(str(path), "ds_config")
    assert (checked.values, checked.path, checked.dtype) == (dtype, str(path), "float16")


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read: No such file or directory"),
    (b"", "not JSON zload reads"),
    (b'{"train_micro_batch_size_per_gpu": 1, // a comment DeepSpeed\'s hjson takes\n}', "not JSON zload reads"),
    (b"[1, 2]", "holds a list, not a JSON object"),
    (b"\xff\xfe", "not JSON zload reads"),
    (b"[" * 5000 + b"]" * 5000, "nests more than"),
])
def test_a_file_that_holds_no_config_is_named(tmp_path, content, says):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(zload.ArgumentValueError) as info:
        read_ds_config(str(path), "config")
    assert info.value.path == str(path) and str(path) in str(info.value) and says in str(info.value), str(info.value)


def test_a_path_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (tmp_path, fifo):
        with pytest.raises(zload.ArgumentValueError, match="not a regular file") as info:
            read_ds_config(str(path), "config")
        assert info.value.path == str(path)


def test_a_hostile_key_is_shown_cut_short():
    key = "k" * 100_000
    with pytest.raises(zload.ArgumentValueError) as info:
        read_ds_config({**DS_CONFIG, "zero_optimization": {**ZERO3, key: 1}}, "config")
    assert len(str(info.value)) < 500 and "(100,000 characters)" in str(info.value)
