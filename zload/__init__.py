"""zload: load and save safetensors checkpoints straight from and into DeepSpeed ZeRO-3 partitions.

Each rank reads (or writes) only the bytes of the partitions it owns; nothing is gathered.
"""

import logging

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

__version__ = "0.1.0"

# Quiet by default: an application that configures logging sees zload's INFO/DEBUG records.
logging.getLogger("zload").addHandler(logging.NullHandler())

__all__ = ["load_into", "save", "convert", "init", "from_pretrained", "open_checkpoint", "CheckpointIndex", "KeyMap",
           "LoadReport", "SaveReport", "ZloadError", "CheckpointError", "CheckpointNotFoundError",
           "InvalidCheckpointError", "PlanError", "ArgumentValueError", "ArgumentTypeError", "PeerLostError",
           "UnsupportedEnvironmentError", "UnsupportedModelError", "WriteError", "ZloadWarning", "__version__"]
