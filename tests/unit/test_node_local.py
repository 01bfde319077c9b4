"""Node-local checkpoints: ranks that cannot see a file receive their bytes from ranks that can."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.support import models
from tests.support.checkpoints import save_sharded


def _checkpoint(tmp_path, seed):
    state = models.state_with_seed(models.Awkward, seed=seed)
    folder = save_sharded(state, tmp_path / "node0" / "ckpt", shards=2)
    reference = tmp_path / "reference.pt"
    torch.save(state, reference)
    return state, folder, reference


def test_a_view_fingerprints_the_files_and_headers_it_sees(tmp_path):
    """Equal fingerprints are how ranks skip exchanging their views: equal for the same checkpoint
    anywhere on disk, different for a missing shard or a different header."""
    from zload.checkpoint.views import local_view

    state, folder, _ = _checkpoint(tmp_path, seed=30)
    copy = Path(shutil.copytree(folder, tmp_path / "node1" / "ckpt"))
    whole = local_view(str(folder))
    assert whole.whole and 0 <= whole.fingerprint < 2**62
    assert local_view(str(copy)).fingerprint == whole.fingerprint
    assert whole.shared().index is whole.index and not whole.shared().sharing

    other = save_sharded(dict(state, cube=state["cube"].half()), tmp_path / "node2" / "ckpt", shards=2)
    assert local_view(str(other)).whole and local_view(str(other)).fingerprint != whole.fingerprint

    sorted(copy.glob("*.safetensors"))[0].unlink()
    partial = local_view(str(copy))
    assert not partial.whole and partial.index.absent and partial.fingerprint != whole.fingerprint

    nowhere, elsewhere = local_view(str(tmp_path / "nowhere")), local_view(str(tmp_path / "elsewhere"))
    assert nowhere.index is None and not nowhere.whole and nowhere.fingerprint == elsewhere.fingerprint
