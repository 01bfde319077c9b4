"""Writing test checkpoints the way transformers lays them out (shards + index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


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
