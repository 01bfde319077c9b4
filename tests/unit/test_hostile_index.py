"""A checkpoint is hostile input: index entries that point outside the folder, files that are not
regular files, headers nested to blow the stack, JSON that Python accepts and safetensors does not.
Every case is refused with a CheckpointError that names the file, quickly, touching nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import zload
from zload import CheckpointError, open_checkpoint
from zload.cli import main as cli

from tests.support.checkpoints import save_sharded


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging: a blocked open() of a FIFO is interrupted by the alarm."""
    def expired(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "a.bias": torch.randn(4, generator=g),
            "b.weight": torch.randn(2, 4, generator=g).to(torch.bfloat16)}


def _rewrite_index(folder, change):
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))


# --------------------------------------------------------------------------------------------
# 5. index entries must name files inside the checkpoint folder


@pytest.fixture
def secret(tmp_path):
    """A valid safetensors file outside the checkpoint, which no index may make zload read."""
    path = tmp_path / "other" / "secret.safetensors"
    path.parent.mkdir()
    save_file({"a.weight": torch.full((4, 3), 42.0)}, str(path))
    return path


def _opened_paths(monkeypatch):
    """Every path os.open / os.stat / builtins.open is given from now on."""
    seen = []
    for owner, name in ((os, "open"), (os, "stat"), (__builtins__ if isinstance(__builtins__, dict)
                                                     else __builtins__.__dict__, "open")):
        real = owner[name] if isinstance(owner, dict) else getattr(owner, name)

        def recording(path, *args, _real=real, **kwargs):
            seen.append(os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else path)
            return _real(path, *args, **kwargs)

        if isinstance(owner, dict):
            monkeypatch.setitem(owner, name, recording)
        else:
            monkeypatch.setattr(owner, name, recording)
    return seen


@pytest.mark.parametrize("entry", ["../other/secret.safetensors", "{secret}", "/etc/passwd",
                                   "/proc/self/environ", "sub/../../other/secret.safetensors", "..",
                                   "", "."])
def test_an_index_entry_outside_the_folder_is_refused_before_opening_it(tmp_path, secret, monkeypatch,
                                                                         entry):
    folder = save_sharded(_state(), tmp_path / "ckpt", shards=2)
    entry = entry.format(secret=secret)
    _rewrite_index(folder, lambda wm: wm.update({"a.weight": entry}))
    seen = _opened_paths(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(folder)
    message = str(err.value)
    assert "'a.weight'" in message and repr(entry) in message and "inside the checkpoint folder" in message
    outside = [p for p in seen if isinstance(p, str)
               and not os.path.abspath(p).startswith(str(folder) + os.sep) and p != str(folder)]
    assert outside == [], f"opened or looked at outside the checkpoint: {outside}"
    assert not any(str(folder / "model-") in str(p) for p in seen), "a shard was opened before the check"


def test_the_cli_refuses_an_index_entry_outside_the_folder(tmp_path, secret, capsys):
    folder = save_sharded(_state(), tmp_path / "ckpt", shards=2)
    _rewrite_index(folder, lambda wm: wm.update({"a.weight": "../other/secret.safetensors"}))
    assert cli(["validate", str(folder)]) == 1
    assert cli(["inspect", str(folder)]) == 2
    assert "inside the checkpoint folder" in capsys.readouterr().err


def test_links_inside_the_folder_may_point_anywhere(tmp_path):
    """The Hub cache's snapshot folders are links into ../../blobs: a name inside the folder is
    what counts, not where its link leads."""
    blobs = tmp_path / "blobs"
    shards = save_sharded(_state(), blobs, shards=2)
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for path in shards.iterdir():
        (snapshot / path.name).symlink_to(os.path.relpath(path, snapshot))
    with open_checkpoint(snapshot) as index:
        assert sorted(index.tensors) == sorted(_state())
        assert index.root == str(snapshot)


# --------------------------------------------------------------------------------------------
# 7. non-regular files are refused without blocking


@pytest.mark.parametrize("fifo", ["model.safetensors", "model.safetensors.index.json",
                                  "adapter.safetensors.index.json", "weights.safetensors", "shard"])
def test_a_fifo_is_refused_without_blocking(tmp_path, fifo):
    folder = tmp_path / "ckpt"
    if fifo == "shard":
        save_sharded(_state(), folder, shards=2)
        fifo = "model-00002-of-00002.safetensors"
        (folder / fifo).unlink()
    else:
        folder.mkdir()
    os.mkfifo(folder / fifo)
    for opener in (lambda: open_checkpoint(folder), lambda: open_checkpoint(folder / fifo)):
        with deadline(10), pytest.raises(CheckpointError) as err:
            opener()
        assert str(folder / fifo) in str(err.value) and "is a FIFO, not a regular file" in str(err.value)
    with deadline(10):
        assert cli(["validate", str(folder)]) == 1


def test_a_directory_named_like_a_checkpoint_file_is_refused(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="is a directory, not a regular file"):
        open_checkpoint(tmp_path)


# --------------------------------------------------------------------------------------------
# 6. nesting that would exhaust the stack


def _header_file(path, header_text: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text + data)
    return path


@pytest.mark.parametrize("depth", [10_000, 1_000_000])
def test_deeply_nested_json_is_a_checkpoint_error(tmp_path, depth):
    nested = b"[" * depth + b"]" * depth
    shard = _header_file(tmp_path / "deep.safetensors", b'{"__metadata__":{"x":' + nested + b"}}")
    with pytest.raises(CheckpointError, match="nested too deeply") as err:
        open_checkpoint(shard)
    assert str(shard) in str(err.value)

    folder = save_sharded(_state(), tmp_path / "ckpt", shards=2)
    index = folder / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes()[:-1] + b', "metadata": ' + nested + b"}")
    with pytest.raises(CheckpointError, match="nested too deeply") as err:
        open_checkpoint(folder)
    assert str(index) in str(err.value)


# --------------------------------------------------------------------------------------------
# 11. accept nothing that safetensors refuses


def _safetensors_refuses(path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                f.get_tensor(name)
    except Exception:
        return True
    return False


ENTRY = '"dtype":"F32","shape":[2],"data_offsets":[{begin},8]'
REFUSED = {
    "minus_zero_offset": '{"w":{' + ENTRY.format(begin="-0") + "}}",
    "minus_zero_dim": '{"w":{"dtype":"F32","shape":[-0,2],"data_offsets":[0,0]},'
                      '"v":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "lone_surrogate_name": '{"w\\ud800":{' + ENTRY.format(begin=0) + "}}",
    "lone_low_surrogate_name": '{"\\udc00":{' + ENTRY.format(begin=0) + "}}",
    "lone_surrogate_metadata": '{"__metadata__":{"k":"\\udbff"},"w":{' + ENTRY.format(begin=0) + "}}",
    "dim_over_u64": '{"w":{"dtype":"F32","shape":[18446744073709551616,0],"data_offsets":[0,0]},'
                    '"v":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "numel_overflows_before_a_zero": '{"w":{"dtype":"F32","shape":[4294967296,4294967296,0],'
                                     '"data_offsets":[0,0]},"v":{"dtype":"F32","shape":[2],'
                                     '"data_offsets":[0,8]}}',
}


@pytest.mark.parametrize("header", REFUSED.values(), ids=REFUSED.keys())
def test_what_safetensors_refuses_zload_refuses(tmp_path, header):
    path = _header_file(tmp_path / "x.safetensors", header.encode(), b"\0" * 8)
    assert _safetensors_refuses(path)  # the premise: the reference implementation says no
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(path)
    assert str(path) in str(err.value)


def test_a_surrogate_pair_is_unicode_and_accepted(tmp_path):
    path = _header_file(tmp_path / "x.safetensors", ('{"w\\ud83d\\ude00":{' + ENTRY.format(begin=0)
                                                      + "}}").encode(), b"\0" * 8)
    assert not _safetensors_refuses(path)
    with open_checkpoint(path) as index:
        assert list(index.tensors) == ["w\U0001F600"]


def test_the_files_stay_open_until_the_index_is_closed(tmp_path):
    save_file(_state(), str(tmp_path / "model.safetensors"))
    before = len(os.listdir("/proc/self/fd"))
    with open_checkpoint(tmp_path) as index:
        assert len(os.listdir("/proc/self/fd")) == before + 1
        assert isinstance(index, zload.checkpoint.index.CheckpointIndex)
    assert len(os.listdir("/proc/self/fd")) == before
