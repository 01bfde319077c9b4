"""Helpers for rank bodies: build models under zero.Init, and check them against a checkpoint.

The reference is always DeepSpeed's own ``GatheredParameters``, compared bit for bit with the
checkpoint tensor cast by ``Tensor.to``, so a wrong partition, offset, cast or padding shows up.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import NamedTuple

import deepspeed
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zload

DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def dtype_config(dtype, config=None) -> dict:
    """``config`` (default ``DS_CONFIG``) whose fp16/bf16 sections ask zero.Init for ``dtype``.

    zero.Init's ``dtype=`` argument is ignored on CPUs without oneDNN fp16 (DeepSpeed 0.19.8
    ``_set_dtype`` then picks bf16 whatever was asked); a config without ``dtype=`` is honoured
    everywhere.
    """
    config = dict(config or DS_CONFIG)
    config["bf16"] = {"enabled": dtype == torch.bfloat16}
    config["fp16"] = {"enabled": dtype == torch.float16}
    return config


class BadConfig(NamedTuple):
    config: object  # a DeepSpeed config (dict), a JSON file's path, or neither
    kind: str  # the class of the error zload raises
    says: str  # what its message holds: the key at fault, under the argument's name
    path: str | None  # its ``path``: the file at fault


def bad_ds_configs(folder, name: str) -> list[BadConfig]:
    """Configs refused before DeepSpeed reads them (``name``: the argument that passes them), some
    in JSON files written into ``folder``."""
    missing, garbled, quantized = (os.path.join(folder, f) for f in ("missing.json", "garbled.json", "quantized.json"))
    with open(garbled, "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": 1,')
    with open(quantized, "w") as f:
        json.dump({**DS_CONFIG, "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}, f)
    quantized_init = {"quantized_initialization": {"num_bits": 8, "group_size": 64, "group_dim": 1, "symmetric": False}}
    return [
        BadConfig({**DS_CONFIG, "zero_optimization": "stage3"}, "ArgumentTypeError",
                  f"{name}[\"zero_optimization\"] is 'stage3' (a str)", None),
        BadConfig({**DS_CONFIG, "zero_optimization": [3]}, "ArgumentTypeError",
                  f"{name}[\"zero_optimization\"] is [3] (a list)", None),
        BadConfig({**DS_CONFIG, "bf16": True}, "ArgumentTypeError", f"{name}[\"bf16\"] is True (a bool)", None),
        BadConfig(missing, "ArgumentValueError", f"{missing}: cannot read: No such file", missing),
        BadConfig(garbled, "ArgumentValueError", f"{garbled}: not JSON", garbled),
        BadConfig(3, "ArgumentTypeError", f"{name} is 3 (an int)", None),
        BadConfig(quantized, "ArgumentValueError",
                  f"{name}[\"zero_optimization\"][\"zero_quantized_nontrainable_weights\"] (in {quantized})", quantized),
        BadConfig({**DS_CONFIG, "weight_quantization": quantized_init}, "ArgumentValueError",
                  f"{name}[\"weight_quantization\"][\"quantized_initialization\"]", None),
        BadConfig({**DS_CONFIG, "sequence_parallel_size": "auto"}, "ArgumentValueError",
                  f"{name}[\"sequence_parallel_size\"] is \"auto\", which transformers' Trainer does not fill", None),
    ]


class Refused(NamedTuple):
    kind: str
    message: str
    path: str | None
    ranks: tuple[int, ...] | None


def refusal(call) -> Refused | None:
    """The error ``call()`` raised (any: DeepSpeed's own too, to compare with zload's), or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return Refused(type(e).__name__, str(e), getattr(e, "path", None), getattr(e, "ranks", None))
    return None


def build_zero(factory, dtype=torch.float32, config=None):
    """``factory()`` under zero.Init; partitions pre-filled with a sentinel so stale bytes show."""
    with deepspeed.zero.Init(config_dict_or_path=dtype_config(dtype, config)):
        model = factory()
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            p.ds_tensor.data.fill_(7.0)
    return model


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN, -0.0 and dtype all take part in equality."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {actual.shape} != {expected.shape}"
    if not torch.equal(bits(actual), bits(expected)):
        diff = (actual.float() != expected.float()).sum().item()
        raise AssertionError(f"{what}: {diff} of {expected.numel()} elements differ")


def check_against(model, expected: dict[str, torch.Tensor], names=None) -> int:
    """Gather every parameter and compare each named tensor with ``expected[name].to(dtype)``.

    Without ``names``, ``expected`` must cover every parameter of the model (under one of its tied
    names). Also checks that the ZeRO-3 padding of those tensors was zeroed. Returns the number
    compared.
    """
    params = list(model.parameters())
    compared, seen = 0, set()
    with deepspeed.zero.GatheredParameters(params):
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        for name in names or expected:
            actual = tensors[name]
            assert_bit_equal(actual.data, expected[name].to(actual.dtype), f"rank {dist.get_rank()}: {name}")
            compared += 1
            seen.add(id(actual))
    if names is None:
        uncovered = [n for n, p in model.named_parameters() if id(p) not in seen]
        assert not uncovered, f"parameters the reference does not cover: {uncovered[:10]}"
    for name, p in model.named_parameters(remove_duplicate=False):
        if hasattr(p, "ds_tensor") and name in (names or expected):
            part = p.ds_tensor.view(-1)
            valid = max(0, min(part.numel(), p.ds_numel - dist.get_rank(p.ds_process_group) * part.numel()))
            assert torch.all(part[valid:] == 0), f"{name}: padding not zeroed"
    return compared


def randomize(model, seed: int) -> None:
    """Distinct, deterministic values in every parameter (the same for the same seed and model),
    ZeRO-3 or plain."""
    generator = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for p in params:
            p.data.copy_(torch.randn(p.shape, generator=generator).to(p.dtype))


def gathered(named: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Whole, cloned values of ``named`` parameters (ZeRO-3 or plain), through GatheredParameters."""
    unique = list({id(p): p for p in named.values()}.values())  # tied names share one parameter
    with deepspeed.zero.GatheredParameters(unique):
        return {n: p.detach().clone() for n, p in named.items()}


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter under every name (tied ones repeated) and every persistent buffer, whole
    and cloned: what a saved checkpoint of ``model`` must hold."""
    state = gathered(dict(model.named_parameters(remove_duplicate=False)))
    for prefix, module in model.named_modules():
        for local, b in module._buffers.items():
            if b is not None and local not in module._non_persistent_buffers_set:
                state[f"{prefix}.{local}" if prefix else local] = b.detach().clone()
    return state


def snapshot(model) -> dict[str, torch.Tensor]:
    """Each rank's own view of the model (partitions, plain params, buffers), to prove it is untouched."""
    state = {}
    for name, p in model.named_parameters():
        state[name] = (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).detach().clone()
    for name, b in model.named_buffers():
        state[name] = b.detach().clone()
    return state


def assert_unchanged(model, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name in before:
        assert_bit_equal(after[name], before[name], f"{name} changed")


def refused_load(model, path, passed=None, **load_kwargs) -> tuple[str, str] | None:
    """``zload.load_into`` of ``passed`` (default: ``model``): the class name and message of the
    error it raised, once ``model`` is proven untouched, or None when it loaded."""
    before = snapshot(model)
    try:
        zload.load_into(model if passed is None else passed, path, **load_kwargs)
    except zload.ZloadError as e:
        assert_unchanged(model, before)
        return type(e).__name__, str(e)
    return None


def load_expected(path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


class WarnedLoad(NamedTuple):
    report: zload.LoadReport
    messages: list[str]  # of the warnings the load gave


def load_recording_warnings(model, path, **load_kwargs) -> WarnedLoad:
    """``zload.load_into(model, path, **load_kwargs)``, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = zload.load_into(model, path, **load_kwargs)
    return WarnedLoad(report, [str(w.message) for w in caught])
