"""``from_pretrained``: a transformers model built as a ZeRO-3 model and loaded, with no rank ever
holding the whole model: ``zload.init`` builds it, ``zload.load_into`` fills it.

transformers is imported only when this is called.
"""

from __future__ import annotations

import os

from .checkpoint.open import local_path
from .distributed import agree, problems_of
from .errors import ArgumentTypeError, ArgumentValueError
from .loading.load_into import load_into
from .model.ds_config import DsConfig, read_ds_config, refuse_weight_quantization
from .model.init import init

GENERATION_CONFIG = "generation_config.json"


def from_pretrained(model_class, path_or_repo_id: str | os.PathLike, ds_config, *, revision: str | None = None,
                    dtype=None, trust_remote_code: bool = False, strict: bool = True, key_map=None,
                    progress: bool | None = None, verify: str = "sample", output_loading_info: bool = False,
                    **config_kwargs):
    """``model_class.from_pretrained(path_or_repo_id)`` as a DeepSpeed ZeRO-3 model: built by
    ``zload.init`` (parameters born partitioned) and filled by ``zload.load_into``, so no rank
    ever holds the whole model.

    ``model_class``: a ``PreTrainedModel`` class or an ``AutoModel*`` class. ``path_or_repo_id``:
    a folder holding ``config.json`` and safetensors weights, or a Hub repo id at ``revision``,
    downloaded once per node. ``ds_config``: the DeepSpeed config (a dict or a JSON file's path),
    ZeRO stage 3, checked by ``zload.ds_config`` (the ranks agree on its verdict). ``dtype`` of the
    parameters (a ``torch.dtype`` or its name): by default the one ``ds_config`` enables, read as
    DeepSpeed reads it (``bf16``, ``fp16``; ``"enabled": "auto"`` enables none), else the
    checkpoint config's, which ``"auto"`` asks for outright; float32 if neither names one.
    ``trust_remote_code`` and ``config_kwargs``
    (config attributes to override) as in ``from_pretrained``; ``strict``, ``key_map``,
    ``progress`` and ``verify`` as in ``load_into``. Returns the model in eval mode, as
    ``from_pretrained`` does, with the checkpoint's generation config where it has one; with
    ``output_loading_info``, ``(model, LoadReport)``. Every rank must call it.
    """
    import transformers

    def check_ds_config():
        checked = read_ds_config(ds_config, "ds_config", zero3=True)
        refuse_weight_quantization(checked, {})
        return checked

    checked, problems = problems_of("checking ds_config", check_ds_config)
    agree(problems, "cannot build a model with this ds_config")
    concrete = isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)
    if not concrete and not (isinstance(model_class, type) and hasattr(model_class, "from_config")):
        raise ArgumentTypeError(f"model_class={model_class!r}: expected a transformers PreTrainedModel class "
                                f"(LlamaForCausalLM) or an AutoModel class (AutoModelForCausalLM)")
    path = os.fspath(path_or_repo_id)
    remote_code = ("*.py",) if trust_remote_code else ()  # the modules a config's auto_map names
    folder = local_path(path, revision, also=(GENERATION_CONFIG, *remote_code))

    def read_config():
        if concrete:
            config, unused = model_class.config_class.from_pretrained(folder, return_unused_kwargs=True,
                                                                      **config_kwargs)
        else:
            config, unused = transformers.AutoConfig.from_pretrained(
                folder, trust_remote_code=trust_remote_code, return_unused_kwargs=True, **config_kwargs)
        if unused:
            raise ArgumentTypeError(f"{', '.join(unused)}: not attributes of {type(config).__name__}; "
                                    f"from_pretrained passes keyword arguments to the config only")
        return config

    config, problems = problems_of(f"reading the config of {path}", read_config)
    agree(problems, f"cannot build a model from {path}")
    dtype = _parameter_dtype(dtype, checked, config)
    config.name_or_path = path
    # transformers' own zero.Init path keeps zero.Init from casting torch.arange (RoPE buffers) too
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    with prevent_arange_dtype_change(), init(_with_dtype(checked, dtype)):
        if concrete:
            model = model_class._from_config(config, dtype=dtype)  # what AutoModel*.from_config runs
        else:
            model = model_class.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
    report = load_into(model, folder, strict=strict, key_map=key_map, progress=progress, verify=verify)
    model.eval()
    if model.can_generate() and os.path.isfile(os.path.join(folder, GENERATION_CONFIG)):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return (model, report) if output_loading_info else model


# the dtypes ZeRO-3 builds parameters in, and the sections of a DeepSpeed config that ask for them
_ZERO_DTYPES = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}


def _parameter_dtype(dtype, ds_config: DsConfig, config):
    """The argument, else the dtype ``ds_config`` enables, else the config's ("auto")."""
    import torch

    if dtype is None:
        dtype = ds_config.dtype or "auto"
    from_config = dtype == "auto"
    if from_config:
        dtype = getattr(config, "dtype", None) or torch.float32
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _ZERO_DTYPES:
        what = f"the checkpoint's config asks for dtype {name}" if from_config else f"dtype={dtype!r}"
        raise ArgumentValueError(f"{what}: ZeRO-3 builds parameters in float32, bfloat16 or float16; "
                                 f"pass dtype= one of those")
    return getattr(torch, name)


def _with_dtype(ds_config: DsConfig, dtype) -> dict:
    """``ds_config`` whose bf16/fp16 sections (as DeepSpeed reads them: "bfloat16" where "bf16" is
    absent) ask ``zload.init`` for ``dtype``: zero.Init's ``dtype=`` is ignored on accelerators
    without float16 (DeepSpeed 0.19.8 ``_set_dtype``), its config never is."""
    sections = {section: {**ds_config.precision[section], "enabled": str(dtype) == f"torch.{name}"}
                for name, section in _ZERO_DTYPES.items() if section}
    return {**ds_config.values, **sections}
