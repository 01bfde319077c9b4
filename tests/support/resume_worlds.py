"""Training runs that save at one world size and resume at another, for the tests of
``load_into(engine, path, optimizer=True)`` and ``save(engine, path, optimizer=True)``.

A run trains a tiny tied Llama with two parameter groups (decay and no decay), frozen parameters
and DeepSpeed's WarmupLR scheduler; ``resume`` builds the same engine at another world size,
restores it one of two ways, and records what its optimizer holds
(``Resumed``) and the losses of the next steps. DeepSpeed's own resume, the reference, converts
the checkpoint with ``ds_to_universal`` and loads it with ``load_universal``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path
from typing import NamedTuple

import torch

from tests.support.harness import run_world
from tests.support.native_checkpoints import _llama_factory, ds_config, fp16_capability_claimed
from tests.support.zero3 import full_state, randomize

LEARNING_RATE = 1e-2
WEIGHT_DECAY = 0.1
NATIVE, ZLOAD = "native", "zload"  # the folders a run saves into


def config(stage: int, dtype: str, offload: bool, universal: bool = False, round_robin: bool = False) -> dict:
    """``native_checkpoints``' config, with a WarmupLR scheduler (and DeepSpeed's universal
    loading for the reference resume; ``round_robin``: ZeRO-1/2 lay each group's parameters out in
    its flat buffer in another order than the group's)."""
    out = ds_config(stage, dtype, offload, None)
    out["zero_optimization"]["round_robin_gradients"] = round_robin
    out["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LEARNING_RATE,
                                                         "warmup_num_steps": 5}}
    if universal:
        out["checkpoint"] = {"load_universal": True}
    return out


def is_frozen(name: str) -> bool:
    return "layers.0.mlp." in name


def engine(stage: int, dtype: str, offload: bool, seed: int, universal: bool = False, groups: str = "decay",
           also_frozen: str | None = None, thawed: bool = False, round_robin: bool = False):
    """A DeepSpeed engine of a tiny tied Llama (``layers.0.mlp`` frozen) with AdamW over two
    parameter groups (``groups="decay"``: matrices with weight decay, vectors without; ``"alike"``:
    the same two groups, both with weight decay; ``"swapped"``: "decay"'s groups in the other
    order; ``"one"``: one group). ``also_frozen``: the parameters whose names hold it are frozen too;
    ``thawed``: ``layers.0.mlp`` is trained too."""
    import deepspeed

    settings = config(stage, dtype, offload, universal, round_robin)
    factory = _llama_factory(True)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=settings):
            module = factory()
    else:
        module = factory()
    randomize(module, seed)
    for name, p in module.named_parameters():
        p.requires_grad_((thawed or not is_frozen(name)) and not (also_frozen and also_frozen in name))
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    matrices = {"params": [p for n, p in trainable if len(getattr(p, "ds_shape", p.shape)) > 1],
                "weight_decay": WEIGHT_DECAY}
    vectors = {"params": [p for n, p in trainable if len(getattr(p, "ds_shape", p.shape)) <= 1],
               "weight_decay": WEIGHT_DECAY if groups == "alike" else 0.0}
    parameter_groups = {"decay": [matrices, vectors], "alike": [matrices, vectors], "swapped": [vectors, matrices],
                        "one": [{"params": [p for _, p in trainable]}]}[groups]
    made, *_ = deepspeed.initialize(model=module, config=settings,
                                    optimizer=torch.optim.AdamW(parameter_groups, lr=LEARNING_RATE))
    return made


def train(made, steps: int, first: int) -> list[float]:
    """``steps`` steps on batches ``first``... (the same on every rank); the losses."""
    losses = []
    for step in range(first, first + steps):
        ids = torch.randint(0, 53, (1, 8), generator=torch.Generator().manual_seed(1000 + step))
        loss = made(input_ids=ids, labels=ids).loss
        made.backward(loss)
        made.step()
        losses.append(loss.item())
    return losses


def _capability(dtype: str):
    return fp16_capability_claimed() if dtype == "fp16" else contextlib.nullcontext()


def _save_body(folder, stage, dtype, offload, steps, groups, more, round_robin):
    """Train ``steps`` steps at this world size and save the same state twice: DeepSpeed's
    ``save_checkpoint`` into ``folder/NATIVE`` (then rank 0 converts it with ds_to_universal) and
    ``zload.save(optimizer=True)`` into ``folder/ZLOAD``; then record the engine and train ``more``
    steps (the run as it would have gone on)."""
    import torch.distributed as dist

    import zload

    with _capability(dtype):
        made = engine(stage, dtype, offload, seed=0, groups=groups, round_robin=round_robin)
        train(made, steps, 0)
        made.save_checkpoint(Path(folder) / NATIVE)
        zload.save(made, Path(folder) / ZLOAD, optimizer=True)
        dist.barrier()
        if dist.get_rank() == 0:
            to_universal(Path(folder) / NATIVE)
        dist.barrier()
        return _held(made, more, steps)


def to_universal(folder) -> None:
    """DeepSpeed's conversion of the newest checkpoint in ``folder`` (its ``ds_to_universal``, as
    ``python -m deepspeed.checkpoint.ds_to_universal`` runs it, here in this process), which
    writes ``folder/latest_universal``."""
    from deepspeed.checkpoint.ds_to_universal import main

    tag = (Path(folder) / "latest").read_text().strip()
    arguments = argparse.Namespace(input_folder=str(Path(folder) / tag),
                                   output_folder=str(Path(folder) / f"{tag}_universal"), num_extract_workers=1,
                                   num_merge_workers=1, keep_temp_folder=False, strict=True,
                                   inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(arguments)


class Resumed(NamedTuple):
    """What one rank's resumed engine holds, and the losses of the steps after."""

    masters: list[torch.Tensor]  # per flat fp32 partition
    states: list[dict[str, torch.Tensor]]  # per flat: exp_avg, exp_avg_sq
    steps: list[float | None]  # per flat
    groups: list[dict]  # hyperparameters
    weights: dict[str, torch.Tensor]  # whole 16-bit weights
    loss_scale: float
    scheduler: dict | None
    global_steps: int
    losses: list[float]
    steps_after: list[float | None]  # per flat, after the steps


def optimizer_flats(made) -> list[torch.Tensor]:
    optimizer = made.optimizer
    return list(getattr(optimizer, "fp32_partitioned_groups_flat", None) or optimizer.single_partition_of_fp32_groups)


def _held(made, steps: int, first: int) -> Resumed:
    optimizer = made.optimizer
    flats = optimizer_flats(made)
    state = [optimizer.optimizer.state.get(f, {}) for f in flats]
    step = [float(s["step"]) if "step" in s else None for s in state]
    held = Resumed([f.detach().clone() for f in flats],
                   [{k: v.detach().clone() for k, v in s.items() if k != "step"} for s in state], step,
                   [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups],
                   full_state(made.module), float(optimizer.loss_scaler.cur_scale),
                   made.lr_scheduler.state_dict() if made.lr_scheduler is not None else None, made.global_steps, [],
                   [])
    losses = train(made, steps, first)
    after = [float(optimizer.optimizer.state[f]["step"]) for f in flats]
    return held._replace(losses=losses, steps_after=after)


def _resume_body(folder, stage, dtype, offload, how, steps, first, groups, round_robin):
    """Build the engine at this world size as the run began, restore it (``how``: "zload" from
    ``folder``; "universal": DeepSpeed's universal checkpoint in ``folder``), and record it.

    From the run's first weights, not others: DeepSpeed's universal resume leaves the frozen
    parameters as they are (it reads parameters from their optimizer states only), which only
    those weights make right; the trained ones differ from them."""
    import zload

    with _capability(dtype):
        made = engine(stage, dtype, offload, seed=0, universal=how == "universal", groups=groups,
                      round_robin=round_robin)
        if how == "universal":
            made.load_checkpoint(folder)
        else:
            zload.load_into(made, folder, optimizer=True)
        return _held(made, steps, first)


def save(folder, world: int, stage: int, dtype: str, offload: bool = False, steps: int = 2,
         groups: str = "decay", more: int = 2, round_robin: bool = False) -> list[Resumed]:
    """Train and save at ``world`` (``_save_body``); what each rank held when it saved, and the
    losses of the ``more`` steps after."""
    return run_world(world, _save_body, str(folder), stage, dtype, offload, steps, groups, more, round_robin)


def resume(folder, world: int, stage: int, dtype: str, offload: bool = False, how: str = "zload",
           steps: int = 2, first: int = 2, groups: str = "decay", round_robin: bool = False) -> list[Resumed]:
    """Resume at ``world`` from what ``save`` wrote into ``folder`` (``how``: "universal" from
    DeepSpeed's checkpoint through its universal checkpoint, "native" by zload from DeepSpeed's
    checkpoint, "zload" from zload's save)."""
    where = Path(folder) / (ZLOAD if how == "zload" else NATIVE)
    return run_world(world, _resume_body, str(where), stage, dtype, offload, how, steps, first, groups, round_robin)


def assert_same(actual: list[Resumed], expected: list[Resumed], what: str) -> None:
    """Bit for bit: every rank's masters, states, steps, hyperparameters, weights, loss scale,
    scheduler, counters and next losses."""
    for rank, (a, e) in enumerate(zip(actual, expected)):
        where = f"{what}, rank {rank}"
        assert len(a.masters) == len(e.masters), where
        for k, (x, y) in enumerate(zip(a.masters, e.masters)):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), f"{where}: fp32 masters of flat {k}"
        for k, (x, y) in enumerate(zip(a.states, e.states)):
            assert x.keys() == y.keys(), f"{where}: states of flat {k}: {sorted(x)} != {sorted(y)}"
            for key in x:
                assert torch.equal(x[key].view(torch.int32), y[key].view(torch.int32)), f"{where}: {key} of flat {k}"
        assert a.steps == e.steps, f"{where}: steps {a.steps} != {e.steps}"
        assert a.groups == e.groups, f"{where}: hyperparameters {a.groups} != {e.groups}"
        assert a.weights.keys() == e.weights.keys(), where
        for name in a.weights:
            assert torch.equal(a.weights[name], e.weights[name]), f"{where}: 16-bit weights of {name}"
        assert (a.loss_scale, a.scheduler, a.global_steps) == (e.loss_scale, e.scheduler, e.global_steps), where
        assert a.losses == e.losses, f"{where}: losses {a.losses} != {e.losses}"


def held_now(made) -> dict:
    """Everything of ``made`` a failed resume must leave as it was, on this rank: its fp32
    masters, optimizer states and hyperparameters, and its own weights (partitions or whole)."""
    optimizer = made.optimizer
    flats = optimizer_flats(made)
    return {"masters": [f.detach().clone() for f in flats],
            "states": [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                        for k, v in optimizer.optimizer.state.get(f, {}).items()} for f in flats],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups],
            "weights": {n: getattr(p, "ds_tensor", p).detach().clone() for n, p in made.module.named_parameters()},
            "global_steps": made.global_steps}


def same_held(a, b) -> bool:
    def same(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, list):
            return isinstance(y, list) and len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        return x == y

    return same(a, b)
