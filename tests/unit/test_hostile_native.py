"""Hostile DeepSpeed checkpoints, what needs no world: unpickling allocates no more than the pickle
itself holds, what ``torch.save`` writes is not refused, and a file name's rank of 10**12 is no
list of 10**12 ranks. Tampered checkpoints loaded on every rank:
tests/distributed/test_hostile_native.py."""

from __future__ import annotations

import io
import pickle
import re
import zipfile

import pytest
import torch
from torch import nn

import zload


transformers = pytest.importorskip("transformers")


def _binunicode(text: bytes) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text


# --------------------------------------------------------------------------------------------
# pickles whose unpickling would allocate, nest or iterate without bound


def _global(name: str) -> bytes:
    module, _, attribute = name.rpartition(".")
    return pickle.GLOBAL + module.encode() + b"\n" + attribute.encode() + b"\n"


def _int(n: int) -> bytes:
    return pickle.BININT + n.to_bytes(4, "little", signed=True)


# the storage of data/0, on the meta device, and a 2**30-element tensor over it
_STORAGE = (pickle.MARK + _binunicode(b"storage") + _global("torch.FloatStorage") + _binunicode(b"0")
            + _binunicode(b"cpu") + _int(4) + pickle.TUPLE + pickle.BINPERSID)
_TENSOR = (_global("torch._utils._rebuild_tensor_v2") + pickle.MARK + _STORAGE + _int(0) + _int(1 << 30)
           + pickle.TUPLE1 + _int(1) + pickle.TUPLE1 + pickle.NEWFALSE + _global("collections.OrderedDict")
           + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.TUPLE + pickle.REDUCE)
_BYTEARRAY = _global("builtins.bytearray") + _int(1 << 30) + pickle.TUPLE1 + pickle.REDUCE  # 1 GiB of zeros


def _hex_chain(times: int) -> bytes:
    """``_codecs.encode`` applied ``times`` times with 'hex' to 2 bytes: 2**(times + 1) bytes."""
    encode = _global("_codecs.encode") + pickle.BINPUT + b"\x00"
    calls = pickle.BINGET + b"\x00"
    return (encode + calls * times + _binunicode(b"ab") + _binunicode(b"latin1") + pickle.TUPLE2 + pickle.REDUCE
            + (_binunicode(b"hex") + pickle.TUPLE2 + pickle.REDUCE) * times)


_HOSTILE_PICKLES = {
    # what torch's weights_only unpickler would allocate, from the pickle's few bytes
    "bytearray(1 << 30)": (_BYTEARRAY, "calls builtins.bytearray, which would allocate 1,073,741,824 bytes"),
    "encode 'hex' 27 times": (_hex_chain(27), "calls _codecs.encode with the encoding 'hex'"),
    "torch.Tensor(1 << 28)": (_global("torch.Tensor") + _int(1 << 28) + pickle.TUPLE1 + pickle.REDUCE,
                              "calls torch.Tensor, which allocates the size it is given"),
    "torch.FloatTensor(1 << 28)": (_global("torch.FloatTensor") + _int(1 << 28) + pickle.TUPLE1 + pickle.REDUCE,
                                   "calls torch.FloatTensor, which allocates"),
    "UntypedStorage.__new__(1 << 30)": (_global("torch.storage.UntypedStorage") + _int(1 << 30) + pickle.TUPLE1
                                        + pickle.NEWOBJ, "calls torch.storage.UntypedStorage, which allocates"),
    "_rebuild_from_type_v2(bytearray, (1 << 30,))": (
        _global("torch._tensor._rebuild_from_type_v2") + pickle.MARK + _global("builtins.bytearray")
        + _global("builtins.bytearray") + _int(1 << 30) + pickle.TUPLE1 + pickle.EMPTY_DICT + pickle.TUPLE
        + pickle.REDUCE, "calls builtins.bytearray, which would allocate 1,073,741,824 bytes"),
    "set(a copy) 20 times": (pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.MARK + pickle.NONE * 1000
                             + pickle.APPENDS + (_global("builtins.set") + pickle.BINGET + b"\x00" + pickle.TUPLE1
                                                 + pickle.REDUCE) * 20,
                             "calls builtins.set, which would allocate 1,000 bytes or items (2,000 by its calls"),
    # what it would iterate over, whatever its size
    "set(tensor)": (_global("builtins.set") + _TENSOR + pickle.TUPLE1 + pickle.REDUCE,
                    "calls builtins.set on an object built by a call"),
    "OrderedDict BUILD from a tensor": (_global("collections.OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
                                        + _TENSOR + pickle.BUILD, "sets an object's state from one built by a call"),
    "bytearray(*tensor)": (_global("builtins.bytearray") + _TENSOR + pickle.REDUCE,
                           "calls builtins.bytearray with arguments that are not a tuple"),
    # nests that zload's walks of what it unpickles would recurse through
    "a list 150,000 deep": (pickle.EMPTY_LIST * 150_000 + pickle.BININT1 + b"\x07" + pickle.APPEND * 150_000,
                            "nests objects more than 100 deep"),
    "a list inside itself": (pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.BINGET + b"\x00" + pickle.APPEND,
                             "places an object inside itself"),
    # lists 0 and 1, list 1 put in a tuple, then list 0 in list 1: the tuple's nesting changed after it was counted
    "a list changed after it was placed": (
        pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.EMPTY_LIST + pickle.BINPUT + b"\x01" + pickle.BINGET
        + b"\x01" + pickle.TUPLE1 + pickle.BINGET + b"\x01" + pickle.BINGET + b"\x00" + pickle.APPEND,
        "changes an object after placing it inside another"),
}


@pytest.mark.parametrize("case", _HOSTILE_PICKLES)
def test_what_unpickling_could_allocate_is_bounded_by_the_pickle(case):
    """The walk of a pickle's opcodes, before torch unpickles it, refuses every call torch's
    weights_only unpickler allows that could allocate more than the pickle's own size, iterate
    an object of any size, or nest objects deeper than zload's walks recurse."""
    from zload.checkpoint.native import check_pickle

    body, why = _HOSTILE_PICKLES[case]
    with pytest.raises(ValueError, match=re.escape(why)):
        check_pickle(pickle.PROTO + b"\x02" + body + pickle.STOP)


def test_what_torch_save_writes_is_not_refused():
    """bytes (written as ``_codecs.encode(text, 'latin1')``), bytearrays, sets, Counters,
    OrderedDicts, shapes, tensors with attributes, parameters and shared objects."""
    from collections import Counter, OrderedDict

    from zload.checkpoint.native import check_pickle

    shared = [1, 2]
    tensor = torch.zeros(3)
    tensor.note = "attribute"
    value = {"bytes": b"\x00\xff" * 100, "array": bytearray(b"abc"), "set": {1, 2}, "counter": Counter("aab"),
             "ordered": OrderedDict(a=1), "shape": torch.Size([2, 3]), "tensor": tensor,
             "parameter": torch.nn.Parameter(torch.ones(2)), "shared": (shared, shared), "complex": 1j}
    buffer = io.BytesIO()
    torch.save(value, buffer)
    with zipfile.ZipFile(buffer) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("data.pkl")]
        check_pickle(archive.read(name))


def test_the_first_missing_ranks_of_a_checkpoint_naming_rank_10_to_the_12_are_named(tmp_path):
    """A hostile file name's rank: no list of every rank below it (it was one: a hang, then
    gigabytes of message)."""
    for rank in (0, 10**12):
        for kind in ("optim", "model"):
            (tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt").touch()
    with pytest.raises(zload.CheckpointNotFoundError) as refused:
        zload.load_into(nn.Linear(2, 2), tmp_path)
    assert "of rank(s) [1, 2, 3, 4, 5, 6, 7, 8, ... (999999999991 more)] are missing" in str(refused.value)
