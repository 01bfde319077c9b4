"""Small models with the shapes and structures that break loaders."""

from __future__ import annotations

import torch
from torch import nn


class Awkward(nn.Module):
    """Sizes that do not divide by world sizes 2, 3, 4; some smaller than the world; empty ones."""

    def __init__(self):
        super().__init__()
        self.tiny = nn.Parameter(torch.randn(1))
        self.empty = nn.Parameter(torch.randn(0))
        self.empty_rows = nn.Parameter(torch.randn(3, 0))
        self.odd = nn.Linear(7, 5)
        self.cube = nn.Parameter(torch.randn(13, 17, 3))
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("scale", torch.randn(3))
        self.register_buffer("temperature", torch.tensor(2.0))  # 0-d (DeepSpeed cannot partition 0-d params)
        self.register_buffer("position_ids", torch.arange(6), persistent=False)


class ParamsOnly(nn.Module):
    """Only ZeRO-3 parameters, so every byte read should be a partition byte."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(31, 29)
        self.b = nn.Parameter(torch.randn(2))
        self.c = nn.Parameter(torch.randn(1001))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight


class LayerScale(nn.Module):
    """timm's LayerScale: the parameter OpenVLA renames after construction."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.ls1 = LayerScale(dim)


class TinyViT(nn.Module):
    def __init__(self, dim: int = 10, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))


def ls_apply_patch(ls_module: LayerScale) -> None:
    """OpenVLA's patch, verbatim in effect: rename ``gamma`` to ``scale_factor`` after zero.Init."""
    ls_module.scale_factor = nn.Parameter(ls_module.gamma.clone())
    ls_module.forward = lambda x: x * ls_module.scale_factor
    del ls_module.gamma


def patch_layerscales(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, LayerScale):
            ls_apply_patch(module)


def patched_tiny_vit() -> nn.Module:
    """A ``TinyViT`` after OpenVLA's LayerScale patch: the checkpoint of a model with orphans."""
    model = TinyViT()
    patch_layerscales(model)
    return model


def state_with_seed(factory, seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A checkpoint-ready state dict of ``factory()`` with values unlike any default init."""
    torch.manual_seed(seed)
    model = factory()
    state = {}
    for name, t in model.state_dict().items():
        if t.is_floating_point():
            t = torch.randn(t.shape) * 3
            t = t.to(dtype)
        else:
            t = t + 1000
        state[name] = t.contiguous()
    return state


def tiny_llama_config(tie: bool = False):
    """A Llama small enough for many multi-rank tests, with sizes that do not divide by 2, 3 or 4
    (intermediate 19, vocabulary 53) and grouped-query attention."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=53, hidden_size=24, intermediate_size=19, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=tie)
