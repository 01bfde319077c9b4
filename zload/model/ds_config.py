"""The DeepSpeed config of ``zload.init`` and ``zload.from_pretrained``, checked before DeepSpeed
reads it.

DeepSpeed reads its config with ``.get`` and ``**`` on whatever each key holds, so a section of
the wrong type (``"bf16": true``) fails with a bare ``AttributeError`` or ``TypeError`` naming no
key; a path that does not exist is decoded as base64; and zero.Init raises "not implemented on CPU
backend" for weight quantization before zload can refuse it. ``read_ds_config`` takes the config
(a dict, or the path of a JSON file) and checks what building under zero.Init reads of it:

- every top-level section DeepSpeed reads as an object is one;
- the sections zload reads too (ZeRO, ``bf16``/``bfloat16``/``fp16``, weight quantization) are
  parsed by DeepSpeed's own models, so they accept exactly what DeepSpeed accepts, including its
  reading of a key set to "auto" in them as the default; their errors name the key;
- the batch sizes, on which DeepSpeed does arithmetic, are numbers above 0, and one of the two
  it asks for is there. "auto" there, which transformers' Trainer fills in, is refused with a
  message saying zload does not resolve it yet.

Keys that neither zload nor the building reads are left to DeepSpeed. A file is read as strict
JSON (``index.read_json_file``: bounded, regular files only), once: callers pass the dict on to
DeepSpeed, never the path. DeepSpeed's other forms (hjson with comments, a base64 string) are
not taken. ``refuse_weight_quantization`` then refuses what zload cannot load into, before
zero.Init is built.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass

from ..checkpoint.index import read_json_file
from ..errors import ArgumentTypeError, ArgumentValueError, CheckpointError
from ..integrations.deepspeed import config_model
from ..report import brief

# top-level sections DeepSpeed 0.19.8 reads as objects (``**section``, ``section.get``) whenever it
# parses a config; the ones it reads specially ("zero_optimization", "bf16", "bfloat16") apart
_SECTIONS = ("activation_checkpointing", "aio", "autotuning", "checkpoint", "comet", "comms_logger", "compile",
             "csv_monitor", "data_efficiency", "data_types", "flops_profiler", "fp16", "hybrid_engine", "optimizer",
             "pipeline", "scheduler", "tensor_parallel", "tensorboard", "torch_autocast", "wandb",
             "weight_quantization")
_NULL_IS_ABSENT = ("aio", "bf16")  # sections DeepSpeed reads as absent when null
_EXAMPLES = {"zero_optimization": '{"stage": 3}', "bf16": '{"enabled": true}', "bfloat16": '{"enabled": true}',
             "fp16": '{"enabled": true}'}
# keys DeepSpeed divides and compares as numbers while it parses (the batch sizes, and the
# Ulysses sequence-parallel size it divides the world size by)
_COUNTS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
           "sequence_parallel_size")


@dataclass(frozen=True)
class DsConfig:
    """A checked DeepSpeed config, and what zload reads of it, read as DeepSpeed reads it."""

    values: dict  # the config, as passed or read from its file
    path: str | None  # the file it was read from
    stage: int  # ZeRO stage
    precision: dict[str, dict]  # the "bf16" (or "bfloat16", where DeepSpeed reads it) and "fp16" sections
    dtype: str | None  # "bfloat16" or "float16", when a precision section enables it
    quantized: tuple[str, ...]  # the weight-quantization options it turns on, as key paths


def _shown(key) -> str:
    if not isinstance(key, str):
        return brief(key, 40)
    return json.dumps(key) if len(key) <= 60 else json.dumps(key[:60])[:-1] + f'..." ({len(key):,} characters)'


def _type_name(value) -> str:
    kind = type(value).__name__
    return "null" if value is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _unresolved_auto(key: str, fix: str, path: str | None) -> ArgumentValueError:
    """The error for "auto" where zload reads a value: resolving it is left to a later version."""
    return ArgumentValueError(f'{key} is "auto": zload does not resolve "auto" values yet (transformers\' '
                              f'Trainer fills them in from its arguments); {fix}', path=path)


def refuse_weight_quantization(config: DsConfig | None, zero_init_kwargs: dict) -> None:
    """Refuse DeepSpeed's weight quantization before zero.Init is built: zload cannot load into
    quantized partitions, and with these options zero.Init builds DeepSpeed's weight quantizer,
    which on a CPU fails first."""
    on = [*(config.quantized if config else ()),
          *(["zero_quantized_nontrainable_weights=True"] if zero_init_kwargs.get("zero_quantized_nontrainable_weights")
            else [])]
    if on:
        raise ArgumentValueError(
            f"zload.init does not build weight-quantized parameters ({', '.join(on)} asks DeepSpeed to), and "
            "zload cannot load into them: build this model with deepspeed.zero.Init and without quantized "
            "weights, or turn those options off", path=config.path if config and config.quantized else None)


def read_ds_config(ds_config, name: str, *, zero3: bool = False) -> DsConfig:
    """``ds_config`` (a dict, or the path of a JSON file, passed as the argument ``name``) checked as
    the module docstring says; with ``zero3``, it must ask for ZeRO stage 3. Raises
    ``ArgumentTypeError`` / ``ArgumentValueError`` naming the key, and the file with ``path``."""
    path = None
    if isinstance(ds_config, (str, os.PathLike)):
        path = os.fspath(ds_config)
        try:
            ds_config = read_json_file(path)
        except CheckpointError as e:
            raise ArgumentValueError(f"{name}: cannot read this DeepSpeed config: {e}. Pass the config as a dict "
                                     f"or as the path of a JSON file", path=path) from e
        if not isinstance(ds_config, dict):
            raise ArgumentValueError(f"{name}: {path} holds {_type_name(ds_config)}, not a JSON object: a DeepSpeed "
                                     f"config is an object of sections", path=path)
    elif not isinstance(ds_config, dict):
        raise ArgumentTypeError(f"{name} is {brief(ds_config, 80)} ({_type_name(ds_config)}): expected a DeepSpeed "
                                f"config, as a dict or the path of a JSON file")
    checker = _Checker(ds_config, name, path)
    for section in _SECTIONS:
        checker.object_or_absent(section)
    checker.object_or_absent("zero_optimization", bool)
    bf16 = "bf16" if ds_config.get("bf16") is not None else "bfloat16"  # DeepSpeed's fallback
    checker.object_or_absent(bf16)
    zero = checker.zero_section(zero3)
    precision, dtype = checker.precision(bf16)
    quantized = checker.quantized(zero)
    checker.counts()
    return DsConfig(ds_config, path, int(zero.stage), precision, dtype, quantized)


class _Checker:
    def __init__(self, values: dict, name: str, path: str | None):
        self.values, self.name, self.path = values, name, path

    def key(self, *keys) -> str:
        """``ds_config["zero_optimization"]["stage"]``, and the file the config came from."""
        text = self.name + "".join(f"[{_shown(k)}]" for k in keys)
        return f"{text} (in {self.path})" if self.path else text

    def value_error(self, message: str) -> ArgumentValueError:
        return ArgumentValueError(message, path=self.path)

    def object_or_absent(self, section: str, *also: type) -> None:
        value = self.values.get(section)
        if isinstance(value, (dict, *also)) or (value is None and (section not in self.values
                                                                  or section in _NULL_IS_ABSENT)):
            return
        example = _EXAMPLES.get(section)
        raise ArgumentTypeError(f"{self.key(section)} is {brief(value, 80)} ({_type_name(value)}): DeepSpeed reads "
                                f"this section as an object" + (f", such as {example}" if example else ""),
                                path=self.path)

    def parsed(self, model, keys: tuple[str, ...], section: dict):
        """``model(**section)``: DeepSpeed's reading of the section at ``keys``, its errors naming the
        keys at fault."""
        import pydantic

        try:
            return model(**section)
        except pydantic.ValidationError as e:
            errors = e.errors()
            shown = [f"{self.key(*keys, *error['loc'])} is {brief(error.get('input'), 80)}: {error['msg']}"
                     for error in errors[:3]]
            more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
            kind = ArgumentTypeError if errors[0]["type"].endswith(("_type", "_parsing")) else ArgumentValueError
            raise kind(f"{'; '.join(shown)}{more}: refused by DeepSpeed's check of {self.key(*keys)}",
                       path=self.path) from e
        except (TypeError, AssertionError, ValueError) as e:  # a key not a string; DeepSpeed's deprecated keys
            kind = ArgumentTypeError if isinstance(e, TypeError) else ArgumentValueError
            raise kind(f"{self.key(*keys)}: refused by DeepSpeed: {e}", path=self.path) from e

    def zero_section(self, zero3: bool):
        """The ZeRO section as DeepSpeed reads it (``true``/``false``: its deprecated form of stage
        1 and 0, whose other keys zload does not read)."""
        section = self.values.get("zero_optimization", {})
        zero = self.parsed(config_model("zero_optimization"), ("zero_optimization",),
                           {"stage": int(section)} if isinstance(section, bool) else section)
        if zero3 and zero.stage != 3:
            key = self.key("zero_optimization", "stage")
            if isinstance(section, bool):
                asked = f"{self.key('zero_optimization')} is {json.dumps(section)}, DeepSpeed's old form"
            elif section.get("stage") == "auto":
                raise _unresolved_auto(key, "set it to 3", self.path)
            else:
                asked = f"{key} is {brief(section['stage'], 80)}" if "stage" in section else f"{key} is not set"
            raise self.value_error(
                f"{asked}, which asks for ZeRO stage {int(zero.stage)}: zload builds and loads ZeRO-3 models "
                f"(parameters partitioned across ranks); set \"zero_optimization\": {{\"stage\": 3}}, or for stages "
                f"0-2, which keep whole models, use transformers' own from_pretrained")
        return zero

    def precision(self, bf16: str) -> tuple[dict[str, dict], str | None]:
        """The precision sections as DeepSpeed reads them (bfloat16's under the key "bf16"), and the
        dtype they enable."""
        sections, enabled = {}, []
        for section, key, dtype in (("bf16", bf16, "bfloat16"), ("fp16", "fp16", "float16")):
            sections[section] = self.values.get(key) or {}
            if self.parsed(config_model(section), (key,), sections[section]).enabled:
                enabled.append(dtype)
        if len(enabled) > 1:
            raise self.value_error(f"{self.key(bf16, 'enabled')} and {self.key('fp16', 'enabled')} are both on: "
                                   f"DeepSpeed builds in one of bfloat16 and float16; turn one off")
        return sections, (enabled or [None])[0]

    def quantized(self, zero) -> tuple[str, ...]:
        on = []
        if "weight_quantization" in self.values:
            keys = ("weight_quantization",)
            model = config_model("weight_quantization")
            if self.parsed(model, keys, self.values["weight_quantization"]).quantized_initialization:
                on.append(self.key(*keys, "quantized_initialization"))
        if zero.zero_quantized_nontrainable_weights:
            on.append(self.key("zero_optimization", "zero_quantized_nontrainable_weights"))
        return tuple(on)

    def counts(self) -> None:
        for key in _COUNTS:
            if key not in self.values or (self.values[key] is None and key != "sequence_parallel_size"):
                continue  # DeepSpeed reads a null batch size as absent
            value = self.values[key]
            if isinstance(value, str) and value == "auto":
                raise _unresolved_auto(self.key(key), "give a number", self.path)
            if not isinstance(value, numbers.Real):  # True is 1 to DeepSpeed
                raise ArgumentTypeError(f"{self.key(key)} is {brief(value, 80)} ({_type_name(value)}): DeepSpeed "
                                        f"needs a number", path=self.path)
            if not value > 0:
                raise self.value_error(f"{self.key(key)} is {value}: DeepSpeed needs a number above 0")
        if all(self.values.get(key) is None for key in _COUNTS[:2]):
            raise self.value_error(f"{self.key()} names no batch size: DeepSpeed needs "
                                   f"\"train_micro_batch_size_per_gpu\" or \"train_batch_size\" even to build a "
                                   f"model; add "
                                   f"\"train_micro_batch_size_per_gpu\": 1 (any value does for building)")
