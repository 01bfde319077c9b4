"""Crash safety of ``zload.save``: a save killed or failing at any point never leaves a reader of
``path`` without a whole checkpoint, never touches the files zload does not own, and leaves
nothing behind that the next save does not remove.

Each case is a real torchrun job (tests/support/save_crash_rank.py) of 2 or 3 gloo ranks that
loads a known checkpoint into a ZeRO-3 ``models.Awkward`` and saves it, sharded, to OUT, a training
output folder holding files of other tools. One rank is killed (``os._exit(9)``) at a chosen point of
the save; torchrun then tears the job down. Then:

- a reader of OUT (model.safetensors first, then the index, as ``from_pretrained`` and zload
  look) finds the complete old checkpoint before the commit point, the complete new one after;
- the other files are byte for byte as they were, and nothing appears next to OUT;
- the surviving ranks that reported raised a ``PeerLostError`` naming the interrupted step;
- a following save (in this process) leaves exactly its own checkpoint and the other files.

A failure that is not a kill (an OSError on one rank) must raise the same ``ZloadError`` on
every rank and leave OUT exactly as it was.
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

import zload

from tests.support import REPO, SUPPORT, models

RANK_SCRIPT = SUPPORT / "save_crash_rank.py"
JOB_TIMEOUT = 120
MAX_SHARD = 200  # bytes: Awkward saves as several shards
# What a training output folder holds besides the weights; zload must never touch it.
OTHERS = {"trainer_state.json": b'{"global_step": 10}\n', "optimizer.pt": b"\x80\x04not really",
          "tokenizer.json": b'{"version": "1.0"}', "runs/events.out.tfevents": b"\x00log",
          "model.safetensors.bak": b"a user's own copy"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The checkpoint every job loads and then saves (so the saved values are known)."""
    folder = tmp_path_factory.mktemp("source")
    state = _state(61)
    save_file(state, str(folder / "in.safetensors"))
    return folder / "in.safetensors", state


def _state(seed: int) -> dict[str, torch.Tensor]:
    return models.state_with_seed(models.Awkward, seed=seed)


def _plain_awkward(seed: int) -> torch.nn.Module:
    model = models.Awkward()
    model.load_state_dict(_state(seed))
    return model


def _prepare(out: Path, previous: str) -> dict[str, torch.Tensor] | None:
    """OUT as a training run leaves it: the other tools' files, and an earlier checkpoint written
    by safetensors (``single``) or by zload with the same shard names the new save uses
    (``sharded``); returns that checkpoint's state."""
    if previous == "none":
        out.parent.mkdir(parents=True, exist_ok=True)
        return None
    for name, data in OTHERS.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    if previous == "single":
        save_file(_state(62), str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        zload.save(_plain_awkward(62), out, max_shard_size=MAX_SHARD)
    return _state(62)


def _tree(path: Path) -> dict[str, bytes] | None:
    """Every file under ``path`` (relative name -> bytes), or None when ``path`` does not exist."""
    if not os.path.lexists(path):
        return None
    assert path.is_dir() and not path.is_symlink(), f"{path} is not a folder"
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _others(out: Path) -> dict[str, bytes]:
    tree = _tree(out) or {}
    return {name: tree.get(name) for name in OTHERS}


def _reader_sees(out: Path) -> dict[str, torch.Tensor] | None:
    """The checkpoint a reader finds in OUT (None: none), read with safetensors the way
    ``from_pretrained`` chooses files; zload must find the same one."""
    if (out / "model.safetensors").exists():
        state = load_file(str(out / "model.safetensors"))
    elif (out / "model.safetensors.index.json").exists():
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        state = {}
        for shard in sorted(set(weight_map.values())):
            state.update(load_file(str(out / shard)))
        assert sorted(state) == sorted(weight_map), "the index and its shards disagree"
    else:
        return None
    with zload.open_checkpoint(out) as index:
        assert sorted(index.tensors) == sorted(state)
    return state


def _same(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    if a is None or b is None:
        return a is b
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


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


def _assert_only(out: Path, state: dict[str, torch.Tensor], others: dict[str, bytes | None]) -> None:
    """OUT holds the checkpoint ``state`` (its files and nothing else of zload's) and ``others``."""
    assert _same(_reader_sees(out), state)
    index = out / "model.safetensors.index.json"
    weights = (sorted(set(json.loads(index.read_text())["weight_map"].values())) + [index.name]
               if index.exists() else ["model.safetensors"])
    expected = sorted(weights + [name for name, data in others.items() if data is not None])
    assert sorted(_tree(out)) == expected
    assert _others(out) == others
    assert not list(out.glob(".zload-save-*"))


# (CRASH_AT, rank killed, world size, shared_filesystem, what OUT held before); see
# tests/support/save_crash_rank.py. Until "publish" no file a reader of OUT uses is touched (OUT may be
# created, and holds the staging folder), so one earlier state per point is enough, all three
# among them and "none" where rank 0 survives to clean up; from "publish" on, where files move
# into OUT, every state.
PREVIOUS = ("none", "single", "sharded")
KILLS = [
    ("plan", 1, 2, None, "none"),         # planning: nothing created yet
    ("create", 0, 2, None, "single"),     # the staging folder and its empty shards exist
    ("write", 0, 2, None, "sharded"),     # rank 0 wrote one chunk
    ("write", 2, 3, None, "none"),        # the last rank wrote one chunk, the others go on writing
    ("send", 1, 3, False, "sharded"),     # no shared filesystem: a rank dies streaming its slices to rank 0
] + [(*kill, previous) for kill in [
    ("publish", 0, 3, None),     # every file written and digested, nothing moved into OUT yet
    ("moved", 0, 2, None),       # the new shards are in OUT, unlisted; the old index still rules
    ("committed", 0, 2, None),   # the new index is in place; stale files not removed yet
    ("finish", 0, 2, None),      # stale files removed; the staging folder is still there
] for previous in PREVIOUS]
AFTER_COMMIT = {"committed", "finish"}
# what a survivor's error says about OUT, by the step it was in when the peer died
STATE_LEFT = dict.fromkeys(["plan"], "Nothing was written") | dict.fromkeys(
    ["create", "write", "send"], "still holds what it held before") | dict.fromkeys(
    ["publish", "moved", "committed", "finish"], "holds the old or the new checkpoint, never a mix")


@pytest.mark.parametrize("crash_at,crash_rank,world,shared,previous", KILLS,
                         ids=[f"{k[0]}-rank{k[1]}-of-{k[2]}-{k[4]}" for k in KILLS])
def test_a_killed_save_leaves_a_whole_checkpoint_and_nothing_the_next_save_keeps(
        tmp_path, source, crash_at, crash_rank, world, shared, previous):
    out = tmp_path / "ckpt" / "out"
    old = _prepare(out, previous)
    others = _others(out) if previous != "none" else dict.fromkeys(OTHERS)

    rc, results, killed, log = _run_job(tmp_path, source[0], out, world, crash_at=crash_at,
                                        crash_rank=crash_rank, shared=shared)
    assert killed == {crash_rank: crash_at}, f"the kill point was not reached:\n{log[-5000:]}"
    assert rc != 0
    assert not any(r["ok"] for r in results.values()), results  # no rank believes it saved
    for r in results.values():  # the survivors that got to say so: a peer is gone, and where
        assert r["error_type"] == "PeerLostError" and "was interrupted" in r["message"], r
        assert STATE_LEFT[crash_at] in r["message"], r

    # A reader finds a whole checkpoint: the old one until the commit point, the new one after.
    assert _same(_reader_sees(out), _state(61) if crash_at in AFTER_COMMIT else old)
    assert _others(out) == others
    assert sorted(p.name for p in out.parent.iterdir()) == (["out"] if os.path.lexists(out) else [])

    # The next save into OUT removes whatever the killed one left.
    zload.save(_plain_awkward(63), out, max_shard_size=MAX_SHARD)
    _assert_only(out, _state(63), others)


@pytest.mark.parametrize("world,shared", [(2, None), (3, False)], ids=["shared-2", "stream-3"])
def test_a_save_replaces_only_its_own_files(tmp_path, source, world, shared):
    """Saving into a folder that holds an earlier checkpoint and other files: the earlier
    checkpoint's files are replaced or removed, every other file stays as it was."""
    out = tmp_path / "out"
    _prepare(out, "sharded")
    others = _others(out)
    legacy = tmp_path / "out.zload-tmp-0123456789abcdef"  # left by a killed save of zload < 0.2
    legacy.mkdir()
    rc, results, killed, log = _run_job(tmp_path, source[0], out, world, shared=shared)
    assert rc == 0 and not killed, log[-5000:]
    assert sorted(results) == list(range(world)) and all(r["ok"] for r in results.values()), results
    _assert_only(out, _state(61), others)
    assert legacy.is_dir()  # named in a warning, not removed: no lock tells whether it still runs


FAILURES = [  # (CRASH_AT, failing rank, world size, shared_filesystem, OUT before, message)
    ("raise", 1, 3, None, "sharded", "injected write failure (EIO)"),  # rank 1's write raises OSError(EIO)
    ("raise", 0, 2, False, "single", "injected write failure (EIO)"),  # rank 0, writing what it streams
    ("raise-pack", 2, 3, False, "none", "injected: cannot read"),  # rank 2, preparing its slices
    ("raise-create", 0, 2, None, "none", "injected: no space left"),  # creating the shards
    ("raise-digest", 0, 2, None, "sharded", "injected: quota exceeded"),  # recording the digests
    ("raise-commit", 0, 2, None, "single", "injected: permission denied"),  # the commit rename
]
# a write of a file that fails is a WriteError naming it; the other points raise above zload's writes
WRITE_ERRORS = {"raise"}


@pytest.mark.parametrize("crash_at,crash_rank,world,shared,previous,expected", FAILURES,
                         ids=[f"{f[0]}-rank{f[1]}-of-{f[2]}{'-stream' if f[3] is False else ''}"
                              for f in FAILURES])
def test_a_failed_save_raises_on_every_rank_and_cleans_up(tmp_path, source, crash_at, crash_rank,
                                                         world, shared, previous, expected):
    """One rank hits an OSError: every rank raises the same ZloadError; no hang, no trace left."""
    out = tmp_path / "out"
    _prepare(out, previous)
    before = _tree(out)
    rc, results, killed, log = _run_job(tmp_path, source[0], out, world, crash_at=crash_at,
                                        crash_rank=crash_rank, shared=shared)
    assert rc != 0 and not killed
    assert sorted(results) == list(range(world)), log[-5000:]
    kind = "WriteError" if crash_at in WRITE_ERRORS else "ZloadError"
    assert all(r["error_type"] == kind for r in results.values()), results
    messages = {r["message"] for r in results.values()}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert expected in message and f"[rank {crash_rank}]" in message and str(out) in message
    assert "nothing was written" in message or "still holds what it held before" in message \
        or "is as it was" in message
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["results"] + (["out"] if before else []))
