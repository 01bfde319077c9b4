"""FP8 checkpoints: which scale dequantises each weight, and where a range of it finds its scales.

FP8 models (DeepSeek-V3/R1, Qwen3-FP8) store ``X.weight`` as ``float8_e4m3fn`` (or ``e5m2``) and
beside it ``X.weight_scale_inv``, one float32 scale per block of ``weight_block_size`` (from
``config.json``'s ``quantization_config``, 128x128 by default), or ``X.weight_scale`` with one
scale for the whole tensor. The value is ``weight.to(float32) * scale``: despite its name the
``_inv`` scale is multiplied (DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant``: ``x`` to
float32, ``y = x * s``, then the default dtype; transformers' ``finegrained_fp8``
``_dequantize_fp8_weight`` multiplies too, but in the target dtype, which can round differently:
zload follows DeepSeek's float32 product). Scales are consumed here: never
unexpected, never required by the model.

A weight of shape ``(..., R, C)`` with block ``(bR, bC)`` has scales ``(..., ceil(R/bR),
ceil(C/bC))``; a per-tensor scale is the same geometry with one block of the whole tensor. Only
``read_quantization`` touches a file (``config.json``); the rest reads names and shapes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from math import prod

from .errors import ZloadError
from .files import FileTable, open_regular
from .index import MAX_INDEX_BYTES, CheckpointIndex, TensorEntry, pread_exactly

SCALE_SUFFIXES = ("_scale_inv", "_scale")  # appended to the weight's name
DEFAULT_BLOCK = (128, 128)
FP8 = {"F8_E4M3", "F8_E5M2"}
_SCALE_DTYPES = {"F32", "BF16", "F16"}
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's ``quantization_config``: its method and block shape (None: none given)."""

    method: str | None = None
    block: tuple[int, int] | None = None
    problem: str | None = None  # why the config cannot be used


@dataclass(frozen=True)
class Scale:
    """The scales of one weight, as a grid: element ``e`` of the weight (flat, row-major) is
    multiplied by scale ``block_index(e)`` of ``entry``."""

    entry: TensorEntry
    rows: int  # R: rows of one matrix of the weight (all of it, for a per-tensor scale)
    columns: int  # C
    block: tuple[int, int]  # (bR, bC)

    @property
    def per_tensor(self) -> bool:
        """One scale for the whole weight (its geometry is one block of ``numel`` x 1)."""
        return self.columns == 1 and self.block == (self.rows, 1)

    @property
    def grid(self) -> tuple[int, int]:
        """(scale rows, scale columns) of one matrix."""
        return -(-self.rows // self.block[0]), -(-self.columns // self.block[1])

    def block_row(self, element: int) -> int:
        """The flat scale row (over all matrices) of weight element ``element``."""
        row = element // self.columns
        return (row // self.rows) * self.grid[0] + (row % self.rows) // self.block[0]

    def rows_for(self, first: int, count: int) -> tuple[int, int]:
        """The scale rows ``[low, high)`` that elements ``[first, first + count)`` need."""
        if count == 0:
            return 0, 0
        return self.block_row(first), self.block_row(first + count - 1) + 1


def read_quantization(root: str) -> Quantization:
    """The ``quantization_config`` of ``root/config.json`` (none if there is no such file)."""
    path = os.path.join(root, CONFIG_FILE) if root else ""
    if not path or not os.path.isfile(path):
        return Quantization()
    try:  # opened as a checkpoint file is: never a FIFO swapped in, never an unbounded read
        with FileTable() as table:
            opened = table.add(open_regular(path), CONFIG_FILE)
            if opened.identity.size > MAX_INDEX_BYTES:
                raise ValueError(f"{opened.identity.size} bytes, over the {MAX_INDEX_BYTES}-byte limit")
            config = json.loads(pread_exactly(opened, opened.identity.size, 0).decode("utf-8"))
    except (ZloadError, OSError, ValueError) as e:
        return Quantization(problem=f"{path}: cannot read its quantization_config: {e}")
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        return Quantization()
    method, block = qc.get("quant_method"), qc.get("weight_block_size")
    if method != "fp8":
        return Quantization(str(method), problem=f"{path}: quantization_config quant_method "
                            f"{method!r} is not supported (zload dequantises 'fp8' only); load the "
                            "checkpoint with the library that made it, or a dequantised copy")
    if block is None:
        return Quantization(method)
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        return Quantization(method, problem=f"{path}: quantization_config weight_block_size {block!r} "
                            "is not two positive integers")
    return Quantization(method, (block[0], block[1]))


def pair_scales(index: CheckpointIndex, quantization: Quantization
                ) -> tuple[dict[str, TensorEntry], dict[str, Scale], list[str]]:
    """Split the index's tensors into weights (every tensor but the scales of FP8 weights) and
    each FP8 weight's ``Scale``; and the problems: FP8 weights without a scale, scales of the wrong
    shape or dtype, an unusable config."""
    tensors = index.tensors
    scale_names = {name + suffix: name for name, entry in tensors.items() if entry.dtype in FP8
                   for suffix in SCALE_SUFFIXES if name + suffix in tensors}
    weights = {n: e for n, e in tensors.items() if n not in scale_names}
    scales, problems = {}, []
    quantised = [n for n in sorted(weights) if weights[n].dtype in FP8]
    if quantised and quantization.problem:
        first = weights[quantised[0]]
        return weights, {}, [f"tensor '{first.name}' ({first.file}): {quantization.problem}"]
    by_weight = {w: s for s, w in sorted(scale_names.items(), reverse=True)}  # _scale_inv first
    for name in quantised:
        entry = weights[name]
        where = f"tensor '{name}' ({entry.file})"
        if name not in by_weight:
            problems.append(f"{where}: {entry.dtype} weight without its scale "
                            f"('{name}_scale_inv' or '{name}_scale'); the checkpoint is incomplete")
            continue
        scale, problem = _scale(entry, tensors[by_weight[name]], quantization)
        if problem:
            problems.append(f"{where}: scale '{by_weight[name]}' ({tensors[by_weight[name]].file}) "
                            f"{problem}")
        else:
            scales[name] = scale
    return weights, scales, problems


def _scale(weight: TensorEntry, scale: TensorEntry, quantization: Quantization
           ) -> tuple[Scale | None, str | None]:
    if scale.dtype not in _SCALE_DTYPES:
        return None, f"is {scale.dtype}, not a float32, bfloat16 or float16 scale"
    if len(scale.fragments) > 1:
        return None, "is stored in pieces; zload reads scales stored whole"
    if scale.numel == 1 and quantization.block is None:
        numel = weight.numel
        return Scale(scale, max(numel, 1), 1, (max(numel, 1), 1)), None
    block = quantization.block or DEFAULT_BLOCK
    if len(weight.shape) < 2:
        return None, f"has shape {list(scale.shape)}: a {list(weight.shape)} weight takes one scale"
    rows, columns = weight.shape[-2:]
    result = Scale(scale, rows, columns, block)
    expected = (*weight.shape[:-2], *result.grid)
    if tuple(scale.shape) != expected or prod(expected) != scale.numel:
        return None, (f"has shape {list(scale.shape)}; a {list(weight.shape)} weight in blocks of "
                      f"{list(block)} needs {list(expected)}")
    return result, None
