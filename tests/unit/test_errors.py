"""Errors: built-in bases where they mean one, the fields ``path``, ``tensor`` and ``ranks``, and
the same class and fields on every rank when one rank's problem is raised on all."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

import zload
from zload.distributed import Problem, problems_of, raise_for

from tests.support import models
from tests.support.checkpoints import save_sharded

SHARD = "model-00001-of-00002.safetensors"


def _rewrite_header(path, change) -> None:
    """Replace the header of safetensors file ``path`` by ``change(header)``; the data stay."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.dumps(change(json.loads(raw[8:8 + n]))).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


def _unknown_dtype(name):
    return lambda header: dict(header, **{name: dict(header[name], dtype="F99")})


def _checkpoint(folder):
    return save_sharded(models.state_with_seed(models.Awkward, seed=60), folder, shards=2)


def _fields(e: zload.ZloadError) -> tuple:
    return type(e).__name__, e.path, e.tensor, e.ranks


# ------------------------------------------------------------------------------------------------
# built-in bases and fields, on one process


def test_a_missing_checkpoint_is_a_file_not_found_error(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError) as info:
        zload.open_checkpoint(missing)
    e = info.value
    assert isinstance(e, zload.CheckpointNotFoundError) and isinstance(e, zload.CheckpointError)
    assert e.path == e.filename == missing and str(e) == f"{missing}: no such file or directory"
    assert e.tensor is None and e.ranks is None


def test_a_missing_shard_is_a_file_not_found_error_naming_it(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt")
    (folder / SHARD).unlink()
    with pytest.raises(zload.CheckpointNotFoundError) as info:
        zload.open_checkpoint(folder)
    assert isinstance(info.value, FileNotFoundError) and info.value.path == str(folder / SHARD)


def test_an_empty_folder_is_not_found_and_an_ambiguous_one_is_invalid(tmp_path):
    with pytest.raises(zload.CheckpointNotFoundError):
        zload.open_checkpoint(tmp_path)
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"w": torch.ones(1)}, str(tmp_path / name))
    with pytest.raises(ValueError) as info:
        zload.open_checkpoint(tmp_path)
    assert isinstance(info.value, zload.InvalidCheckpointError) and info.value.path == str(tmp_path)


def test_a_bad_header_is_a_value_error_naming_the_file_and_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2), "v": torch.zeros(3)}, str(path))
    _rewrite_header(path, _unknown_dtype("v"))
    with pytest.raises(ValueError) as info:
        zload.open_checkpoint(path)
    e = info.value
    assert isinstance(e, zload.InvalidCheckpointError) and isinstance(e, zload.ZloadError)
    assert (e.path, e.tensor) == (str(path), "v") and "unknown dtype 'F99'" in str(e)

    path.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")
    with pytest.raises(zload.InvalidCheckpointError) as info:
        zload.open_checkpoint(path)
    assert (info.value.path, info.value.tensor) == (str(path), None)


def test_bad_arguments_are_value_and_type_errors(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        zload.load_into(torch.nn.Module(), tmp_path, verify="never")
    assert isinstance(info.value, zload.ArgumentValueError)
    with pytest.raises(ValueError) as info:
        zload.load_into(torch.nn.Module(), tmp_path, revision="main")
    assert isinstance(info.value, zload.ArgumentValueError) and info.value.path == str(tmp_path)
    with pytest.raises(TypeError) as info:
        zload.load_into("a model", tmp_path)
    assert isinstance(info.value, zload.ArgumentTypeError)
    with pytest.raises(ValueError) as info:  # agreed on (here by one rank), class kept
        zload.save(torch.nn.Linear(2, 2), tmp_path / "out", max_shard_size="lots")
    assert isinstance(info.value, zload.ArgumentValueError) and info.value.ranks == (0,)
    with pytest.raises(TypeError) as info:
        zload.save(torch.nn.Linear(2, 2), tmp_path / "out", master_weights=True)
    assert isinstance(info.value, zload.ArgumentTypeError) and info.value.ranks == (0,)


def test_a_mode_is_its_string_and_a_wrong_one_names_the_values_allowed(tmp_path, monkeypatch):
    """Modes are str enums: users pass strings, members equal and print as them; a string that is
    no mode is an ArgumentValueError listing the modes (an environment variable's too)."""
    from zload.checkpoint.views import Verify
    from zload.kernels import backend
    from zload.model.targets import Kind

    assert Verify.of("full", "verify") is Verify.FULL and Verify.of(Verify.FULL, "verify") is Verify.FULL
    assert Verify.FULL == "full" and f"{Verify.FULL}" == "full" and Kind.PARTITION == "partition"
    with pytest.raises(zload.ArgumentValueError, match=r"^verify=\['full'\]: expected one of 'sample', 'full'$"):
        Verify.of(["full"], "verify")
    (tmp_path / "plain").mkdir()
    with pytest.raises(zload.ArgumentValueError, match="weights='fp16': expected one of 'master', 'module'"):
        zload.convert(tmp_path / "plain", tmp_path / "out", weights="fp16")
    monkeypatch.setenv("ZLOAD_KERNEL", "cuda")
    with pytest.raises(zload.ArgumentValueError, match="ZLOAD_KERNEL='cuda': expected one of 'auto', 'torch', 'trit"):
        backend()


def test_a_plan_error_is_a_value_error(tmp_path):
    save_file({"weight": torch.ones(3, 3), "bias": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        zload.load_into(torch.nn.Linear(2, 2), tmp_path)
    assert isinstance(info.value, zload.PlanError) and info.value.ranks == (0,)


def test_zload_raises_a_subclass_that_says_which_stage_refused():
    """No ``raise ZloadError(...)`` in zload: the base class is for catching, and for the problems
    of bugs (``problems_of``), and for a rank reporting that another failed."""
    import ast
    from pathlib import Path

    bare = []
    for path in sorted(Path(zload.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", None) == "ZloadError":
                bare.append(f"{path.name}:{node.lineno}")
    assert not bare, bare


# ------------------------------------------------------------------------------------------------
# raise_for: which problem's class and fields the agreed error has


def test_the_agreed_error_keeps_the_class_and_fields_of_the_problem():
    bad = Problem.of(zload.InvalidCheckpointError("f: bad", path="f", tensor="t"))
    with pytest.raises(zload.InvalidCheckpointError) as info:
        raise_for([[], [bad], [], [bad]], "refused")
    assert _fields(info.value) == ("InvalidCheckpointError", "f", "t", (1, 3))
    assert str(info.value) == "refused:\n  - [rank 1, 3] f: bad"


def test_a_checkpoint_problem_comes_before_a_plan_problem_and_others():
    plan = Problem(zload.PlanError, "'w': shape")
    gone = Problem.of(zload.CheckpointNotFoundError("g: gone", path="g"))
    other = Problem(zload.ZloadError, "unexpected error")
    with pytest.raises(zload.CheckpointNotFoundError) as info:
        raise_for([[other, plan], [plan], [gone]], "refused")
    assert _fields(info.value) == ("CheckpointNotFoundError", "g", None, (2,))
    assert info.value.filename == "g" and "[rank 0] unexpected error" in str(info.value)
    with pytest.raises(zload.PlanError) as info:
        raise_for([[other], [plan]], "refused")
    assert info.value.ranks == (1,)


def test_a_problem_keeps_the_fields_of_its_class():
    def lost():
        raise zload.PeerLostError("peer gone", stage="saving", path="p")

    _, problems = problems_of("talking", lost)
    with pytest.raises(zload.PeerLostError) as info:
        raise_for([problems, []], "failed")
    assert (info.value.stage, info.value.path, info.value.ranks) == ("saving", "p", (0,))


def test_an_error_of_many_ranks_problems_is_capped_and_shows_its_own():
    from zload.distributed import MAX_PROBLEMS_SHOWN

    gathered = [[Problem(zload.PlanError, f"'w{rank}.{k}': shape") for k in range(3)] for rank in range(64)]
    gathered[63].append(Problem(zload.InvalidCheckpointError, "f: bad", {"path": "f", "tensor": None}))
    with pytest.raises(zload.InvalidCheckpointError) as refused:
        raise_for(gathered, "refused")
    lines = str(refused.value).splitlines()
    assert len(lines) == 1 + MAX_PROBLEMS_SHOWN + 1, lines
    assert "[rank 63] f: bad" in str(refused.value) and lines[-1] == f"  - ... and {64 * 3 + 1 - 10} more problems"
