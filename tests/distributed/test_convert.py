"""``zload.convert`` / ``zload convert``: DeepSpeed's own checkpoints into Hugging Face safetensors.

Checkpoints are real: ``deepspeed.initialize``, one training step, ``engine.save_checkpoint``
(tests/support/native_checkpoints.py, the cases of tests/distributed/test_native_checkpoints.py,
built once a session). The reference is DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``:
every tensor written must equal it bit for bit, in name and dtype, a tied alias written once under
the name stored.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import zload

from tests.distributed.test_native_checkpoints import CASES
from tests.distributed.test_save import fill_the_disk
from tests.support import REPO
from tests.support.checkpoints import read_all
from tests.support.harness import exit_aborting_hook, run_world
from tests.support.models import tiny_llama_config
from tests.support.native_checkpoints import NativeCase, deepspeed_reference, zload_reference
from tests.support.zero3 import assert_bit_equal

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------------------------------
# helpers

def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def _check_master(out, case: NativeCase) -> dict[str, torch.Tensor]:
    """``out`` holds what zload reads of ``case`` (DeepSpeed's reference), names, dtypes and
    bits, each tied alias once, under the name stored."""
    reference, written = zload_reference(case), read_all(out)
    assert set(case.tied) <= set(reference)
    assert sorted(written) == sorted(set(reference) - set(case.tied))
    for name, tensor in written.items():
        assert_bit_equal(tensor, reference[name], name)
    assert zload.open_checkpoint(out).tensors.keys() == written.keys()
    return written


def _converted(folder, out, **kwargs) -> Path:
    zload.convert(folder, out, **kwargs)
    return Path(out)


def _convert_body(folder, out, kwargs) -> list[str]:
    return zload.convert(folder, out, **kwargs).files


# ---------------------------------------------------------------------------------------------
# master weights: DeepSpeed's reference

@pytest.fixture(scope="module")
def zero3_w2(native_checkpoint, tmp_path_factory) -> NativeCase:
    """A bf16 tiny Llama, ZeRO-3 on 2 ranks, frozen parameters and tied embeddings, in a folder
    that also holds its config.json, as an HF Trainer's checkpoint-N/ does."""
    case = native_checkpoint(world=2, stage=3, dtype="bf16")
    folder = tmp_path_factory.mktemp("trainer") / "checkpoint-1"
    shutil.copytree(case.folder, folder)
    tiny_llama_config(tie=True).to_json_file(folder / "config.json")
    return case._replace(folder=folder, tag_folder=folder / case.tag_folder.name)


def test_zero3_bf16_masters_as_deepspeed_writes_them(zero3_w2, tmp_path):
    written = _check_master(_converted(zero3_w2.folder, tmp_path / "out"), zero3_w2)
    frozen, trainable = zero3_w2.frozen_names[0], "model.embed_tokens.weight"
    assert written[frozen].dtype == torch.bfloat16 and written[trainable].dtype == torch.float32
    assert not torch.equal(written[trainable], zero3_w2.module_weights[trainable].float()), "masters are fp32"
    assert_bit_equal(written[trainable], zero3_w2.masters[trainable], trainable)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert (tmp_path / "out" / "config.json").read_bytes() == (zero3_w2.folder / "config.json").read_bytes()


def test_dot_dot_after_a_link_goes_up_from_where_the_link_leads(zero3_w2, tmp_path):
    """As for ``zload.save``: ``latest/../out`` with ``latest`` a link into ``runs/`` is
    ``runs/out``, never ``./out``."""
    (tmp_path / "runs" / "run-7").mkdir(parents=True)
    (tmp_path / "latest").symlink_to(tmp_path / "runs" / "run-7")
    zload.convert(zero3_w2.folder, tmp_path / "reference")
    zload.convert(zero3_w2.folder, f"{tmp_path}/latest/../out")
    assert not (tmp_path / "out").exists()
    assert _files(tmp_path / "runs" / "out") == _files(tmp_path / "reference")


def test_the_output_loads_with_transformers_alone(zero3_w2, tmp_path):
    """``from_pretrained`` without DeepSpeed gets every tensor, the tied head included, equal to
    DeepSpeed's reference: nothing missing, unexpected or re-initialised."""
    zload.convert(zero3_w2.tag_folder, tmp_path / "out")
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                                output_loading_info=True)
    assert not any(info.values()), info
    reference = deepspeed_reference(zero3_w2.folder)
    state = model.state_dict()
    assert sorted(state) == sorted(reference)
    for name, tensor in state.items():
        assert_bit_equal(tensor, reference[name].float(), name)


@pytest.mark.parametrize("name", CASES)
def test_every_kind_of_checkpoint(native_checkpoint, tmp_path, name):
    """ZeRO-1/2/3, bf16/fp16/fp32, saved by 1-3 ranks; several fp32 flat groups; an offloaded
    optimizer; ZeRO-1/2's last partitions saved without their padding; buffers (floating ones as
    float32, integer ones as they are); ZeRO-1's frozen parameters, which DeepSpeed's reader drops,
    as the module holds them."""
    case = native_checkpoint(**CASES[name])
    written = _check_master(_converted(case.folder, tmp_path / "out"), case)
    for buffer in case.buffer_names:
        floating = case.module_weights[buffer].is_floating_point()
        assert written[buffer].dtype == (torch.float32 if floating else case.module_weights[buffer].dtype)


# ---------------------------------------------------------------------------------------------
# module weights: the engine's own

@pytest.mark.parametrize("name", ["z3-bf16-w2-groups", "z3-fp16-w2", "z2-bf16-w2", "z1-bf16-w2-awkward"])
def test_module_weights_are_the_engines_own(native_checkpoint, tmp_path, name):
    """ZeRO-3 stores only fp32 masters: cast to the module's 16 bits they are bit for bit the live
    engine's gathered weights (frozen ones too); ZeRO-1/2 store the module's weights as they are."""
    case = native_checkpoint(**CASES[name])
    written = read_all(_converted(case.folder, tmp_path / "out", weights="module"))
    assert sorted(written) == sorted(set(case.module_weights) - set(case.tied))
    for tensor_name, tensor in written.items():
        assert_bit_equal(tensor, case.module_weights[tensor_name], tensor_name)


# ---------------------------------------------------------------------------------------------
# layout and processes

def test_sharded_as_save_pretrained_shards(zero3_w2, tmp_path):
    """A small max_shard_size: huggingface_hub's splitter over the tensors in module order, the
    index naming every tensor, each file's digest recorded (``verify="full"`` checks it)."""
    report = zload.convert(zero3_w2.folder, tmp_path / "out", max_shard_size="8KB")
    n = len(report.files)
    assert n > 2 and report.files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    written = _check_master(tmp_path / "out", zero3_w2)
    assert sorted(index["weight_map"]) == sorted(written)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    assert os.listdir(tmp_path / "out").count("config.json") == 1
    done = subprocess.run([sys.executable, "-m", "zload", "validate", "--full", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and f"{n} files matched the digest" in done.stdout, done.stderr


@pytest.mark.parametrize("world", [2, 3])
def test_processes_write_the_same_bytes_as_one(zero3_w2, tmp_path, world):
    for shard in ("5GB", "6KB"):
        zload.convert(zero3_w2.folder, tmp_path / f"one-{shard}", max_shard_size=shard)
        files = run_world(world, _convert_body, zero3_w2.folder, str(tmp_path / f"many-{shard}"),
                          {"max_shard_size": shard, "staging_bytes": 4096})
        assert files == [files[0]] * world and (len(files[0]) == 1) == (shard == "5GB")
        assert _files(tmp_path / f"many-{shard}") == _files(tmp_path / f"one-{shard}")


# ---------------------------------------------------------------------------------------------
# the config.json copied beside the weights

SECRET = b"hf_a-token-not-to-publish"


def _checkpoint_with(zero3_w2, folder: Path, config=None) -> Path:
    """A copy of the HF Trainer folder ``zero3_w2.folder`` at ``folder``; ``config(path)`` puts
    what the test wants at its config.json."""
    shutil.copytree(zero3_w2.folder, folder)
    (folder / "config.json").unlink()
    if config:
        config(folder / "config.json")
    return folder


def _convert_all(jobs) -> list[list[str]]:
    """Convert each (checkpoint, out) of ``jobs`` in turn; the ZloadWarnings each gave this rank."""
    seen = []
    for folder, out in jobs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zload.convert(folder, out, staging_bytes=4096)
        seen.append([str(w.message) for w in caught if issubclass(w.category, zload.ZloadWarning)])
    return seen


def _run_conversions(tmp_path, checkpoints: dict[str, Path]) -> dict[str, list[list[str]]]:
    """Every checkpoint converted by two ranks into OUT/<name>: the warnings of rank 0 and 1."""
    jobs = [(str(folder), str(tmp_path / "out" / name)) for name, folder in checkpoints.items()]
    warned = run_world(2, _convert_all, jobs, timeout=120)
    return {name: [warned[0][k], warned[1][k]] for k, name in enumerate(checkpoints)}


def test_only_a_config_inside_the_checkpoint_is_copied(zero3_w2, tmp_path):
    """A config.json that is a link out of the checkpoint folder (to a token), directly or through
    a link inside it, is left out with a warning (rank 0's, which copies it) naming it and where it
    leads; one that is a link staying inside, or a Hub cache snapshot's link into the repository's
    blobs, is copied byte for byte. The weights are written either way."""
    model_config = (zero3_w2.folder / "config.json").read_bytes()
    (tmp_path / "token").write_bytes(SECRET)

    def inside(config):
        (config.parent / "configs").mkdir()
        (config.parent / "configs" / "model.json").write_bytes(model_config)
        config.symlink_to("configs/model.json")

    def through(config):
        (config.parent / "alias.json").symlink_to(tmp_path / "token")
        config.symlink_to("alias.json")

    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "0123abc"
    (tmp_path / "hub" / "models--org--name" / "blobs").mkdir(parents=True)
    (tmp_path / "hub" / "models--org--name" / "blobs" / "4567def").write_bytes(model_config)
    checkpoints = {
        "outside": _checkpoint_with(zero3_w2, tmp_path / "outside", lambda c: c.symlink_to(tmp_path / "token")),
        "relative": _checkpoint_with(zero3_w2, tmp_path / "relative", lambda c: c.symlink_to("../token")),
        "through": _checkpoint_with(zero3_w2, tmp_path / "through", through),
        "inside": _checkpoint_with(zero3_w2, tmp_path / "inside", inside),
        "hub": _checkpoint_with(zero3_w2, snapshot / "last-checkpoint",
                                lambda c: c.symlink_to("../../../blobs/4567def")),
    }
    warned = _run_conversions(tmp_path, checkpoints)
    zload.convert(zero3_w2.folder, tmp_path / "reference")
    weights = _files(tmp_path / "reference")
    for name in ("outside", "relative", "through"):
        (note,), [] = warned[name]
        assert note == (f"{checkpoints[name] / 'config.json'} is not copied beside the weights: it is "
                        f"a link to '{tmp_path / 'token'}', outside {checkpoints[name]}, and no other file of "
                        "this machine (a token, a key) may end up there; copy the model's config.json there "
                        "yourself")
        assert _files(tmp_path / "out" / name) == {"model.safetensors": weights["model.safetensors"]}
    for name in ("inside", "hub"):
        assert warned[name] == [[], []]
        assert _files(tmp_path / "out" / name) == weights and weights["config.json"] == model_config


@pytest.mark.parametrize("kind", ["fifo", "not-json", "folder", "dangling"])
def test_a_config_that_is_no_regular_json_file_is_left_out(zero3_w2, tmp_path, kind):
    """A FIFO named config.json (which would block a reader forever), a file that is not JSON (a
    token dropped there), a folder or a dangling link: left out with a warning that names it and
    says why; the weights are written, no rank waits."""
    make = {"fifo": os.mkfifo, "not-json": lambda c: c.write_bytes(SECRET), "folder": os.mkdir,
            "dangling": lambda c: c.symlink_to("nowhere.json")}[kind]
    folder = _checkpoint_with(zero3_w2, tmp_path / "checkpoint", make)
    (notes, []), = _run_conversions(tmp_path, {"out": folder}).values()
    read = folder / ("nowhere.json" if kind == "dangling" else "config.json")  # the link's target
    why = {"fifo": "is a FIFO, not a regular file", "not-json": "not JSON zload reads",
           "folder": "is a directory, not a regular file", "dangling": "cannot read: No such file"}[kind]
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"{folder / 'config.json'} is not copied beside the weights: {read}: {why}")
    assert notes[0].endswith("; copy the model's config.json there yourself"), notes
    zload.convert(zero3_w2.folder, tmp_path / "reference")
    weights = _files(tmp_path / "reference")["model.safetensors"]
    assert _files(tmp_path / "out" / "out") == {"model.safetensors": weights}


def test_zload_convert_warns_of_the_config_it_leaves_out(zero3_w2, tmp_path):
    """``zload convert`` in one process: a config.json linking to a token outside the checkpoint
    is named on stderr and left out; the conversion succeeds."""
    (tmp_path / "token").write_bytes(SECRET)
    folder = _checkpoint_with(zero3_w2, tmp_path / "checkpoint", lambda c: c.symlink_to(tmp_path / "token"))
    done = subprocess.run([sys.executable, "-m", "zload", "convert", str(folder), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"ZloadWarning: {folder / 'config.json'} is not copied beside the weights: it is a link to "
            f"'{tmp_path / 'token'}', outside {folder}") in done.stderr, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]


# ---------------------------------------------------------------------------------------------
# failures: every rank raises the same error, OUT keeps what it held

def _convert_failing_on(rank_failing, folder, out, corrupt, how) -> tuple[str, str] | list[str]:
    import torch.distributed as dist

    import zload.saving.writer

    rank, original = dist.get_rank(), zload.saving.writer._pwrite_all
    if rank == rank_failing and how == "disk":
        def disk_full(*args):
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        zload.saving.writer._pwrite_all = disk_full
    try:
        return zload.convert(corrupt if rank == rank_failing and how == "corrupt" else folder, out,
                             staging_bytes=4096).files
    except zload.ZloadError as e:
        return type(e).__name__, str(e)
    finally:
        zload.saving.writer._pwrite_all = original


@pytest.mark.parametrize("how,world", [("corrupt", 2), ("disk", 3)])
def test_a_failure_on_one_rank_fails_every_rank_and_leaves_out_as_it_was(zero3_w2, tmp_path, how, world):
    """A corrupt optimizer state file that one rank reads (its own copy), or a full disk on one
    rank while writing: the same error on every rank, naming the rank; OUT as it was."""
    corrupt = tmp_path / "corrupt"
    shutil.copytree(zero3_w2.folder, corrupt)
    victim = next((corrupt / "global_step1").glob("*rank_1_mp_rank_00_optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-1000])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone's notes")
    results = run_world(world, _convert_failing_on, 1, zero3_w2.folder, str(out), str(corrupt), how)
    assert all(isinstance(r, tuple) for r in results), results
    # the same error, but for the heading, where each rank names the checkpoint it was given
    assert len({(kind, message.split("\n", 1)[1]) for kind, message in results}) == 1, results
    kind, message = results[0]
    expected = {"corrupt": ("InvalidCheckpointError", "nothing was written"),
                "disk": ("WriteError", "still holds what it held before")}[how]
    assert kind == expected[0] and expected[1] in message and "[rank 1]" in message, message
    assert _files(out) == {"notes.txt": b"someone's notes"}


def _pages(folder) -> int:
    """The 4 KiB pages the files in ``folder`` take on a tmpfs."""
    return sum(-(-p.stat().st_size // 4096) for p in Path(folder).iterdir())


def _convert_error(folder, out):
    """As ``test_save._save_linear``: the error's class, errno, path and message, or None."""
    try:
        zload.convert(folder, out, staging_bytes=4096)
    except zload.ZloadError as e:
        return type(e).__name__, getattr(e, "errno", None), e.path, str(e)
    return None


def test_a_full_disk_fails_every_rank_and_leaves_out_as_it_was(zero3_w2, tmp_path, small_disk):
    """A real full filesystem (a small tmpfs) under OUT, which holds an earlier conversion that
    leaves too little room for the new files beside it: every rank raises a WriteError (ENOSPC)
    naming the file being written, what state OUT is in and what to do (``fill_the_disk``); OUT
    keeps the earlier conversion."""
    zload.convert(zero3_w2.folder, tmp_path / "reference")
    pages = _pages(tmp_path / "reference") + 1  # and the notes
    out = small_disk((pages + pages // 2) * 4096) / "out"
    assert fill_the_disk(out, _convert_error, zero3_w2.folder) == {**_files(tmp_path / "reference"),
                                                                   "notes.txt": b"someone's notes"}


@pytest.mark.slow
def test_a_file_size_limit_fails_zload_convert_under_torchrun(zero3_w2, tmp_path):
    """``torchrun -m zload convert`` in processes whose files may not grow past a limit
    (RLIMIT_FSIZE, ``ulimit -f``), smaller than the one-file output: a real EFBIG while creating
    it, which each rank reports as a named error saying to write smaller shards, OUT as it was;
    smaller shards then fit."""
    zload.convert(zero3_w2.folder, tmp_path / "reference")
    limit = (tmp_path / "reference" / "model.safetensors").stat().st_size // 2
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone's notes")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "zload", "convert", str(zero3_w2.folder), str(out)]

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
                          preexec_fn=limited)
    assert done.returncode != 0, done.stdout[-3000:]
    # each rank that reports before torchrun stops the others when the first exits (their lines
    # may interleave)
    errors = done.stderr.count(f"zload: error: cannot save to {out}; nothing was written:")
    assert errors >= 1 and done.stderr.count(
        "/model.safetensors: the file would be larger than its filesystem or this process (ulimit -f) allows "
        "(EFBIG); write smaller shards (max_shard_size)") == errors, done.stderr[-3000:]
    assert "unexpected" not in done.stderr
    # a staging folder may be left if torchrun stopped rank 0 before it removed it: the next
    # conversion into OUT removes it (checked below)
    assert [p.name for p in out.iterdir() if not p.name.startswith(".zload-save-")] == ["notes.txt"]
    cmd += ["--max-shard-size", str(limit // 2)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
                          preexec_fn=limited)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    zload.convert(zero3_w2.folder, tmp_path / "shards", max_shard_size=limit // 2)
    assert _files(out) == {**_files(tmp_path / "shards"), "notes.txt": b"someone's notes"}


# ---------------------------------------------------------------------------------------------
# the command line

def test_cli(zero3_w2, tmp_path):
    from zload.cli import main

    assert main(["convert", str(zero3_w2.folder), str(tmp_path / "cli"), "--max-shard-size", "10KB"]) == 0
    zload.convert(zero3_w2.folder, tmp_path / "api", max_shard_size="10KB")
    assert _files(tmp_path / "cli") == _files(tmp_path / "api")
    assert main(["convert", str(zero3_w2.tag_folder), str(tmp_path / "module"), "--module-weights"]) == 0
    assert read_all(tmp_path / "module")["model.norm.weight"].dtype == torch.bfloat16
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2


def test_cli_under_torchrun(zero3_w2, tmp_path):
    """``torchrun -m zload convert``: the processes join one group, each writes its share."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "zload", "convert", str(zero3_w2.folder), str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(f"saved {cmd[-1]} (") == 2
    # gloo sometimes aborts at interpreter exit after the work is done; a finished conversion must
    # still exit 0: here every rank's teardown aborts (an exit handler that calls abort)
    aborting = {**env, "PYTHONPATH": f"{exit_aborting_hook(tmp_path / 'hook')}{os.pathsep}{REPO}"}
    cmd[-1] = str(tmp_path / "aborting")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=aborting)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(f"saved {cmd[-1]} (") == 2  # the report is printed before leaving
    assert _files(tmp_path / "aborting") == _files(tmp_path / "out")
    zload.convert(zero3_w2.folder, tmp_path / "one")
    assert _files(tmp_path / "out") == _files(tmp_path / "one")


# ``zload convert`` started by a process of a distributed job inherits its RANK, WORLD_SIZE,
# MASTER_ADDR and MASTER_PORT: it converts alone when told to, else fails within seconds

def _zload_convert_child(folder, out, args, env) -> tuple[int, float, str] | None:
    """Rank 0 runs ``zload convert`` as a subprocess (its environment inherited), as a training
    script converting after training would."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "zload", "convert", str(folder), str(out), *args],
                          capture_output=True, text=True, timeout=200,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    return done.returncode, time.monotonic() - start, done.stderr


@pytest.mark.parametrize("args,env", [(["--single-process"], {}), ([], {"ZLOAD_SINGLE_PROCESS": "1"})])
def test_convert_from_inside_a_job_runs_as_one_process_when_told(zero3_w2, tmp_path, args, env):
    status, _, stderr = run_world(2, _zload_convert_child, zero3_w2.folder, tmp_path / "out", args, env)[0]
    assert status == 0, stderr[-3000:]
    zload.convert(zero3_w2.folder, tmp_path / "one")
    assert _files(tmp_path / "out") == _files(tmp_path / "one")


def _assert_fails_within_seconds(result, out: Path, why: str) -> None:
    status, seconds, stderr = result
    assert status == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert seconds < 40, f"{seconds:.0f} s"  # the command's own wait is 5 s; the rest is importing torch
    assert "zload: error: this zload convert's environment (RANK=0, WORLD_SIZE=2, MASTER_ADDR:MASTER_PORT=" in stderr
    assert why in stderr and "pass --single-process (or set ZLOAD_SINGLE_PROCESS=1)" in stderr, stderr
    assert "torchrun --nproc_per_node 2 -m zload convert" in stderr and "Nothing was written." in stderr
    assert not out.exists()


def test_convert_from_inside_a_job_fails_within_seconds(zero3_w2, tmp_path):
    """The job's rank 0 holds the store at MASTER_PORT (no torchrun agent): the child cannot use it."""
    result = run_world(2, _zload_convert_child, zero3_w2.folder, tmp_path / "out", [], {})[0]
    _assert_fails_within_seconds(result, tmp_path / "out", "could not be used")


WORKER = """
import json, os, subprocess, sys, time
if os.environ["RANK"] == "0":
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "zload", "convert", *sys.argv[1:]], capture_output=True, text=True)
    print(json.dumps([done.returncode, time.monotonic() - start, done.stderr]))
"""


@pytest.mark.slow
def test_convert_from_inside_a_torchrun_worker_fails_within_seconds(zero3_w2, tmp_path):
    """Under torchrun the workers share the agent's store: the child joins it, and rank 1's
    process never comes."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "worker.py"), str(zero3_w2.folder), str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    _assert_fails_within_seconds(result, tmp_path / "out", "within 5 s the process of rank 1 did not come; process ")
    assert ", which started this one, holds the same variables: a process of a distributed job" in result[2]


WRAPPER = """
[ "$RANK" = 1 ] && sleep 8
"$PYTHON" -m zload convert "$@"
"""


@pytest.mark.slow
def test_torchrun_of_a_shell_wrapper_gives_its_processes_time_to_meet(zero3_w2, tmp_path):
    """torchrun starts a shell script that runs ``zload convert`` (not with exec): the shell holds
    the launch variables too, but a launcher started it, so the processes wait for each other as
    long as any launch's, and rank 1 coming 8 s late still converts."""
    (tmp_path / "wrapper.sh").write_text(WRAPPER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--no-python",
           "sh", str(tmp_path / "wrapper.sh"), str(zero3_w2.folder), str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    zload.convert(zero3_w2.folder, tmp_path / "one")
    assert _files(tmp_path / "out") == _files(tmp_path / "one")


def _convert_with_rank_weights(folder, out):
    """Rank 0 converts the masters, the others the module's weights: (error class, message)."""
    import torch.distributed as dist

    try:
        zload.convert(folder, out, weights="master" if dist.get_rank() == 0 else "module")
    except zload.ZloadError as e:
        return type(e).__name__, str(e)
    return None


def test_ranks_converting_with_different_arguments_are_refused(zero3_w2, tmp_path):
    """Every rank refuses a conversion whose ranks passed different arguments, naming the argument
    and what each rank passed, before anything is read or written."""
    results = run_world(2, _convert_with_rank_weights, zero3_w2.folder, str(tmp_path / "out"))
    assert all(r is not None and r[0] == "ArgumentValueError" for r in results), results
    assert "weights:" in results[0][1] and "'module' on rank 1" in results[0][1], results[0][1]
    assert not (tmp_path / "out").exists()
