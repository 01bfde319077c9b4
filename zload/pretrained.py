"""``from_pretrained``: a transformers model built as a ZeRO-3 model and loaded, with no rank ever
holding the whole model: ``zload.init`` builds it, ``zload.load_into`` fills it.

transformers is imported only when this is called.
"""

from __future__ import annotations

import os

from .checkpoint.open import local_path
from .distributed import agree, collective, problems_of, stage, warn_for_all
from .errors import ArgumentTypeError, ArgumentValueError
from .integrations.deepspeed import gathered_parameters
from .integrations.transformers import hidden_size_of, initialize_missing
from .loading.load_into import load_into
from .model.ds_config import DsConfig, read_ds_config, refuse_weight_quantization, resolve_auto
from .model.init import init, is_unloaded, mark_loaded
from .report import LoadReport, shortened

GENERATION_CONFIG = "generation_config.json"


def from_pretrained(model_class, path_or_repo_id: str | os.PathLike, ds_config, *, revision: str | None = None,
                    dtype=None, trust_remote_code: bool = False, strict: bool = False, key_map=None,
                    progress: bool | None = None, verify: str = "sample", output_loading_info: bool = False,
                    torch_dtype=None, **config_kwargs):
    """``model_class.from_pretrained(path_or_repo_id)`` as a DeepSpeed ZeRO-3 model: built by
    ``zload.init`` (parameters born partitioned) and filled by ``zload.load_into``, so no rank
    ever holds the whole model.

    ``model_class``: a ``PreTrainedModel`` class or an ``AutoModel*`` class. ``path_or_repo_id``:
    a folder holding ``config.json`` and safetensors weights, or a Hub repo id at ``revision``,
    downloaded once per node. ``ds_config``: the DeepSpeed config (a dict or a JSON file's path),
    ZeRO stage 3, checked by ``zload.ds_config`` (the ranks agree on its verdict), its "auto"
    values filled in as transformers' Trainer does (``ds_config.resolve_auto``; the hidden size
    from the checkpoint's config). ``dtype`` of the parameters (a ``torch.dtype`` or its name;
    ``torch_dtype``, its old name, is taken with transformers' deprecation warning): by default
    the one ``ds_config`` enables, read as DeepSpeed reads it (``bf16``, ``fp16``; ``"enabled":
    "auto"`` enables none), else the checkpoint config's, which ``"auto"`` asks for outright;
    float32 if neither names one. ``trust_remote_code`` and ``config_kwargs`` (config attributes
    to override) as in ``from_pretrained``; ``key_map``, ``progress`` and ``verify`` as in
    ``load_into``.

    Parameters the checkpoint lacks (a new head on a base model's checkpoint) are initialised as
    transformers' ``from_pretrained`` initialises them: by the model's own ``_init_weights``, on
    rank 0 under a gather of just those parameters, then broadcast, so every rank holds the same
    values, drawn from the global random generator (``torch.manual_seed``) as transformers draws
    them; they are listed in the report's ``newly_initialized`` and warned about. ``strict=True``
    refuses such a checkpoint instead (``PlanError``, as ``load_into``).

    Returns the model in eval mode, as ``from_pretrained`` does, with the checkpoint's generation
    config where it has one; with ``output_loading_info``, ``(model, info)``: ``info`` is the dict
    transformers returns (``missing_keys``, ``unexpected_keys`` and ``mismatched_keys`` sets,
    ``error_msgs`` list), and ``info.report`` the ``LoadReport``. Every rank must call it.
    """
    import transformers

    dtype = _renamed_dtype(dtype, torch_dtype)

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

    def read_config_and_resolve():
        config = read_config()
        parameter_dtype = _parameter_dtype(dtype, checked, config)
        return config, parameter_dtype, resolve_auto(checked, dtype=parameter_dtype, hidden_size=hidden_size_of(config))

    read, problems = problems_of(f"reading the config of {path}", read_config_and_resolve)
    agree(problems, f"cannot build a model from {path}")
    config, dtype, resolved = read
    config.name_or_path = path
    # transformers' own zero.Init path keeps zero.Init from casting torch.arange (RoPE buffers) too
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    with prevent_arange_dtype_change(), init(_with_dtype(resolved, dtype)):
        if concrete:
            model = model_class._from_config(config, dtype=dtype)  # what AutoModel*.from_config runs
        else:
            model = model_class.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
    report = load_into(model, folder, strict=strict, key_map=key_map, progress=progress, verify=verify,
                       _initialises_missing=not strict)
    _fill_missing(model, report, path)
    model.eval()
    if model.can_generate() and os.path.isfile(os.path.join(folder, GENERATION_CONFIG)):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return (model, LoadingInfo(report)) if output_loading_info else model


class LoadingInfo(dict):
    """What transformers' ``from_pretrained(..., output_loading_info=True)`` returns as its second
    value, with the same keys and types (``missing_keys``, ``unexpected_keys``,
    ``mismatched_keys``: sets; ``error_msgs``: a list), and zload's ``LoadReport`` as ``report``.
    Nothing is ever mismatched or an error here: zload refuses a checkpoint whose shapes do not
    fit (``PlanError``) rather than skipping the tensor."""

    def __init__(self, report: LoadReport):
        super().__init__(missing_keys=set(report.missing), unexpected_keys=set(report.unexpected),
                         mismatched_keys=set(), error_msgs=[])
        self.report = report


def _renamed_dtype(dtype, torch_dtype):
    """``dtype``, or ``torch_dtype``, its older name, which transformers still takes."""
    if torch_dtype is None:
        return dtype
    if dtype is not None:
        raise ArgumentTypeError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} both given: torch_dtype is the "
                                f"old name of dtype; pass dtype only")
    warn_for_all("`torch_dtype` is deprecated! Use `dtype` instead!", stacklevel=3, category=FutureWarning)
    return torch_dtype


def _fill_missing(model, report: LoadReport, path: str) -> None:
    """Initialise the parameters ``load_into`` left unwritten (``from_pretrained``'s docstring says
    how), report them and warn as transformers does. A collective; a failure on any rank is raised
    on every rank."""
    named = [(name, param) for name, param in model.named_parameters() if is_unloaded(param)]
    if not named:
        return
    params = [param for _, param in named]
    doing = f"initialising the weights {path} lacks"
    with stage(doing, "Those weights may be left unwritten: build the model again."), collective():
        with gathered_parameters(params, modifier_rank=0):
            _, problems = problems_of(doing, lambda: initialize_missing(model, params))
        agree(problems, f"cannot initialise the weights of {type(model).__name__} that {path} lacks")
    for param in params:
        mark_loaded(param)
    report.newly_initialized = [name for name, _ in named]
    shown = shortened([repr(name) for name, _ in named], 20)
    warn_for_all(f"Some weights of {type(model).__name__} were not initialized from the model checkpoint at {path} "
                 f"and are newly initialized: [{shown}]\nYou should probably TRAIN this model on a down-stream task "
                 f"to be able to use it for predictions and inference.", stacklevel=3)


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
