"""zload.save: HF-layout safetensors written by every rank from its own partitions."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zload

from . import models
from .harness import run_world
from .zero3 import build_zero, full_state


def _save_and_report(load_path, out, max_shard_size, shared):
    model = build_zero(models.Awkward)
    zload.load_into(model, load_path)
    report = zload.save(model, out, max_shard_size=max_shard_size, shared_filesystem=shared,
                        buffer_bytes=64)
    return report.files, report.bytes_written


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_save_round_trip_bit_exact(tmp_path, world):
    state = models.state_with_seed(models.Awkward, seed=41)
    save_file(state, str(tmp_path / "in.safetensors"))
    out = tmp_path / "out"
    results = run_world(world, _save_and_report, str(tmp_path / "in.safetensors"), str(out), 200, None)
    files, _ = results[0]
    assert len(files) > 1 and (out / "model.safetensors.index.json").exists()
    saved = {}
    for f in files:
        saved.update(load_file(str(out / f)))
    assert sorted(saved) == sorted(state)  # non-persistent buffers are not saved
    for name, tensor in saved.items():
        assert torch.equal(tensor, state[name]), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved.values())
    assert sum(r[1] for r in results) == sum(t.numel() * t.element_size() for t in saved.values())


def _save_transposed(out, kind):
    from .test_load_converted import MODELS

    cls, make_config = MODELS[kind]
    torch.manual_seed(3)
    model = build_zero(lambda: cls(make_config()))
    for p in model.parameters():  # values unlike any init, the same on every rank
        p.ds_tensor.data.copy_(torch.arange(p.ds_tensor.numel(), dtype=p.ds_tensor.dtype) / 7
                               + dist.get_rank(p.ds_process_group) * p.ds_tensor.numel() / 7)
    report = zload.save(model, out, max_shard_size="30KB")
    return report.gathered, full_state(model)


@pytest.mark.parametrize("kind", ["transposed_llama", "fused_transposed_llama"])
def test_save_gathers_only_tensors_whose_conversion_is_no_layout(tmp_path, kind):
    """A checkpoint stores up_proj transposed (or gate and up fused and transposed): only those
    parameters are gathered, and transformers loads the folder back exactly."""
    from .test_load_converted import MODELS, SLOW_PATH

    results = run_world(3, _save_transposed, str(tmp_path / "out"), kind)
    gathered, expected = results[0]
    assert gathered == SLOW_PATH[kind]
    loaded, info = MODELS[kind][0].from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    for name, tensor in loaded.named_parameters():  # every parameter, none skipped by name
        assert torch.equal(tensor, expected[name]), name


def test_leftovers_of_a_killed_save_are_named_and_kept(tmp_path):
    """A save names the temporary folders an earlier, killed save left next to its path (one could
    belong to a save still running elsewhere, so they are not deleted) and saves as usual."""
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
