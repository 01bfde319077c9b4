"""Where a launcher started a process, its world is the launcher's: zload makes a world of one
(tests/distributed/test_no_launcher.py) only where none did."""

from __future__ import annotations

import os

import pytest

from zload.integrations import deepspeed as ds


@pytest.mark.parametrize("variable,value", [("MASTER_PORT", "29500"), ("OMPI_COMM_WORLD_SIZE", "4"),
                                            ("SLURM_NTASKS", "8")])
def test_a_launched_process_is_left_to_its_launcher(monkeypatch, variable, value):
    """Never a world of one where a launcher may have started several processes."""
    for name in (*ds.LAUNCHER_VARIABLES, "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ds, "_deepspeed", lambda: pytest.fail("a world was made for a launched process"))
    monkeypatch.setenv(variable, value)
    ds.join_world_of_one()
    assert os.environ.get("RANK") is None
