"""Names: which checkpoint bytes make up each model tensor.

Checkpoint names and model names often differ: a user's own renames (``key_map``), a base-model
checkpoint loaded into a model with a head (or the other way round), transformers' checkpoint
conversion mapping, PEFT's adapter names. ``match`` resolves all of that into one ``Source`` per
model tensor: a list of ``Piece``s, each a contiguous run of one checkpoint tensor placed at an
element offset of the destination. A plain rename is one piece; transformers' stacking and
concatenation of per-expert tensors are several; any other conversion has no pieces and is
materialised by ``convert`` on one rank (the slow path).

The functions here read names and shapes only; nothing touches tensor data or processes.
"""

from __future__ import annotations

import copy
import functools
import logging
import re
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from typing import Callable, Mapping

from .index import CheckpointIndex, TensorEntry
from .targets import Target

KeyMap = Mapping[str, str] | Callable[[str], "str | None"]
logger = logging.getLogger("zload")


@dataclass(frozen=True)
class Piece:
    """``numel`` elements of ``entry`` from element ``src_offset`` go to element ``dst_offset``."""

    entry: TensorEntry
    src_offset: int
    dst_offset: int
    numel: int


@dataclass(frozen=True)
class Source:
    """Where one model tensor's values come from."""

    entries: tuple[TensorEntry, ...]  # the checkpoint tensors it is built from
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...] = ()
    # Slow path: given a reader ``entry -> torch.Tensor``, build the whole tensor.
    convert: Callable | None = field(default=None, compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


@dataclass
class Matching:
    sources: dict[int, Source]  # target index -> source
    unexpected: list[str]
    problems: list[str]
    required: set[int] | None = None  # target indices the checkpoint must cover; None: all required


def whole(entry: TensorEntry) -> Source:
    return Source((entry,), entry.shape, (Piece(entry, 0, 0, entry.numel),))


# --- user key map ---

def apply_key_map(names: list[str], key_map: KeyMap | None) -> tuple[dict[str, str], list[str]]:
    """checkpoint name -> renamed name (names a callable maps to None are dropped), and problems."""
    if key_map is None:
        return {n: n for n in names}, []
    renamed, problems, taken = {}, [], {}
    for name in names:
        if callable(key_map):
            new = key_map(name)
        else:
            new = name
            for pattern, replacement in key_map.items():
                new = re.sub(pattern, replacement, new)
        if new is None:
            continue
        if new in taken:
            problems.append(f"key_map maps both '{taken[new]}' and '{name}' to '{new}'")
            continue
        taken[new] = name
        renamed[name] = new
    return renamed, problems


# --- model-side aliases (PEFT) ---

def peft_info(module):
    """(adapter name, tuner prefix) if ``module`` is a PEFT model, else None."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(module, peft.PeftModel):
        return None
    return module.active_adapter, getattr(module.base_model, "prefix", "lora_")


def peft_role(name: str, adapter: str, prefix: str) -> tuple[str, list[str]]:
    """("adapter" | "other" | "base", the names peft's own checkpoints use for tensor ``name``).

    ``lora_A.<adapter>.weight`` is saved by peft as ``lora_A.weight``, and a trainable copy
    ``head.modules_to_save.<adapter>.weight`` as ``head.weight``; a wrapped base weight
    (``q_proj.base_layer.weight``, ``head.original_module.weight``) comes from a base checkpoint
    under the base model's name.
    """
    parts = name.split(".")
    for i in range(1, len(parts)):
        if parts[i] == adapter and parts[i - 1].startswith(prefix):
            return "adapter", [".".join(parts[:i] + parts[i + 1:])]
        if parts[i] == adapter and parts[i - 1] == "modules_to_save":
            return "adapter", [".".join(parts[:i - 1] + parts[i + 1:])]
    if any(p.startswith(prefix) or p == "modules_to_save" for p in parts):
        return "other", []  # a tensor of another adapter
    base = [p for p in parts if p not in ("base_layer", "original_module")]
    return "base", ([".".join(base)] if len(base) != len(parts) else [])


def _aliases(targets: list[Target], module, names: list[str]) -> tuple[dict[str, int], dict[int, str] | None]:
    """Every name a checkpoint may use for each target; for a PEFT model also each target's role.

    A PEFT model takes an adapter checkpoint (one with tuner names such as ``lora_A``) or a base
    checkpoint; where both a base weight and an adapter's copy of it (``modules_to_save``) answer
    to the same saved name, the kind of checkpoint decides which one it feeds.
    """
    lookup: dict[str, int] = {}
    peft = peft_info(module)
    roles: dict[int, str] | None = None if peft is None else {}
    adapter_checkpoint = peft is not None and any(
        part.startswith(peft[1]) for name in names for part in name.split("."))
    for i, target in enumerate(targets):
        for name in target.names:
            lookup.setdefault(name, i)
    own = set(lookup)
    for i, target in enumerate(targets if peft is not None else ()):
        roles[i], extra = peft_role(target.name, *peft)
        for alias in extra:
            if alias not in lookup or (alias not in own and (roles[i] == "adapter") == adapter_checkpoint):
                lookup[alias] = i
    return lookup, roles


# --- prefix alignment ---

def align_prefix(unmatched: list[str], known: Mapping[str, int]) -> dict[str, str]:
    """Rename unmatched checkpoint names by adding or stripping one leading module path.

    A checkpoint saved from a base model (``embeddings.x``) loads into a model with a head
    (``bert.embeddings.x``) and the other way round. Applied only when one single prefix explains
    every unmatched name that any prefix explains, so a guess never silently picks between two.
    """
    if not unmatched:
        return {}
    model_suffixes: dict[str, set[str]] = {}
    for name in known:
        parts = name.split(".")
        for k in range(1, len(parts)):
            model_suffixes.setdefault(".".join(parts[k:]), set()).add(".".join(parts[:k]))
    candidates: dict[str, dict[str, str]] = {}
    for name in unmatched:
        for prefix in model_suffixes.get(name, ()):  # add a prefix
            candidates.setdefault(f"+{prefix}", {})[name] = f"{prefix}.{name}"
        parts = name.split(".")
        for k in range(1, len(parts)):  # strip a prefix
            rest = ".".join(parts[k:])
            if rest in known:
                candidates.setdefault(f"-{'.'.join(parts[:k])}", {})[name] = rest
    if len(candidates) != 1:
        return {}
    (renames,) = candidates.values()
    return renames


# --- transformers conversion mapping ---

class _LazyPattern:
    """A regular expression compiled when first used; otherwise used like ``re.Pattern``."""

    __slots__ = ("_args", "_compiled")

    def __init__(self, *args):
        self._args = args
        self._compiled = None

    def __getattr__(self, name):
        if self._compiled is None:
            self._compiled = re.compile(*self._args)
        return getattr(self._compiled, name)

    def __copy__(self):
        return self  # immutable, as re.Pattern

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return re.compile, self._args


class _DeferredTransform:
    """A transformers ``WeightTransform`` constructed when first used.

    transformers hands out its registry only as deep copies (``get_checkpoint_conversion_mapping``),
    and a deep copy of this is the real transform, so a load constructs only its own model's few.
    """

    __slots__ = ("_args", "_built", "_cls", "_kwargs")

    def __init__(self, cls, *args, **kwargs):
        self._cls, self._args, self._kwargs, self._built = cls, args, kwargs, None

    def _transform(self):
        if self._built is None:
            self._built = self._cls(*self._args, **self._kwargs)
        return self._built

    def __getattr__(self, name):
        return getattr(self._transform(), name)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._transform(), memo)


_UNAVAILABLE = object()
_deferred_registry = None  # built on first use; _UNAVAILABLE where this transformers does not fit


def _build_deferred_registry(conversion_mapping, core_model_loading):
    """transformers' conversion registry, every transform in it deferred (``_DeferredTransform``).

    transformers' build function runs with its own copy of its module's namespace, in which each
    transform class makes a deferred transform instead, so no other thread sees a swapped class.
    The few transforms the build itself looks into are constructed then, with their regexes
    compiled on first use (``_LazyPattern``).
    """
    build = conversion_mapping._build_checkpoint_conversion_mapping
    namespace = dict(build.__globals__)
    for name, value in build.__globals__.items():
        if isinstance(value, type) and issubclass(value, core_model_loading.WeightTransform):
            namespace[name] = functools.partial(_DeferredTransform, value)
    deferred_build = types.FunctionType(build.__code__, namespace, build.__name__, build.__defaults__,
                                        build.__closure__)
    lazy_re = types.SimpleNamespace(**vars(re))
    lazy_re.compile = _LazyPattern
    core_model_loading.re = lazy_re  # WeightTransform.__init__ compiles through this name
    try:
        return deferred_build()
    finally:
        core_model_loading.re = re


@contextmanager
def conversion_registry():
    """Lend transformers a conversion registry of deferred transforms, if it has none.

    On first use transformers builds its registry for every model type it knows: about 1,100
    transforms and their regexes (45 ms; several times that when a collection of a large heap lands
    in it). A load needs only the few transforms of one model; deferred, the registry takes about
    1 ms. transformers' own registry state is restored after the block, and versions lacking these
    internals use the plain path.
    """
    global _deferred_registry
    from transformers import conversion_mapping, core_model_loading

    if (getattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", False) is not None
            or not hasattr(conversion_mapping, "_build_checkpoint_conversion_mapping")
            or not hasattr(core_model_loading, "WeightTransform")
            or getattr(core_model_loading, "re", None) is not re):
        yield
        return
    if _deferred_registry is None:
        try:
            _deferred_registry = _build_deferred_registry(conversion_mapping, core_model_loading)
        except Exception as e:  # a transformers version this does not fit: use its own path
            logger.debug("zload: deferred conversion registry unavailable (%r); using transformers' own", e)
            _deferred_registry = _UNAVAILABLE
    if _deferred_registry is _UNAVAILABLE:
        yield
        return
    conversion_mapping._checkpoint_conversion_mapping_cache = _deferred_registry
    try:
        yield
    finally:
        if conversion_mapping._checkpoint_conversion_mapping_cache is _deferred_registry:
            conversion_mapping._checkpoint_conversion_mapping_cache = None


def transformers_model(module):
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

    from .index import DTYPES

    def meta_tensor(entry):
        return torch.empty(entry.shape, dtype=getattr(torch, DTYPES[entry.dtype][0]), device="meta")

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


def match(index: CheckpointIndex, targets: list[Target], module=None,
          key_map: KeyMap | None = None) -> Matching:
    """Resolve every checkpoint tensor to the model tensor it feeds (see module docstring)."""
    renamed, problems = apply_key_map(sorted(index.tensors), key_map)
    lookup, peft_roles = _aliases(targets, module, list(renamed.values()))
    sources: dict[int, Source] = {}
    used: set[str] = set()

    def assign(i: int, source: Source) -> None:
        if i in sources and set(source.names + sources[i].names) <= set(targets[i].names):
            used.update(source.names)  # a tied weight stored under more than one of its names
            return
        if i in sources:
            problems.append(f"model tensor '{targets[i].name}' is fed by both "
                            f"{list(sources[i].names)} and {list(source.names)}")
            return
        sources[i] = source
        used.update(source.names)

    plain = renamed
    hf = transformers_model(module)
    if hf is not None:
        model_names = set(lookup) | {n for n, _ in hf.named_buffers()}
        plain, groups = _transformers_renames(hf, renamed, model_names)
        for target_key, (converter, members) in groups.items():
            group = [(pattern, index.tensors[name]) for pattern, name in members]
            for key, source in _converter_sources(hf, converter, target_key, group,
                                                  lookup.__contains__).items():
                assign(lookup[key], source)

    unmatched = [n for n, new in plain.items() if new not in lookup]
    fixes = align_prefix([plain[n] for n in unmatched], lookup)
    for name, new in plain.items():
        new = fixes.get(new, new)
        if new in lookup:
            assign(lookup[new], whole(index.tensors[name]))

    required = None
    if peft_roles is not None:
        # A PEFT model takes an adapter checkpoint (its adapter tensors required, base left alone)
        # or a base checkpoint (base tensors required, adapters left as initialised).
        role = "adapter" if any(peft_roles[i] == "adapter" for i in sources) else "base"
        required = {i for i, r in peft_roles.items() if r == role}
    unexpected = sorted(set(index.tensors) - used)
    return Matching(sources, unexpected, problems, required)
