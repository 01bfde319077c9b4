"""``trainer_resume``: transformers' Trainer resumes a DeepSpeed run at any world size.

The Trainer resumes its DeepSpeed engine with DeepSpeed's ``engine.load_checkpoint``, which refuses
a checkpoint saved at another world size. Within ``trainer_resume`` it resumes with
``zload.load_into(engine, path, optimizer=True)`` instead. transformers is imported only when it
is called.
"""

from __future__ import annotations

from .integrations.transformers import trainer_deepspeed_resume
from .loading.load_into import load_into


def trainer_resume():
    """A context manager within which ``trainer.train(resume_from_checkpoint=...)`` of transformers'
    Trainer under DeepSpeed (ZeRO-1/2/3) resumes from a checkpoint saved at any world size::

        with zload.trainer_resume():
            trainer.train(resume_from_checkpoint="out/checkpoint-500")

    The engine's fp32 masters, optimizer states, step counts, hyperparameters, loss scaler, LR
    scheduler, counters and 16-bit weights are restored by ``zload.load_into(engine, path,
    optimizer=True)`` from the DeepSpeed checkpoint the Trainer saved in ``checkpoint-N`` (or from
    ``zload.save(engine, path, optimizer=True)``'s files there), each rank reading only its own
    partitions; the Trainer restores the rest as it always does (``trainer_state.json``: global step
    and data position; the RNG states of the ranks it has files for). For a PEFT model the Trainer
    asks for a non-strict load (its checkpoints hold the trained parameters alone), and the
    parameters the checkpoint lacks are left as they are. Outside the context nothing is changed;
    every Trainer of the process resumes this way while one is open. Raises
    ``UnsupportedEnvironmentError`` where the installed transformers' Trainer has no DeepSpeed
    resume to replace.
    """
    return trainer_deepspeed_resume(_resume)


def _resume(engine, path, strict: bool) -> None:
    load_into(engine, path, strict=strict, optimizer=True)
