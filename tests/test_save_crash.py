"""Crash safety of ``zload.save``: a save killed or failing at any point leaves ``path`` as it was.

Each case is a real torchrun job (tests/save_crash_rank.py) of 2 or 3 gloo ranks that loads a
known checkpoint into a ZeRO-3 ``models.Awkward`` and saves it, sharded, to OUT. One rank is
killed (``os._exit(9)``) at a chosen point of the save; torchrun then tears the job down. OUT is
compared byte for byte with what it was before: absent, or a previous checkpoint. Temporary
siblings ``OUT.zload-tmp-*`` may remain after a kill (nobody is left to remove them); they are
never at OUT's name. A failure that is not a kill (an OSError on one rank) must raise the same
``ZloadError`` on every rank, remove the temporary folder and leave OUT as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from . import models

RANK_SCRIPT = Path(__file__).with_name("save_crash_rank.py")
REPO = Path(__file__).parent.parent
JOB_TIMEOUT = 120
OLD_NOTE = "a previous checkpoint, to be kept until a save succeeds\n"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The checkpoint every job loads and then saves (so the saved values are known)."""
    folder = tmp_path_factory.mktemp("source")
    state = models.state_with_seed(models.Awkward, seed=61)
    save_file(state, str(folder / "in.safetensors"))
    return folder / "in.safetensors", state


def _previous_checkpoint(out: Path) -> None:
    out.mkdir(parents=True)
    save_file(models.state_with_seed(models.Awkward, seed=62), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "NOTE.txt").write_text(OLD_NOTE)


def _tree(path: Path) -> dict[str, bytes] | None:
    """Every file under ``path`` (relative name -> bytes), or None when ``path`` does not exist."""
    if not os.path.lexists(path):
        return None
    assert path.is_dir() and not path.is_symlink(), f"{path} is not a folder"
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f"{out.name}.zload-tmp-*"))


def _run_job(tmp_path: Path, source_file: Path, out: Path, world: int, *, crash_at: str | None = None,
             crash_rank: int = 0, shared: bool | None = None):
    """Run one torchrun job; (return code, {rank: result}, ranks killed where planned, log)."""
    results = tmp_path / "results"
    results.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CRASH_AT", "CRASH_RANK", "SHARED")}
    env.update(OUT=str(out), IN=str(source_file), RESULTS=str(results), PYTHONPATH=str(REPO),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if crash_at:
        env.update(CRASH_AT=crash_at, CRASH_RANK=str(crash_rank))
    if shared is not None:
        env["SHARED"] = "1" if shared else "0"
    # --standalone: torchrun picks free ports itself (no race between picking one and binding it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "--max-restarts", "0", "--monitor-interval", "0.1", str(RANK_SCRIPT)]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        log = job.communicate(timeout=JOB_TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        log = job.communicate()[0]
        pytest.fail(f"the job hung (> {JOB_TIMEOUT} s):\n{log[-5000:]}")
    finally:
        try:  # workers torchrun may have left behind: this job's own process group only
            os.killpg(job.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    got = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in results.glob("rank*.json")}
    killed = {int(p.name.removeprefix("killed-rank")): p.read_text() for p in results.glob("killed-rank*")}
    return job.returncode, got, killed, log


def _assert_new_checkpoint(out: Path, state: dict[str, torch.Tensor]) -> None:
    """OUT holds exactly the saved checkpoint: shards + index, the loaded values bit for bit."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert sorted(_tree(out)) == sorted(shards + ["model.safetensors.index.json"])
    saved = {}
    for shard in shards:
        saved.update(load_file(str(out / shard)))
    assert sorted(saved) == sorted(state)
    for name, tensor in saved.items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name


# (CRASH_AT, rank killed, world size, shared_filesystem); see tests/save_crash_rank.py
KILLS = [
    ("plan", 1, 2, None),        # planning: nothing created yet
    ("create", 0, 2, None),      # the temporary folder and its empty shards exist
    ("write", 0, 2, None),       # rank 0 wrote one chunk
    ("write", 2, 3, None),       # the last rank wrote one chunk, the others go on writing
    ("send", 1, 3, False),       # no shared filesystem: a rank dies streaming its slices to rank 0
    ("metadata", 0, 2, None),    # all ranks agreed the writes succeeded; index not yet written
    ("swap", 0, 3, None),        # complete and fsynced, not yet renamed into place
]


@pytest.mark.parametrize("previous", [False, True], ids=["no-previous", "previous"])
@pytest.mark.parametrize("crash_at,crash_rank,world,shared", KILLS,
                         ids=[f"{k[0]}-rank{k[1]}-of-{k[2]}" for k in KILLS])
def test_a_killed_save_leaves_path_as_it_was(tmp_path, source, record_property, crash_at, crash_rank,
                                             world, shared, previous):
    out = tmp_path / "ckpt" / "out"
    if previous:
        _previous_checkpoint(out)
    else:
        out.parent.mkdir()
    before = _tree(out)

    rc, results, killed, log = _run_job(tmp_path, source[0], out, world, crash_at=crash_at,
                                        crash_rank=crash_rank, shared=shared)
    assert killed == {crash_rank: crash_at}, f"the kill point was not reached:\n{log[-5000:]}"
    assert rc != 0
    assert not any(r["ok"] for r in results.values()), results  # no rank believes it saved
    assert _tree(out) == before, f"{out} changed after a kill at {crash_at!r}"
    if not previous:
        assert not os.path.lexists(out)
    # only temporary siblings may remain, never anything else next to OUT
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        ([out.name] if previous else []) + _siblings(out))
    leftovers = _siblings(out)
    assert len(leftovers) <= 1
    record_property("leftover_tmp", leftovers)
    if crash_rank == 0 and crash_at != "plan":
        assert leftovers, "rank 0 died after creating the temporary folder: nobody removes it"


@pytest.mark.parametrize("previous", [False, True], ids=["no-previous", "previous"])
def test_killed_right_after_the_swap_keeps_the_new_checkpoint(tmp_path, source, record_property,
                                                              previous):
    """Past the rename, the save has happened: OUT is the new checkpoint, whole."""
    out = tmp_path / "out"
    if previous:
        _previous_checkpoint(out)
    rc, _, killed, log = _run_job(tmp_path, source[0], out, 2, crash_at="swapped", crash_rank=0)
    assert killed == {0: "swapped"}, log[-5000:]
    assert rc != 0
    _assert_new_checkpoint(out, source[1])
    leftovers = _siblings(out)
    record_property("leftover_tmp", leftovers)
    if previous:  # the old checkpoint, exchanged out of the way, was about to be removed
        assert len(leftovers) == 1
        assert (out.parent / leftovers[0] / "NOTE.txt").read_text() == OLD_NOTE
    else:
        assert leftovers == []


@pytest.mark.parametrize("world,shared", [(2, None), (3, False)], ids=["shared-2", "stream-3"])
def test_a_successful_save_replaces_the_previous_checkpoint(tmp_path, source, world, shared):
    out = tmp_path / "out"
    _previous_checkpoint(out)
    stale = tmp_path / "out.zload-tmp-0123456789abcdef"  # left by an earlier killed save
    stale.mkdir()
    (stale / ".zload-writing").write_text("0123456789abcdef")

    rc, results, killed, log = _run_job(tmp_path, source[0], out, world, shared=shared)
    assert rc == 0 and not killed, log[-5000:]
    assert sorted(results) == list(range(world)) and all(r["ok"] for r in results.values()), results
    _assert_new_checkpoint(out, source[1])
    # this save's own temporary folder is gone (an earlier save's stale one is not its business)
    assert set(_siblings(out)) <= {stale.name}


FAILURES = [
    ("raise", 1, 3, False, "injected write failure"),  # rank 1's write raises OSError(EIO)
    ("raise-create", 0, 2, True, "injected: no space left"),  # rank 0 fails creating the shards
]


@pytest.mark.parametrize("crash_at,crash_rank,world,previous,expected", FAILURES,
                         ids=[f"{f[0]}-rank{f[1]}-of-{f[2]}" for f in FAILURES])
def test_a_failed_save_raises_on_every_rank_and_cleans_up(tmp_path, source, crash_at, crash_rank,
                                                         world, previous, expected):
    """One rank hits an OSError: every rank raises the same ZloadError; no hang, no trace left."""
    out = tmp_path / "out"
    if previous:
        _previous_checkpoint(out)
    before = _tree(out)
    rc, results, killed, log = _run_job(tmp_path, source[0], out, world, crash_at=crash_at,
                                        crash_rank=crash_rank)
    assert rc != 0 and not killed
    assert sorted(results) == list(range(world)), log[-5000:]
    assert all(r["error_type"] == "ZloadError" for r in results.values()), results
    messages = {r["message"] for r in results.values()}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert expected in message and f"[rank {crash_rank}]" in message and str(out) in message
    assert _tree(out) == before
    assert _siblings(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["results"] + (["out"] if previous else []))
