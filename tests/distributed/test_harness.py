"""The test harness itself: a test sees zload's module state as a new process has it, whatever an
earlier test in the same world (or in the pytest process) left there."""

from __future__ import annotations

from zload.integrations import transformers_registry

from tests.support.harness import run_world
from tests.unit.test_harness import LEFTOVER, _leave_triton_marked_broken, _why_triton_is_off


def test_a_rank_body_does_not_inherit_the_previous_bodys_triton_failure():
    run_world(2, _leave_triton_marked_broken)
    assert run_world(2, _why_triton_is_off) == [None, None]


def _leave_a_registry_behind():
    transformers_registry._deferred_registry = LEFTOVER  # as a transformers patched by a test leaves it


def _registry_left():
    return transformers_registry._deferred_registry


def test_a_rank_body_does_not_inherit_the_previous_bodys_conversion_registry():
    run_world(2, _leave_a_registry_behind)
    assert run_world(2, _registry_left) == [None, None]
