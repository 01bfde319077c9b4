"""DeepSpeed's own checkpoints (``engine.save_checkpoint``) indexed like safetensors.

``save_checkpoint(dir)`` writes ``dir/latest`` (the newest tag) and ``dir/<tag>/`` holding the
model states (``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank at ZeRO-3, one
``mp_rank_00_model_states.pt`` at ZeRO-1/2: names, shapes, frozen parameters, buffers) and one
``*zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank holding its flat fp32 master
partition. Each model tensor is indexed as the fragments of those partitions that hold it
(``TensorEntry.fragments``), so a load at any world size reads only byte ranges of the saved
partitions, and nothing gathers the model.

A ``.pt`` file is a zip archive whose records are stored uncompressed (a compressed pickle is
refused: it could inflate without bound). It is unpickled by ``torch.load(weights_only=True)``
onto the meta device: no tensor data is read, and torch records where each storage lies
(``_checkpoint_offset``). Every class or function the pickle names that torch does not allow
(DeepSpeed's loss scaler, a trainer's client state, a hostile ``builtins.eval``) becomes an inert
stand-in, so nothing in a checkpoint runs: where zload reads nothing from it the load goes on,
where it reads (a stand-in in place of a dict or tensor) the file is refused. torch refuses names
from ``os``, ``posix``, ``nt`` and ``sys`` outright, so a file naming them is refused. Before torch
runs a pickle, a walk of its opcodes (``check_pickle``) refuses one that could take too long,
nest deeper than zload's own walks recurse, or make the calls torch allows allocate more than
the pickle's size (``bytearray(1 << 30)`` is 20 bytes). Each storage must start a stored
(uncompressed) record of the archive, of its size, inside the file, before its bytes are
indexed. The geometry is DeepSpeed's own, as ``deepspeed/utils/zero_to_fp32.py`` (0.19.8)
rebuilds it, checked against the sizes found, and the files must be of one save: every rank's
file records what the others do (steps, DeepSpeed version, shapes, loss scaler, hyperparameters),
and the model states no fewer optimizer steps than the optimizer states have taken.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
import struct
import zipfile
from dataclasses import dataclass, field
from math import prod

from ..errors import CheckpointNotFoundError, InvalidCheckpointError
from ..report import brief, ranks_listed, shortened
from .files import FileTable, OpenFile, absolute_path, open_regular
from .index import DTYPES, MAX_HEADER_BYTES, CheckpointIndex, Fragment, TensorEntry, pread_exactly, shard_path
from .partition import Partition

LATEST = "latest"  # the file save_checkpoint writes: the tag of the newest checkpoint
_MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM_STATES = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"  # an IntEnum: unpickled as its int
_MAX_LATEST_BYTES = 4096
_MAX_NUMEL = 2**63 - 1  # torch counts a tensor's elements in an int64
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # a zip member's local header, before name and extra


def native_folder(path: str) -> str | None:
    """The tag folder of the DeepSpeed checkpoint at ``path`` (the folder ``save_checkpoint``
    wrote, whose ``latest`` names the tag, or a tag folder itself); None if it is not one."""
    if not os.path.isdir(path):
        return None
    if any(_MODEL_STATES.fullmatch(n) for n in os.listdir(path)):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.lexists(latest):
        return None
    with FileTable() as table:
        opened = table.add(open_regular(latest), LATEST)
        if opened.identity.size > _MAX_LATEST_BYTES:
            raise InvalidCheckpointError(f"{latest}: {opened.identity.size} bytes; DeepSpeed's '{LATEST}' "
                                         "holds one tag name", path=latest)
        tag = pread_exactly(opened, opened.identity.size, 0).decode("utf-8", "replace").strip()
    folder = shard_path(path, tag)
    if folder is None or os.path.dirname(os.path.normpath(tag)):
        raise InvalidCheckpointError(f"{latest}: names the tag {tag!r}, which is not a folder name inside "
                                     f"{path}", path=latest)
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"{latest}: names the tag {tag!r}, but {folder} is not a folder "
                                      "(a save that did not finish, or a copied checkpoint missing it)",
                                      path=folder)
    return folder


def _refusal(e: Exception) -> str:
    """Why torch could not unpickle, in its own words but without the advice it wraps them in:
    to load with weights_only=False, which would let the checkpoint run code."""
    import torch

    text = str(e).split("\n\nCheck the documentation")[0]
    text = text.replace(getattr(torch.serialization, "UNSAFE_MESSAGE", "\0"), "")
    text = text.rsplit("WeightsUnpickler error: ", 1)[-1].replace("Weights only load failed.", "")
    return " ".join(text.split())[:300]


_MAX_PICKLE_NODES = 10_000_000  # a DeepSpeed pickle holds thousands; shared references count each time
_MAX_PICKLE_DEPTH = 100  # DeepSpeed's saves nest 9 levels; zload's walks of what it unpickles recurse
# the opcodes torch's weights_only unpickler runs; it refuses any other before running it
_TORCH_OPCODES = frozenset({
    "PROTO", "STOP", "MARK", "GLOBAL", "REDUCE", "NEWOBJ", "BUILD", "BINPERSID", "APPEND", "APPENDS", "SETITEM",
    "SETITEMS", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE",
    "SHORT_BINSTRING", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"})
_COPIES = frozenset({"builtins.set", "collections.OrderedDict", "collections.Counter", "torch.Size"})
_ENCODINGS = frozenset({"latin1", "latin_1", "utf_8", "utf8", "ascii"})  # none makes more bytes than UTF-8 does
_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"  # calls the function the pickle passes it


class _Node:
    """What the walk knows of one object the unpickler would build."""

    __slots__ = ("parts", "depth", "size", "value", "items", "name", "made_by", "inside")

    def __init__(self, parts: int = 1, depth: int = 0, size: int | None = 0, value=None, items=None,
                 name: str | None = None, made_by: str | None = None):
        self.parts, self.depth = parts, depth  # its parts, shared ones counted each time; its nesting
        self.size = size  # its items or bytes; None: built by a call, of a size the walk does not know
        self.value = value  # an int's value, a short str's text
        self.items = items  # a tuple's nodes
        self.name = name  # the global it is
        self.made_by = made_by  # the global whose call built it
        self.inside = False  # placed inside another object: changing it now would leave that one's counts stale


class _PickleWalk:
    """Walks a pickle's opcodes as torch's weights_only unpickler would run them, building
    nothing, and raises ``ValueError`` where running them could take too long (a nest whose
    hashing or printing takes 2**depth steps: shared references counted each time), nest too
    deep for a recursive walk, or allocate more than the pickle's own size: ``bytearray(1 << 30)``
    is 20 bytes of pickle, ``_codecs.encode(x, 'hex')`` doubles ``x``, ``torch.Tensor(n)`` and the
    storage classes allocate ``n``, ``set(t)`` iterates a tensor of any size, and
    ``_rebuild_from_type_v2`` calls what it is passed. ``stand_ins``: the globals unpickled as
    zload's inert stand-ins, which keep what they are given and run nothing."""

    def __init__(self, data: bytes, stand_ins: frozenset[str]):
        import torch

        self.data, self.stand_ins = data, stand_ins
        self.constructors = frozenset(["torch.Tensor"] + [f"{c.__module__}.{c.__name__}" for c in (
            *torch._tensor_classes, *torch._storage_classes)])
        self.built = 0  # bytes or items that calls allocate beyond what the pickle spells out

    def run(self) -> None:
        import pickletools

        stack: list[_Node] = []
        marks: list[int] = []
        memo: dict[int, _Node] = {}
        for op, arg, position in pickletools.genops(self.data):
            name, self.where = op.name, f"opcode {op.name} at byte {position}"
            if name not in _TORCH_OPCODES or name == "STOP":
                return  # torch refuses an opcode it does not know before running it
            if name == "MARK":
                marks.append(len(stack))
            elif name in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "GLOBAL":
                stack.append(_Node(name=self._global(position)))
            elif name in ("BININT", "BININT1", "BININT2", "LONG1"):
                stack.append(_Node(value=arg))
            elif name in ("NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT", "PROTO"):
                if name != "PROTO":
                    stack.append(_Node())
            elif name == "BINUNICODE":
                size = len(arg.encode("utf-8", "surrogatepass"))
                stack.append(_Node(size=size, value=arg if size < 64 else None))
            elif name == "SHORT_BINSTRING":
                stack.append(_Node(size=len(arg)))
            elif name in ("EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
                stack.append(_Node(items=[] if name == "EMPTY_TUPLE" else None))
            elif name in ("TUPLE", "APPENDS", "SETITEMS"):
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                if name == "TUPLE":
                    stack.append(self._holding(items, items=items))
                else:
                    self._grow(stack[-1], items, name)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                count = int(name[-1])
                if len(stack) < count:
                    raise IndexError("stack underflow")
                items = stack[-count:]
                del stack[-count:]
                stack.append(self._holding(items, items=items))
            elif name in ("APPEND", "SETITEM", "BUILD"):
                items = [stack.pop()] if name != "SETITEM" else [stack.pop(-2), stack.pop()]
                self._grow(stack[-1], items, name)
            elif name == "BINPERSID":  # a storage, on the meta device
                stack.append(self._holding([stack.pop()], size=None))
            else:  # REDUCE, NEWOBJ
                args = stack.pop()
                stack.append(self._call(stack.pop(), args, name))

    def refuse(self, why: str):
        raise ValueError(f"{why} ({self.where})")

    def _global(self, position: int) -> str:
        """The name torch reads for a GLOBAL opcode (two lines, mapped from Python 2's names)."""
        from torch._utils import IMPORT_MAPPING, NAME_MAPPING

        first = self.data.index(b"\n", position + 1)
        module = self.data[position + 1:first].decode("utf-8")
        name = self.data[first + 1:self.data.index(b"\n", first + 1)].decode("utf-8")
        module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
        return f"{module}.{name}"

    def _holding(self, parts: list[_Node], **fields) -> _Node:
        """A new object made of ``parts``, which are then inside it."""
        for part in parts:
            part.inside = True
        node = _Node(parts=1 + sum(p.parts for p in parts), depth=1 + max((p.depth for p in parts), default=0),
                     **{"size": len(parts), **fields})
        self._check(node)
        return node

    def _check(self, node: _Node) -> None:
        if node.parts > _MAX_PICKLE_NODES:
            self.refuse(f"it would build an object of more than {_MAX_PICKLE_NODES:,} parts")
        if node.depth > _MAX_PICKLE_DEPTH:
            self.refuse(f"it nests objects more than {_MAX_PICKLE_DEPTH} deep")

    def _grow(self, target: _Node, items: list[_Node], op: str) -> None:
        if target in items:
            self.refuse("it places an object inside itself")
        if target.inside:  # only a reference cycle, or a crafted pickle, changes an object it already placed
            self.refuse("it changes an object after placing it inside another")
        if op == "BUILD" and target.made_by not in self.stand_ins and items[0].size is None:
            self.refuse("it sets an object's state from one built by a call, which torch would iterate over "
                        "whatever its size")
        for item in items:
            item.inside = True
        target.parts += sum(i.parts for i in items)
        target.depth = max(target.depth, 1 + max((i.depth for i in items), default=0))
        if target.size is not None and op != "BUILD":
            target.size += len(items) // (2 if op.startswith("SETITEM") else 1)
        self._check(target)

    def _call(self, callee: _Node, args: _Node, op: str) -> _Node:
        """The object ``callee(*args)`` builds (``NEWOBJ``: ``callee.__new__(callee, *args)``)."""
        return self._holding([callee, args], size=self._allocates(callee, args, op), made_by=callee.name)

    def _allocates(self, callee: _Node, args: _Node, op: str) -> int | None:
        """What calling ``callee`` with ``args`` allocates beyond its arguments (bytes or items,
        counted against the pickle's size), when it builds a container or bytes; None when it
        builds something else."""
        name = callee.name
        if args.items is None:
            self.refuse(f"it calls {name or 'an object'} with arguments that are not a tuple (torch would iterate "
                        "over them whatever their size)")
        if name is None:
            self.refuse("it calls an object that is not a global")
        if name in self.constructors:
            self.refuse(f"it calls {name}, which allocates the size it is given (torch.save writes tensors as "
                        "storages, never as such calls)")
        items, size = args.items, None
        if name == _FROM_TYPE and op == "REDUCE" and len(items) == 4:
            self._allocates(items[0], items[2], op)  # it calls items[0](*items[2])
        elif name == "builtins.bytearray" and op == "REDUCE" and items:
            if len(items) == 1 and isinstance(items[0].value, int):
                size = max(items[0].value, 0)
            else:
                size = self._sized(items[0], name) if len(items) == 1 else self._encoded(items, name)
        elif name == "_codecs.encode" and op == "REDUCE" and items:
            size = self._encoded(items, name)
        elif name in _COPIES and (op == "REDUCE" or name == "torch.Size"):  # the others' __new__ builds empty
            size = self._sized(items[0], name) if items else 0
        if size is not None:
            self.built += size
            if self.built > len(self.data):
                self.refuse(f"it calls {name}, which would allocate {size:,} bytes or items ({self.built:,} by its "
                            f"calls so far), more than the {len(self.data):,} bytes of the pickle itself")
        return size

    def _sized(self, node: _Node, name: str) -> int:
        if node.size is None:
            self.refuse(f"it calls {name} on an object built by a call, which torch would iterate over whatever "
                        "its size")
        return node.size

    def _encoded(self, items: list[_Node], name: str) -> int:
        """The bytes ``name(text, encoding, errors)`` makes: at most the UTF-8 of ``text`` for the
        encodings torch.save writes ('latin1') and a few others; other codecs (and error handlers)
        can make many bytes of few."""
        encoding = items[1].value if len(items) > 1 else "utf_8"
        errors = items[2].value if len(items) > 2 else "strict"
        if not (isinstance(encoding, str) and encoding.lower().replace("-", "_") in _ENCODINGS
                and errors == "strict" and len(items) <= 3):
            self.refuse(f"it calls {name} with the encoding {brief(encoding)} and the errors {brief(errors)}, "
                        "which torch.save never writes (a codec can make many bytes of few)")
        return self._sized(items[0], name)


def check_pickle(data: bytes, stand_ins: frozenset[str] = frozenset()) -> None:
    """Raise ``ValueError`` if torch's weights_only unpickler, running ``data``, could take too
    long, nest objects too deep, or allocate more than ``data``'s own size (``_PickleWalk``);
    ``stand_ins``: the globals it would unpickle as zload's inert stand-ins."""
    try:
        _PickleWalk(data, stand_ins).run()
    except (IndexError, KeyError) as e:
        raise ValueError(f"a malformed pickle ({type(e).__name__} while walking its opcodes)") from e


class _Inert:
    """Stands in for each class a checkpoint's pickle names that torch does not allow (one
    subclass per name, ``stands_for``): built from anything, it runs nothing and keeps what it
    was given, which zload compares across a save's files (a loss scaler's state) and reads
    where DeepSpeed records something in such a class (ZeRO-1/2's ``fragment_address``)."""

    __slots__ = ("args", "state")
    stands_for = ""

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state


def _stand_in(name: str) -> type:
    return type("_Inert", (_Inert,), {"__slots__": (), "stands_for": name})


@dataclass(frozen=True)
class Stored:
    """A tensor as a ``.pt`` file stores it: contiguous bytes from ``start`` of ``file``."""

    file: str
    start: int
    numel: int
    dtype: str  # safetensors code
    shape: tuple[int, ...]


class _PtFile:
    """One ``.pt`` file, unpickled onto the meta device, and where its stored records lie."""

    def __init__(self, opened: OpenFile, key: str):
        import torch

        self.opened, self.key = opened, key
        digest = hashlib.sha256()
        with open(os.dup(opened.fd), "rb", closefd=True) as f:
            try:
                archive = zipfile.ZipFile(f)
                members = archive.infolist()
                pickles = [i for i in members if i.filename.endswith("/data.pkl")]
                if len(pickles) != 1:
                    raise zipfile.BadZipFile(f"{len(pickles)} data.pkl records, expected 1")
                if pickles[0].compress_type != zipfile.ZIP_STORED:  # a small record may inflate to gigabytes
                    raise zipfile.BadZipFile(f"record {pickles[0].filename!r} is compressed; torch.save stores "
                                             "every record uncompressed")
                if pickles[0].file_size > MAX_HEADER_BYTES:  # it is read whole, three times
                    raise zipfile.BadZipFile(f"record {pickles[0].filename!r} is {pickles[0].file_size} bytes, "
                                             f"over the {MAX_HEADER_BYTES}-byte limit zload sets for it")
                pickled = archive.read(pickles[0])
                digest.update(pickled)
                self.written_as = pickles[0].filename.rsplit("/", 1)[0] + ".pt"  # torch.save names it so
            except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
                raise self.invalid(f"is not an archive torch.save wrote ({e})") from e
            self.records = {}  # data offset -> record
            for info in members:
                self.records[self._data_offset(info)] = info
                digest.update(repr((info.filename, info.header_offset, info.file_size)).encode())
            try:
                f.seek(0)
                unknown = torch.serialization.get_unsafe_globals_in_checkpoint(f)
                try:
                    check_pickle(pickled, frozenset(unknown) - {_STAGE_ENUM})
                except ValueError as e:
                    raise self.invalid(f"its pickle is refused before unpickling: {e}; replace the file with an "
                                       "intact copy of the save") from e
                stand_ins = [(int if name == _STAGE_ENUM else _stand_in(name), name) for name in unknown]
                f.seek(0)
                with torch.serialization.safe_globals(stand_ins):
                    self.state = torch.load(f, map_location="meta", weights_only=True)
                if not isinstance(self.state, dict):
                    raise ValueError(f"it holds {type(self.state).__name__}, not a dict")
            except InvalidCheckpointError:
                raise
            except Exception as e:  # torch raises many kinds for a bad archive or pickle
                raise self.invalid(f"cannot be unpickled with weights_only=True ({type(e).__name__}: "
                                   f"{_refusal(e)}); DeepSpeed's own saves can be: replace the file with an "
                                   "intact copy of the save") from e
        opened.header_sha256 = digest.hexdigest()

    def invalid(self, why: str, tensor: str | None = None) -> InvalidCheckpointError:
        return InvalidCheckpointError(f"{self.opened.path}: {why}", path=self.opened.path, tensor=tensor)

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        header = pread_exactly(self.opened, _LOCAL_HEADER.size, info.header_offset)
        signature, *_, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        if signature != b"PK\x03\x04":
            raise self.invalid(f"record {info.filename!r} has no local header at byte {info.header_offset}")
        return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length

    def get(self, mapping, key: str, kind: type, what: str):
        """``mapping[key]``, which must be a ``kind``."""
        value = mapping.get(key) if isinstance(mapping, dict) else None
        if not isinstance(value, kind):
            raise self.invalid(f"{what} {key!r} is {type(value).__name__}, expected {kind.__name__}; "
                               "not a DeepSpeed checkpoint zload knows")
        return value

    def number(self, value, what: str) -> int | float | None:
        """The number ``value`` is, or holds (a one-element tensor: its value read from the file);
        None for anything else."""
        import torch

        from .dtypes import TORCH_DTYPES

        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if not isinstance(value, torch.Tensor):
            return None
        stored = self.tensor(value, what)
        if stored.numel != 1:
            return None
        raw = bytearray(pread_exactly(self.opened, DTYPES[stored.dtype][1], stored.start))
        return torch.frombuffer(raw, dtype=TORCH_DTYPES[stored.dtype]).item()

    def tensor(self, value, what: str) -> Stored:
        """Where the tensor ``value`` (a meta tensor from ``state``) lies in the file."""
        import torch

        from .dtypes import CODES

        if not isinstance(value, torch.Tensor) or value.device.type != "meta":
            raise self.invalid(f"{what} is {type(value).__name__}, expected a tensor", what)
        # torch's own methods, unbound: the pickle may have set attributes of these names on it
        tensor = torch.Tensor
        code = CODES.get(value.dtype)
        if code is None:
            raise self.invalid(f"{what} has dtype {value.dtype}, which zload cannot read", what)
        storage = tensor.untyped_storage(value)
        base = getattr(storage, "_checkpoint_offset", None)
        info = self.records.get(base)
        if info is None or "/data/" not in info.filename:
            raise self.invalid(f"{what}: its storage does not start a data record of the archive", what)
        nbytes = torch.UntypedStorage.nbytes(storage)
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
            raise self.invalid(f"{what}: record {info.filename!r} is compressed or not "
                               f"{nbytes} bytes; torch.save stores tensors uncompressed", what)
        size, offset, numel = tensor.element_size(value), tensor.storage_offset(value), tensor.numel(value)
        if base + info.file_size > self.opened.identity.size or not tensor.is_contiguous(value) \
                or (offset + numel) * size > info.file_size:
            raise self.invalid(f"{what}: not a contiguous tensor inside its record", what)
        return Stored(self.key, base + offset * size, numel, code, tuple(value.shape))


def _shape(file: _PtFile, value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(d, int) and d >= 0 for d in value):
        raise file.invalid(f"{what}: shape {brief(value)} is not a tuple of sizes", what)
    numel = 1
    for size in value:  # stopped at once: a long shape of large sizes would take minutes to multiply
        numel *= size
        if numel > _MAX_NUMEL:
            raise file.invalid(f"{what}: shape {brief(value)} has more elements than a tensor can (2**63)", what)
    return tuple(value)


def _entry(name: str, dtype: str, shape: tuple[int, ...], pieces: list[Fragment], home: str) -> TensorEntry:
    """``name`` stored in ``pieces``; an empty tensor has none, and lies (in name) in ``home``, so
    that ranks lacking the checkpoint are sent it with that file's tensors."""
    numel = prod(shape)
    if len(pieces) == 1 and pieces[0].numel == numel:
        return TensorEntry(name, pieces[0].file, dtype, shape, pieces[0].start, numel * DTYPES[dtype][1])
    if not pieces:
        return TensorEntry(name, home, dtype, shape, 0, 0)
    return TensorEntry(name, pieces[0].file, dtype, shape, -1, numel * DTYPES[dtype][1], tuple(pieces))


def _whole(name: str, stored: Stored, shape: tuple[int, ...]) -> TensorEntry:
    """``name``, of ``shape``, stored whole as ``stored``."""
    return _entry(name, stored.dtype, shape, _Flat([stored]).fragments(0, stored.numel, 0), stored.file)


class _Flat:
    """Stored tensors read as one concatenation (a rank's fp32 flat groups, a ZeRO-1/2 group's
    partitions of all ranks)."""

    def __init__(self, stored: list[Stored]):
        self.stored = stored
        self.starts = [0]
        for s in stored:
            self.starts.append(self.starts[-1] + s.numel)

    def fragments(self, first: int, count: int, element: int) -> list[Fragment]:
        """The fragments of elements ``[first, first + count)``, placed at element ``element``
        onward of the tensor they belong to."""
        pieces = []
        i = max(0, bisect.bisect_right(self.starts, first) - 1)
        while i < len(self.stored) and self.starts[i] < first + count:
            stored, offset = self.stored[i], self.starts[i]
            low, high = max(first, offset), min(first + count, offset + stored.numel)
            if low < high:
                pieces.append(Fragment(element + low - first, high - low, stored.file,
                                       stored.start + (low - offset) * DTYPES[stored.dtype][1]))
            i += 1
        return pieces


@dataclass
class NativeLayout:
    """What a DeepSpeed checkpoint holds, read from its files (before any tensor is indexed)."""

    stage: int
    world: int
    param_shapes: list[dict[str, tuple[int, ...]]]  # trainable, per optimizer group, in order
    flat: list[list[Stored]]  # per rank: its fp32 flat groups
    paddings: list[list[int]] | None  # ZeRO-1/2: per group, the padding after each parameter
    frozen_shapes: dict[str, tuple[int, ...]]
    frozen: dict[str, list[Stored]]  # per rank (ZeRO-3: padded partitions; else one whole tensor)
    buffers: dict[str, Stored]
    module: dict[str, Stored]  # ZeRO-1/2: the module's weights as stored (16-bit when trained so)
    module_dtypes: dict[str, str]  # every parameter's and buffer's dtype in the module
    shared: dict[str, str]  # tied names: alias -> the name stored
    sliced: dict[str, int] | None = None  # ZeRO-1/2: each trainable parameter's elements by the slice mappings
    # the unpickled files, for what a resume reads beyond the weights (``optimizer_state``): each
    # rank's optimizer states, and the model states of rank 0
    optim_files: list[_PtFile] = field(default_factory=list, repr=False)
    model_file: _PtFile | None = field(default=None, repr=False)


def _files(flat: list[Stored]) -> str:
    return shortened(list(dict.fromkeys(s.file for s in flat)), 3) or "no flat groups"


def _quoted(names, limit: int = 3) -> str:
    """The first ``limit`` of ``names`` quoted, for a message that names the tensors at fault."""
    names = list(names)
    text = ", ".join(f"'{name}'" for name in names[:limit])
    return text + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _listed_twice(layout: NativeLayout) -> list[str]:
    """The names the layout lists more than once (DeepSpeed lists each tensor once: one listed
    twice would be read from one place or the other depending on the reader's order)."""
    kinds: dict[str, str] = {}
    problems = []
    for kind, names in (("parameter", [n for group in layout.param_shapes for n in group]),
                        ("frozen parameter", layout.frozen_shapes), ("buffer", layout.buffers)):
        for name in names:
            if name in kinds:
                problems.append(f"'{name}' is listed twice (as a {kinds[name]} and as a {kind})")
            kinds.setdefault(name, kind)
    return problems


def _span(names) -> str:
    """``names`` (in order) as one message can name them all: 'a', 'a' and 'b', or 'a' to 'z'."""
    names = list(names)
    return " and ".join(f"'{n}'" for n in names) if len(names) <= 2 else f"'{names[0]}' to '{names[-1]}'"


def _zero3_misfit(layout: NativeLayout, sizes: list[int]) -> str | None:
    """What is wrong where ZeRO-3's fp32 flat groups (``sizes``: one rank's) do not hold the
    partitions param_shapes lays out: the group whose sizes disagree, naming its parameters. The
    files record no size per trainable parameter, so which shape is wrong cannot be told."""
    takes = _zero3_takes(layout.param_shapes, layout.world)
    if len(takes) == len(sizes):  # DeepSpeed saves one flat group per group
        wrong = next((g for g, (take, held) in enumerate(zip(takes, sizes)) if take != held), None)
        if wrong is None:
            return None
        names, take, held = list(layout.param_shapes[wrong]), takes[wrong], sizes[wrong]
        what, holds = f"group {wrong}'s", "its fp32 flat group holds"
    elif sum(takes) != sum(sizes):
        names, take, held = [n for group in layout.param_shapes for n in group], sum(takes), sum(sizes)
        what, holds = "the", "the fp32 flat groups hold"
    else:
        return None
    return (f"the shapes param_shapes gives {what} {len(names)} trainable parameters ({_span(names)}) take {take} "
            f"elements on each rank, but {holds} {held} ({_files(layout.flat[0])}): one of those shapes, or the "
            "flat group, is not what DeepSpeed saved, and the files do not record which")


def _zero12_shape_evidence(layout: NativeLayout, name: str, shape: tuple[int, ...]) -> str | None:
    """Where ZeRO-1/2's files record ``name``'s size otherwise than param_shapes: the module's
    weight (saved whole), and the elements the optimizer's slice mappings place in the ranks'
    partitions."""
    stored = layout.module.get(name)
    if stored is not None and stored.shape != shape:
        return (f"'{name}': param_shapes gives the shape {shape}, but the module holds it as {stored.shape} "
                f"({stored.file})")
    sliced = (layout.sliced or {}).get(name)
    if sliced is not None and sliced != prod(shape):
        return (f"'{name}': param_shapes gives the shape {shape} ({prod(shape)} elements), but the optimizer states' "
                f"param_slice_mappings place {sliced} of its elements in the ranks' fp32 partitions "
                f"({_files([f[0] for f in layout.flat if f])})")
    return None


def native_entries(layout: NativeLayout, module_weights: bool = False) -> tuple[dict[str, TensorEntry], list[str]]:
    """Every tensor of the checkpoint as fragments of the stored partitions, and what is wrong.

    Trainable parameters are the fp32 masters (``module_weights``: the module's own weights for
    ZeRO-1/2, which store them; ZeRO-3 stores only masters), frozen parameters and buffers are as
    stored; a tied alias is the tensor it is tied to. Pure: the sizes found are checked against
    the layout DeepSpeed writes, so a file that lies about them is refused, not misread; each
    problem names the tensor at fault where the files tell which (ZeRO-1/2's module and slice
    mappings record each parameter's size), else the tensors one of which is, or the files.
    """
    world, entries, problems = layout.world, {}, _listed_twice(layout)
    trainable = [(name, shape) for group in layout.param_shapes for name, shape in group.items()]
    sizes = [[s.numel for s in flat] for flat in layout.flat]
    home = layout.flat[0][0].file if layout.flat and layout.flat[0] else ""
    # fp32 unless DeepSpeed was told to keep 16-bit masters (bf16_master_weights_and_grads)
    masters = {s.dtype for flat in layout.flat for s in flat}
    if len(masters) > 1:
        problems.append(f"the fp32 flat groups mix dtypes {sorted(masters)} ({_files(layout.flat[0])})")
        return entries, problems
    master = masters.pop() if masters else "F32"

    def add_trainable(name: str, shape: tuple[int, ...], pieces: list[Fragment], group: int) -> None:
        covered = sum(p.numel for p in pieces)  # short only when the sizes lie (ZeRO-1/2's slack)
        if covered != prod(shape):
            problems.append(f"'{name}': only {covered} of its {prod(shape)} elements lie inside the fp32 partitions "
                            f"(its shape, a shape or padding before it in group {group}, or a partition is not what "
                            "DeepSpeed saved)")
        entries[name] = _entry(name, master, shape, pieces, home)

    # ZeRO-3's partitions are all alike; ZeRO-1/2 drops the group's padding from the last ones
    differing = next((rank for rank, s in enumerate(sizes) if len(s) != len(sizes[0])
                      or (layout.stage == 3 and s != sizes[0])), None)
    if differing is not None:
        problems.append(f"the ranks' fp32 flat groups differ in size: rank 0's ({_files(layout.flat[0])}) hold "
                        f"{brief(sizes[0])} elements, rank {differing}'s ({_files(layout.flat[differing])}) "
                        f"{brief(sizes[differing])} (files of different saves?)")
        return entries, problems
    if layout.stage == 3:
        misfit = _zero3_misfit(layout, sizes[0])
        if misfit:
            problems.append(misfit)
            return entries, problems
        offset = 0
        flats = [_Flat(flat) for flat in layout.flat]
        for g, group in enumerate(layout.param_shapes):
            for name, shape in group.items():
                partitions = [Partition(prod(shape), world, rank) for rank in range(world)]
                add_trainable(name, shape, [piece for rank, part in enumerate(partitions)
                                            for piece in flats[rank].fragments(offset, part.valid, part.start)], g)
                offset += partitions[0].size
    else:
        paddings = layout.paddings or [[0] * len(group) for group in layout.param_shapes]
        if not len(layout.param_shapes) == len(sizes[0]) == len(paddings):
            problems.append(f"parameter groups (of {_quoted(n for n, _ in trainable)}): {len(layout.param_shapes)}, "
                            f"fp32 partitions per rank: {len(sizes[0])}, lists of alignment paddings: "
                            f"{len(paddings)}; DeepSpeed saves one of each per group")
            return entries, problems
        pinned = [p for name, shape in trainable for p in [_zero12_shape_evidence(layout, name, shape)] if p]
        if pinned:
            problems += pinned
            return entries, problems
        for g, (group, group_paddings) in enumerate(zip(layout.param_shapes, paddings)):
            if len(group_paddings) != len(group):
                problems.append(f"group {g} (of {_quoted(group)}): {len(group)} parameters but "
                                f"{len(group_paddings)} alignment paddings")
                continue
            whole = _Flat([layout.flat[rank][g] for rank in range(world)])
            offset = 0
            for (name, shape), padding in zip(group.items(), group_paddings):
                add_trainable(name, shape, whole.fragments(offset, prod(shape), 0), g)
                offset += prod(shape) + padding
            # as zero_to_fp32: the group was padded to a multiple of 2 * world, and the padding
            # dropped from the last partitions
            align, held = 2 * world, sum(s[g] for s in sizes)
            if -(-offset // align) != -(-held // align):
                problems.append(f"the shapes and alignment paddings of group {g}'s {len(group)} parameters "
                                f"({_span(group)}) take {offset} elements, but the ranks' fp32 partitions hold {held}: "
                                "one of them, or a partition, is not what DeepSpeed saved, and the files do not "
                                "record which")
    for name, shape in layout.frozen_shapes.items():
        parts, numel = layout.frozen.get(name, []), prod(shape)
        dtype = parts[0].dtype if parts else "F32"
        if layout.stage == 3:
            partitions = [Partition(numel, world, rank) for rank in range(world)]
            size = partitions[0].size
            if len(parts) != world or any(p.numel != size or p.dtype != dtype for p in parts):
                problems.append(f"frozen parameter '{name}': expected a {size}-element partition from each of "
                                f"{world} ranks, found {[p.numel for p in parts]}")
                continue
            pieces = [Fragment(part.start, part.valid, p.file, p.start) for part, p in zip(partitions, parts)]
            entries[name] = _entry(name, dtype, shape, [p for p in pieces if p.numel], parts[0].file)
        elif len(parts) != 1 or parts[0].numel != numel:
            problems.append(f"frozen parameter '{name}': expected one tensor of {numel} elements")
        else:
            entries[name] = _whole(name, parts[0], shape)
    if module_weights and layout.stage < 3:
        for name, shape in trainable:
            stored = layout.module.get(name)
            if stored is None or stored.numel != prod(shape):
                problems.append(f"'{name}': the module's weights lack it, or hold another size")
                continue
            entries[name] = _whole(name, stored, shape)
    for name, stored in layout.buffers.items():
        entries[name] = _whole(name, stored, stored.shape)
    for alias, name in layout.shared.items():
        if name in entries and alias not in entries:
            entry = entries[name]
            entries[alias] = TensorEntry(alias, entry.file, entry.dtype, entry.shape, entry.start, entry.nbytes,
                                         entry.fragments)
    return entries, problems


class _Attribute(str):
    """A step into an object's attribute in a ``_difference`` path."""


def _difference(a, b, path: tuple = ()) -> tuple[tuple, object, object] | None:
    """The first place where the unpickled values ``a`` and ``b`` differ: its path (keys, indexes
    and attributes) and the two values there; None where they are alike. Tensors are alike by
    dtype and shape (their bytes are not read), stand-ins by name, arguments and state."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        alike = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)
        return None if alike else (path, a, b)
    if isinstance(a, _Inert) and isinstance(b, _Inert) and a.stands_for == b.stands_for:
        return (_difference(a.args, b.args, path + (_Attribute("args"),))
                or _difference(a.state, b.state, path + (_Attribute("state"),)))
    if isinstance(a, dict) and isinstance(b, dict):
        if len(a) != len(b) or any(_difference(x, y) for x, y in zip(a, b)):
            return path, list(a), list(b)  # other keys, or in another order
        return next(filter(None, (_difference(a[k], b[k], path + (k,)) for k in a)), None)
    if isinstance(a, (list, tuple)) and type(a) is type(b) and not isinstance(a, torch.Size):  # a shape is one value
        if len(a) != len(b):
            return path, a, b
        return next(filter(None, (_difference(x, y, path + (i,)) for i, (x, y) in enumerate(zip(a, b)))), None)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return None  # both NaN
    try:
        alike = type(a) is type(b) and bool(a == b)
    except Exception:  # an object that cannot say
        alike = a is b
    return None if alike else (path, a, b)


def _path(path: tuple) -> str:
    """``path`` as Python would write the access: ``param_shapes[0]['a.weight']``."""
    return "".join(f".{step}" if isinstance(step, _Attribute) else f"[{brief(step)}]" if i else str(step)
                   for i, step in enumerate(path))


def _tensor_at(path: tuple) -> str | None:
    """The tensor a ``_difference`` path leads to, if any: shapes and fragments are by name."""
    for i, step in enumerate(path[:-1]):
        if isinstance(step, str) and step in ("param_shapes", "frozen_param_shapes", "frozen_param_fragments",
                                              "module"):
            names = [s for s in path[i + 1:] if isinstance(s, str) and not isinstance(s, _Attribute)]
            return names[0] if names else None
    return None


def _optimizer_steps(file: _PtFile, base) -> tuple:
    """The distinct step counts in the base optimizer's state (``state[i]['step']``: a number, or a
    one-element tensor read from the file), as ints where whole; none before its first step, or
    for an optimizer that keeps no count."""
    entries = base.get("state") if isinstance(base, dict) else base  # ZeRO-1/2's elastic saves: a list
    entries = entries.values() if isinstance(entries, dict) else entries if isinstance(entries, list) else []
    steps = {file.number(entry.get("step"), f"the base optimizer's state[{i}]['step']")
             for i, entry in enumerate(entries) if isinstance(entry, dict)}
    steps = {int(s) if isinstance(s, float) and s.is_integer() else s for s in steps
             if isinstance(s, (int, float)) and not isinstance(s, bool) and s == s}
    return tuple(sorted(steps))


# what every rank's file of one save records alike
_MODEL_FACTS = ("ds_version", "global_steps", "skipped_steps", "global_samples", "dp_world_size", "mp_world_size",
                "param_shapes", "frozen_param_shapes", "buffer_names", "module", "frozen_param_fragments")
_OPTIMIZER_FACTS = ("zero_stage", "partition_count", "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad",
                    "param_alignment_paddings", "ds_version")
_STEPS = "the base optimizer's step count"


def _optimizer_facts(file: _PtFile, state: dict, stage: int) -> dict:
    """What every rank's optimizer states of one save record alike (not their partitions, nor
    ZeRO-1/2's slice mappings and group paddings, which are each rank's own)."""
    base = state.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    facts = {key: state[key] for key in _OPTIMIZER_FACTS if key in state}
    facts["param_groups"] = base.get("param_groups") if isinstance(base, dict) else None
    steps = _optimizer_steps(file, base)
    return {"ds_version": file.state.get("ds_version"), "optimizer_state_dict": facts,
            _STEPS: steps[0] if len(steps) == 1 else steps}


def _disagreement(files: list[_PtFile], facts: list[dict]) -> tuple[_PtFile, _PtFile, tuple, object, object] | None:
    """The first file whose ``facts`` differ from the first file's: (it, the first file, the
    path, its value, the first file's value)."""
    for file, fact in zip(files[1:], facts[1:]):
        found = _difference(fact, facts[0])
        if found:
            return file, files[0], *found
    return None


def _of_another_save(file: _PtFile, other: _PtFile, path: tuple, value, others, kind: str, why: str = ""):
    return file.invalid(f"{_path(path)} is {brief(value)} here, but {brief(others)} in {other.key}{why}: the ranks' "
                        f"{kind} are of different steps or saves; copy the save again (all of its files), or remove "
                        "the files an older save left", _tensor_at(path))


def _zero3_takes(param_shapes: list[dict[str, tuple[int, ...]]], world: int) -> list[int]:
    """The elements each rank's fp32 flat group holds for each group of ``param_shapes``, as
    DeepSpeed lays ZeRO-3 out: a partition of ceil(numel / world) per parameter."""
    return [sum(Partition(prod(shape), world, 0).size for shape in group.values()) for group in param_shapes]


def _zero3_fits(param_shapes, world: int, sizes: list[int]) -> bool:
    """Whether ``param_shapes`` lays out the ZeRO-3 flat groups of ``sizes`` (one rank's): one
    flat group per group, as DeepSpeed saves them, or in all when cut otherwise."""
    takes = _zero3_takes(param_shapes, world)
    return takes == sizes if len(takes) == len(sizes) else sum(takes) == sum(sizes)


def _check_model_states(files: list[_PtFile], stage: int, world: int, flat: list[Stored]) -> None:
    """Raise unless the ranks' model states (ZeRO-3: one per rank) are of one save. Where their
    param_shapes differ, the file whose shapes do not fit the fp32 flat groups (``flat``, one
    rank's) is the one at fault."""
    found = _disagreement(files, [{key: f.state.get(key) for key in _MODEL_FACTS} for f in files])
    if found is None:
        return
    file, other, path, value, others = found
    why = ""
    if path[0] == "param_shapes" and stage == 3:
        sizes = [s.numel for s in flat]
        fits = [_zero3_fits([_shapes(f, g, f"param_shapes[{i}]") for i, g in enumerate(
            f.get(f.state, "param_shapes", list, "entry"))], world, sizes) for f in (file, other)]
        if fits == [True, False]:
            file, other, value, others = other, file, others, value
        if fits[0] != fits[1]:
            why = ", whose shapes fit the sizes of the fp32 flat groups (these do not)"
    raise _of_another_save(file, other, path, value, others, "model states", why)


def _check_steps(main: _PtFile, optim: _PtFile, optimizer_facts: dict, world: int) -> None:
    """Raise unless the model states (``main``) and the optimizer states (``optim``, whose facts
    every rank's share) are of one save: one DeepSpeed version, the ranks that saved, and no more
    optimizer steps than the engine took (``global_steps`` less the ``skipped_steps`` that fp16
    overflows skip). Model states of a later step than the optimizer states pass: a run resumed
    without its optimizer states (``load_optimizer_states=False``) writes the same."""
    again = "copy the save again (all of its files), or remove the files an older save left"
    versions = main.state.get("ds_version"), optim.state.get("ds_version")
    if all(isinstance(v, str) for v in versions) and versions[0] != versions[1]:
        raise main.invalid(f"written by DeepSpeed {brief(versions[0])}, but {optim.key} by {brief(versions[1])}: "
                           f"files of different saves; {again}")
    ranks = main.state.get("dp_world_size")
    if isinstance(ranks, int) and ranks != world:
        raise main.invalid(f"dp_world_size is {ranks} here, but {world} ranks saved optimizer states ({optim.key} "
                           f"and the others): files of different saves; {again}")
    taken, skipped, steps = main.state.get("global_steps"), main.state.get("skipped_steps"), optimizer_facts[_STEPS]
    steps = max(steps, default=None) if isinstance(steps, tuple) else steps
    if steps is not None and isinstance(taken, int) and isinstance(skipped, int) and steps > taken - skipped:
        raise main.invalid(f"global_steps is {taken} and skipped_steps {skipped} here, so the optimizer stepped at "
                           f"most {taken - skipped} times, but the base optimizer in {optim.key} has taken {steps} "
                           f"steps: model states of an earlier step than the optimizer states; {again}")


def _sliced(states: list[dict]) -> dict[str, int] | None:
    """ZeRO-1/2: the elements of each trainable parameter in the ranks' fp32 partitions, by the
    slice mappings DeepSpeed records (``param_slice_mappings``: per rank, per group, each
    parameter's ``fragment_address(numel, start)``); None where a rank records none."""
    sliced: dict[str, int] = {}
    for state in states:
        mappings = state.get("param_slice_mappings")
        if not isinstance(mappings, list):
            return None
        for group in mappings:
            for name, address in group.items() if isinstance(group, dict) else ():
                numel = address.state.get("numel") if isinstance(address, _Inert) and isinstance(
                    address.state, dict) else None
                if isinstance(numel, int) and not isinstance(numel, bool) and numel >= 0:
                    sliced[name] = sliced.get(name, 0) + numel
    return sliced


def _rank_files(folder: str, names: list[str], pattern: re.Pattern, what: str) -> dict[int, str]:
    """The files of ``names`` matching ``pattern``, by data-parallel rank (model parallel rank 0
    only: zload does not read tensor- or pipeline-parallel checkpoints)."""
    found: dict[int, str] = {}
    for name in names:
        m = pattern.fullmatch(name)
        if not m:
            continue
        rank, model_rank = int(m.group(1) or 0), int(m.group(2))
        if model_rank != 0:
            raise InvalidCheckpointError(f"{folder}: {name} is a model-parallel rank's file; zload reads "
                                         "data-parallel (ZeRO) checkpoints only", path=os.path.join(folder, name))
        if rank in found:
            raise InvalidCheckpointError(f"{folder}: both {found[rank]} and {name} hold rank {rank}'s {what}; "
                                         "remove the one an older save left", path=os.path.join(folder, name))
        found[rank] = name
    if sorted(found) != list(range(len(found))):
        # the first few missing, and how many more: a name may say rank 10**12, too many to list
        first = [rank for rank in range(min(max(found), len(found) + 8)) if rank not in found]
        missing = shortened(first, total=max(found) + 1 - len(found))
        raise CheckpointNotFoundError(f"{folder}: the {what} of rank(s) [{missing}] are missing (a save that did "
                                      "not finish, or files not copied from every node)", path=folder)
    return found


def _check_saved_ranks(folder: str, found: dict[int, str], saved: int, what: str, why: str) -> None:
    """Raise unless ``found`` (ranks 0 to n - 1, from ``_rank_files``) holds the files of exactly the
    ``saved`` ranks that saved; ``why`` says where that count comes from."""
    if len(found) < saved:
        raise CheckpointNotFoundError(f"{folder}: the {what} of rank(s) {ranks_listed(range(len(found), saved))} are "
                                      f"missing ({why}): a save that did not finish, or files not copied from "
                                      "every node", path=folder)
    if len(found) > saved:
        extra = [found[rank] for rank in range(saved, len(found))]
        raise InvalidCheckpointError(f"{folder}: {shortened(extra, 3)}: the {what} of rank(s) beyond the {saved} that "
                                     f"saved ({why}); remove the files an older save left",
                                     path=os.path.join(folder, extra[0]))


def _stored_map(file: _PtFile, mapping, what: str) -> dict[str, Stored]:
    if not isinstance(mapping, dict) or not all(isinstance(k, str) for k in mapping):
        raise file.invalid(f"{what} is not a mapping of names to tensors")
    return {name: file.tensor(value, f"{what} '{name}'") for name, value in mapping.items()}


def _shapes(file: _PtFile, mapping, what: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(mapping, dict) or not all(isinstance(k, str) for k in mapping):
        raise file.invalid(f"{what} is not a mapping of names to shapes")
    return {name: _shape(file, shape, f"{what} '{name}'") for name, shape in mapping.items()}


def read_layout(folder: str, table: FileTable) -> NativeLayout:
    """Open and unpickle (onto the meta device) the files of the tag folder ``folder`` into
    ``table``, and read their layout."""
    names = sorted(os.listdir(folder))
    optim = _rank_files(folder, names, _OPTIM_STATES, "optimizer states (*_optim_states.pt)")
    if not optim:
        raise CheckpointNotFoundError(f"{folder}: no *_optim_states.pt files, which hold the weights of a "
                                      "DeepSpeed ZeRO checkpoint (saved without optimizer states?)", path=folder)

    def load(name: str) -> _PtFile:
        return _PtFile(table.add(open_regular(os.path.join(folder, name)), name), name)

    def check_names(files: list[_PtFile]) -> None:
        """Each file of a rank bears (inside) the name it was saved under: a copy of another
        rank's file of the same sizes would otherwise load as silently wrong values."""
        for file in files:
            saved_as_a_rank_file = any(p.fullmatch(file.written_as) for p in (_OPTIM_STATES, _MODEL_STATES))
            if file.written_as != file.key and saved_as_a_rank_file:
                raise file.invalid(f"was written as {file.written_as} (torch.save names the archive inside after "
                                   "the file): another rank's file copied over this one? Copy the save again")

    optim_files = [load(optim[rank]) for rank in range(len(optim))]
    world = len(optim_files)
    states = [f.get(f.state, "optimizer_state_dict", dict, "entry") for f in optim_files]
    first = optim_files[0]
    stage = first.get(states[0], "zero_stage", int, "entry")
    if stage not in (1, 2, 3):
        raise first.invalid(f"ZeRO stage {stage}; zload reads ZeRO stages 1-3")
    counts = states[0].get("partition_count")  # ZeRO-1/2: one per parameter group
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or not all(isinstance(c, int) and c > 0 for c in counts):
        raise first.invalid(f"partition_count {brief(states[0].get('partition_count'))} is not a count of ranks")
    if len(set(counts)) > 1:
        raise first.invalid(f"parameter groups partitioned over {sorted(set(counts))} ranks: expert parallelism, "
                            "which zload does not read; convert it with DeepSpeed's ds_to_universal.py")
    _check_saved_ranks(folder, optim, max(counts), "optimizer states (*_optim_states.pt)",
                       f"partition_count in {first.key}")
    check_names(optim_files)
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat = []
    for f, state in zip(optim_files, states):
        groups = f.get(state, key, list, "entry")
        flat.append([f.tensor(g, f"{key}[{i}]") for i, g in enumerate(groups)])
    optimizer_facts = [_optimizer_facts(f, state, stage) for f, state in zip(optim_files, states)]
    found = _disagreement(optim_files, optimizer_facts)
    if found:
        raise _of_another_save(*found, "optimizer states")
    paddings = states[0].get("param_alignment_paddings") if stage < 3 else None
    if paddings is not None and not (isinstance(paddings, list) and all(
            isinstance(p, list) and all(isinstance(x, int) and x >= 0 for x in p) for p in paddings)):
        raise first.invalid("param_alignment_paddings is not a list of lists of sizes")

    model = _rank_files(folder, names, _MODEL_STATES, "model states (*_model_states.pt)")
    expected = world if stage == 3 else 1
    _check_saved_ranks(folder, model, expected, "model states (*_model_states.pt)",
                       f"a ZeRO-{stage} save by {world} ranks writes {expected}")
    model_files = [load(model[rank]) for rank in range(expected)]
    check_names(model_files)
    main = model_files[0]
    if main.state.get("ds_autoep_layers"):
        raise main.invalid("an AutoEP save (experts partitioned over expert groups), which zload does not read; "
                           "convert it with DeepSpeed's ds_to_universal.py")
    groups = main.get(main.state, "param_shapes", list, "entry")
    param_shapes = [_shapes(main, g, f"param_shapes[{i}]") for i, g in enumerate(groups)]
    frozen_shapes = _shapes(main, main.state.get("frozen_param_shapes") or {}, "frozen_param_shapes")
    frozen: dict[str, list[Stored]] = {}
    for f in model_files:
        for name, stored in _stored_map(f, f.state.get("frozen_param_fragments") or {},
                                        "frozen_param_fragments").items():
            frozen.setdefault(name, []).append(stored)
    module = _stored_map(main, main.get(main.state, "module", dict, "entry"), "module")
    buffer_names = main.get(main.state, "buffer_names", list, "entry")
    if not all(isinstance(n, str) for n in buffer_names):
        raise main.invalid("buffer_names is not a list of names")
    missing = [n for n in buffer_names if n not in module]
    if missing:
        raise main.invalid(f"buffers {missing[:5]} are listed in buffer_names but not in the module")
    shared = main.state.get("shared_params") or {}
    if not isinstance(shared, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items()):
        raise main.invalid("shared_params is not a mapping of names to names")
    _check_model_states(model_files, stage, world, flat[0])
    _check_steps(main, first, optimizer_facts[0], world)
    if stage == 1 and not frozen_shapes:
        # ZeRO-1 records no frozen parameters (zero_to_fp32 drops them), but its module holds them
        trainable = {n for group in param_shapes for n in group}
        for name, stored in module.items():
            if name not in trainable and name not in buffer_names and name not in shared:
                frozen_shapes[name], frozen[name] = stored.shape, [stored]
    return NativeLayout(stage, world, param_shapes, flat, paddings, frozen_shapes, frozen,
                        {n: module[n] for n in buffer_names}, module if stage < 3 else {},
                        {n: s.dtype for n, s in module.items()}, dict(shared), _sliced(states) if stage < 3 else None,
                        optim_files, main)


def read_native(folder: str, table: FileTable,
                module_weights: bool = False) -> tuple[NativeLayout, dict[str, TensorEntry]]:
    """The layout of the DeepSpeed checkpoint in tag folder ``folder`` and its tensors
    (``native_entries``), its files opened into ``table``; raises if they do not agree."""
    layout = read_layout(folder, table)
    entries, problems = native_entries(layout, module_weights)
    if problems:
        raise InvalidCheckpointError(f"{folder}: does not hold the layout of a ZeRO-{layout.stage} save by "
                                     f"{layout.world} ranks: {'; '.join(problems[:3])}", path=folder)
    return layout, entries


def open_native(source: str, folder: str, table: FileTable, module_weights: bool = False) -> CheckpointIndex:
    """Index the DeepSpeed checkpoint in tag folder ``folder`` (found from ``source``)."""
    layout, entries = read_native(folder, table, module_weights)
    return CheckpointIndex(source, tuple(table.files), entries, opened=table, root=absolute_path(folder),
                           layout=layout)


def converted_tensors(layout: NativeLayout, entries: dict[str, TensorEntry],
                      module_weights: bool = False) -> list[tuple[TensorEntry, str]]:
    """What a conversion of the checkpoint writes: each tensor's entry and its output dtype
    (safetensors code), in the module's order, as ``save_pretrained`` writes them.

    The values of DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``: trainable parameters
    as fp32 masters, frozen ones as stored, floating buffers as float32 (``entries`` without
    ``module_weights``); or, from entries with ``module_weights``, every tensor in the module's
    dtype (ZeRO-3 masters cast to it, which is what the engine's 16-bit weights are). Tied aliases
    are left out: the tensor is written once, under the name stored, as ``save_pretrained`` does.
    """
    from .dtypes import TORCH_DTYPES

    order = [n for n in layout.module_dtypes if n in entries] + [n for n in entries if n not in layout.module_dtypes]
    out = []
    for name in order:
        if name in layout.shared:
            continue
        entry = entries[name]
        if module_weights:
            dtype = layout.module_dtypes.get(name, entry.dtype)
        elif name in layout.buffers and TORCH_DTYPES[entry.dtype].is_floating_point:
            dtype = "F32"  # as zero_to_fp32 restores buffers saved in 16 bits
        else:
            dtype = entry.dtype
        out.append((entry, dtype))
    return out
