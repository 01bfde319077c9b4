"""Writing test checkpoints the way transformers lays them out (shards + index)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_sharded(state: dict[str, torch.Tensor], folder: Path, shards: int) -> Path:
    """``model-0000k-of-0000N.safetensors`` files plus ``model.safetensors.index.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(state)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[k::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def read_all(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder``; none may be in two files."""
    saved = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        part = load_file(str(f))
        assert not saved.keys() & part.keys(), f"{f.name}: a tensor written twice"
        saved.update(part)
    return saved


def metadata_with_digest(path) -> dict[str, str]:
    """The header's __metadata__ of a file zload.save wrote, after checking the data digest it
    records against the file's bytes (computed here independently of zload: the SHA-256 of the
    concatenated SHA-256s of the data area's 16 MiB blocks)."""
    raw = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    metadata = json.loads(raw[8:8 + length])["__metadata__"]
    data, block = raw[8 + length:], 16 << 20
    blocks = b"".join(hashlib.sha256(data[i:i + block]).digest() for i in range(0, len(data), block))
    assert metadata.pop("zload_data_digest") == "sha256/16MiB:" + hashlib.sha256(blocks).hexdigest(), path
    return metadata


BIN_STATE = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(4, dtype=torch.bfloat16)}


def bin_weights_folder(folder: Path, kind: str) -> Path:
    """A folder of PyTorch ``.bin`` weights as ``save_pretrained(safe_serialization=False)`` writes
    them: one ``pytorch_model.bin`` (``kind`` "single") or two shards and their index ("sharded"),
    with a config and a Trainer's ``training_args.bin``, which holds no weights."""
    folder.mkdir()
    if kind == "single":
        torch.save(BIN_STATE, folder / "pytorch_model.bin")
    else:
        names = {"pytorch_model-00001-of-00002.bin": ["a.weight"], "pytorch_model-00002-of-00002.bin": ["b.bias"]}
        for file, keys in names.items():
            torch.save({k: BIN_STATE[k] for k in keys}, folder / file)
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"weight_map": {k: f for f, keys in names.items() for k in keys}}))
    (folder / "config.json").write_text("{}")
    (folder / "training_args.bin").write_bytes(b"not weights")
    return folder
