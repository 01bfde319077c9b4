"""PEFT: the names peft's own checkpoints use for a ``PeftModel``'s tensors, and which of them a
checkpoint must cover.

peft itself is never imported: a module can only be a ``PeftModel`` once its user imported peft.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from ..distributed import Choice


class Role(Choice):
    """What a tensor of a ``PeftModel`` is to its active adapter."""

    ADAPTER = "adapter"  # one of the active adapter's own tensors
    OTHER = "other"  # a tensor of another adapter
    BASE = "base"  # a tensor of the base model


def peft_info(module):
    """(adapter name, tuner prefix) if ``module`` is a PEFT model, else None."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(module, peft.PeftModel):
        return None
    return module.active_adapter, getattr(module.base_model, "prefix", "lora_")


def peft_role(name: str, adapter: str, prefix: str) -> tuple[Role, list[str]]:
    """(its ``Role``, the names peft's own checkpoints use for tensor ``name``).

    ``lora_A.<adapter>.weight`` is saved by peft as ``lora_A.weight``, and a trainable copy
    ``head.modules_to_save.<adapter>.weight`` as ``head.weight``; a wrapped base weight
    (``q_proj.base_layer.weight``, ``head.original_module.weight``) comes from a base checkpoint
    under the base model's name.
    """
    parts = name.split(".")
    for i in range(1, len(parts)):
        if parts[i] == adapter and parts[i - 1].startswith(prefix):
            return Role.ADAPTER, [".".join(parts[:i] + parts[i + 1:])]
        if parts[i] == adapter and parts[i - 1] == "modules_to_save":
            return Role.ADAPTER, [".".join(parts[:i - 1] + parts[i + 1:])]
    if any(p.startswith(prefix) or p == "modules_to_save" for p in parts):
        return Role.OTHER, []
    base = [p for p in parts if p not in ("base_layer", "original_module")]
    return Role.BASE, ([".".join(base)] if len(base) != len(parts) else [])


def add_peft_aliases(lookup: dict[str, int], model_names: list[str], peft: tuple[str, str],
                     checkpoint_names: list[str]) -> dict[int, Role]:
    """Add to ``lookup`` (name -> target index) the names peft's checkpoints use for the targets
    named ``model_names``; return each target's role (``peft_role``).

    A PEFT model takes an adapter checkpoint (one with tuner names such as ``lora_A``) or a base
    checkpoint; where both a base weight and an adapter's copy of it (``modules_to_save``) answer
    to the same saved name, the kind of checkpoint decides which one it feeds.
    """
    adapter_checkpoint = any(part.startswith(peft[1])
                             for name in checkpoint_names for part in name.split("."))
    own = set(lookup)
    roles: dict[int, Role] = {}
    for i, name in enumerate(model_names):
        roles[i], extra = peft_role(name, *peft)
        for alias in extra:
            if alias not in lookup or (alias not in own and (roles[i] == Role.ADAPTER) == adapter_checkpoint):
                lookup[alias] = i
    return roles


def required_by_role(roles: dict[int, Role], fed: Iterable[int]) -> set[int]:
    """The targets a checkpoint feeding targets ``fed`` must cover: an adapter checkpoint its
    adapter's tensors (the base left alone), a base checkpoint the base tensors (adapters left as
    initialised)."""
    role = Role.ADAPTER if any(roles[i] == Role.ADAPTER for i in fed) else Role.BASE
    return {i for i, r in roles.items() if r == role}
