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

Which tensor is the scale: when only one of ``X.weight_scale_inv`` and ``X.weight_scale`` is
stored, it is. When both are, ``X.weight_scale_inv`` is the scale and ``X.weight_scale`` must be a
single element (a per-tensor scale some exporters keep beside the block scales), consumed and
ignored; two of more than one element each are ambiguous, and refused.

A weight of shape ``(..., R, C)`` with block ``(bR, bC)`` has scales ``(..., ceil(R/bR),
ceil(C/bC))``; a per-tensor scale is the same geometry with one block of the whole tensor. Only
``read_quantization`` touches a file (``config.json``); the rest reads names and shapes. What it
reads changes values, so the ranks of a job agree on it as on a header (``checkpoint.LocalView``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod

from ..errors import ZloadError
from ..report import brief, ranks_listed
from .index import CheckpointIndex, TensorEntry, read_json_file

SCALE_SUFFIXES = ("_scale_inv", "_scale")  # appended to the weight's name
DEFAULT_BLOCK = (128, 128)
MAX_BLOCK = 2**63 - 1  # torch's sizes are 64-bit
FP8 = {"F8_E4M3", "F8_E5M2"}
_SCALE_DTYPES = {"F32", "BF16", "F16"}
CONFIG_FILE = "config.json"
_FIX_CONFIG = (f"zload reads the FP8 weights' block size from its quantization_config: fix {CONFIG_FILE}, "
               "or load a dequantised copy")


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's ``quantization_config``: its method and block shape (None: none given).

    Names no path (``config.json`` is named as the checkpoint names its files), so that ranks
    whose copies lie in different folders compare equal ones equal."""

    method: str | None = None
    block: tuple[int, int] | None = None
    problem: str | None = None  # why the config cannot be used

    def describe(self) -> str:
        if self.problem:
            return f"a config zload cannot use ({self.problem})"
        if self.method is None:
            return "no quantization_config (or no config.json)"
        return f"quant_method {self.method!r}, weight_block_size {list(self.block) if self.block else None}"


def agreed_quantization(seen: dict[int, Quantization]) -> Quantization:
    """The quantization to load with, given what each rank that has the checkpoint read (``seen``,
    by rank): theirs when they all read the same, else one whose problem says who read what (their
    dequantised values would differ)."""
    ranks: dict[Quantization, list[int]] = {}
    for rank, quantization in sorted(seen.items()):
        ranks.setdefault(quantization, []).append(rank)
    if len(ranks) <= 1:
        return next(iter(ranks), Quantization())
    read = "; ".join(f"ranks {ranks_listed(r)} read {q.describe()}" for q, r in ranks.items())
    return Quantization(problem=f"{CONFIG_FILE}: the copies differ between ranks: {read}; every node must "
                                f"hold the same {CONFIG_FILE}")


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
    def kernel_block(self) -> tuple[int, int]:
        """The block cut to the matrix, which gives each element the scale the block does: whatever
        block a config gives, the kernels' 64-bit arithmetic and the widening of a row's scales
        stay within the weight."""
        return min(self.block[0], self.rows), min(self.block[1], self.columns)

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
    """The ``quantization_config`` of ``root/config.json`` (none if there is no such file).

    Never raises: a config that cannot be used (unreadable, not a regular file, not JSON, too
    large or deep, an unknown method, a bad block size) is a ``problem``, which refuses a load
    only if the checkpoint has FP8 weights: the config means nothing to the others."""
    path = os.path.join(root, CONFIG_FILE) if root else ""
    if not path or not os.path.lexists(path):
        return Quantization()
    try:
        config = read_json_file(path)
    except ZloadError as e:  # each of its messages starts with the path, which differs between nodes
        return Quantization(problem=f"{CONFIG_FILE}: {str(e).removeprefix(f'{path}: ')}; {_FIX_CONFIG}")
    if not isinstance(config, dict):
        return Quantization(problem=f"{CONFIG_FILE}: holds {brief(config, 60)}, not a JSON object; {_FIX_CONFIG}")
    qc = config.get("quantization_config")
    if qc is None:
        return Quantization()
    if not isinstance(qc, dict):
        return Quantization(problem=f"{CONFIG_FILE}: quantization_config {brief(qc, 60)} is not a JSON object; "
                                    f"{_FIX_CONFIG}")
    method, block = qc.get("quant_method"), qc.get("weight_block_size")
    if method != "fp8":
        return Quantization(method[:60] if isinstance(method, str) else None,
                            problem=f"{CONFIG_FILE}: quantization_config quant_method {brief(method, 60)} is not "
                                    "supported (zload dequantises 'fp8' only); load the checkpoint with the "
                                    "library that made it, or a dequantised copy")
    if block is None:
        return Quantization(method)
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK for b in block)):
        return Quantization(method, problem=f"{CONFIG_FILE}: quantization_config weight_block_size "
                                            f"{brief(block, 100)} is not two positive integers below 2**63; "
                                            f"{_FIX_CONFIG}")
    return Quantization(method, (block[0], block[1]))


def pair_scales(index: CheckpointIndex, quantization: Quantization
                ) -> tuple[dict[str, TensorEntry], dict[str, Scale], list[str]]:
    """Split the index's tensors into weights (every tensor but the scales of FP8 weights) and
    each FP8 weight's ``Scale`` (which one: see the module docstring); and the problems: FP8
    weights without a scale or with two, scales of the wrong shape or dtype, an unusable config."""
    tensors = index.tensors
    stored = {name: [name + suffix for suffix in SCALE_SUFFIXES if name + suffix in tensors]
              for name, entry in tensors.items() if entry.dtype in FP8}  # _scale_inv first
    consumed = {scale for found in stored.values() for scale in found}
    weights = {n: e for n, e in tensors.items() if n not in consumed}
    scales, problems = {}, []
    quantised = [n for n in sorted(weights) if weights[n].dtype in FP8]
    if quantised and quantization.problem:
        first = weights[quantised[0]]
        return weights, {}, [f"tensor '{first.name}' ({first.file}): {quantization.problem}"]
    for name in quantised:
        entry, found = weights[name], [tensors[s] for s in stored[name]]
        where = f"tensor '{name}' ({entry.file})"
        if not found:
            problems.append(f"{where}: {entry.dtype} weight without its scale "
                            f"('{name}_scale_inv' or '{name}_scale'); the checkpoint is incomplete")
            continue
        if len(found) == 2 and found[1].numel != 1:
            inverse, plain = found
            problems.append(f"{where}: both '{inverse.name}' ({inverse.file}, shape {list(inverse.shape)}) and "
                            f"'{plain.name}' ({plain.file}, shape {list(plain.shape)}) are stored, and either could "
                            f"be its scale: with both, zload takes '{inverse.name}' and expects '{plain.name}' to "
                            "be a single element; keep only the tensor that scales this weight, or load a "
                            "dequantised copy")
            continue
        scale, problem = _scale(entry, found[0], quantization)
        if problem:
            problems.append(f"{where}: scale '{found[0].name}' ({found[0].file}) {problem}")
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
