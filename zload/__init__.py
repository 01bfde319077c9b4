"""zload: load and save safetensors checkpoints straight from and into DeepSpeed ZeRO-3 partitions.

Each rank reads (or writes) only the bytes of the partitions it owns; nothing is gathered.

The public names are imported on first use (PEP 562 ``__getattr__``): importing the package and the
``zload`` command's ``--version`` and ``--help`` do not import torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

__version__ = "0.1.0"  # a literal: pyproject.toml reads it without importing zload

# Quiet by default: an application that configures logging sees zload's INFO/DEBUG records.
logging.getLogger("zload").addHandler(logging.NullHandler())

_ERRORS = ("ArgumentTypeError", "ArgumentValueError", "CheckpointError", "CheckpointNotFoundError",
           "InvalidCheckpointError", "PeerLostError", "PlanError", "UnsupportedEnvironmentError",
           "UnsupportedModelError", "WriteError", "ZloadError", "ZloadWarning")
# public name -> the module that defines it
_MODULES = {
    "load_into": ".loading.load_into", "save": ".saving.save", "convert": ".saving.convert",
    "init": ".model.init", "from_pretrained": ".pretrained", "open_checkpoint": ".checkpoint.open",
    "CheckpointIndex": ".checkpoint.index", "KeyMap": ".model.names", "LoadReport": ".report",
    "SaveReport": ".report", "trainer_resume": ".trainer", **dict.fromkeys(_ERRORS, ".errors"),
}

__all__ = ["load_into", "save", "convert", "init", "from_pretrained", "trainer_resume", "open_checkpoint",
           "CheckpointIndex", "KeyMap", "LoadReport", "SaveReport", "ZloadError", "CheckpointError",
           "CheckpointNotFoundError", "InvalidCheckpointError", "PlanError", "ArgumentValueError",
           "ArgumentTypeError", "PeerLostError", "UnsupportedEnvironmentError", "UnsupportedModelError", "WriteError",
           "ZloadWarning", "__version__"]


def __getattr__(name: str):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .checkpoint.index import CheckpointIndex
    from .checkpoint.open import open_checkpoint
    from .errors import (
        ArgumentTypeError,
        ArgumentValueError,
        CheckpointError,
        CheckpointNotFoundError,
        InvalidCheckpointError,
        PeerLostError,
        PlanError,
        UnsupportedEnvironmentError,
        UnsupportedModelError,
        WriteError,
        ZloadError,
        ZloadWarning,
    )
    from .loading.load_into import load_into
    from .model.init import init
    from .model.names import KeyMap
    from .pretrained import from_pretrained
    from .report import LoadReport, SaveReport
    from .saving.convert import convert
    from .saving.save import save
    from .trainer import trainer_resume
