"""Names: which checkpoint bytes make up each model tensor.

Checkpoint names and model names often differ: a user's own renames (``key_map``), a base-model
checkpoint loaded into a model with a head (or the other way round), transformers' checkpoint
conversion mapping, PEFT's adapter names. ``match`` resolves all of that into one ``Source`` per
model tensor: a list of ``Piece``s, each a contiguous run of one checkpoint tensor placed at an
element offset of the destination. A plain rename is one piece; transformers' stacking and
concatenation of per-expert tensors are several; any other conversion has no pieces and is
materialised by ``convert`` on one rank (the slow path).

This module holds the matching itself; what transformers and PEFT models name differently comes
from ``integrations/``, which imports neither library unless a model of it is being loaded. The
functions here read names and shapes only; nothing touches tensor data or processes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ..checkpoint.index import CheckpointIndex
from ..checkpoint.pieces import Source, whole
from ..checkpoint.quantized import Quantization, Scale, pair_scales
from .targets import Target

KeyMap = Mapping[str, str] | Callable[[str], "str | None"]


@dataclass
class Matching:
    sources: dict[int, Source]  # target index -> source
    unexpected: list[str]
    problems: list[str]
    required: set[int] | None = None  # target indices the checkpoint must cover; None: all required


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


def match(index: CheckpointIndex, targets: list[Target], module=None,
          key_map: KeyMap | None = None, quantization: Quantization = Quantization()) -> Matching:
    """Resolve every checkpoint tensor to the model tensor it feeds (see module docstring); the
    scales of FP8 weights go with their weights' pieces (``quantization``: the checkpoint's config)."""
    # imported here, not above: the integrations build on this module's Piece and Source
    from ..integrations.peft import add_peft_aliases, peft_info, required_by_role
    from ..integrations.transformers import apply_conversion_mapping, transformers_model

    weights, scales, problems = pair_scales(index, quantization)
    index = replace(index, tensors=weights)
    renamed, key_problems = apply_key_map(sorted(index.tensors), key_map)
    problems += key_problems
    lookup: dict[str, int] = {}  # every name a checkpoint may use for each target
    for i, target in enumerate(targets):
        for name in target.names:
            lookup.setdefault(name, i)
    peft = peft_info(module)
    peft_roles = None if peft is None else add_peft_aliases(
        lookup, [t.name for t in targets], peft, list(renamed.values()))
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
        plain, converted = apply_conversion_mapping(hf, index, renamed, lookup)
        for key, source in converted:
            assign(lookup[key], source)

    unmatched = [n for n, new in plain.items() if new not in lookup]
    fixes = align_prefix([plain[n] for n in unmatched], lookup)
    for name, new in plain.items():
        new = fixes.get(new, new)
        if new in lookup:
            assign(lookup[new], whole(index.tensors[name]))

    required = None if peft_roles is None else required_by_role(peft_roles, sources)
    unexpected = sorted(set(index.tensors) - used)
    for i, source in sources.items():
        sources[i] = _with_scales(source, scales)
    return Matching(sources, unexpected, problems, required)


def _with_scales(source: Source, scales: dict[str, Scale]) -> Source:
    """``source`` with each FP8 piece's scale."""
    if not any(e.name in scales for e in source.entries):
        return source
    pieces = tuple(replace(p, scale=scales.get(p.entry.name)) for p in source.pieces)
    return replace(source, pieces=pieces, scaled=True)
