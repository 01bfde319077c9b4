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
- the batch sizes, on which DeepSpeed does arithmetic, are numbers above 0 or "auto", and one of
  the two it asks for is there.

``resolve_auto`` then fills in the "auto" values of what zero.Init parses, as transformers'
Trainer does (``HfTrainerDeepSpeedConfig``), so that the config a Trainer takes builds too:
DeepSpeed itself compares an "auto" batch size with 0 and fails with a ``TypeError``, and reads an
"auto" bucket size or persistence threshold as its own default, not as the value the Trainer's
engine will use (DeepSpeed 0.19.8's zero.Init reads none of these three; the engine decides which
parameters stay whole). "auto" in what zero.Init does not read (optimizer, scheduler,
``gradient_clipping``) is left to the Trainer; DeepSpeed's parser takes it as it is.

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
from dataclasses import dataclass, replace

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
_BATCH_SIZES = _COUNTS[:3]  # the ones transformers' Trainer fills in
# the ZeRO keys transformers' Trainer sets from the model's hidden size h
# (HfTrainerDeepSpeedConfig.trainer_config_finalize), and how
_FROM_HIDDEN_SIZE = {"reduce_bucket_size": lambda h: h * h,
                     "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                     "stage3_param_persistence_threshold": lambda h: 10 * h}


@dataclass(frozen=True)
class DsConfig:
    """A checked DeepSpeed config, and what zload reads of it, read as DeepSpeed reads it."""

    values: dict  # the config, as passed or read from its file
    path: str | None  # the file it was read from
    name: str  # the argument that passed it, as errors name it
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


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


def _bf16_key(values: dict) -> str:
    """The key DeepSpeed reads bfloat16's section under: "bfloat16" where "bf16" is absent or null."""
    return "bf16" if values.get("bf16") is not None else "bfloat16"


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
    checker.object_or_absent(_bf16_key(ds_config))
    zero = checker.zero_section(zero3)
    precision, dtype = checker.precision()
    quantized = checker.quantized(zero)
    checker.counts()
    return DsConfig(ds_config, path, name, int(zero.stage), precision, dtype, quantized)


def resolve_auto(config: DsConfig, *, dtype, hidden_size) -> DsConfig:
    """``config`` with the "auto" values that building under zero.Init reads filled in as
    transformers' Trainer fills them (the module docstring says why):

    - ``"enabled": "auto"`` in the bf16 and fp16 sections: on for the section of ``dtype`` (a
      ``torch.dtype`` or its name; the Trainer's ``bf16``/``fp16`` arguments), off otherwise;
    - the batch sizes: an "auto" one is dropped and DeepSpeed derives it from the others
      (``train_batch_size`` = micro batch x accumulation steps x world size, the relation it
      checks); where neither ``train_batch_size`` nor the micro batch is left, the micro batch is
      1 (building reads no batch size, but DeepSpeed asks for one);
    - ``reduce_bucket_size`` (h**2), ``stage3_prefetch_bucket_size`` (0.9 h**2) and
      ``stage3_param_persistence_threshold`` (10 h) from ``hidden_size`` h. Without one they are
      left out, so DeepSpeed's defaults apply while building: ``zero.Init`` reads none of them (the
      engine reads them, from the config the user gives ``deepspeed.initialize``).

    The values passed are not changed: the result holds copies."""
    is_int = isinstance(hidden_size, numbers.Integral) and not isinstance(hidden_size, bool)
    if hidden_size is not None and not (is_int and hidden_size > 0):
        raise (ArgumentValueError if is_int else ArgumentTypeError)(
            f"hidden_size={brief(hidden_size, 80)}: expected the model's hidden size, an int above 0 (its config's "
            f"hidden_size)")
    values = dict(config.values)
    wanted = None if dtype is None else str(dtype).removeprefix("torch.")
    for section, key, name in (("bf16", _bf16_key(values), "bfloat16"), ("fp16", "fp16", "float16")):
        if _is_auto(config.precision[section].get("enabled")):
            values[key] = {**config.precision[section], "enabled": wanted == name}
    for key in _BATCH_SIZES:
        if _is_auto(values.get(key)):
            del values[key]
    if all(values.get(key) is None for key in _BATCH_SIZES[:2]):
        values["train_micro_batch_size_per_gpu"] = 1
    zero = values.get("zero_optimization")
    auto = [key for key in _FROM_HIDDEN_SIZE if isinstance(zero, dict) and _is_auto(zero.get(key))]
    if auto:
        kept = {key: value for key, value in zero.items() if key not in auto}
        values["zero_optimization"] = kept if hidden_size is None else {
            **zero, **{key: _FROM_HIDDEN_SIZE[key](hidden_size) for key in auto}}
    precision, enabled = _Checker(values, config.name, config.path).precision()
    return replace(config, values=values, precision=precision, dtype=enabled)


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
            elif _is_auto(section.get("stage")):
                raise self.value_error(f'{key} is "auto", which transformers\' Trainer does not fill in either '
                                       f'(DeepSpeed reads it as stage 0): set it to 3')
            else:
                asked = f"{key} is {brief(section['stage'], 80)}" if "stage" in section else f"{key} is not set"
            raise self.value_error(
                f"{asked}, which asks for ZeRO stage {int(zero.stage)}: zload builds and loads ZeRO-3 models "
                f"(parameters partitioned across ranks); set \"zero_optimization\": {{\"stage\": 3}}, or for stages "
                f"0-2, which keep whole models, use transformers' own from_pretrained")
        return zero

    def precision(self) -> tuple[dict[str, dict], str | None]:
        """The precision sections as DeepSpeed reads them (bfloat16's under the key "bf16"), and the
        dtype they enable."""
        bf16 = _bf16_key(self.values)
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
            if _is_auto(value) and key in _BATCH_SIZES:
                continue  # resolve_auto fills it in
            if _is_auto(value):
                raise self.value_error(f'{self.key(key)} is "auto", which transformers\' Trainer does not fill '
                                       f'in: give a number')
            if not isinstance(value, numbers.Real):  # True is 1 to DeepSpeed
                raise ArgumentTypeError(f"{self.key(key)} is {brief(value, 80)} ({_type_name(value)}): DeepSpeed "
                                        f"needs a number", path=self.path)
            if not value > 0:
                raise self.value_error(f"{self.key(key)} is {value}: DeepSpeed needs a number above 0")
        if all(self.values.get(key) is None for key in _BATCH_SIZES[:2]):
            raise self.value_error(f"{self.key()} names no batch size: DeepSpeed needs "
                                   f"\"train_micro_batch_size_per_gpu\" or \"train_batch_size\" even to build a "
                                   f"model; add "
                                   f"\"train_micro_batch_size_per_gpu\": 1 (any value does for building)")
