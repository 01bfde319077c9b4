"""The test harness itself: a test sees zload's module state as a new process has it, whatever an
earlier test in the same world (or in the pytest process) left there."""

from __future__ import annotations

from zload import kernels


LEFTOVER = "RuntimeError: left by an earlier test"


def _leave_triton_marked_broken():
    kernels._triton_broken = LEFTOVER  # as a failed Triton launch leaves it


def _why_triton_is_off():
    return kernels._triton_broken


# The next two run in this order (pytest keeps a file's order): the first leaves the state behind.

def test_an_in_process_test_leaves_triton_marked_broken():
    _leave_triton_marked_broken()


def test_the_next_in_process_test_does_not_inherit_it():
    assert _why_triton_is_off() is None
