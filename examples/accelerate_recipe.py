"""Recipe: Accelerate with DeepSpeed ZeRO-3, everything frozen but ``lm_head``, saved with zload.

Under ZeRO-3 each rank holds a flat slice of every parameter, trainable or frozen, and the module
only empty placeholders: a checkpoint written from the placeholders loses tensors ("Removed
shared tensor"), and the usual saves avoid that by gathering the whole model onto one rank.
``zload.save`` writes every tensor at full size straight from the ranks' partitions, and plain
``from_pretrained`` (no DeepSpeed) reloads the trained model whole.

    python -m torch.distributed.run --nproc_per_node 2 examples/accelerate_recipe.py --out DIR
    python examples/accelerate_recipe.py --out DIR      # launches itself on 2 CPU ranks
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import recipe_world
import zload

DS_CONFIG = {  # ZeRO-3; no optimizer section, so DeepSpeed wraps the torch AdamW below
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
}


def train_lm_head(base: str):
    """One step on ``lm_head`` alone; returns the engine."""
    # CPU only: Accelerate finds no GPU, so it would count one process; its process state made
    # for the CPU first counts the world right. (Accelerator(cpu=True) would give up DeepSpeed.)
    PartialState(cpu=True)
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DS_CONFIG, zero_stage=3))
    assert accelerator.distributed_type == "DEEPSPEED" and accelerator.num_processes == dist.get_world_size()
    with zload.init(DS_CONFIG):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(base))
    zload.load_into(model, base)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head."))
    optimizer = torch.optim.AdamW(model.lm_head.parameters(), lr=1e-2)
    engine, optimizer = accelerator.prepare(model, optimizer)

    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(dist.get_rank()))
    accelerator.backward(engine(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()
    return engine


class Captured(logging.Handler):
    """Keeps transformers' log records: a tensor it drops ("Removed shared tensor") is only logged."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def reload_and_compare(saved: str, base: str, trained: dict[str, torch.Tensor]) -> list[str]:
    """Plain ``from_pretrained``, no DeepSpeed: every tensor whole and equal to the trained one."""
    # Accelerate told transformers that ZeRO-3 is on, so from_pretrained would build under
    # zero.Init, waiting for the other ranks; this rank now loads as plain transformers does.
    unset_hf_deepspeed_config()
    captured = Captured()
    transformers.logging.get_logger().addHandler(captured)
    transformers.logging.set_verbosity_info()
    try:
        reloaded, info = AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
    finally:
        transformers.logging.get_logger().removeHandler(captured)
        transformers.logging.set_verbosity_error()
    problems = [f"from_pretrained logged: {m}" for m in captured.messages if "Removed shared tensor" in m]
    problems += [f"from_pretrained reports {kind}: {names}" for kind, names in info.items() if names]
    state = reloaded.state_dict()
    problems += [f"{name}: reloaded {tuple(state[name].shape)}, trained {tuple(value.shape)}, or other values"
                 for name, value in trained.items() if not torch.equal(state[name], value)]
    start = load_file(os.path.join(base, "model.safetensors"))
    if torch.equal(state["lm_head.weight"], start["lm_head.weight"]):
        problems.append("the step did not change lm_head")
    return problems


def main(out: str) -> None:
    base = recipe_world.pretrained_llama(out, tie_word_embeddings=False)
    engine = train_lm_head(base)
    saved = os.path.join(out, "saved")
    zload.save(engine, saved)  # every rank writes its own partitions, frozen ones too; no gather

    trained = recipe_world.gathered(engine.module)
    problems = reload_and_compare(saved, base, trained) if dist.get_rank() == 0 else []
    recipe_world.finish(problems, f"accelerate recipe: OK ({len(trained)} tensors reloaded whole by from_pretrained)")


if __name__ == "__main__":
    raise SystemExit(recipe_world.main(__file__, __doc__.split("\n\n")[0], main))
