"""A script started with plain ``python``: no torchrun, no process group. ``zload.init`` makes a
world of one, as torchrun would for one process, and ``load_into`` and ``save`` work in it; under a
launcher the world is the launcher's (tests/unit/test_no_launcher.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from safetensors.torch import save_file

from tests.support import REPO
from tests.support.checkpoints import read_all
from tests.support.zero3 import assert_bit_equal

# what torchrun sets: none of it in the script's environment
LAUNCHED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

SCRIPT = """
import sys
import torch
import torch.distributed as dist
import zload

folder = sys.argv[1]
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
with zload.init(config):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
zload.load_into(model, folder + "/model.safetensors")
zload.save(model, folder + "/saved")
print("world", dist.get_rank(), dist.get_world_size(), dist.get_backend())
"""


def test_a_script_run_with_plain_python_loads_and_saves_in_a_world_of_one(tmp_path):
    torch.manual_seed(0)
    state = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).state_dict()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHED and not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "world 0 1 gloo" in done.stdout
    saved = read_all(tmp_path / "saved")
    assert sorted(saved) == sorted(state)
    for name, tensor in state.items():
        assert_bit_equal(saved[name], tensor.to(torch.bfloat16), name)
