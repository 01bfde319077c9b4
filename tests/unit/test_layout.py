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
    ("zload", "zload.__main__", "zload.cli", "zload.pretrained", "zload.trainer"),
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


# What zload uses of DeepSpeed beyond its public names: attributes and methods of its parameters,
# optimizers and zero.Init, its enums and functions. ``ds_*`` attributes are all DeepSpeed's.
DEEPSPEED_INTERNALS = {
    "ds_tensor", "ds_numel", "ds_shape", "ds_id", "ds_status", "ds_secondary_tensor", "ds_process_group",
    "ds_persist", "ds_numel_aligned", "ds_quant_scale", "final_location", "nvme_swapper",
    "convert_to_zero_parameters", "_convert_to_deepspeed_param", "_partition_param", "_partition_world_size",
    "_aligned_size", "_zero_init_param", "_post_init_method", "print_rank_0", "zero_init_context",
    "zero_param_process_group", "local_device", "remote_device", "__old_new__", "_old_apply",
    "ZeroParamStatus", "PartitionedParamStatus", "OffloadDeviceEnum", "checkpoint_event_prologue",
    "checkpoint_event_epilogue", "refresh_fp32_params", "safe_set_local_fp32_param", "safe_get_local_fp32_param",
    "safe_get_full_fp32_param", "GatheredParameters", "DeepSpeedEngine",
    # a ZeRO optimizer's flat partitions, groups and states (a resume)
    "fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "single_partition_of_fp32_groups",
    "fp16_groups", "bit16_groups", "sub_group_to_group_id", "swap_optimizer", "_hp_mapping", "lp_fragment_address",
    "hp_fragment_address", "update_lp",
}
DEEPSPEED_MODULE = "zload.integrations.deepspeed"


def _deepspeed_uses(path: Path) -> list[str]:
    """Where ``path`` imports DeepSpeed, names one of its internals (an attribute, a name, a string
    given to ``getattr``/``hasattr``), or looks DeepSpeed up by name (``sys.modules.get("deepspeed")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "deepspeed"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "deepspeed":
            names = [node.module]
        elif isinstance(node, ast.Attribute) and (node.attr in DEEPSPEED_INTERNALS or node.attr.startswith("ds_")):
            names = [node.attr]
        elif isinstance(node, ast.Name) and node.id in DEEPSPEED_INTERNALS:
            names = [node.id]
        elif isinstance(node, ast.Call):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and (a.value in DEEPSPEED_INTERNALS or a.value.split(".")[0] == "deepspeed")]
        found += [f"{path.relative_to(ROOT.parent)}:{node.lineno}: {name}" for name in names]
    return found


def test_only_the_deepspeed_integration_touches_deepspeed():
    """DeepSpeed's internals change between releases: one module (which checks the version) uses
    them. Not its checkpoint files' names (``checkpoint.native``), which are data."""
    modules = _modules()
    assert _deepspeed_uses(modules[DEEPSPEED_MODULE])  # the check sees what it looks for
    wrong = [use for name, path in sorted(modules.items()) if name != DEEPSPEED_MODULE
             for use in _deepspeed_uses(path)]
    assert not wrong, "\n".join(wrong)
