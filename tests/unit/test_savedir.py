"""zload.savedir without processes: what a save may touch in its folder, and how killed saves are
told from running ones (a lock) and cleaned up after (their manifest)."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors.torch import save_file

import zload
from zload.saving.folder import LOCK, MANIFEST, STAGING_PREFIX, SaveFolder


def _killed_save(folder, token, manifest=None, lock=True, staged=()):
    """The staging folder a save killed at some point leaves: nobody holds its lock. A manifest
    given as lists of names records each file's identity as the folder holds it now."""
    staging = folder / (STAGING_PREFIX + token)
    staging.mkdir(parents=True)
    (staging / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    for name in staged:
        (staging / name).write_text("staged " + name)
    if lock:
        (staging / LOCK).write_text(f"{token}\npid 1 on elsewhere\n")
    if manifest is not None:
        manifest = dict({"commit": "model.safetensors.index.json", "configs": []}, **manifest)
        for key in ("created", "stale"):
            if isinstance(manifest[key], list):
                manifest[key] = {n: _identity(folder / n) for n in manifest[key]}
        (staging / MANIFEST).write_text(json.dumps(manifest))
    return staging


def _identity(path):
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def test_a_running_save_is_never_disturbed(tmp_path):
    running = SaveFolder(str(tmp_path), "a" * 16)
    running.begin()
    second = SaveFolder(str(tmp_path), "b" * 16)
    with pytest.raises(zload.WriteError, match=f"another zload.save into {tmp_path} is running "
                                               f"\\(pid {os.getpid()} on ") as refused:
        second.begin()
    assert refused.value.errno == errno.EBUSY and refused.value.path == str(tmp_path)
    second.clean_up_killed_saves()
    assert os.path.isdir(running.staging)  # its lock is held: not touched
    running.abort()
    assert not os.path.exists(running.staging)
    second.begin()  # the lock is free now
    second.abort()


def test_a_killed_save_before_its_commit_is_undone(tmp_path):
    """Killed after moving its shards in: they are removed; the checkpoint it would have replaced
    (still the one readers use) and every other file stay."""
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"moved in, never listed")
    (tmp_path / "notes.txt").write_text("mine")
    _killed_save(tmp_path, "c" * 16, {"single": "model.safetensors",
                                      "created": ["model-00001-of-00002.safetensors",
                                                  "model.safetensors.index.json"],
                                      "stale": ["model.safetensors"]})
    SaveFolder(str(tmp_path), "d" * 16).clean_up_killed_saves()
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "notes.txt"]


def test_a_killed_save_after_its_commit_is_completed(tmp_path):
    """Killed after its index replaced the old one: the stale shards it had not removed go."""
    (tmp_path / "model-c0ffee00-00001-of-00001.safetensors").write_bytes(b"new")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model-c0ffee00-00001-of-00001.safetensors"}}))
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"old")
    (tmp_path / "config.json").write_text("old config")
    _killed_save(tmp_path, "c0ffee00" * 2, {"single": "model.safetensors",
                                            "created": ["model-c0ffee00-00001-of-00001.safetensors",
                                                        "model.safetensors.index.json"],
                                            "stale": ["model-00001-of-00001.safetensors"],
                                            "configs": ["config.json"]}, staged=["config.json"])
    SaveFolder(str(tmp_path), "e" * 16).clean_up_killed_saves()
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model-c0ffee00-00001-of-00001.safetensors",
                                            "model.safetensors.index.json"]
    assert (tmp_path / "config.json").read_text() == "staged config.json"  # the new weights' config


def test_only_the_file_recorded_is_removed(tmp_path):
    """A name a killed save recorded, since taken by another file (save_pretrained, say): kept."""
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"the killed save's")
    _killed_save(tmp_path, "9" * 16, {"single": "model.safetensors",
                                      "created": ["model-00001-of-00002.safetensors"], "stale": []})
    (tmp_path / "model-00001-of-00002.safetensors").unlink()
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"someone else's, written since")
    SaveFolder(str(tmp_path), "8" * 16).clean_up_killed_saves()
    assert (tmp_path / "model-00001-of-00002.safetensors").read_bytes() == b"someone else's, written since"


def test_a_manifest_can_only_name_weights_files_in_the_folder(tmp_path):
    """A hostile or corrupt manifest cannot make the cleanup remove anything else."""
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("config.json", "train.py", "sub.safetensors"):
        (folder / name).write_text("keep")
    (folder / "dir.safetensors").mkdir()
    _killed_save(folder, "f" * 16, {"single": "model.safetensors",
                                    "created": ["../outside.safetensors", str(outside), "config.json",
                                                "train.py", "dir.safetensors", ".", ".."],
                                    "stale": ["sub.safetensors/../train.py"]})
    _killed_save(folder, "0" * 16, {"single": "../../etc/passwd", "created": ["sub.safetensors"],
                                    "stale": []})
    SaveFolder(str(folder), "1" * 16).clean_up_killed_saves()
    assert outside.exists() and sorted(os.listdir(folder)) == ["config.json", "dir.safetensors",
                                                               "sub.safetensors", "train.py"]


def test_a_save_killed_before_it_wrote_anything_lasting_leaves_only_its_staging(tmp_path):
    """Without a manifest (killed before its commit began) or a lock file (killed right after
    making its folder), only the staging folder itself is removed."""
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    _killed_save(tmp_path, "2" * 16)
    _killed_save(tmp_path, "3" * 16, lock=False)
    (tmp_path / (STAGING_PREFIX + "link")).symlink_to(tmp_path / "model.safetensors")
    SaveFolder(str(tmp_path), "4" * 16).clean_up_killed_saves()
    assert sorted(os.listdir(tmp_path)) == [STAGING_PREFIX + "link", "model.safetensors"]


def test_a_hostile_manifest_never_blocks_the_cleanup(tmp_path):
    staging = _killed_save(tmp_path, "5" * 16)
    os.mkfifo(staging / MANIFEST)
    folder = SaveFolder(str(tmp_path), "6" * 16)
    folder.clean_up_killed_saves()  # a FIFO for a manifest: refused, not opened for reading
    assert not staging.exists()


def test_two_saves_starting_together_do_not_both_go_on(tmp_path):
    """Each takes its lock, then looks for another running save: the second always sees the first."""
    first, second = SaveFolder(str(tmp_path), "a" * 16), SaveFolder(str(tmp_path), "b" * 16)
    real = first._refuse_if_another_save_runs
    calls = []

    def second_starts_meanwhile():
        calls.append(1)
        if len(calls) == 1:  # first's look before taking its lock: second slips in right then
            real()
            second.begin()
        else:
            real()

    first._refuse_if_another_save_runs = second_starts_meanwhile
    with pytest.raises(zload.ZloadError, match="another zload.save"):
        first.begin()
    first.abort()
    second.abort()
    assert os.listdir(tmp_path) == []


def test_a_failed_save_removes_the_folders_it_made(tmp_path):
    folder = SaveFolder(str(tmp_path / "a" / "b" / "c"), "7" * 16)
    folder.begin()
    assert folder.abort() == f"{tmp_path / 'a' / 'b' / 'c'} is as it was"
    assert os.listdir(tmp_path) == []


def test_a_single_file_that_cannot_give_way_to_shards_rolls_the_commit_back(tmp_path, monkeypatch):
    """model.safetensors would hide the new index from every reader: the save is not committed."""
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    folder = SaveFolder(str(tmp_path), "4" * 16)
    folder.begin()
    for k in (1, 2):
        (tmp_path / folder.staging / f"model-0000{k}-of-00002.safetensors").write_bytes(b"new")
    real_remove = os.remove

    def refusing(path, *args, **kwargs):
        if os.path.basename(path) == "model.safetensors":
            raise PermissionError(13, "Permission denied", path)
        return real_remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", refusing)
    with pytest.raises(zload.ZloadError, match="would load instead of the new checkpoint's index"):
        folder.commit("model.safetensors", ["model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors"],
                      {"weight_map": {"w": "model-00001-of-00002.safetensors"}}, [])
    assert not folder.committed
    assert folder.abort() == f"{tmp_path} is as it was"
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def _optimizer_state(folder, shard, digest="old"):
    """An optimizer index (and its shard) as zload.save(optimizer=True) leaves them in ``folder``."""
    (folder / shard).write_bytes(b"optimizer state " + digest.encode())
    (folder / "optimizer.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"weights": [digest]}, "weight_map": {"w.fp32": shard}}))


def _killed_after_commit(folder, with_optimizer):
    """A save killed once its index replaced the old one (before its configs and optimizer index
    moved in), over a checkpoint saved with its optimizer state."""
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"old")
    _optimizer_state(folder, "optimizer-00001-of-00001.safetensors")
    stale = ["model-00001-of-00001.safetensors", "optimizer-00001-of-00001.safetensors"]
    (folder / "model-c0ffee00-00001-of-00001.safetensors").write_bytes(b"new")
    created = ["model-c0ffee00-00001-of-00001.safetensors", "model.safetensors.index.json"]
    staged, configs = [], []
    if with_optimizer:
        (folder / "optimizer-c0ffee00-00001-of-00001.safetensors").write_bytes(b"new optimizer state")
        created.append("optimizer-c0ffee00-00001-of-00001.safetensors")
        staged = configs = ["optimizer.safetensors.index.json"]
    else:
        stale.append("optimizer.safetensors.index.json")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model-c0ffee00-00001-of-00001.safetensors"}}))
    staging = _killed_save(folder, "c0ffee00" * 2, {"single": "model.safetensors", "created": created,
                                                     "stale": stale, "configs": configs,
                                                     "beside": "optimizer.safetensors"}, staged=staged)
    if with_optimizer:
        _optimizer_state(staging, "optimizer-c0ffee00-00001-of-00001.safetensors", "new")
    SaveFolder(str(folder), "e" * 16).clean_up_killed_saves()


def test_a_killed_save_with_its_optimizer_state_is_completed_with_it(tmp_path):
    """Its optimizer index moves in as a config does; the earlier optimizer state's shard goes."""
    _killed_after_commit(tmp_path, with_optimizer=True)
    assert sorted(os.listdir(tmp_path)) == ["model-c0ffee00-00001-of-00001.safetensors",
                                            "model.safetensors.index.json",
                                            "optimizer-c0ffee00-00001-of-00001.safetensors",
                                            "optimizer.safetensors.index.json"]
    index = json.loads((tmp_path / "optimizer.safetensors.index.json").read_text())
    assert index["metadata"]["weights"] == ["new"]


def test_a_killed_save_without_optimizer_state_removes_the_earlier_one(tmp_path):
    """As a save that finishes does: the optimizer state belonged to the weights it replaced."""
    _killed_after_commit(tmp_path, with_optimizer=False)
    assert sorted(os.listdir(tmp_path)) == ["model-c0ffee00-00001-of-00001.safetensors",
                                            "model.safetensors.index.json"]


def test_a_killed_save_before_its_commit_keeps_the_earlier_optimizer_state(tmp_path):
    """Rolled back: its optimizer shards go; the earlier weights keep their optimizer state."""
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    _optimizer_state(tmp_path, "optimizer-00001-of-00001.safetensors")
    (tmp_path / "optimizer-c0ffee00-00001-of-00001.safetensors").write_bytes(b"moved in, never listed")
    _killed_save(tmp_path, "c0ffee00" * 2, {"single": "model.safetensors",
                                            "created": ["optimizer-c0ffee00-00001-of-00001.safetensors"],
                                            "stale": ["optimizer-00001-of-00001.safetensors"],
                                            "beside": "optimizer.safetensors"})
    SaveFolder(str(tmp_path), "d" * 16).clean_up_killed_saves()
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "optimizer-00001-of-00001.safetensors",
                                            "optimizer.safetensors.index.json"]


def _unwritable(monkeypatch, path, flags_refused):
    """``os.open`` of ``path`` with any of ``flags_refused`` fails as for a file of another user's
    (root may open any, so the test makes it so)."""
    from zload.saving import folder as folder_module

    real_open = os.open

    def refusing(name, flags, *args):
        if str(name) == str(path) and flags & os.O_ACCMODE in flags_refused:
            raise PermissionError(errno.EACCES, "Permission denied", name)
        return real_open(name, flags, *args)

    monkeypatch.setattr(folder_module.os, "open", refusing)


@pytest.mark.parametrize("lock", ["a FIFO we may not write", "a folder", "a file we may not open", "a symlink"])
def test_a_lock_that_cannot_be_ours_never_blocks_a_save_and_stays(tmp_path, monkeypatch, lock):
    """A staging folder whose lock is not a regular file we can open (a FIFO opened read-only
    blocks until a writer comes; another user's lock cannot be opened): the next save neither
    waits on it nor removes the folder, and says which folder to remove."""
    import threading

    staging = _killed_save(tmp_path, "7" * 16, lock=lock == "a file we may not open")
    if lock == "a FIFO we may not write":
        os.mkfifo(staging / LOCK)
        _unwritable(monkeypatch, staging / LOCK, {os.O_RDWR})
    elif lock == "a folder":
        (staging / LOCK).mkdir()
    elif lock == "a file we may not open":
        _unwritable(monkeypatch, staging / LOCK, {os.O_RDWR, os.O_RDONLY})
    else:
        (staging / LOCK).symlink_to(tmp_path / "elsewhere")
    save = SaveFolder(str(tmp_path), "8" * 16)
    done = threading.Thread(target=lambda: (save.begin(), save.clean_up_killed_saves(), save.abort()), daemon=True)
    done.start()
    done.join(10)
    if done.is_alive():  # unblock the reader before failing
        os.close(os.open(staging / LOCK, os.O_WRONLY | os.O_NONBLOCK))
    assert not done.is_alive(), "the save blocked opening the lock"
    assert os.path.lexists(staging / LOCK) and any(str(staging) in note for note in save.notes), save.notes
