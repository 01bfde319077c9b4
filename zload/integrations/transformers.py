"""transformers: a ``PreTrainedModel``'s checkpoint conversion mapping as ``names.Source``s.

transformers renames checkpoint tensors and converts some (stacks per-expert tensors, concatenates,
splits, transposes) as it loads. Renames become plain names; a conversion that only moves whole
rows becomes byte ranges (``Piece``s) of its inputs; any other is run on one rank (``convert``).
transformers is imported only inside these functions, once a transformers model is being loaded.

``from_pretrained`` is transformers' call of that name for ZeRO-3: config, ``zload.init``,
``zload.load_into`` in one call. ``trainer_deepspeed_resume`` puts another resume in place of the
Trainer's DeepSpeed one (``zload.trainer_resume``).
"""

from __future__ import annotations

import copy
import inspect
import sys
import threading
from collections.abc import Callable, Collection
from contextlib import ExitStack, contextmanager
from math import prod
from unittest import mock

from ..checkpoint.dtypes import TORCH_DTYPES
from ..checkpoint.index import CheckpointIndex
from ..checkpoint.pieces import Piece, Source
from ..errors import UnsupportedEnvironmentError
from .transformers_registry import conversion_registry


def transformers_model(module):
    """``module`` if it is a transformers ``PreTrainedModel``, else None (transformers is never
    imported here: a model of it exists only once its user imported it)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        return None
    return module


def _layout_ops_only(converter) -> bool:
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist

    return all(type(op) in (Chunk, Concatenate, MergeModulelist) for op in converter.operations)


def _run_converter(converter, target_key, group, make_tensor, module) -> dict:
    """Run a transformers WeightConverter on tensors made by ``make_tensor(entry)``."""
    conv = copy.deepcopy(converter)
    for pattern, entry in group:
        conv.add_tensor(target_key, entry.name, pattern, make_tensor(entry))
    return conv.convert(target_key, model=module, config=module.config)


def _pieces_from_layout(group, meta_out, module, converter, target_key) -> dict[str, tuple] | None:
    """Pieces of each output of a stack/concatenate/chunk converter, or None when the layout
    cannot be expressed as whole rows of the inputs.

    The converter is run on stand-ins holding one code per row (all dims but the last) of each
    input; since those ops move whole rows, the codes come out in the order the rows take in the
    real output, whose flat layout follows from the row widths.
    """
    import torch

    def stand_in(entry):
        j = position[entry.name]
        rows = prod(entry.shape[:-1]) if entry.shape else 0
        codes = torch.arange(rows, dtype=torch.int64) + (j << 40)
        return codes.reshape(*entry.shape[:-1], 1)

    entries = [e for _, e in group]
    position = {e.name: j for j, e in enumerate(entries)}
    if any(len(e.shape) == 0 for e in entries):
        return None
    coded = _run_converter(converter, target_key, group, stand_in, module)
    widths = torch.tensor([e.shape[-1] for e in entries], dtype=torch.int64)
    result = {}
    for key, meta in meta_out.items():
        codes = coded.get(key)
        if codes is None or tuple(codes.shape[:-1]) != tuple(meta.shape[:-1]):
            return None
        codes = codes.reshape(-1)
        src = codes >> 40
        row = codes & ((1 << 40) - 1)
        width = widths[src]
        if meta.dim() and not torch.all(width.reshape(-1, codes.numel() // max(1, prod(meta.shape[:-1])))
                                        .sum(1) == meta.shape[-1]):
            return None
        dst = torch.cumsum(width, 0) - width
        # a new piece starts where the source changes or its rows stop being consecutive
        starts = torch.ones_like(src, dtype=torch.bool)
        starts[1:] = (src[1:] != src[:-1]) | (row[1:] != row[:-1] + 1)
        idx = torch.nonzero(starts).reshape(-1).tolist() + [codes.numel()]
        pieces = []
        for a, b in zip(idx, idx[1:]):
            j, w = int(src[a]), int(widths[src[a]])
            pieces.append(Piece(entries[j], int(row[a]) * w, int(dst[a]), int(width[a:b].sum())))
        result[key] = (tuple(meta.shape), tuple(pieces))
    return result


def _converter_sources(module, converter, target_key, group,
                       wanted: Callable[[str], bool]) -> dict[str, Source]:
    """Sources for the ``wanted`` model tensors one transformers WeightConverter produces."""
    import torch

    def meta_tensor(entry):
        return torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype], device="meta")

    meta_out = _run_converter(converter, target_key, group, meta_tensor, module)
    keys = [key for key in meta_out if wanted(key)]
    entries = tuple(e for _, e in group)
    layout = _pieces_from_layout(group, meta_out, module, converter, target_key) \
        if _layout_ops_only(converter) else None
    if layout is not None:
        return {key: Source(entries, *layout[key]) for key in keys}
    built: dict = {}  # outputs converted but not yet handed out

    def converter_for(key):
        def convert(read_tensor):
            # The first output asked for reads the inputs and converts them once for all outputs;
            # each is handed out once, so none is held after its turn.
            if key not in built:
                outputs = _run_converter(converter, target_key, group, read_tensor, module)
                built.update((k, outputs[k]) for k in keys)
            return built.pop(key)
        return convert

    return {key: Source(entries, tuple(meta_out[key].shape), (), converter_for(key)) for key in keys}


def _transformers_renames(module, renamed: dict[str, str], model_names: set[str]):
    """Apply transformers' conversion mapping: plain renames, and converter groups by target."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    with conversion_registry():
        mapping = get_model_conversion_mapping(module)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = dict.fromkeys(model_names, True)
    plain: dict[str, str] = {}
    groups: dict[str, tuple] = {}
    # transformers renames in this order (its GroupWeightRename keeps state from key to key), and
    # the first source of a tied weight is the one read
    for original in sorted(renamed, key=lambda n: dot_natural_key(renamed[n])):
        name = renamed[original]
        new, pattern = rename_source_key(name, renamings, converters, module.base_model_prefix, meta)
        if new not in meta and name in meta:
            new, pattern = name, None
        if pattern is None:
            plain[original] = new
        else:
            converter, members = groups.setdefault(new, (by_pattern[pattern], []))
            members.append((pattern, original))
    return plain, groups


def apply_conversion_mapping(module, index: CheckpointIndex, renamed: dict[str, str],
                             known: Collection[str]) -> tuple[dict[str, str], list[tuple[str, Source]]]:
    """transformers' conversion mapping of ``module`` applied to ``renamed`` (checkpoint name ->
    name so far): the plain renames, and (model name, source) for each tensor among the model's
    ``known`` names that a converter builds."""
    plain, groups = _transformers_renames(module, renamed, set(known))
    converted: list[tuple[str, Source]] = []
    for target_key, (converter, members) in groups.items():
        group = [(pattern, index.tensors[name]) for pattern, name in members]
        converted += _converter_sources(module, converter, target_key, group, known.__contains__).items()
    return plain, converted


def revert_conversion(module, tensors: dict) -> dict:
    """``tensors`` (by model name) as transformers' ``save_pretrained`` writes them: its conversion
    mapping reversed, for names and shapes (meta tensors) or values."""
    from transformers.core_model_loading import revert_weight_conversion

    with conversion_registry():
        return revert_weight_conversion(module, tensors)


def skip_weight_init(stack: ExitStack, skipping: Callable) -> None:
    """While ``stack`` is open, transformers' own weight initialisation leaves parameters alone:
    its guarded copies of ``torch.nn.init`` go through ``skipping`` and a model's
    ``initialize_weights`` does nothing (``tie_weights`` still runs). Nothing is imported: a model
    of transformers is being built only if transformers is imported already."""
    init = sys.modules.get("transformers.initialization")
    if init is not None:
        saved = dict(init.TORCH_INIT_FUNCTIONS)
        init.TORCH_INIT_FUNCTIONS.update({name: skipping(f) for name, f in saved.items()})
        stack.callback(init.TORCH_INIT_FUNCTIONS.update, saved)
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None:
        stack.enter_context(mock.patch.object(modeling.PreTrainedModel, "initialize_weights", lambda self: None))


def hidden_size_of(config) -> int | None:
    """The hidden size transformers' Trainer sizes a DeepSpeed config by (``hidden_size``, else the
    largest of ``hidden_sizes``, else those of ``text_config``), or None where the config has none."""
    for owner in (config, getattr(config, "text_config", None)):
        if hasattr(owner, "hidden_size"):
            return owner.hidden_size
        if hasattr(owner, "hidden_sizes"):
            return max(owner.hidden_sizes)
    return None


def initialize_missing(model, params: Collection) -> None:
    """Initialise ``params`` (parameters of ``model`` that its checkpoint lacked, whole while this
    runs) as transformers' ``from_pretrained`` initialises missing weights: every other parameter
    and buffer is marked initialised (``_is_hf_initialized``), and ``model.initialize_weights()``
    runs the model's own ``_init_weights``, whose init functions skip what is marked. So the random
    draws are those transformers makes, in its order, from the same generator. A module is visited
    only if it or a child of it holds one of ``params`` (``_init_weights`` may set a child's): on
    any other, a ZeRO-3 parameter is an empty partition that its ``_init_weights`` might index."""
    wanted = {id(p) for p in params}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in wanted:
            tensor._is_hf_initialized = True
    for module in model.modules():
        near = (p for m in (module, *module.children()) for p in m.parameters(recurse=False))
        if not any(id(p) in wanted for p in near):
            module._is_hf_initialized = True
    model.initialize_weights()


# transformers' Trainer resumes a DeepSpeed engine through this function of ``transformers.trainer``
# (``deepspeed_load_checkpoint(engine, path, load_module_strict=...)``: DeepSpeed's
# ``engine.load_checkpoint``); ``trainer_deepspeed_resume`` replaces it while any of its contexts
# is open, so that contexts nested or in several threads never leave another's replacement behind.
_TRAINER_HOOK = "deepspeed_load_checkpoint"
_hook_lock = threading.Lock()
_hook = {"open": 0, "original": None}  # the contexts open, and the Trainer's own function meanwhile


def _trainer_hook(trainer):
    """The Trainer's DeepSpeed resume in ``transformers.trainer``, refused where transformers has
    none of the shape zload replaces (tested with transformers 5.25)."""
    import transformers

    hook = getattr(trainer, _TRAINER_HOOK, None)
    try:
        shape = list(inspect.signature(hook).parameters)[:3] if callable(hook) else None
    except (TypeError, ValueError):
        shape = None
    if shape is None or len(shape) < 3 or shape[2] != "load_module_strict":
        raise UnsupportedEnvironmentError(
            f"transformers {transformers.__version__}'s Trainer has no {_TRAINER_HOOK}(engine, path, "
            "load_module_strict) to resume a DeepSpeed engine through, which zload.trainer_resume replaces "
            "(tested with transformers 5.25): resume with zload.load_into(engine, path, optimizer=True) "
            "after the Trainer built its engine, or install a transformers whose Trainer has it")
    return hook


@contextmanager
def trainer_deepspeed_resume(resume):
    """While open, transformers' Trainer resumes its DeepSpeed engine from a checkpoint with
    ``resume(engine, path, strict)`` (``strict``: the Trainer's ``load_module_strict``, False for
    a PEFT model) in place of DeepSpeed's ``engine.load_checkpoint``; everything else the Trainer
    restores (``trainer_state.json``, RNG states, its own LR scheduler) it still restores itself.
    The Trainer's own function is back once the last such context closes, whatever raised."""
    import transformers.trainer as trainer

    _trainer_hook(trainer)

    def hook(deepspeed_engine, checkpoint_path, load_module_strict=True):
        resume(deepspeed_engine, checkpoint_path, load_module_strict)

    with _hook_lock:
        if not _hook["open"]:
            _hook["original"] = getattr(trainer, _TRAINER_HOOK)
            setattr(trainer, _TRAINER_HOOK, hook)
        _hook["open"] += 1
    try:
        yield
    finally:
        with _hook_lock:
            _hook["open"] -= 1
            if not _hook["open"]:
                setattr(trainer, _TRAINER_HOOK, _hook["original"])
