"""The README's Python snippets run as written: all of them, in order, as one script on every
rank of a 2-rank CPU world, in a folder where ``checkpoints/my-model`` is a tiny fp32 Llama
written by transformers' ``save_pretrained`` (sharded, so that its index file exists too).

The last snippet leaves without the interpreter's teardown, where gloo sometimes aborts a finished
script. The test makes every rank's teardown abort, so a script that reaches it fails every time
rather than in a few runs of a hundred."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support import REPO
from tests.support.harness import exit_aborting_hook


def python_snippets(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)


@pytest.mark.slow
def test_every_python_snippet_in_the_readme_runs(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    snippets = python_snippets((REPO / "README.md").read_text())
    assert len(snippets) >= 4
    assert "os._exit(" in snippets[-1] and not any("os._exit(" in s for s in snippets[:-1])  # it ends them
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "checkpoints" / "my-model", max_shard_size="200KB")
    assert (tmp_path / "checkpoints" / "my-model" / "model.safetensors.index.json").exists()
    script = tmp_path / "readme_snippets.py"
    script.write_text("\n\n".join(snippets))
    aborting_at_exit = exit_aborting_hook(tmp_path / "hook")
    env = dict(os.environ, PYTHONPATH=f"{aborting_at_exit}{os.pathsep}{REPO}", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error:" in line]
    assert done.returncode == 0, "\n".join(errors[:20]) + "\n--- the end of stderr:\n" + done.stderr[-6000:]
    assert (tmp_path / "checkpoints" / "step-1000").is_dir()  # the saving snippet wrote there
