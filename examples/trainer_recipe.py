"""Recipe: the Hugging Face Trainer under DeepSpeed ZeRO-3 with zload.

1. Full fine-tuning: the model is built with its parameters born partitioned (``zload.init``) and
   loaded from the pretrained checkpoint with ``zload.load_into`` before training; the Trainer
   writes every checkpoint's weights once, with ``zload.save`` (the whole model, frozen parameters
   included, no gather), in place of its own save (``ZloadTrainer``).
2. LoRA: a run saves adapter-only checkpoints into node-local folders (each node its own disk);
   a second run resumes from the last one with ``zload.load_into`` of the base, then the adapter,
   although only node 0 holds the files.

    python -m torch.distributed.run --nproc_per_node 2 examples/trainer_recipe.py --out DIR
    python examples/trainer_recipe.py --out DIR      # launches 2 "nodes" of 1 CPU rank each
"""

from __future__ import annotations

import os

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM, Trainer, TrainingArguments

import recipe_world
import zload

DS_CONFIG = {  # ZeRO-3; no optimizer section, so DeepSpeed wraps the Trainer's AdamW (torch)
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
}
STEPS, SAVE_EVERY = 4, 2


class ZloadTrainer(Trainer):
    """The Trainer, each checkpoint's weights written once, by ``zload.save``: every rank its own
    partitions, the whole model (frozen parameters included) or, for a PeftModel, the adapter alone.

    It replaces the Trainer's own save of the weights, which under ZeRO-3 (without
    ``stage3_gather_16bit_weights_on_model_save``) is a DeepSpeed checkpoint of the 16-bit model
    states, and for a PeftModel the adapter gathered: with ``zload.save`` beside it, every
    checkpoint would be written twice. The trade-off: with ``save_only_model=True`` (below), a
    checkpoint holds the weights (safetensors, which ``from_pretrained`` and ``zload.load_into``
    read) and ``trainer_state.json``, not the optimizer's state. To resume the optimizer too
    (``trainer.train(resume_from_checkpoint=...)``), leave ``save_only_model`` off: the Trainer then
    also writes DeepSpeed's checkpoint (``global_stepN/``: the optimizer's state with its fp32 master
    weights, and the 16-bit weights again), so the weights are on disk twice. Where that costs too
    much, use the plain Trainer (DeepSpeed's checkpoint only) and turn the checkpoint you keep into
    safetensors with ``zload convert``, or load it as it is: ``zload.load_into`` reads DeepSpeed
    checkpoints.
    """

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Every rank calls it (the Trainer's checkpoints, or trainer.save_model() after training).
        output_dir = output_dir or self.args.output_dir
        zload.save(self.model, output_dir)
        if self.processing_class is not None and self.args.should_save:
            self.processing_class.save_pretrained(output_dir)


def trainer_for(model, output_dir: str, steps: int) -> Trainer:
    # use_cpu=True only for this CPU-only demo: without it Accelerate, finding no GPU, counts one
    # process and gives every rank all the data; DeepSpeed is used all the same.
    args = TrainingArguments(
        output_dir=output_dir, deepspeed=DS_CONFIG, use_cpu=True, per_device_train_batch_size=2,
        max_steps=steps, save_steps=SAVE_EVERY, learning_rate=1e-2, seed=0,
        # the weights and the Trainer's state, not the optimizer's (ZloadTrainer: the trade-off)
        save_only_model=True, logging_strategy="no", report_to="none", disable_tqdm=True)
    rows = torch.randint(0, model.config.vocab_size, (16, 12), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": ids, "labels": ids} for ids in rows]
    return ZloadTrainer(model=model, args=args, train_dataset=data)


def pretrained(base: str) -> LlamaForCausalLM:
    """The pretrained model, ZeRO-3 partitioned: built without init or broadcast (``zload.init``),
    then loaded by each rank reading only its own partitions."""
    with zload.init(DS_CONFIG):
        model = LlamaForCausalLM(AutoConfig.from_pretrained(base))
    zload.load_into(model, base)
    return model


def saved_twice(checkpoint: str) -> list[str]:
    """The DeepSpeed checkpoint in ``checkpoint`` (there is none: ZloadTrainer saves once)."""
    return [f"{checkpoint}: also holds {name}: the weights were saved twice"
            for name in sorted(os.listdir(checkpoint)) if name == "latest" or name.startswith("global_step")]


def full_finetune(base: str, out: str) -> list[str]:
    model = pretrained(base)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen, and saved all the same
    trainer = trainer_for(model, os.path.join(out, "full"), steps=STEPS)
    trainer.train()

    # The last checkpoint holds the trained model, every tensor at full size, written once.
    last = os.path.join(out, "full", f"checkpoint-{STEPS}")
    saved = load_file(os.path.join(last, "model.safetensors"))
    start = load_file(os.path.join(base, "model.safetensors"))
    problems = [f"{name}: {last} differs from the trained model"
                for name, value in recipe_world.gathered(model).items() if not torch.equal(saved[name], value)]
    problems += saved_twice(last)
    if not torch.equal(saved["model.embed_tokens.weight"], start["model.embed_tokens.weight"]):
        problems.append("the frozen embedding is not the pretrained one")
    if torch.equal(saved["lm_head.weight"], start["lm_head.weight"]):
        problems.append("training did not change lm_head")
    return problems


def lora_model(base: str):
    return get_peft_model(pretrained(base), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def resume_lora(base: str, out: str) -> list[str]:
    # Checkpoints go to node-local disk. zload.save on the other nodes sends their bytes to rank 0,
    # so node 0 holds each (adapter-only) checkpoint whole, and the other nodes nothing of it.
    output_dir = os.path.join(recipe_world.node_folder(out), "lora")
    first = trainer_for(lora_model(base), output_dir, steps=SAVE_EVERY)
    first.train()
    is_lora = lambda name: ".lora_" in name  # noqa: E731
    trained = recipe_world.gathered(first.model, is_lora)

    # Resume: the base as before, then the adapter's tensors alone (the base is left as loaded).
    # Ranks on a node without the checkpoint are sent their bytes by a rank that has them.
    checkpoint = os.path.join(output_dir, f"checkpoint-{SAVE_EVERY}")
    model = lora_model(base)
    report = zload.load_into(model, checkpoint)
    resumed = recipe_world.gathered(model, is_lora)
    problems = [f"{name}: resumed from {checkpoint}, differs from the saved adapter"
                for name, value in trained.items() if not torch.equal(resumed[name], value)]
    if sorted(resumed) != sorted(trained):
        problems.append("the resumed model has other LoRA parameters than the saved one")
    if not os.path.exists(checkpoint) and report.bytes_received == 0:
        problems.append(f"this node has no {checkpoint}, yet received nothing")
    problems += saved_twice(checkpoint) if os.path.exists(checkpoint) else []
    trainer_for(model, os.path.join(output_dir, "resumed"), steps=STEPS).train()  # and trains on
    return problems


def main(out: str) -> None:
    base = recipe_world.pretrained_llama(out)
    problems = full_finetune(base, out) + resume_lora(base, out)
    recipe_world.finish(problems, "trainer recipe: OK (checkpoints written once, by zload.save, LoRA "
                        "resumed from an adapter-only checkpoint in node-local folders)")


if __name__ == "__main__":
    raise SystemExit(recipe_world.main(__file__, __doc__.split("\n\n")[0], main, nodes=2))
