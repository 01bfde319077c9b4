"""Checkpoint index: safetensors headers -> where every tensor's bytes are.

Pure Python (no torch), so the geometry that everything else relies on is cheap to test. Headers
are validated as strictly as the safetensors format itself demands, because a header that lies
about offsets would otherwise make a rank silently read another tensor's bytes.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from typing import Mapping

from .errors import CheckpointError

# safetensors dtype code -> (torch dtype attribute name, bytes per element)
DTYPES: Mapping[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
    "C64": ("complex64", 8),
}

# The safetensors reference implementation refuses larger headers; so do we.
MAX_HEADER_BYTES = 100_000_000
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its file and the absolute byte range of its data."""

    name: str
    file: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in ``file``
    nbytes: int

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a (possibly sharded) checkpoint, by name."""

    source: str
    files: tuple[str, ...]
    tensors: Mapping[str, TensorEntry]
    absent: tuple[str, ...] = ()  # shards the index lists that this machine does not have


    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _reject_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key '{key}'")
        seen[key] = value
    return seen


def _is_nonneg_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(path: str, name: str, raw, data_start: int) -> TensorEntry:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor '{name}': {why}")

    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"header entry must have exactly dtype, shape and data_offsets, got {raw!r}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if dtype not in DTYPES:
        raise bad(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_nonneg_int(d) for d in shape):
        raise bad(f"shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_nonneg_int(o) for o in offsets) or offsets[0] > offsets[1]):
        raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    begin, end = offsets
    expected = prod(shape) * DTYPES[dtype][1]
    if end - begin != expected:
        raise bad(f"data_offsets {offsets} hold {end - begin} bytes but shape {shape} of {dtype} "
                  f"needs {expected}")
    return TensorEntry(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def read_header(path: str) -> dict[str, TensorEntry]:
    """Parse and validate one safetensors file's header; returns its tensors by name."""
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: file is {file_size} bytes, too short to be safetensors")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header length {header_len} exceeds the "
                                      f"{MAX_HEADER_BYTES}-byte limit of the safetensors format")
            if 8 + header_len > file_size:
                raise CheckpointError(f"{path}: header length {header_len} runs past the end of the "
                                      f"{file_size}-byte file (truncated?)")
            header_bytes = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from e

    try:
        text = header_bytes.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("header does not start with '{'")
        header = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")

    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")

    data_start = 8 + header_len
    entries = {name: _parse_entry(path, name, raw, data_start) for name, raw in header.items()}

    # The format requires the data area to be exactly covered: no overlap, no hole, no excess.
    cursor, previous = data_start, None
    for entry in sorted(entries.values(), key=lambda e: (e.start, e.nbytes)):
        if entry.start != cursor:
            where = f"overlaps '{previous}'" if entry.start < cursor else "leaves a gap before it"
            raise CheckpointError(f"{path}: tensor '{entry.name}' at data offset "
                                  f"{entry.start - data_start} {where}")
        cursor, previous = entry.start + entry.nbytes, entry.name
    if cursor != file_size:
        if cursor > file_size:
            raise CheckpointError(f"{path}: tensor '{previous}' ends at byte {cursor} but the file "
                                  f"has only {file_size} bytes (truncated?)")
        raise CheckpointError(f"{path}: {file_size - cursor} bytes after the last tensor are not "
                              f"described by the header")
    return entries


def _read_weight_map(index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except OSError as e:
        raise CheckpointError(f"{index_path}: cannot read: {e.strerror or e}") from e
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{index_path}: not a valid index file: {e}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
    return weight_map


def _index_from_weight_map(index_path: str, missing_ok: bool) -> CheckpointIndex:
    weight_map = _read_weight_map(index_path)
    folder = os.path.dirname(os.path.abspath(index_path))
    shards = sorted(set(weight_map.values()))
    tensors: dict[str, TensorEntry] = {}
    absent: set[str] = set()  # shard names
    for shard in shards:
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            if missing_ok:
                absent.add(shard)
                continue
            raise CheckpointError(f"{shard_path}: shard listed in {index_path} does not exist")
        for name, entry in read_header(shard_path).items():
            if name in tensors:
                raise CheckpointError(f"{shard_path}: tensor '{name}' also appears in "
                                      f"{tensors[name].file}")
            if weight_map.get(name) != shard:
                raise CheckpointError(f"{shard_path}: tensor '{name}' is not listed for this shard in "
                                      f"{index_path}")
            tensors[name] = entry
    for name, shard in weight_map.items():
        if name not in tensors and shard not in absent:
            raise CheckpointError(f"{os.path.join(folder, shard)}: tensor '{name}' listed in "
                                  f"{index_path} is not in the shard")
    return CheckpointIndex(index_path, tuple(os.path.join(folder, s) for s in shards), tensors,
                           tuple(os.path.join(folder, s) for s in sorted(absent)))


def _resolve(path: str) -> str:
    """The file to start from: a .safetensors file or an index .json."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such file or directory")
    for name in (INDEX_FILE, SINGLE_FILE):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    listing = sorted(os.listdir(path))
    indexes = [n for n in listing if n.endswith(".safetensors.index.json")]
    singles = [n for n in listing if n.endswith(".safetensors")]
    if len(indexes) == 1:
        return os.path.join(path, indexes[0])
    if not indexes and len(singles) == 1:
        return os.path.join(path, singles[0])
    raise CheckpointError(f"{path}: expected {INDEX_FILE} or {SINGLE_FILE}; found "
                          f"{', '.join(indexes + singles) or 'no safetensors files'}")


def open_checkpoint(path: str | os.PathLike, *, missing_ok: bool = False) -> CheckpointIndex:
    """Index a checkpoint: a .safetensors file, an index .json, or a directory holding either.

    ``missing_ok``: shards the index lists but this machine lacks are recorded in ``absent``
    instead of raising (another node may hold them).
    """
    start = _resolve(os.fspath(path))
    if start.endswith(".json"):
        return _index_from_weight_map(start, missing_ok)
    return CheckpointIndex(start, (os.path.abspath(start),), read_header(os.path.abspath(start)))
