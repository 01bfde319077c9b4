"""zload.save: HF-layout safetensors written by every rank from its own partitions."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import zload


def test_leftovers_of_a_killed_save_are_named_and_kept(tmp_path):
    """A save names the temporary folders that killed saves of zload before 0.2 left next to its
    path (those took no lock: one could belong to a save still running, so they are not deleted)
    and saves as usual."""
    out = tmp_path / "out"
    leftover = tmp_path / "out.zload-tmp-0123456789abcdef"
    leftover.mkdir()
    (tmp_path / "other.zload-tmp-0123456789abcdef").mkdir()  # another path's: not mentioned
    model = torch.nn.Linear(3, 2)
    with pytest.warns(zload.ZloadWarning, match="temporary folders") as caught:
        zload.save(model, out)
    (warning,) = [w for w in caught if issubclass(w.category, zload.ZloadWarning)]
    assert str(leftover) in str(warning.message) and "other.zload-tmp" not in str(warning.message)
    assert warning.filename == __file__  # points at the caller's save() line
    assert leftover.is_dir() and torch.equal(load_file(str(out / "model.safetensors"))["weight"],
                                             model.weight.detach())


@pytest.mark.parametrize("model", [None, {"weight": torch.zeros(2)}])
def test_what_is_no_model_is_refused_naming_save(tmp_path, model):
    with pytest.raises(zload.ArgumentTypeError, match=r"^zload\.save expects an nn\.Module or a DeepSpeedEngine"):
        zload.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dot_dot_after_a_link_goes_up_from_where_the_link_leads(tmp_path):
    """``latest/../other``, with ``latest`` a link into ``runs/``, is ``runs/other`` to the kernel
    and to ``save_pretrained``. Read as text (``os.path.abspath``) it was ``./other``, and the save
    replaced the checkpoint there, which was not its target."""
    real = tmp_path / "runs" / "run-7"
    real.mkdir(parents=True)
    (tmp_path / "latest").symlink_to(real)
    zload.save(torch.nn.Linear(3, 2), tmp_path / "other")  # a checkpoint the save must not touch
    before = {p.name: p.read_bytes() for p in (tmp_path / "other").iterdir()}
    model = torch.nn.Linear(3, 2)
    report = zload.save(model, f"{tmp_path}/latest/../other")
    assert {p.name: p.read_bytes() for p in (tmp_path / "other").iterdir()} == before
    assert report.path == str(tmp_path / "runs" / "other")
    assert torch.equal(load_file(str(tmp_path / "runs" / "other" / "model.safetensors"))["weight"],
                       model.weight.detach())


def test_the_report_names_the_shards_as_they_are_in_the_folder(tmp_path):
    """A second sharded save into a folder finds the standard shard names taken (by the first
    checkpoint) and tags its shards with the save's token. The report names those, not the
    standard names, which were the earlier checkpoint's files and are gone."""
    model = torch.nn.Linear(64, 64)
    first = zload.save(model, tmp_path / "out", max_shard_size=10_000)
    second = zload.save(model, tmp_path / "out", max_shard_size=10_000)
    in_folder = {p.name for p in (tmp_path / "out").iterdir()}
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(second.files) > 1 and set(second.files) <= in_folder and not set(second.files) & set(first.files)
    assert set(weight_map.values()) == set(second.files)
