"""zload.save: HF-layout safetensors written by every rank from its own partitions."""

from __future__ import annotations

import json
import os
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zload

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import build_zero, full_state


def _save_and_report(load_path, out, max_shard_size, shared):
    model = build_zero(models.Awkward)
    zload.load_into(model, load_path)
    return zload.save(model, out, max_shard_size=max_shard_size, shared_filesystem=shared, staging_bytes=64)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_save_round_trip_bit_exact(tmp_path, world):
    state = models.state_with_seed(models.Awkward, seed=41)
    save_file(state, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out"
    reports = run_world(world, _save_and_report, str(tmp_path / "in.safetensors"), str(out), 200, None)
    files = reports[0].files
    assert len(files) > 1 and (out / "model.safetensors.index.json").exists()
    saved = {}
    for f in files:
        saved.update(load_file(str(out / f)))
    assert sorted(saved) == sorted(state)  # non-persistent buffers are not saved
    for name, tensor in saved.items():
        assert torch.equal(tensor, state[name]), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved.values())
    assert sum(r.bytes_written for r in reports) == sum(t.numel() * t.element_size() for t in saved.values())


class SavedModel(NamedTuple):
    report: zload.SaveReport
    state: dict[str, torch.Tensor]  # the model's weights, whole


def _save_transposed(out, kind):
    from tests.distributed.test_load_converted import MODELS

    cls, make_config = MODELS[kind]
    torch.manual_seed(3)
    model = build_zero(lambda: cls(make_config()))
    for p in model.parameters():  # values unlike any init, the same on every rank
        p.ds_tensor.data.copy_(torch.arange(p.ds_tensor.numel(), dtype=p.ds_tensor.dtype) / 7
                               + dist.get_rank(p.ds_process_group) * p.ds_tensor.numel() / 7)
    report = zload.save(model, out, max_shard_size="30KB")
    return SavedModel(report, full_state(model))


@pytest.mark.parametrize("kind", ["transposed_llama", "fused_transposed_llama"])
def test_save_gathers_only_tensors_whose_conversion_is_no_layout(tmp_path, kind):
    """A checkpoint stores up_proj transposed (or gate and up fused and transposed): only those
    parameters are gathered, and transformers loads the folder back exactly."""
    from tests.distributed.test_load_converted import MODELS, SLOW_PATH

    saved = run_world(3, _save_transposed, str(tmp_path / "out"), kind)[0]
    assert saved.report.gathered == SLOW_PATH[kind]
    loaded, info = MODELS[kind][0].from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    for name, tensor in loaded.named_parameters():  # every parameter, none skipped by name
        assert torch.equal(tensor, saved.state[name]), name


def _save_into(folder, target, state_file):
    """Every rank saves a ZeRO-3 model to ``target`` with ``folder`` as its working directory;
    returns (error type, message) or None when the save succeeded."""
    import os

    model = build_zero(models.Awkward)
    zload.load_into(model, state_file)
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        zload.save(model, target)
    except zload.ZloadError as e:
        return type(e).__name__, str(e)
    finally:
        os.chdir(cwd)
    return None


def _project(folder):
    """A folder as a user's working directory looks: source files, a subfolder, a dotfile."""
    files = {"train.py": b"print('train')\n", "src/model.py": b"class M: ...\n", ".gitignore": b"*.pt\n",
             "trainer_state.json": b"{}"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_saving_into_the_working_directory_keeps_everything_else(tmp_path):
    """zload.save(model, "."): the working directory gains the checkpoint and loses nothing."""
    state = models.state_with_seed(models.Awkward, seed=42)
    save_file(state, str(tmp_path / "in.safetensors"))
    work = tmp_path / "work"
    work.mkdir()
    files = _project(work)
    assert run_world(2, _save_into, str(work), ".", str(tmp_path / "in.safetensors")) == [None, None]
    assert _files(work) == dict(files, **{"model.safetensors": (work / "model.safetensors").read_bytes()})
    assert sorted(load_file(str(work / "model.safetensors"))) == sorted(state)


@pytest.mark.parametrize("kind", ["file", "link_to_file", "dangling_link", "fifo"])
def test_a_path_that_is_no_folder_is_refused_untouched(tmp_path, kind):
    """Nothing is moved, replaced or created; every rank says why and that nothing was written."""
    import os

    state = models.state_with_seed(models.Awkward, seed=43)
    save_file(state, str(tmp_path / "in.safetensors"))
    (tmp_path / "real.bin").write_bytes(b"someone's file")
    target = tmp_path / "out"
    if kind == "file":
        target.write_bytes(b"someone's file")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(tmp_path / ("real.bin" if kind == "link_to_file" else "nowhere"))
    before = sorted(p.name for p in tmp_path.iterdir())
    results = run_world(2, _save_into, str(tmp_path), "out", str(tmp_path / "in.safetensors"))
    assert len(set(results)) == 1 and results[0] is not None, results
    kind_, message = results[0]
    assert kind_ == "ArgumentValueError" and "nothing was written" in message
    assert {"file": "is a file", "link_to_file": "is a file", "fifo": "not a folder",
            "dangling_link": "does not exist"}[kind] in message
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "real.bin").read_bytes() == b"someone's file"
    assert os.path.islink(target) == (kind in ("link_to_file", "dangling_link"))
    if kind == "file":
        assert target.read_bytes() == b"someone's file"


def test_a_link_to_a_folder_is_written_through(tmp_path):
    """As save_pretrained does: the link stays a link, the folder it points to gets the checkpoint
    and keeps its other files."""
    state = models.state_with_seed(models.Awkward, seed=44)
    save_file(state, str(tmp_path / "in.safetensors"))
    real = tmp_path / "runs" / "run-7"
    real.mkdir(parents=True)
    files = _project(real)
    (tmp_path / "latest").symlink_to(real)
    assert run_world(2, _save_into, str(tmp_path), "latest", str(tmp_path / "in.safetensors")) == [None, None]
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "latest").resolve() == real
    assert _files(real) == dict(files, **{"model.safetensors": (real / "model.safetensors").read_bytes()})
    saved = load_file(str(real / "model.safetensors"))
    assert all(torch.equal(saved[k], state[k]) for k in state)


def _saved_twice(out):
    model = build_zero(models.Awkward)
    return [zload.save(model, out, max_shard_size=200).files for _ in range(2)]


def test_every_rank_reports_the_shards_as_rank_0_named_them(tmp_path):
    """Rank 0 alone sees that a second save's standard shard names are taken and tags them with
    the save's token; every rank's report names the files now in the folder."""
    (first, second), (first_1, second_1) = run_world(2, _saved_twice, str(tmp_path / "out"))
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert first == first_1 and second == second_1 and len(second) > 1
    assert set(second) == set(weight_map.values()) and not set(second) & set(first)
    assert all((tmp_path / "out" / name).is_file() for name in second)


def _saved_under_the_old_name(out):
    model = build_zero(models.Awkward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = zload.save(model, out, max_shard_size=200, buffer_bytes=64)
    return report.files, [str(w.message) for w in caught if "buffer_bytes" in str(w.message)]


def test_buffer_bytes_is_the_old_name_of_staging_bytes(tmp_path):
    """load_into and save name their I/O buffer the same; save's old name still works, with a warning
    (rank 0's: every rank would give the same)."""
    (files, warned), (_, elsewhere) = run_world(2, _saved_under_the_old_name, str(tmp_path / "out"))
    assert files and len(warned) == 1 and "staging_bytes" in warned[0] and elsewhere == [], warned


def _save_in_dtype(out, dtype):
    """A ZeRO-3 Linear saved with ``dtype``: the dtypes written, or the error's (class, message)."""
    model = build_zero(lambda: torch.nn.Linear(4, 3))
    try:
        zload.save(model, out, dtype=dtype)
    except zload.ZloadError as e:
        return type(e).__name__, str(e)
    return sorted(str(t.dtype) for t in load_file(f"{out}/model.safetensors").values())


def test_dtype_is_a_torch_dtype_or_its_name(tmp_path):
    """``dtype`` is resolved once, where it enters: torch.bfloat16 and "bfloat16" save the same;
    a name of no dtype is an ArgumentValueError on every rank (it was an unexpected error)."""
    for dtype in (torch.bfloat16, "bfloat16", "torch.bfloat16"):
        assert run_world(2, _save_in_dtype, str(tmp_path / "out"), dtype) == [["torch.bfloat16"] * 2] * 2
    (kind, message), again = run_world(2, _save_in_dtype, str(tmp_path / "out"), "bfloat17")
    assert again == (kind, message) and kind == "ArgumentValueError", message
    assert "dtype='bfloat17': expected a torch.dtype, such as torch.bfloat16" in message


def _save_linear(out):
    """Every rank saves a ZeRO-3 128x128 Linear (64 KiB of weights) to ``out``; (error class,
    errno, path, message), or None when the save succeeded."""
    model = build_zero(lambda: torch.nn.Linear(128, 128))
    try:
        zload.save(model, out, staging_bytes=4096)
    except zload.ZloadError as e:
        return type(e).__name__, getattr(e, "errno", None), e.path, str(e)
    return None


def fill_the_disk(out, body, *args) -> dict[str, bytes]:
    """``body(*args, out)`` (a save of two ranks, which returns what ``_save_linear`` does) run
    twice on a filesystem with room for one result in ``out``: the first succeeds, and the second,
    beside it, meets the full disk. Every rank raises a WriteError (ENOSPC) naming the file being
    written, what state the folder is in and what to do, not a bug's traceback; the first result
    and someone's file stay as they were, and no byte of the second does. Returns ``out``'s files."""
    import errno
    import os
    import re

    assert run_world(2, body, *args, str(out)) == [None, None]
    (out / "notes.txt").write_text("someone's notes")
    before, free = _files(out), os.statvfs(out).f_bfree
    results = run_world(2, body, *args, str(out))
    assert len(set(results)) == 1, results
    kind, code, path, message = results[0]
    assert (kind, code) == ("WriteError", errno.ENOSPC), message
    assert re.fullmatch(re.escape(str(out)) + r"/\.zload-save-[0-9a-f]+/model\.safetensors", path), path
    assert f"cannot write {path}: no space left on its filesystem (ENOSPC); free space there" in message
    assert f"saving to {out} failed; {out} still holds what it held before" in message
    assert "unexpected" not in message
    assert _files(out) == before and os.statvfs(out).f_bfree == free
    return before


def test_a_full_disk_fails_every_rank_and_leaves_the_folder_as_it_was(small_disk):
    out = small_disk(24 * 4096) / "out"  # a save takes 17 pages: room for one, not two
    assert sorted(fill_the_disk(out, _save_linear)) == ["model.safetensors", "notes.txt"]


def _save_with_rank_arguments(folder, case):
    """Every rank saves, rank 0 with other arguments than the rest (``case``); (the error class,
    its message) or None, and whether anything was written into ``folder``."""
    rank = dist.get_rank()
    model = build_zero(models.Awkward)
    arguments = {"dtype": {"dtype": torch.float16 if rank == 0 else None},
                 "max_shard_size": {"max_shard_size": 200 if rank == 0 else "5GB"}}.get(case, {})
    try:
        zload.save(model if case != "model" or rank else None, os.path.join(folder, "out"), **arguments)
        return None
    except zload.ZloadError as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("case", ["dtype", "max_shard_size", "model"])
def test_ranks_saving_with_different_arguments_are_refused(tmp_path, case):
    """A save whose ranks passed different arguments (another dtype or shard size, no model) is
    refused on every rank, naming the argument, before anything is written: they would have
    written a checkpoint of mixed dtypes, failed with a misleading error, or waited for each other.
    The path may differ (each node may name its local disk otherwise)."""
    results = run_world(2, _save_with_rank_arguments, str(tmp_path), case)
    assert all(r is not None for r in results), results
    assert {kind for kind, _ in results} == {"ArgumentValueError"}, results
    assert all(f"{case}:" in message and "nothing was written" in message for _, message in results), results
    assert list(tmp_path.iterdir()) == []
