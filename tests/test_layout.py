"""The package's layout is its pipeline: each layer imports only itself and the layers below, and
no module imports another in a circle (lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import zload

ROOT = Path(zload.__file__).parent
LAYERS = (  # lowest first
    ("zload.errors", "zload.report", "zload.distributed", "zload.progress", "zload.collector"),
    ("zload.kernels",),
    ("zload.checkpoint",),
    ("zload.integrations",),
    ("zload.model",),
    ("zload.loading",),
    ("zload.saving",),
    ("zload", "zload.__main__", "zload.cli", "zload.pretrained"),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("zload", *path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The zload modules ``name`` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                target = f"{origin}.{alias.name}"
                found.add(target if target in modules else origin)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _layer(name: str) -> int:
    return max(i for i, layer in enumerate(LAYERS) for prefix in layer
               if name == prefix or (prefix != "zload" and name.startswith(prefix + ".")))


def test_each_layer_imports_only_itself_and_the_layers_below():
    modules = _modules()
    wrong = [f"{name} ({LAYERS[_layer(name)][0]}) imports {other} ({LAYERS[_layer(other)][0]})"
             for name, path in modules.items() for other in sorted(_imports(name, path, modules))
             if _layer(other) > _layer(name)]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_others():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def circle_from(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                return path[path.index(other):] + [other] if other in path else [name, other]
            if other not in state:
                found = circle_from(other, path + [other])
                if found:
                    return found
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            circle = circle_from(name, [name])
            assert circle is None, " -> ".join(circle)
