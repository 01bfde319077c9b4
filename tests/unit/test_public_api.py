"""What users call, receive or pass is reachable from ``zload`` itself, and no function hides a
module of the same name."""

from __future__ import annotations

import importlib

import pytest

import zload

from tests.support import python


def test_exports_are_what_users_receive_or_pass():
    from zload.checkpoint.index import CheckpointIndex
    from zload.model.names import KeyMap

    assert zload.CheckpointIndex is CheckpointIndex and zload.KeyMap is KeyMap
    assert set(zload.__all__) >= {"load_into", "save", "init", "open_checkpoint", "CheckpointIndex", "KeyMap"}


def test_reports_are_built_by_name():
    """Fourteen fields in a row are too easy to shift by one: a report takes keywords only."""
    import pytest

    report = zload.LoadReport(source="x", rank=1, world_size=2, bytes_read=3)
    assert (report.rank, report.world_size, report.bytes_read, report.bytes_sent) == (1, 2, 3, 0)
    with pytest.raises(TypeError):
        zload.LoadReport("x", 1, 2)
    with pytest.raises(TypeError):
        zload.SaveReport("x", [], 0, 0, [], 0.0)


def test_no_function_hides_its_module():
    for name in zload.__all__:
        try:
            module = importlib.import_module(f"zload.{name}")
        except ModuleNotFoundError:
            continue
        assert getattr(zload, name) is module, f"zload.{name} is not the module zload/{name}.py"
    assert callable(zload.save) and callable(zload.init)
    assert importlib.import_module("zload.saving.save").save is zload.save
    assert importlib.import_module("zload.model.init").init is zload.init


def test_modules_meet_through_public_names():
    """No zload module imports another's private names or reaches into another object's private
    members (``self._reader._queue``): each boundary is a public seam."""
    import ast
    from pathlib import Path

    crossings = []
    for path in sorted(Path(zload.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                crossings += [f"{path.name}: imports {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and isinstance(node.value, ast.Attribute) and node.value.attr.startswith("_")):
                crossings.append(f"{path.name}:{node.lineno}: ...{node.value.attr}.{node.attr}")
    assert not crossings, crossings


def test_the_lazy_package_gives_every_public_name():
    """``import zload`` imports torch only when a name that needs it is first used."""
    code = ("import zload, sys; assert 'torch' not in sys.modules, 'torch imported'; "
            "from zload import load_into, LoadReport, ZloadError; "
            "assert 'torch' in sys.modules and zload.LoadReport is LoadReport; "
            "assert set(zload.__all__) <= set(dir(zload)); "
            "assert all(getattr(zload, n) is not None for n in zload.__all__); "
            "from zload import *; g = globals(); print(all(g[n] is getattr(zload, n) for n in zload.__all__))")
    done = python(["-c", code])
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert zload.__version__ == "0.1.0"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        zload.nothing  # noqa: B018
