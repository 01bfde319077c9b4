"""zload: load safetensors checkpoints straight into DeepSpeed ZeRO-3 partitions.

Each rank reads only the bytes of the partitions it owns; nothing is gathered.
"""

import logging

from .errors import CheckpointError, PlanError, ZloadError
from .index import open_checkpoint
from .load import ZloadWarning, load_into
from .report import LoadReport

__version__ = "0.1.0"

# Quiet by default: an application that configures logging sees zload's INFO/DEBUG records.
logging.getLogger("zload").addHandler(logging.NullHandler())

__all__ = ["load_into", "open_checkpoint", "LoadReport", "ZloadError", "CheckpointError",
           "PlanError", "ZloadWarning", "__version__"]
