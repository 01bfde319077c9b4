"""Hub repo ids in worlds of ranks: one download shared by the ranks, a missing repo or another
cache failing every rank, a load from the cache. The hand-made cache and the cases in one process:
tests/unit/test_hub.py."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import zload
from zload.checkpoint.hub import download

from tests.support.harness import run_world
from tests.unit import test_hub as single_process
from tests.unit.test_hub import REPO, STATE, hub_cache

cache, snapshot = single_process.cache, single_process.snapshot  # the fixtures, found here by pytest


# --- multi-process ---

class Resolved(NamedTuple):
    local: str  # the folder REPO resolved to
    offline_calls: list[bool]  # local_files_only of each snapshot_download call
    tensors: list[str]  # in the resolved folder


def _resolve_recording(cache):
    """Resolve REPO, recording which snapshot_download calls this rank made."""
    import huggingface_hub

    real, calls = huggingface_hub.snapshot_download, []

    def spy(*args, **kwargs):
        calls.append(kwargs["local_files_only"])
        return real(*args, **kwargs)

    huggingface_hub.snapshot_download = spy
    try:
        with hub_cache(cache):
            local = download(REPO, None)
    finally:
        huggingface_hub.snapshot_download = real
    return Resolved(local, calls, sorted(zload.open_checkpoint(local).tensors))


def test_ranks_share_one_download(snapshot, cache):
    """Local rank 0 resolves (would download) first; local rank 1 then reads the cache only."""
    first, second = run_world(2, _resolve_recording, cache)
    assert Path(first.local) == Path(second.local) == snapshot
    assert first.offline_calls == [False] and second.offline_calls == [True]
    assert first.tensors == second.tensors == sorted(STATE)


def _resolve_error(cache_of_rank, repo):
    import torch.distributed as dist

    with hub_cache(Path(cache_of_rank[dist.get_rank()])):
        try:
            download(repo, None)
        except zload.CheckpointError as e:
            return str(e)
    return None


def test_missing_repo_fails_on_every_rank(cache):
    messages = run_world(2, _resolve_error, [cache, cache], "other-org/missing")
    assert messages[0] is not None and messages[0] == messages[1]
    assert "other-org/missing" in messages[0] and "HF_HUB_OFFLINE=1" in messages[0]


def test_rank_with_another_cache_fails_on_every_rank(snapshot, cache, tmp_path):
    """Rank 0 finds the repo, rank 1 looks in a cache it does not share: both raise the same."""
    messages = run_world(2, _resolve_error, [cache, tmp_path / "elsewhere"], REPO)
    assert messages[0] is not None and messages[0] == messages[1]
    assert "[rank 1]" in messages[0] and "must share HF_HUB_CACHE" in messages[0]


class Tiny(torch.nn.Module):
    """The model STATE belongs to."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 2, bias=False)
        self.b = torch.nn.Module()
        self.b.bias = torch.nn.Parameter(torch.zeros(4))


def _load_repo(cache):
    from tests.support.zero3 import build_zero, check_against

    with hub_cache(cache):
        model = build_zero(Tiny)
        report = zload.load_into(model, REPO)
    return check_against(model, STATE), report.source


@pytest.mark.parametrize("world", [1, 2])
def test_load_into_a_repo_id(snapshot, cache, world):
    """load_into finds no rank with a local path REPO, resolves it from the cache, and loads."""
    for compared, source in run_world(world, _load_repo, cache):
        assert compared == len(STATE) and Path(source) == snapshot


def _load_repo_telling(cache):
    from tests.distributed.test_output import _telling

    with hub_cache(cache):
        return _telling(lambda: zload.load_into(Tiny(), REPO)).records


def test_the_repo_resolved_is_logged_by_rank_0(snapshot, cache):
    """With the load's report: the same on every rank, so rank 0 alone says it."""
    on_0, on_1 = run_world(2, _load_repo_telling, cache)
    assert any(REPO in record and str(snapshot) in record for record in on_0), on_0
    assert on_1 == []
