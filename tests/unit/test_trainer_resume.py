"""``zload.trainer_resume()``: what it puts in place of the Trainer's DeepSpeed resume, and that
the Trainer is as it was outside it (tests/distributed/test_trainer_resume.py resumes real runs)."""

from __future__ import annotations

import pytest

import zload
from zload import trainer as trainer_resume_module

trainer = pytest.importorskip("transformers.trainer")


def test_within_it_the_trainer_resumes_with_load_into(monkeypatch):
    calls = []
    monkeypatch.setattr(trainer_resume_module, "load_into", lambda *a, **k: calls.append((a, k)))
    with zload.trainer_resume():
        trainer.deepspeed_load_checkpoint("engine", "out/checkpoint-5", load_module_strict=False)
        trainer.deepspeed_load_checkpoint("engine", "out/checkpoint-6")
    assert calls == [(("engine", "out/checkpoint-5"), {"strict": False, "optimizer": True}),
                     (("engine", "out/checkpoint-6"), {"strict": True, "optimizer": True})]


def test_the_trainer_is_as_it_was_outside_it_whatever_raised():
    original = trainer.deepspeed_load_checkpoint
    with pytest.raises(KeyError):
        with zload.trainer_resume():
            assert trainer.deepspeed_load_checkpoint is not original
            raise KeyError("the training failed")
    assert trainer.deepspeed_load_checkpoint is original


def test_nested_contexts_leave_no_replacement_behind():
    original = trainer.deepspeed_load_checkpoint
    outer, inner = zload.trainer_resume(), zload.trainer_resume()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # out of order, as threads may close them
    assert trainer.deepspeed_load_checkpoint is not original
    inner.__exit__(None, None, None)
    assert trainer.deepspeed_load_checkpoint is original


@pytest.mark.parametrize("hook", [None, lambda engine, path: None], ids=["absent", "another-signature"])
def test_a_trainer_without_the_hook_is_refused(monkeypatch, hook):
    if hook is None:
        monkeypatch.delattr(trainer, "deepspeed_load_checkpoint")
    else:
        monkeypatch.setattr(trainer, "deepspeed_load_checkpoint", hook)
    with pytest.raises(zload.UnsupportedEnvironmentError, match="has no deepspeed_load_checkpoint"):
        with zload.trainer_resume():
            pytest.fail("entered")
    assert getattr(trainer, "deepspeed_load_checkpoint", None) is hook
