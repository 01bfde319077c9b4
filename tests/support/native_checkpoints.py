"""DeepSpeed's own checkpoints (``engine.save_checkpoint``) as fixtures for the tests of zload's
reader of them, with what the live engine held when it wrote them.

``make_native_checkpoint`` trains a tiny model for a real step (or several, or none, some of them
skipped for an fp16 overflow) in a world of real ranks and lets DeepSpeed write its checkpoint;
the rank body also records, from the live engine, the whole module-dtype weights
(``GatheredParameters``) and the fp32 masters (``safe_get_full_fp32_param``). Those go to a
sibling folder, so the checkpoint folder holds only what DeepSpeed wrote.
``deepspeed_reference`` is DeepSpeed's own offline reader of the same folder.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.support.harness import run_world
from tests.support.models import tiny_llama_config
from tests.support.zero3 import full_state, randomize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LEARNING_RATE = 1e-2


class NativeCase(NamedTuple):
    folder: Path  # what engine.save_checkpoint was given: holds `latest` and the tag folder
    tag_folder: Path  # folder / f"global_step{steps}"
    world: int
    stage: int
    dtype: str  # "bf16", "fp16" or "fp32"
    module_weights: dict[str, torch.Tensor]  # every parameter name (tied aliases too) and persistent buffer
    masters: dict[str, torch.Tensor]  # fp32 masters of the trainable parameters, by canonical name
    param_names: list[str]  # canonical names, in module order
    frozen_names: list[str]
    buffer_names: list[str]  # persistent buffers
    tied: dict[str, str]  # alias -> canonical name


class AwkwardTrainable(nn.Module):
    """``models.Awkward`` made trainable: sizes that divide by neither 2, 3 nor 4, a parameter
    smaller than any world, floating and integer buffers (one 0-d, one not persistent). No empty
    parameters: ZeRO-3's forward cannot fetch them (``torch.cat`` of no tensors) and ZeRO-1/2
    keep no fp32 master for them (``safe_get_full_fp32_param`` answers None)."""

    def __init__(self):
        super().__init__()
        self.tiny = nn.Parameter(torch.randn(1))
        self.odd = nn.Linear(7, 5)
        self.cube = nn.Parameter(torch.randn(13, 17, 3))
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("scale", torch.randn(3))
        self.register_buffer("temperature", torch.tensor(2.0))
        self.register_buffer("position_ids", torch.arange(6), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A scalar loss that every parameter and the floating buffers take part in."""
        linear = self.odd(x).float().square().mean()
        cube = (self.cube * self.scale).float().square().mean()
        return (linear + cube) * self.tiny.float().square().sum() * self.temperature.float()


def _llama_factory(tied: bool):
    """transformers' modeling module is imported here, before zero.Init: importing it inside
    fails on this torch/DeepSpeed."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tie=tied)
    return lambda: LlamaForCausalLM(config)


MODELS = {
    # factory_for(tied) -> factory, whether a name is frozen, a loss from the engine (the same
    # batch on every rank)
    "llama": (_llama_factory, lambda name: "layers.0.mlp." in name,
              lambda engine, ids: engine(input_ids=ids, labels=ids).loss),
    "awkward": (lambda tied: AwkwardTrainable, lambda name: name == "odd.bias",
                lambda engine, ids: engine(ids[:, :7].to(engine.module.odd.weight.dtype))),
}


def ds_config(stage: int, dtype: str, offload_optimizer: bool, sub_group_size: int | None) -> dict:
    zero = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # keep the torch AdamW with an offloaded optimizer
        "bf16": {"enabled": dtype == "bf16"},
        # a small first loss scale, so that the one step is not skipped for an overflow
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 4},
        "zero_optimization": zero,
    }


@contextlib.contextmanager
def fp16_capability_claimed():
    """Let DeepSpeed's CPU accelerator answer yes to ``is_fp16_supported``.

    The answer is oneDNN's ``_is_mkldnn_fp16_supported()``: whether the CPU has fp16 *instructions*
    (AVX512-FP16 / AMX-FP16). torch computes fp16 on any CPU without them. In DeepSpeed 0.19.8 the
    answer is read only by ``DeepSpeedEngine._do_sanity_check`` (which refuses fp16), by
    ``supported_dtypes()`` (the gradient buckets of the non-ZeRO all-reduce) and by zero.Init and
    Muon when no dtype is configured; no code that computes, partitions or writes a checkpoint
    reads it, so what ``save_checkpoint`` writes is what an fp16-capable machine would write.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True  # an instance attribute shadows the method
    try:
        yield
    finally:
        del accelerator.is_fp16_supported


def _engine(factory, is_frozen, config, stage: int, frozen: bool, seed: int):
    """A DeepSpeed engine training the module ``factory`` builds (its ``is_frozen`` parameters
    frozen if ``frozen``) with a new AdamW, and the module's parameter names, frozen names and
    tied aliases."""
    import deepspeed

    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            module = factory()
    else:
        module = factory()
    randomize(module, seed)
    names = [n for n, _ in module.named_parameters()]
    canonical = {}  # parameter -> its first name, the one named_parameters() gives
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(p, name)
    aliases = {n: canonical[p] for n, p in module.named_parameters(remove_duplicate=False) if canonical[p] != n}
    frozen_names = [n for n in names if frozen and is_frozen(n)]
    for name, p in module.named_parameters():
        p.requires_grad_(name not in frozen_names)
    trainable = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, config=config,
                                      optimizer=torch.optim.AdamW(trainable, lr=LEARNING_RATE))
    return engine, names, frozen_names, aliases


def _train_and_save_body(folder, expected, *, stage, dtype, frozen, tied, offload_optimizer,
                         sub_group_size, model, seed, steps, overflow_steps, restart_optimizer_after):
    """``steps`` real steps of a tiny model (the first ``overflow_steps`` of them with gradients
    that overflow, which DeepSpeed skips; after ``restart_optimizer_after`` of them, a save and a
    resume from it without the optimizer states), then ``engine.save_checkpoint(folder)``; rank
    0 writes what the live engine holds to ``expected``. Returns the tag DeepSpeed wrote."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    factory_for, is_frozen, loss_of = MODELS[model]
    factory = factory_for(tied)
    config = ds_config(stage, dtype, offload_optimizer, sub_group_size)
    torch.manual_seed(seed)
    capability = fp16_capability_claimed() if dtype == "fp16" else contextlib.nullcontext()
    with capability:
        engine, names, frozen_names, aliases = _engine(factory, is_frozen, config, stage, frozen, seed)
        assert bool(engine.zero_offload_optimizer()) == offload_optimizer
        before = full_state(engine.module)
        for step in range(steps):
            if step == restart_optimizer_after:  # as a new process resumes: a new engine, a new optimizer
                resumed = f"{folder}-before-restart"
                engine.save_checkpoint(resumed)
                engine = _engine(factory, is_frozen, config, stage, frozen, seed)[0]
                engine.load_checkpoint(resumed, load_optimizer_states=False)
            ids = torch.randint(0, 53, (1, 8), generator=torch.Generator().manual_seed(seed + 1 + step))
            loss = loss_of(engine, ids)
            engine.backward(loss * float("inf") if step < overflow_steps else loss)
            engine.step()
        assert engine.skipped_steps == overflow_steps, "a step was skipped (fp16 loss scale overflow)"
        assert engine.global_steps == steps
        engine.save_checkpoint(folder)

        masters = {}
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                masters[name] = safe_get_full_fp32_param(p).detach().cpu().clone()  # a collective
                changed = not torch.equal(masters[name], before[name].float())
                assert changed == (steps > overflow_steps), f"{name}: the steps did nothing, or a skipped one did"
        weights = full_state(engine.module)

    if dist.get_rank() == 0:
        expected = Path(expected)
        expected.mkdir(parents=True)
        save_file({n: t.contiguous() for n, t in weights.items()}, expected / "module_weights.safetensors")
        save_file(masters, expected / "masters.safetensors")
        buffer_names = [n for n in weights if n not in names and n not in aliases]
        (expected / "names.json").write_text(json.dumps({
            "param_names": names, "frozen_names": frozen_names, "buffer_names": buffer_names,
            "tied": aliases}, indent=1))
    return (Path(folder) / "latest").read_text().strip()


def make_native_checkpoint(root: Path, *, world: int, stage: int, dtype: str, frozen: bool = True,
                           tied: bool = True, offload_optimizer: bool = False,
                           sub_group_size: int | None = None, model: str = "llama",
                           seed: int = 0, steps: int = 1, overflow_steps: int = 0,
                           restart_optimizer_after: int | None = None) -> NativeCase:
    """DeepSpeed's checkpoint of a tiny model after ``steps`` AdamW steps (none: the optimizer
    has not stepped), the first ``overflow_steps`` of them skipped for an fp16 overflow, written
    into ``root`` by a ``world``-rank engine, and the live engine's weights and masters (kept in
    ``root.parent / f"{root.name}-expected"``). ``restart_optimizer_after``: that many steps in,
    the run saves (beside ``root``) and resumes from that save without its optimizer states, so
    the optimizer counts its steps from 0 again while the engine's ``global_steps`` goes on."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    if model not in MODELS:
        raise ValueError(f"model {model!r}: expected one of {sorted(MODELS)}")
    if sub_group_size is not None and stage != 3:
        raise ValueError("sub_group_size splits ZeRO-3's fp32 partitions only (stage 3)")
    if overflow_steps and (dtype != "fp16" or overflow_steps > steps):
        raise ValueError("overflow_steps: some of the steps, with fp16 (only its loss scaling skips steps)")
    if restart_optimizer_after is not None and not 0 < restart_optimizer_after < steps:
        raise ValueError("restart_optimizer_after: a number of steps between 0 and steps")
    root = Path(root)
    expected = root.parent / f"{root.name}-expected"
    tags = run_world(world, _train_and_save_body, str(root), str(expected), stage=stage, dtype=dtype,
                     frozen=frozen, tied=tied, offload_optimizer=offload_optimizer,
                     sub_group_size=sub_group_size, model=model, seed=seed, steps=steps,
                     overflow_steps=overflow_steps, restart_optimizer_after=restart_optimizer_after)
    names = json.loads((expected / "names.json").read_text())
    return NativeCase(folder=root, tag_folder=root / tags[0], world=world, stage=stage, dtype=dtype,
                      module_weights=load_file(expected / "module_weights.safetensors"),
                      masters=load_file(expected / "masters.safetensors"), **names)


def deepspeed_reference(folder) -> dict[str, torch.Tensor]:
    """DeepSpeed's own offline consolidation of the checkpoint in ``folder`` (``zero_to_fp32``):
    trainable parameters from the fp32 masters, frozen ones as stored, tied aliases, buffers."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    return {name: t.contiguous() for name, t in state.items()}


def zload_reference(case: NativeCase) -> dict[str, torch.Tensor]:
    """What zload reads from ``case``: DeepSpeed's reference, and ZeRO-1's frozen parameters, which
    it lacks (ZeRO-1 records none) and zload reads from the saved module: checked against the live
    engine's."""
    reference = deepspeed_reference(case.folder)
    if case.stage == 1:
        assert not set(case.frozen_names) & set(reference), "DeepSpeed now keeps ZeRO-1's frozen parameters"
        reference.update({n: case.module_weights[n] for n in case.frozen_names})
    return reference
