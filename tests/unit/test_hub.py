"""Hub repo ids resolved through a hand-made huggingface_hub cache; never a network call.

The cache is laid out exactly as huggingface_hub writes it (``models--ORG--NAME/refs/main`` holding
a commit hash, ``snapshots/<hash>/`` holding the files, ``trees/<hash>.json`` listing the repo), and
HF_HUB_OFFLINE is on, so huggingface_hub refuses any request before it is sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import zload
from zload.checkpoint.hub import ALLOW_PATTERNS, download

from tests import support
from tests.support.checkpoints import save_sharded

REPO = "some-org/tiny-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
STATE = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(4)}


@contextmanager
def hub_cache(cache: Path):
    """Point huggingface_hub at ``cache``, offline, and restore everything after.

    huggingface_hub reads its environment once, at import, into ``huggingface_hub.constants``, so
    both the variables (for processes that import it later) and the constants are set. Also usable
    in long-lived rank processes, where monkeypatch is not available.
    """
    import huggingface_hub.constants as constants

    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    consts = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": True}
    old_env = {k: os.environ.get(k) for k in env}
    old_consts = {k: getattr(constants, k) for k in consts}
    os.environ.update(env)
    for k, v in consts.items():
        setattr(constants, k, v)
    try:
        yield cache
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in old_consts.items():
            setattr(constants, k, v)


def _sharded_state(snapshot: Path) -> None:
    save_sharded(STATE, snapshot, shards=2)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "tiny"}))


def populate(cache: Path, repo: str = REPO, commit: str = COMMIT, fill=_sharded_state) -> Path:
    """A cached snapshot of ``repo`` at ``commit`` (= refs/main), its files written by
    ``fill(folder)``: by default 2 shards of STATE, their index, a config.

    The tree listing also names ``pytorch_model.bin``, which the snapshot lacks: huggingface_hub
    would call such a snapshot incomplete, unless allow_patterns leaves the file out.
    """
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    fill(snapshot)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)  # no trailing newline, as huggingface_hub writes
    files = {p.name: {"size": p.stat().st_size, "blob_id": f"{i:040x}"}
             for i, p in enumerate(sorted(snapshot.iterdir()))}
    files["pytorch_model.bin"] = {"size": 10, "blob_id": "f" * 40}
    (storage / "trees").mkdir()
    (storage / "trees" / f"{commit}.json").write_text(
        json.dumps({"format_version": 1, "files": files}))
    return snapshot


@pytest.fixture
def cache(tmp_path):
    with hub_cache(tmp_path / "hub") as path:
        yield path


@pytest.fixture
def snapshot(cache):
    return populate(cache)


# --- single process ---

@pytest.mark.parametrize("revision", [None, "main", COMMIT])
def test_repo_id_resolves_to_cached_snapshot(snapshot, revision):
    local = download(REPO, revision)
    assert Path(local) == snapshot
    index = zload.open_checkpoint(local)
    assert sorted(index.tensors) == sorted(STATE) and len(index.files) == 2


def test_only_safetensors_index_and_configs_are_fetched(snapshot, monkeypatch):
    import huggingface_hub

    real, calls = huggingface_hub.snapshot_download, []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    assert Path(download(REPO, None)) == snapshot
    (kwargs,) = calls
    assert kwargs["allow_patterns"] == ALLOW_PATTERNS == [
        "*.safetensors", "*.safetensors.index.json", "config.json", "adapter_config.json"]
    assert not kwargs["local_files_only"]
    # The setup is meaningful: without the patterns the missing pytorch_model.bin is required.
    with pytest.raises(OSError, match="incomplete"):
        real(REPO)


def test_uncached_revision_is_named(snapshot):
    with pytest.raises(zload.CheckpointError) as info:
        download(REPO, "v2")
    message = str(info.value)
    assert REPO in message and "revision v2" in message
    assert f"hf download {REPO} --revision v2" in message and "HF_HUB_OFFLINE=1" in message


def test_unknown_repo_offline_says_how_to_download(cache):
    with pytest.raises(zload.CheckpointNotFoundError) as info:  # a FileNotFoundError too
        download("other-org/missing", None)
    message = str(info.value)
    assert info.value.path == "other-org/missing" and "revision main" in message
    assert "HF_HUB_OFFLINE=1 is set" in message and "`hf download other-org/missing`" in message


def test_a_repo_with_only_pytorch_weights_says_how_to_convert_them(cache):
    """The snapshot holds no .bin (only safetensors are fetched), so the repo's listing, which
    huggingface_hub cached while downloading, says what it holds instead."""
    populate(cache, fill=lambda folder: (folder.mkdir(parents=True),
                                         (folder / "config.json").write_text('{"model_type": "tiny"}')))
    with pytest.raises(zload.CheckpointNotFoundError) as info:
        zload.load_into(torch.nn.Linear(2, 2), REPO)
    assert "pytorch_model.bin" in str(info.value) and "save_pretrained" in str(info.value), str(info.value)


def test_local_path_with_revision_is_refused(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(zload.ArgumentValueError, match="revision='main' applies to Hub repo ids only"):
        zload.load_into(torch.nn.Module(), tmp_path, revision="main")


def refuse_the_hub(monkeypatch):
    """Fail the test if huggingface_hub is asked for a snapshot (which could touch the network)."""
    import huggingface_hub

    def refused(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)


@pytest.mark.parametrize("path", ["a/b/c/d", "no--such", "./missing.safetensors", "checkpoints/my-model/",
                                  "~/checkpoints/my-model", "/no/such/checkpoint", "model.safetensors",
                                  "weights.safetensors.index.json"])
def test_missing_path_that_cannot_be_a_repo_id_is_a_local_error_only(cache, path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refuse_the_hub(monkeypatch)
    with pytest.raises(zload.CheckpointNotFoundError) as info:
        zload.load_into(torch.nn.Module(), path)
    assert str(info.value) == f"no such local file or folder: {os.path.abspath(path)}: check the path"


def test_missing_path_that_could_be_a_repo_id_names_both_readings(cache, tmp_path, monkeypatch):
    """The README's own "checkpoints/my-model", offline and not cached: neither a local folder nor
    a cached repo, and the error says both, and what to do about each."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(zload.CheckpointNotFoundError) as info:
        zload.load_into(torch.nn.Module(), "checkpoints/my-model")
    message = str(info.value)
    assert f"no such local file or folder: {tmp_path / 'checkpoints' / 'my-model'}; " in message
    assert (f"as a Hub repo id (revision main): not in the local cache {cache} and the Hub could not be "
            f"reached (HF_HUB_OFFLINE=1 is set)") in message
    assert "check the path" in message and "`hf download checkpoints/my-model`, or unset HF_HUB_OFFLINE" in message


def test_unreachable_hub_names_both_readings(cache, monkeypatch):
    """Online but without a network, huggingface_hub finds nothing cached and cannot ask the Hub."""
    import huggingface_hub
    import huggingface_hub.constants as constants
    from huggingface_hub.utils import LocalEntryNotFoundError

    def no_network(*args, **kwargs):
        raise LocalEntryNotFoundError("connection refused")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    with pytest.raises(zload.CheckpointNotFoundError) as info:
        download("checkpoints/my-model", None)
    message = str(info.value)
    assert "no such local file or folder: " in message
    assert "the Hub could not be reached (connection refused)" in message
    assert "`hf download checkpoints/my-model`, or check the network" in message


@pytest.mark.parametrize("path, both", [("checkpoints/my-model", True), ("checkpoints/my-model/", False)])
def test_the_command_line_names_both_readings_too(tmp_path, path, both):
    """``zload inspect`` as a user runs it, with HF_HUB_OFFLINE=1 and an empty HF_HOME."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": str(support.REPO)}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "zload", "inspect", path], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and not done.stdout and "Traceback" not in done.stderr
    assert f"no such local file or folder: {tmp_path / 'checkpoints' / 'my-model'}" in done.stderr
    assert ("as a Hub repo id (revision main): not in the local cache" in done.stderr) == both
    assert ("Hub" in done.stderr) == both


def test_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(zload.CheckpointNotFoundError, match="install huggingface_hub"):
        download(REPO, None)


def test_zload_imports_without_huggingface_hub():
    code = ("import sys; sys.modules['huggingface_hub'] = None; "
            "import zload, zload.checkpoint.hub, zload.checkpoint.open")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_command_line_takes_repo_ids_as_load_into_does(snapshot, capsys):
    """``zload inspect org/name`` finds the snapshot ``load_into(model, "org/name")`` would: both
    ask one module what the checkpoint is."""
    from zload.cli import main

    assert main(["inspect", REPO, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert sorted(t["name"] for t in summary["tensors"]) == sorted(STATE)
    assert {Path(f["path"]).parent for f in summary["files"]} == {snapshot}
    assert main(["validate", REPO, "--revision", COMMIT]) == 0
    assert main(["plan", REPO, "--revision", "v2", "-n", "2"]) == 2  # not cached: named, no traceback
    assert "revision v2" in capsys.readouterr().err


def test_a_sharded_repo_in_a_cache_reached_through_a_link_asks_for_its_shards_by_name(tmp_path):
    """Header-only reading of a repo (``zload inspect`` of a repo id): where the downloaded index's
    path goes through a link (``HF_HOME`` on another disk), each shard is still asked for by its
    name in the repo, not by a path climbing out of the snapshot."""
    from zload.checkpoint.files import FileTable
    from zload.checkpoint.open import _remote_index

    snapshot = tmp_path / "disk" / "hub" / "snapshots" / COMMIT
    save_sharded(STATE, snapshot, shards=2)
    (tmp_path / "home").symlink_to(tmp_path / "disk")
    asked = []

    class Repo:  # the part of hub.RemoteRepo that _remote_index uses
        repo, revision, commit = REPO, None, COMMIT
        sizes = {p.name: p.stat().st_size for p in snapshot.iterdir()}

        def url(self, name):
            return f"https://hub/{name}"

        def download(self, name):
            return str(tmp_path / "home" / "hub" / "snapshots" / COMMIT / name)

        def header(self, name):
            asked.append(name)
            raise zload.CheckpointNotFoundError(f"no {name} in the repo", path=name)

    with pytest.raises(zload.CheckpointNotFoundError), FileTable() as table:
        _remote_index(Repo(), table)
    assert asked == ["model-00001-of-00002.safetensors"]
