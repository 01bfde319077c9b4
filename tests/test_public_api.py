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


def test_the_readme_module_map_is_the_layout():
    """The README's module map names every module of zload/ and zload/integrations/, and no module
    that is not there (a rename or a lost section shows up here)."""
    import re
    from pathlib import Path

    root = Path(zload.__file__).parent
    readme = (root.parent / "README.md").read_text()
    section = readme[readme.index("## Development"):readme.index("CI (`.ci/run`)")]
    named = set(re.findall(r"`(?:zload/(?:integrations/)?)?([a-z_]+\.py)`", section))
    modules = {p.name for p in [*root.glob("*.py"), *(root / "integrations").glob("*.py")]} - {"__init__.py",
                                                                                                "__main__.py"}
    tree = {p.name for folder in ("zload", "benchmarks", "tests", "examples") for p in (root.parent / folder).rglob("*.py")}
    assert modules <= named, f"not in the README's module map: {sorted(modules - named)}"
    assert named <= tree, f"in the module map but not in the tree: {sorted(named - tree)}"
