"""zload/ copied into another project's tree must work as is."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tests.support import REPO

PACKAGE = REPO / "zload"

VENDORED_USE = r"""
import sys, importlib.abc

class NoTopLevelZload(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "zload" or name.startswith("zload."):
            raise ImportError("the vendored copy imported the installed zload: " + name)

sys.meta_path.insert(0, NoTopLevelZload())

import torch
from safetensors.torch import save_file
from trainer._vendor import zload

lazy = {"transformers", "peft", "triton", "deepspeed"} & set(sys.modules)
assert not lazy, f"imported eagerly: {lazy}"
model = torch.nn.Linear(3, 2)
save_file({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, "ckpt.safetensors")
report = zload.load_into(model, "ckpt.safetensors")
assert torch.equal(model.weight, torch.ones(2, 3)) and report.loaded == ["weight", "bias"]
assert not {"transformers", "peft"} & set(sys.modules)
print("vendored ok")
"""


def test_vendored_copy_imports_and_loads(tmp_path):
    vendor = tmp_path / "trainer" / "_vendor"
    shutil.copytree(PACKAGE, vendor / "zload", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (vendor / "__init__.py").write_text("")
    result = subprocess.run([sys.executable, "-c", VENDORED_USE], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "vendored ok" in result.stdout, result.stderr[-3000:]


def test_package_has_no_compiled_extension_or_absolute_self_import():
    for path in PACKAGE.rglob("*"):
        assert path.suffix not in {".so", ".pyd", ".c", ".cpp", ".cu"}, path
        if path.suffix == ".py":
            text = path.read_text()
            assert "import zload" not in text and "from zload" not in text, path
