"""Checkpoint index: safetensors headers -> where every tensor's bytes are.

Pure Python (no torch), so the geometry that everything else relies on is cheap to test. Headers
are validated as strictly as the safetensors format itself demands, because a header that lies
about offsets would otherwise make a rank silently read another tensor's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from math import prod
from urllib.parse import quote

from ..errors import CheckpointError, CheckpointNotFoundError, InvalidCheckpointError
from ..report import brief, shortened
from .files import FileTable, OpenFile, absolute_path, open_regular

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

# The safetensors reference implementation refuses larger headers; so do we, and index files too.
MAX_HEADER_BYTES = 100_000_000
MAX_INDEX_BYTES = MAX_HEADER_BYTES
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_U64_MAX = 2**64 - 1  # safetensors reads sizes, shapes and offsets as 64-bit unsigned integers


@dataclass(frozen=True)
class Fragment:
    """Elements ``[first, first + numel)`` of a tensor stored apart from the rest of it: from
    byte ``start`` of ``file`` (a rank's flat partition in a DeepSpeed checkpoint)."""

    first: int
    numel: int
    file: str
    start: int


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its file and the absolute byte range of its data, or, for a
    tensor stored in pieces, the ``fragments`` that hold it (then ``file`` is the first piece's
    and ``start`` means nothing: read it through ``spans``)."""

    name: str
    file: str  # the file's key: its name inside the checkpoint folder (``CheckpointIndex.path``)
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in ``file``
    nbytes: int
    fragments: tuple[Fragment, ...] = ()  # in element order, covering every element once

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def files(self) -> tuple[str, ...]:
        """The keys of every file that holds this tensor (none for an empty one stored in pieces)."""
        if self.fragments:
            return tuple(dict.fromkeys(f.file for f in self.fragments))
        return (self.file,) if self.file else ()

    def spans(self, first: int, count: int) -> list[tuple[str, int, int, int]]:
        """Where elements ``[first, first + count)`` lie: (file, byte offset, element offset
        from ``first``, element count) for each stored run."""
        size = self.itemsize
        if not self.fragments:
            return [(self.file, self.start + first * size, 0, count)] if count else []
        spans = []
        for f in self.fragments:
            low, high = max(first, f.first), min(first + count, f.first + f.numel)
            if low < high:
                spans.append((f.file, f.start + (low - f.first) * size, low - first, high - low))
        return spans


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a (possibly sharded) checkpoint, by name, and its files as opened when
    their headers were read (``opened``; every read of tensor bytes goes through it).

    Files are named by key, their path relative to the checkpoint's folder ``root`` (as an index's
    weight map names them): the same on every node wherever the folder lies, so ranks can name
    files to each other, and plans name bytes without knowing where the files are.
    """

    source: str
    files: tuple[str, ...]  # keys
    tensors: Mapping[str, TensorEntry]
    absent: tuple[str, ...] = ()  # keys of the shards the index lists that this machine does not have
    opened: FileTable | None = field(default=None, compare=False, repr=False)
    root: str = ""
    # SHA-256 of the index's weight map (which file holds each tensor; "" without an index): ranks
    # that lack some shards take those shards' tensors from another rank's map, so the maps must agree
    weight_map_sha256: str = ""
    # A Hub repo read over HTTP (``open.open_source(headers_only=True)``): the URL its files lie
    # under, their headers alone read; ``root`` then holds only its index and config
    remote: str = ""
    # what a DeepSpeed checkpoint's files hold beyond tensors (``native.NativeLayout``), which a
    # resume reads its optimizer states from; None for safetensors and for an index shared by ranks
    layout: object = field(default=None, compare=False, repr=False)

    def path(self, key: str) -> str:
        """Where the file ``key`` lies: on this machine, or, for a ``remote`` repo, its URL."""
        return self.remote + quote(key) if self.remote else os.path.join(self.root, key)

    @property
    def total_bytes(self) -> int:
        """The bytes of the tensors stored, a tied alias of a DeepSpeed checkpoint counted once."""
        return sum({(t.file, t.start, t.fragments): t.nbytes for t in self.tensors.values() if t.nbytes}.values())

    def close(self) -> None:
        """Close the files (also done when the index is garbage-collected)."""
        if self.opened is not None:
            self.opened.close()

    def __enter__(self) -> CheckpointIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()




_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way JSON text holds a surrogate


def _strict_json(text: str, what: str):
    """``json.loads`` refusing what serde_json (safetensors' parser) refuses and Python accepts:
    ``-0`` as an integer, NaN and Infinity, lone surrogates; and duplicate keys, which it
    silently resolves. Deep nesting is a ``ValueError`` here, not a ``RecursionError``. The
    checks that cost a call per value run only when the text could need them."""

    def integer(literal: str) -> int:
        if literal == "-0":
            raise ValueError("-0 is not an integer safetensors accepts")
        return int(literal)

    def constant(literal: str):
        raise ValueError(f"{literal} is not JSON")

    surrogates = _SURROGATE_ESCAPE.search(text) is not None

    def strict_object(pairs):
        if not surrogates:  # the common case, in one call: a duplicate makes the dict shorter
            seen = dict(pairs)
            if len(seen) == len(pairs):
                return seen
        seen = {}
        for key, value in pairs:
            if surrogates:
                for text_ in (key, value) if isinstance(value, str) else (key,):
                    try:
                        text_.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ValueError(f"string {brief(text_)} holds a lone surrogate (not "
                                         "Unicode)") from None
            if key in seen:
                raise ValueError(f"duplicate key {brief(key)}")
            seen[key] = value
        return seen

    try:
        return json.loads(text, parse_int=integer if "-0" in text else None, parse_constant=constant,
                          object_pairs_hook=strict_object)
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None


def _is_u64(value) -> bool:
    return type(value) is int and 0 <= value <= _U64_MAX  # JSON gives int exactly (bool is not)


def _parse_entry(path: str, key: str, name: str, raw, data_start: int) -> TensorEntry:
    def bad(why: str) -> InvalidCheckpointError:
        return InvalidCheckpointError(f"{path}: tensor {brief(name)}: {why}", path=path, tensor=name)

    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"header entry must have exactly dtype, shape and data_offsets, got {brief(raw)}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"unknown dtype {brief(dtype)} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise bad(f"shape must be a list of non-negative 64-bit integers, got {brief(shape)}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_u64(o) for o in offsets) or offsets[0] > offsets[1]):
        raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end < 2**64, got "
                  f"{brief(offsets)}")
    numel = 1
    for dim in shape:  # as safetensors multiplies: left to right, any overflow refused
        numel *= dim
        if numel > _U64_MAX:
            raise bad(f"shape {brief(shape)} has more than 2**64 elements")
    if numel * DTYPES[dtype][1] * 8 > _U64_MAX:
        raise bad(f"shape {brief(shape)} of {dtype} has more than 2**64 bits")
    begin, end = offsets
    expected = numel * DTYPES[dtype][1]
    if end - begin != expected:
        raise bad(f"data_offsets {offsets} hold {end - begin} bytes but shape {brief(shape)} of "
                  f"{dtype} needs {expected}")
    return TensorEntry(name, key, dtype, tuple(shape), data_start + begin, end - begin)


def pread_exactly(opened: OpenFile, nbytes: int, offset: int) -> bytes:
    try:
        data = os.pread(opened.fd, nbytes, offset)
    except OSError as e:
        raise CheckpointError(f"{opened.path}: cannot read: {e.strerror}", path=opened.path) from e
    if len(data) != nbytes:
        raise CheckpointError(f"{opened.path}: ends at byte {offset + len(data)} while reading "
                              f"{nbytes} bytes at {offset} (changed while being read?)", path=opened.path)
    return data


MAX_JSON_DEPTH = 64  # configs and indexes nest a few levels; a deeper document is hostile


def _nesting_checked(value, what: str):
    """``value`` (parsed JSON), refused if it nests deeper than ``MAX_JSON_DEPTH``: code that walks
    it later (a copy, a comparison, a message) must never recurse without bound."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children and depth > MAX_JSON_DEPTH:
            raise ValueError(f"{what} nests more than {MAX_JSON_DEPTH} levels deep")
        pending.extend((child, depth + 1) for child in children)
    return value


def read_json_file(path: str) -> object:
    """The JSON document in the small file ``path`` (a config, an index of our own), opened as a
    checkpoint file is (regular files only, never blocking), its size and nesting bounded; an
    ``InvalidCheckpointError`` naming the file otherwise."""
    with FileTable() as table:
        return read_json(table.add(open_regular(path), path))[0]


def read_json(opened: OpenFile) -> tuple[object, bytes]:
    """The JSON document in the small file ``opened`` and its bytes, as ``read_json_file`` reads
    them: what a caller copies is then the very bytes checked."""
    path = opened.path
    if opened.identity.size > MAX_INDEX_BYTES:
        raise InvalidCheckpointError(f"{path}: {opened.identity.size} bytes, over the {MAX_INDEX_BYTES}-byte "
                                     "limit zload sets for a JSON file", path=path)
    data = pread_exactly(opened, opened.identity.size, 0)
    try:
        try:
            return _nesting_checked(json.loads(data.decode("utf-8")), "the document"), data
        except RecursionError:
            raise ValueError(f"the document nests more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        raise InvalidCheckpointError(f"{path}: not JSON zload reads: {str(e)[:300]}", path=path) from e


def header_length(path: str, file_size: int, prefix: bytes) -> int:
    """The header length that the first bytes ``prefix`` (8, or the whole file if shorter) of the
    ``file_size``-byte safetensors file ``path`` give, refused before the header is read if the
    file cannot hold it."""
    if file_size < 8:
        raise InvalidCheckpointError(f"{path}: file is {file_size} bytes, too short to be safetensors", path=path)
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise InvalidCheckpointError(f"{path}: header length {header_len} exceeds the "
                                     f"{MAX_HEADER_BYTES}-byte limit of the safetensors format", path=path)
    if 8 + header_len > file_size:
        raise InvalidCheckpointError(f"{path}: header length {header_len} runs past the end of the "
                                     f"{file_size}-byte file (truncated?)", path=path)
    return header_len


def parse_header(opened: OpenFile, key: str) -> dict[str, TensorEntry]:
    """Parse and validate the header of an opened safetensors file (the checkpoint's file ``key``);
    returns its tensors by name and records the header's digest, data start and metadata in
    ``opened``."""
    path, file_size = opened.path, opened.identity.size
    header_len = header_length(path, file_size, pread_exactly(opened, min(8, file_size), 0))
    header_bytes = pread_exactly(opened, header_len, 8)

    try:
        text = header_bytes.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("header does not start with '{'")
        header = _strict_json(text, "header")
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise InvalidCheckpointError(f"{path}: header is not valid JSON: {e}", path=path) from e
    if not isinstance(header, dict):
        raise InvalidCheckpointError(f"{path}: header is not a JSON object", path=path)

    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise InvalidCheckpointError(f"{path}: __metadata__ must map strings to strings", path=path)

    data_start = 8 + header_len
    entries = {name: _parse_entry(path, key, name, raw, data_start) for name, raw in header.items()}

    # The format requires the data area to be exactly covered: no overlap, no hole, no excess.
    cursor, previous = data_start, None
    for entry in sorted(entries.values(), key=lambda e: (e.start, e.nbytes)):
        if entry.start != cursor:
            where = f"overlaps '{previous}'" if entry.start < cursor else "leaves a gap before it"
            raise InvalidCheckpointError(f"{path}: tensor {brief(entry.name)} at data offset "
                                         f"{entry.start - data_start} {where}", path=path, tensor=entry.name)
        cursor, previous = entry.start + entry.nbytes, entry.name
    if cursor != file_size:
        if cursor > file_size:
            raise InvalidCheckpointError(f"{path}: tensor {brief(previous)} ends at byte {cursor} but the "
                                         f"file has only {file_size} bytes (truncated?)", path=path, tensor=previous)
        raise InvalidCheckpointError(f"{path}: {file_size - cursor} bytes after the last tensor are not "
                                     f"described by the header", path=path)
    opened.header_sha256 = hashlib.sha256(header_bytes).hexdigest()
    opened.data_start = data_start
    opened.metadata = dict(metadata or {})
    return entries


def read_header(path: str) -> dict[str, TensorEntry]:
    """Parse and validate one safetensors file's header; returns its tensors by name (their
    ``file`` is the file's name, its key in a checkpoint of that one file)."""
    key = os.path.basename(path)
    with FileTable() as table:
        return parse_header(table.add(open_regular(path), key), key)


def read_weight_map(index_path: str, table: FileTable) -> dict[str, str]:
    opened = table.add(open_regular(index_path), os.path.basename(index_path))
    if opened.identity.size > MAX_INDEX_BYTES:
        raise InvalidCheckpointError(f"{index_path}: {opened.identity.size} bytes, over the "
                                     f"{MAX_INDEX_BYTES}-byte limit zload sets for an index file", path=index_path)
    try:
        weight_map = _strict_json(pread_exactly(opened, opened.identity.size, 0).decode("utf-8"),
                                  "index").get("weight_map")
    except (ValueError, AttributeError) as e:
        raise InvalidCheckpointError(f"{index_path}: not a valid index file: {e}", path=index_path) from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InvalidCheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names",
                                     path=index_path)
    return weight_map


def shard_path(folder: str, shard: str) -> str | None:
    """Where shard name ``shard`` of an index in ``folder`` lies, or None if it names a place
    outside ``folder`` (an absolute path, ``..``) or no file at all. Judged on the name alone:
    links inside the folder (the Hub cache's snapshot links) are followed as usual."""
    if not shard or "\x00" in shard or os.path.isabs(shard):
        return None
    try:
        os.fsencode(shard)
    except UnicodeError:
        return None
    normal = os.path.normpath(shard)
    if normal in (".", "..") or normal.startswith(".." + os.sep):
        return None
    return os.path.join(folder, normal)


def index_from_weight_map(index_path: str, table: FileTable, missing_ok: bool,
                          open_file: Callable[[str], OpenFile] = open_regular) -> CheckpointIndex:
    """The checkpoint of the index ``index_path``: its shards opened with ``open_file`` (a path in
    the index's folder -> the file opened; ``CheckpointNotFoundError`` if there is none)."""
    weight_map = read_weight_map(index_path, table)
    folder = os.path.dirname(absolute_path(index_path))
    shards = sorted(set(weight_map.values()))
    paths = {}
    for shard in shards:  # every name is checked before any shard is opened
        paths[shard] = shard_path(folder, shard)
        if paths[shard] is None:
            tensor = next(name for name, s in weight_map.items() if s == shard)
            raise InvalidCheckpointError(f"{index_path}: tensor {brief(tensor)} is mapped to {brief(shard)}, "
                                         f"which is not a file inside the checkpoint folder {folder}",
                                         path=index_path, tensor=tensor)
    tensors: dict[str, TensorEntry] = {}
    absent: set[str] = set()  # shard names
    for shard in shards:
        try:
            opened = open_file(paths[shard])
        except CheckpointNotFoundError:
            if missing_ok:
                absent.add(shard)
                continue
            raise CheckpointNotFoundError(f"{paths[shard]}: shard listed in {index_path} does not exist",
                                          path=paths[shard]) from None
        key = os.path.relpath(paths[shard], folder)
        for name, entry in parse_header(table.add(opened, key), key).items():
            if name in tensors:
                raise InvalidCheckpointError(f"{paths[shard]}: tensor {brief(name)} also appears in "
                                             f"{os.path.join(folder, tensors[name].file)}", path=paths[shard],
                                             tensor=name)
            if weight_map.get(name) != shard:
                raise InvalidCheckpointError(f"{paths[shard]}: tensor {brief(name)} is not listed for this "
                                             f"shard in {index_path}", path=paths[shard], tensor=name)
            tensors[name] = entry
    for name, shard in weight_map.items():
        if name not in tensors and shard not in absent:
            raise InvalidCheckpointError(f"{paths[shard]}: tensor {brief(name)} listed in {index_path} is not "
                                         f"in the shard", path=paths[shard], tensor=name)
    key = {shard: os.path.relpath(paths[shard], folder) for shard in shards}
    mapped = hashlib.sha256(repr(sorted((name, key[shard]) for name, shard in weight_map.items())).encode())
    return CheckpointIndex(index_path, tuple(key[s] for s in shards), tensors,
                           tuple(key[s] for s in sorted(absent)), table, folder, mapped.hexdigest())


def pytorch_weights_hint(names, source: str = "FOLDER") -> str:
    """What to do about the PyTorch ``.bin`` weights among ``names`` (the files of ``source``, a
    folder or a Hub repo id): "" if none."""
    found = sorted(n for n in names if n.endswith(".bin.index.json") or (n.endswith(".bin") and "model" in n))
    if not found:
        return ""
    return (f"; it holds PyTorch .bin weights ({shortened(found, 3)}), and zload reads safetensors only: "
            f"convert them once with transformers, e.g. AutoModelForCausalLM.from_pretrained({source})"
            ".save_pretrained(OUT) (transformers 4: save_pretrained(OUT, safe_serialization=True)), "
            "then load OUT")
