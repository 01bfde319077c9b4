"""Seeded fuzzing of what zload reads before anything else: safetensors headers and index files.

Each case mutates a real checkpoint (written by safetensors itself): flipped bytes, wrong length
fields, deep nesting, shifted or odd offsets and shapes, duplicated or renamed keys, index
entries pointing elsewhere. The outcome must be a ``ZloadError`` or a correct load, nothing else:
when zload accepts a file, safetensors must accept it too and both must read the same tensors.
Hundreds of cases run against the index code in this process; a handful go through
``load_into`` at world size 2.
"""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import zload
from zload.loading.execute import read_tensor

from tests.support.checkpoints import save_sharded

CASES = 400


def _original(folder: Path) -> Path:
    state = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
             "c": torch.randn(2, 2).to(torch.bfloat16), "e": torch.zeros(0), "s": torch.tensor(2.5)}
    path = folder / "model.safetensors"
    save_file(state, str(path), metadata={"format": "pt", "note": "fuzz"})
    return path


def _split(raw: bytes) -> tuple[int, bytes, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return length, raw[8:8 + length], raw[8 + length:]


def _json_mutation(rng: random.Random, header: bytes) -> bytes:
    """A mutation of the header's JSON that keeps it (mostly) JSON."""
    parsed = json.loads(header)
    names = [n for n in parsed if n != "__metadata__"]
    name = rng.choice(names)
    entry = parsed[name]
    kind = rng.randrange(12)
    if kind == 0:
        entry["data_offsets"][rng.randrange(2)] += rng.choice([-9, -1, 1, 4, 8, 1 << 40])
    elif kind == 1:
        entry["data_offsets"] = rng.choice([[-0.0, 8], [0, 2**64], [2**64 - 1, 2**64 - 1], "0,8", [0], None])
    elif kind == 2:
        entry["shape"] = rng.choice([[], [0], [-1], [2**63, 2**63, 0], [1.0], [True], "3", [2**64]])
    elif kind == 3:
        entry["dtype"] = rng.choice(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "f32", "", 7])
    elif kind == 4:
        entry[rng.choice(["extra", "dtype", "shape"])] = [[[]]]
    elif kind == 5:
        del parsed[name]
    elif kind == 6:
        parsed[name + "\ud800"] = parsed.pop(name)
    elif kind == 7:
        parsed["__metadata__"] = rng.choice([{"k": 1}, ["x"], None, {"k": "v" * 1000}, {"\udc80": "x"}])
    elif kind == 8:
        depth = rng.choice([50, 5000, 200_000])
        text = json.dumps(parsed)
        return (text[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}").encode()
    elif kind == 9:
        text = json.dumps(parsed)
        return (text[:-1] + ", " + json.dumps(name) + ": " + json.dumps(entry) + "}").encode()
    elif kind == 10:
        other = rng.choice(names)
        parsed[name]["data_offsets"], parsed[other]["data_offsets"] = \
            parsed[other]["data_offsets"], parsed[name]["data_offsets"]
    else:
        text = json.dumps(parsed).replace('"data_offsets": [0,', '"data_offsets": [-0,')
        return text.encode()
    return json.dumps(parsed).encode()


def mutate_file(rng: random.Random, raw: bytes) -> bytes:
    length, header, data = _split(raw)
    kind = rng.randrange(8)
    if kind == 0:  # flip bytes of the header
        header = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            header[rng.randrange(len(header))] ^= 1 << rng.randrange(8)
        return raw[:8] + bytes(header) + data
    if kind == 1:  # a wrong length field
        length = rng.choice([0, 1, length - 1, length + 1, length + 8, len(raw), 2**63, 100_000_001])
        return struct.pack("<Q", length) + header + data
    if kind == 2:  # cut short or lengthened
        return raw[:rng.randrange(len(raw))] if rng.random() < 0.7 else raw + b"\0" * rng.randint(1, 9)
    if kind == 3:  # flip bytes of the data: still a valid file, other values
        data = bytearray(data)
        data[rng.randrange(len(data))] ^= 0xFF
        return raw[:8 + length] + bytes(data)
    text = _json_mutation(rng, header)
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def mutate_index(rng: random.Random, index_text: str, shards: list[str]) -> str:
    index = json.loads(index_text)
    weight_map = index["weight_map"]
    name = rng.choice(sorted(weight_map))
    kind = rng.randrange(11)
    if kind == 9:  # harmless: the same shard, spelt differently
        weight_map.update({n: "./" + s for n, s in weight_map.items() if s == weight_map[name]})
    elif kind == 10:  # harmless: metadata zload does not use
        index["metadata"] = {"total_size": rng.choice([0, -1, "big"])}
    elif kind == 0:
        weight_map[name] = rng.choice(["../x.safetensors", "/etc/passwd", "/proc/self/environ", "",
                                       "sub/../../" + shards[0], ".", "nothing.safetensors"])
    elif kind == 1:
        weight_map[name] = rng.choice([s for s in shards if s != weight_map[name]] or shards)
    elif kind == 2:
        del weight_map[name]
    elif kind == 3:
        weight_map["ghost"] = rng.choice(shards)
    elif kind == 4:
        weight_map[name] = rng.choice([3, None, ["a"], {"x": 1}])
    elif kind == 5:
        index["metadata"] = "[" * 100_000 + "]" * 100_000
        text = json.dumps(index)
        return text.replace('"' + index["metadata"] + '"', index["metadata"])
    elif kind == 6:
        index = rng.choice([[1, 2], "weight_map", {"metadata": {}}, {"weight_map": []}])
    elif kind == 7:
        return index_text[:rng.randrange(len(index_text))]
    else:
        weight_map["./" + name] = weight_map.pop(name)
    return json.dumps(index)


def _agrees_with_safetensors(index) -> None:
    """Every file zload accepted, safetensors accepts; every tensor has its dtype, shape and bytes."""
    by_file: dict[str, list] = {}
    for entry in index.tensors.values():
        by_file.setdefault(entry.file, []).append(entry)
    for file in index.files:
        with safe_open(index.path(file), "pt") as f:
            assert sorted(f.keys()) == sorted(e.name for e in by_file.get(file, []))
            for entry in by_file.get(file, []):
                expected = f.get_tensor(entry.name)
                got = read_tensor(index.opened, entry)
                assert got.dtype == expected.dtype and got.shape == expected.shape
                assert torch.equal(got.view(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


def _outcome(path) -> str:
    """Open and check one mutated checkpoint; 'refused: <class>' or 'accepted'."""
    try:
        index = zload.open_checkpoint(path)
    except zload.ZloadError as e:
        assert str(path) in str(e) or os.path.dirname(str(path)) in str(e), e
        return f"refused: {type(e).__name__}"
    with index:
        _agrees_with_safetensors(index)
    return "accepted"


def test_mutated_headers_are_refused_or_read_as_safetensors_reads_them(tmp_path):
    original = _original(tmp_path).read_bytes()
    rng = random.Random(20261203)
    outcomes = {}
    for case in range(CASES):
        path = tmp_path / f"case{case}.safetensors"
        path.write_bytes(mutate_file(rng, original))
        outcome = _outcome(path)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        path.unlink()
    assert set(outcomes) == {"accepted", "refused: InvalidCheckpointError"}, outcomes  # a ValueError too
    assert outcomes["refused: InvalidCheckpointError"] > CASES // 2, outcomes


def test_mutated_indexes_are_refused_or_read_as_safetensors_reads_them(tmp_path):
    state = {f"layer{k}.w": torch.randn(k + 1, 3) for k in range(6)}
    folder = save_sharded(state, tmp_path / "ckpt", shards=3)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    index_path = folder / "model.safetensors.index.json"
    index_text = index_path.read_text()
    rng = random.Random(31)
    outcomes = {}
    for _ in range(CASES // 2):
        index_path.write_text(mutate_index(rng, index_text, shards))
        outcome = _outcome(folder)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert "accepted" in outcomes and "refused: InvalidCheckpointError" in outcomes, outcomes
    assert set(outcomes) <= {"accepted", "refused: InvalidCheckpointError", "refused: CheckpointNotFoundError"}, outcomes
