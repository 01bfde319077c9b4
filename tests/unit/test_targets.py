"""Target collection: every parameter and buffer of a model under the names the model itself
gives them (no processes, no files)."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from zload.model.targets import FULL, collect_targets


def test_targets_name_every_alias_in_module_order_with_buffer_persistence():
    """``collect_targets`` sees what ``named_parameters(remove_duplicate=False)`` and ``state_dict``
    see: a submodule shared under two names, a weight tied across modules, unset entries, and
    which buffers are persistent."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 3)
            self.register_buffer("stat", torch.zeros(3))
            self.register_buffer("scratch", torch.zeros(2), persistent=False)
            self.register_parameter("unset", None)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = Block()
            self.again = self.first  # the same block under a second name
            self.second = Block()
            self.head = torch.nn.Linear(2, 3, bias=False)
            self.head.weight = self.second.lin.weight  # tied
            self.register_module("absent", None)

    model = Model()
    targets = collect_targets(model)
    params, buffers = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        buffers.setdefault(id(b), []).append(name)
    assert [t.names for t in targets] == [tuple(n) for n in [*params.values(), *buffers.values()]]
    assert all(t.kind == FULL for t in targets)
    assert {t.name: t.required for t in targets if t.name in dict(model.named_buffers())} == \
        {"first.stat": True, "first.scratch": False, "second.stat": True, "second.scratch": False}
    assert {n for t in targets if t.required for n in t.names} == set(model.state_dict(keep_vars=True))


def test_targets_carry_their_tensors_torch_dtypes():
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    model.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    assert [(t.name, t.dtype) for t in collect_targets(model)] == \
        [("weight", torch.bfloat16), ("bias", torch.bfloat16), ("steps", torch.int64)]


def test_targets_follow_the_modules_own_named_parameters():
    """A module may override how it names its members (torch's checkpoint_wrapper strips its
    wrapped module's name; PEFT's LoRA MultiheadAttention re-registers weights in named_modules):
    parameters are named as the model's own ``named_parameters`` names them."""
    model = checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)))
    names = [n for t in collect_targets(model) for n in t.names]
    assert names[:4] == [n for n, _ in model.named_parameters(remove_duplicate=False)] == \
        ["0.weight", "0.bias", "1.weight", "1.bias"]
    patched = torch.nn.Sequential(torch.nn.Linear(2, 3))  # on the instance, not the class
    renamed = patched.named_parameters
    patched.named_parameters = lambda *a, **k: ((n.replace("0.", "first."), p) for n, p in renamed(*a, **k))
    assert [t.names for t in collect_targets(patched)] == [("first.weight",), ("first.bias",)]
