"""What users call, receive or pass is reachable from ``zload`` itself, and no function hides a
module of the same name."""

from __future__ import annotations

import importlib

import zload


def test_exports_are_what_users_receive_or_pass():
    from zload.index import CheckpointIndex
    from zload.names import KeyMap

    assert zload.CheckpointIndex is CheckpointIndex and zload.KeyMap is KeyMap
    assert set(zload.__all__) >= {"load_into", "save", "init", "open_checkpoint", "CheckpointIndex", "KeyMap"}


def test_no_function_hides_its_module():
    for name in zload.__all__:
        try:
            module = importlib.import_module(f"zload.{name}")
        except ModuleNotFoundError:
            continue
        assert getattr(zload, name) is module, f"zload.{name} is not the module zload/{name}.py"
    assert callable(zload.save) and callable(zload.init)
    assert importlib.import_module("zload.saving").save is zload.save
    assert importlib.import_module("zload.building").init is zload.init
