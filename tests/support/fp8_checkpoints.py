"""FP8 checkpoints made with the reference block quantisation (DeepSeek-V3's ``weight_quant``:
one scale per block, ``amax / finfo.max``, values ``(w / scale).to(fp8)``), and the reference
dequantisation every zload load is compared with bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def quantize(weight: torch.Tensor, block: tuple[int, int] | None, dtype=torch.float8_e4m3fn):
    """(fp8 weight, float32 scales): one scale per ``block`` of the last two dims, or one for the
    whole tensor when ``block`` is None."""
    w = weight.to(torch.float32)
    fmax = torch.finfo(dtype).max
    if block is None:
        scale = (w.abs().max().clamp(min=1e-12) / fmax).reshape(())
        return (w / scale).to(dtype), scale
    expanded = _expanded(_block_amax(w, block) / fmax, w.shape, block)
    return (w / expanded).to(dtype), _block_amax(w, block) / fmax


def _block_amax(w: torch.Tensor, block) -> torch.Tensor:
    rows, columns = w.shape[-2:]
    b_r, b_c = block
    grid = (-(-rows // b_r), -(-columns // b_c))
    padded = torch.zeros(*w.shape[:-2], grid[0] * b_r, grid[1] * b_c)
    padded[..., :rows, :columns] = w.abs()
    blocks = padded.reshape(*w.shape[:-2], grid[0], b_r, grid[1], b_c)
    return blocks.amax(dim=(-3, -1)).clamp(min=1e-12)


def _expanded(scale: torch.Tensor, shape, block) -> torch.Tensor:
    rows, columns = shape[-2:]
    return scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :columns]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The reference: ``weight.to(float32) * scale`` expanded per block (float32)."""
    if block is None:
        return weight.to(torch.float32) * scale.to(torch.float32)
    return weight.to(torch.float32) * _expanded(scale.to(torch.float32), weight.shape, block)


def quantized_name(name: str, tensor: torch.Tensor) -> bool:
    """Which tensors an FP8 model stores quantised: the linear layers' weights."""
    return tensor.dim() == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name


def write_fp8(source: Path, folder: Path, block: tuple[int, int] | None, dtype=torch.float8_e4m3fn,
              scale_suffix: str = "_scale_inv", block_in_config: bool = True) -> dict[str, torch.Tensor]:
    """``source`` (a save_pretrained folder, one file) quantised into ``folder`` (config.json with
    its ``quantization_config``); returns the reference dequantised state (float32)."""
    state = load_file(str(source / "model.safetensors"))
    folder.mkdir(parents=True, exist_ok=True)
    stored, reference = {}, {}
    for name, tensor in state.items():
        if quantized_name(name, tensor):
            weight, scale = quantize(tensor, block, dtype)
            stored[name], stored[name + scale_suffix] = weight, scale
            reference[name] = dequantize(weight, scale, block)
        else:
            stored[name] = reference[name] = tensor
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block_in_config:
        config["quantization_config"]["weight_block_size"] = None if block is None else list(block)
    (folder / "config.json").write_text(json.dumps(config))
    return reference


def write_reference(source: Path, folder: Path, reference: dict[str, torch.Tensor]) -> None:
    """The dequantised values as a plain float32 checkpoint (config without quantisation), for
    ``from_pretrained`` to rename as the model names them."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(reference, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text((source / "config.json").read_text())


def _json(value):
    return lambda path: path.write_text(json.dumps(value))


# config.json files zload cannot read a block size from: kind -> (make one at a path, what the
# problem says). Each refuses an FP8 load, and none matters to a checkpoint without FP8 weights.
BAD_CONFIGS = {
    "nested 200,000 deep": (lambda path: path.write_text("[" * 200_000 + "]" * 200_000),
                            "not JSON zload reads: the document nests more than 64 levels deep"),
    "not JSON": (lambda path: path.write_text('{"quantization_config": '), "not JSON zload reads"),
    "a directory": (lambda path: path.mkdir(), "is a directory, not a regular file"),
    "a FIFO": (os.mkfifo, "is a FIFO, not a regular file"),
    "a dangling link": (lambda path: path.symlink_to(path.with_name("nowhere.json")), "cannot read"),
    "a JSON list": (_json([1, 2]), "holds [1, 2], not a JSON object"),
    "quantization_config a string": (_json({"quantization_config": "fp8"}),
                                     "quantization_config 'fp8' is not a JSON object"),
    "a block of 2**70": (_json({"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 2**70]}}),
                         "weight_block_size [1, 1180591620717411303424] is not two positive integers below 2**63"),
}
