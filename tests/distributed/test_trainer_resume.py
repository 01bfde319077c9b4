"""transformers' Trainer resumed at another world size: ``trainer.train(resume_from_checkpoint=...)``
within ``zload.trainer_resume()``.

A run of the real Trainer under DeepSpeed ZeRO-3 saves ``checkpoint-N`` (DeepSpeed's
``save_checkpoint``, through the Trainer) at 2 ranks and is resumed at 3. The reference is
``zload.load_into(engine, checkpoint, optimizer=True)`` on an engine the same Trainer builds at 3
ranks, which tests/distributed/test_resume_optimizer.py proves equal to DeepSpeed's own universal
resume.
"""

from __future__ import annotations

import pytest

from tests.support import resume_worlds as worlds
from tests.support.harness import run_world

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, MORE = 2, 2  # the steps before the checkpoint, and after the resume
DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True}


class _Stop(Exception):
    """Ends the reference run once its engine is resumed and recorded."""


def _trainer(out: str, steps: int, lora: bool, on_begin=None):
    """A Trainer of the tiny Llama (the same first weights on every rank; ``lora``: a PeftModel of
    it) under ZeRO-3, saving a checkpoint every ``STEPS`` steps, DeepSpeed's included;
    ``on_begin(trainer)`` runs as training begins (after a resume)."""
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from tests.support.models import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie=True))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    # use_cpu: without it Accelerate, finding no GPU, counts one process (examples/trainer_recipe.py)
    args = TrainingArguments(output_dir=out, deepspeed=DS_CONFIG, use_cpu=True, bf16=True,
                             per_device_train_batch_size=1, max_steps=steps, save_steps=STEPS, learning_rate=1e-2,
                             weight_decay=0.1, seed=0, logging_strategy="no", report_to="none", disable_tqdm=True)
    rows = torch.randint(0, 53, (24, 8), generator=torch.Generator().manual_seed(7))
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids} for ids in rows])

    class Begin(TrainerCallback):
        def on_train_begin(self, *_, **__):
            on_begin(trainer)

    if on_begin is not None:
        trainer.add_callback(Begin())
    return trainer


def _save_body(out, lora):
    _trainer(out, STEPS, lora).train()


def _resume_body(out, lora):
    """At this world size: the Trainer resumed within ``trainer_resume`` (what its engine holds and
    its global step as training begins, and its global step at the end), and the reference: the
    engine the same Trainer builds, resumed by ``load_into``."""
    import os

    import zload

    checkpoint = os.path.join(out, f"checkpoint-{STEPS}")
    begun = {}

    def record(trainer):
        begun.update(held=worlds.held_now(trainer.model_wrapped), step=trainer.state.global_step)

    resumed = _trainer(os.path.join(out, "resumed"), STEPS + MORE, lora, record)
    with zload.trainer_resume():
        resumed.train(resume_from_checkpoint=checkpoint)
    held, step = begun["held"], begun["step"]

    def reference_resume(trainer):
        zload.load_into(trainer.model_wrapped, checkpoint, optimizer=True, strict=not lora)
        begun.update(held=worlds.held_now(trainer.model_wrapped))
        raise _Stop

    try:
        _trainer(os.path.join(out, "reference"), STEPS + MORE, lora, reference_resume).train()
    except _Stop:
        pass
    restored = all("exp_avg" in state for state, master in zip(held["states"], held["masters"]) if master.numel())
    return step, resumed.state.global_step, worlds.same_held(held, begun["held"]), held["global_steps"], restored


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_trainer_resumes_at_another_world_size(tmp_path, lora):
    run_world(2, _save_body, str(tmp_path), lora)
    for begun, ended, same, engine_steps, restored in run_world(3, _resume_body, str(tmp_path), lora):
        assert same, "the resumed engine differs from load_into's resume of the checkpoint"
        assert restored and (begun, engine_steps, ended) == (STEPS, STEPS, STEPS + MORE)
