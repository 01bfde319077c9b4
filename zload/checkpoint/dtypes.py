"""The safetensors dtype codes as torch dtypes, for the code that holds tensors.

``index`` keeps to codes (pure Python, no torch), as do a checkpoint's entries; what a plan reads
into or writes from tensors (``Target``, ``ReadItem``, a save's ``OutTensor``) carries a
``torch.dtype``, resolved from the code here, once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .index import DTYPES

TORCH_DTYPES: Mapping[str, torch.dtype] = {code: getattr(torch, name) for code, (name, _) in DTYPES.items()}
CODES: Mapping[torch.dtype, str] = {dtype: code for code, dtype in TORCH_DTYPES.items()}
