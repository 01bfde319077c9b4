"""zload.savedir without processes: what a save may touch in its folder, and how killed saves are
told from running ones (a lock) and cleaned up after (their manifest)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import zload
from zload.savedir import LOCK, MANIFEST, STAGING_PREFIX, SaveFolder


def _killed_save(folder, token, manifest=None, lock=True):
    """The staging folder a save killed at some point leaves: nobody holds its lock."""
    staging = folder / (STAGING_PREFIX + token)
    staging.mkdir(parents=True)
    (staging / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    if lock:
        (staging / LOCK).write_text(f"{token}\npid 1 on elsewhere\n")
    if manifest is not None:
        (staging / MANIFEST).write_text(json.dumps(manifest))
    return staging


def test_a_running_save_is_never_disturbed(tmp_path):
    running = SaveFolder(str(tmp_path), "a" * 16)
    running.begin()
    second = SaveFolder(str(tmp_path), "b" * 16)
    with pytest.raises(zload.ZloadError, match=f"another zload.save into {tmp_path} is running "
                                               f"\\(pid {os.getpid()} on "):
        second.begin()
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
    _killed_save(tmp_path, "c0ffee00" * 2, {"single": "model.safetensors",
                                            "created": ["model-c0ffee00-00001-of-00001.safetensors",
                                                        "model.safetensors.index.json"],
                                            "stale": ["model-00001-of-00001.safetensors"]})
    SaveFolder(str(tmp_path), "e" * 16).clean_up_killed_saves()
    assert sorted(os.listdir(tmp_path)) == ["model-c0ffee00-00001-of-00001.safetensors",
                                            "model.safetensors.index.json"]


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
