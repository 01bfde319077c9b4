"""What a run of many ranks prints: warnings and the load's report from rank 0 alone (every rank with
ZLOAD_ALL_RANKS=1), DeepSpeed's version from each node's first rank; errors of many problems capped;
the name zload once on each line; a progress bar for saves."""

from __future__ import annotations

import io
import logging
import os
import sys
import traceback
import warnings
from typing import NamedTuple

import deepspeed
import pytest
import torch
import torch.distributed as dist
import tqdm
from safetensors.torch import save_file
from torch import nn

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.distributed.test_deepspeed_version import _installed
from tests.support.zero3 import build_zero


class Told(NamedTuple):
    warnings: list[str]  # each warning as warnings.showwarning prints its first line
    records: list[str]  # each record of the "zload" logger, as "%(name)s: %(message)s" formats it


def _telling(call) -> Told:
    """``call()``, and the warnings and log records it gave."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger = logging.getLogger("zload")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    shown = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno).splitlines()[0] for w in caught
             if issubclass(w.category, zload.ZloadWarning)]
    return Told(shown, stream.getvalue().splitlines())


def _partial_load_body(path, all_ranks):
    """A load that warns (a tensor missing, one unexpected) and logs its report."""
    if all_ranks:
        os.environ["ZLOAD_ALL_RANKS"] = "1"
    try:
        return _telling(lambda: zload.load_into(nn.Linear(3, 2), path, strict=False))
    finally:
        os.environ.pop("ZLOAD_ALL_RANKS", None)


@pytest.mark.parametrize("all_ranks", [False, True])
def test_warnings_and_the_report_come_from_rank_0_unless_all_ranks_are_asked(tmp_path, all_ranks):
    save_file({"weight": torch.ones(2, 3), "extra": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    told = run_world(2, _partial_load_body, str(tmp_path), all_ranks)
    for rank, (shown, records) in enumerate(told):
        if rank == 0 or all_ranks:
            assert len(shown) == 2 and any("extra" in w for w in shown) and any("bias" in w for w in shown), shown
            assert records and "loaded 1 tensor" in records[0], records
        else:
            assert shown == [] and records == [], (shown, records)


def _newer_deepspeed_body(path, nodes):
    """DeepSpeed 0.20.1 where this rank's node has it; ``nodes``: one rank per node, or one node."""
    if nodes == 2:
        os.environ["LOCAL_RANK"] = "0"  # each rank the first of its own node
    model = build_zero(models.ParamsOnly)
    try:
        if nodes == 1 or dist.get_rank() == 1:  # on two nodes, only rank 1's has the newer DeepSpeed
            with _installed("0.20.1"):
                return _telling(lambda: zload.load_into(model, path)).warnings
        return _telling(lambda: zload.load_into(model, path)).warnings
    finally:
        os.environ["LOCAL_RANK"] = str(dist.get_rank())


def test_the_deepspeed_installed_is_warned_about_by_each_nodes_first_rank(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(models.state_with_seed(models.ParamsOnly, seed=4), str(path))
    on_one_node = run_world(2, _newer_deepspeed_body, path, 1)
    assert len(on_one_node[0]) == 1 and "DeepSpeed 0.20.1 is installed" in on_one_node[0][0], on_one_node
    assert on_one_node[1] == [], "rank 1 shares rank 0's node and its DeepSpeed"
    shown = on_one_node[0][0].split(": ", 1)[1]  # after the file and line: ZloadWarning: ...
    assert shown.lower().count("zload") == 1, shown
    on_two_nodes = run_world(2, _newer_deepspeed_body, path, 2)
    assert on_two_nodes[0] == [], "rank 0's node has a tested DeepSpeed"
    assert len(on_two_nodes[1]) == 1 and "DeepSpeed 0.20.1 is installed" in on_two_nodes[1][0], on_two_nodes


def _error_line(call) -> str:
    """The last line of the traceback ``call()`` raised: the error's class and its message's first line."""
    try:
        call()
    except zload.ZloadError as e:
        return traceback.format_exception_only(e)[-1].splitlines()[0]
    raise AssertionError("no error")


def _names_zload_once_body(path):
    told = _telling(lambda: zload.load_into(nn.Linear(3, 2), path, strict=False))
    error = _error_line(lambda: zload.load_into(nn.Linear(4, 2), path))
    return [*told.warnings, *told.records, error]


def test_each_warning_log_line_and_error_names_zload_once(tmp_path):
    save_file({"weight": torch.ones(2, 3), "extra": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    lines = run_world(2, _names_zload_once_body, str(tmp_path))[0]
    assert len(lines) >= 4, lines  # two warnings, the report's lines, the error
    for line in lines:
        assert line.lower().count("zload") <= 1, line
    assert sum("zload" in line.lower() for line in lines) >= 4, lines


# ------------------------------------------------------------------------------------------------
# long lists in errors


class Stack(nn.Module):
    """30 layers of widths ``first`` to ``first + 29``."""

    def __init__(self, first: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(first + k, 1, bias=False) for k in range(30))


def _many_problems_body(path):
    with pytest.raises(zload.PlanError) as mismatched:
        zload.load_into(Stack(2), path)
    model = build_zero(models.ParamsOnly)
    with deepspeed.zero.GatheredParameters(list(model.parameters())), pytest.raises(zload.PlanError) as gathered:
        zload.load_into(model, path)
    return str(mismatched.value), str(gathered.value)


def test_an_error_of_many_tensors_is_a_few_lines(tmp_path):
    """30 tensors, each of another shape: the first problems, then how many more; every parameter
    gathered: one line naming the first few."""
    save_file({**Stack(3).state_dict(), **models.state_with_seed(models.ParamsOnly, seed=2)},
              str(tmp_path / "model.safetensors"))
    from zload.distributed import MAX_PROBLEMS_SHOWN

    for mismatched, gathered in run_world(2, _many_problems_body, str(tmp_path / "model.safetensors")):
        assert mismatched.count("\n") == MAX_PROBLEMS_SHOWN + 1 and "... and 20 more problems" in mismatched
        (line,) = [line for line in gathered.splitlines() if "is gathered" in line]
        assert "'a.weight'" in line and "(1 more)" in line, gathered


# ------------------------------------------------------------------------------------------------
# the save's progress bar


def _save_with_bar_body(root, progress):
    from zload import progress as bars

    stream, (stderr, delay) = io.StringIO(), (sys.stderr, bars.DELAY_S)
    sys.stderr, bars.DELAY_S = stream, 0  # the bar draws at once, into ``stream``
    try:
        report = zload.save(build_zero(models.ParamsOnly), f"{root}/out", progress=progress)
    finally:
        sys.stderr, bars.DELAY_S = stderr, delay
    return report.bytes_written, stream.getvalue()


@pytest.mark.parametrize("progress", [True, False])
def test_a_save_draws_a_bar_of_the_bytes_rank_0_writes(tmp_path, progress):
    (written, drawn), (_, elsewhere) = run_world(2, _save_with_bar_body, str(tmp_path), progress)
    assert elsewhere == ""
    if progress:
        size = tqdm.tqdm.format_sizeof(written)
        assert "100%" in drawn and f"{size}/{size}" in drawn, drawn
    else:
        assert drawn == ""
