"""zload's optimizer files (docs/optimizer-format.md) read back, and refused where they are not
what zload writes; the JSON values the metadata holds; the padding of a flat partition a resume
zeroes. No process group: the worlds are in tests/distributed/test_resume_optimizer.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from zload.checkpoint.optimizer_state import NotPlain, plain, saved_optimizer
from zload.errors import InvalidCheckpointError
from zload.integrations.deepspeed import Flat, Slot
from zload.loading.optimizer import _fits, _padding

SHAPES = {"a.weight": (2, 3), "b.weight": (4,)}
STATES = ["fp32", "exp_avg", "exp_avg_sq"]


def write(folder, metadata_changes=None, tensors_changes=None, drop=()):
    """An optimizer state as zload.save writes it: two groups of one parameter each, in one
    shard; ``metadata_changes`` / ``tensors_changes`` replace what it would hold."""
    tensors = {f"{n}.{s}": torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + k
               for n, shape in SHAPES.items() for k, s in enumerate(STATES)}
    tensors.update(tensors_changes or {})
    for name in drop:
        del tensors[name]
    save_file(tensors, folder / "optimizer-00001-of-00001.safetensors")
    metadata = {"format": "zload-optimizer", "version": 1, "states": STATES,
                "param_groups": [{"hyperparameters": {"lr": 0.1, "betas": [0.9, 0.99]}, "params": ["a.weight"],
                                  "step": 3},
                                 {"hyperparameters": {"lr": 0.1, "betas": [0.9, 0.99]}, "params": ["b.weight"],
                                  "step": 3}],
                "loss_scaler": {"cur_scale": 1.0, "other": 5}, "lr_scheduler": None,
                "engine": {"global_steps": 3}, "world_size": 2, "weights": ["abc"]}
    metadata.update(metadata_changes or {})
    index = folder / "optimizer.safetensors.index.json"
    index.write_text(json.dumps({"metadata": metadata, "weight_map": dict.fromkeys(
        tensors, "optimizer-00001-of-00001.safetensors")}))
    return index


def test_zloads_optimizer_files_are_read(tmp_path):
    write(tmp_path)
    index = saved_optimizer(str(tmp_path), "here")
    try:
        assert list(index.states) == STATES
        assert {n: e.shape for n, e in index.states["exp_avg"].items()} == SHAPES
        assert [(g.members, g.step, g.hyperparameters["betas"]) for g in index.groups] == [
            (("a.weight",), 3, [0.9, 0.99]), (("b.weight",), 3, [0.9, 0.99])]
        assert index.loss_scaler == {"cur_scale": 1.0}  # what a loss scaler learns, nothing else
        assert index.counters == {"global_steps": 3} and index.weights == ("abc",)
    finally:
        index.close()


def test_a_folder_without_optimizer_files_has_no_optimizer_state(tmp_path):
    assert saved_optimizer(str(tmp_path), "here") is None


HOSTILE = {
    "another format": ({"format": "torch"}, {}, (), "format"),
    "a later version": ({"version": 2}, {}, (), "format version 2"),
    "states without the masters first": ({"states": ["exp_avg", "fp32"]}, {}, (), "'states'"),
    "a state name with a dot": ({"states": ["fp32", "exp.avg"]}, {}, (), "'states'"),
    "a group that is no mapping": ({"param_groups": [["a.weight"]]}, {}, (), "param_groups[0]"),
    "a parameter in two groups": ({"param_groups": [{"hyperparameters": {}, "params": ["a.weight", "b.weight"]},
                                                    {"hyperparameters": {}, "params": ["b.weight"]}]},
                                  {}, (), "in more than one group"),
    "a state missing": ({}, {}, ("b.weight.exp_avg_sq",), "no 'exp_avg_sq' state for b.weight"),
    "a tensor of no listed parameter": ({}, {"c.weight.fp32": torch.zeros(1)}, (), "'c.weight.fp32'"),
    "a state of another shape": ({}, {"a.weight.exp_avg": torch.zeros(3, 2)}, (), "not of its parameter's shape"),
    "weights digests that are no list": ({"weights": "abc"}, {}, (), "'weights'"),
    "a scheduler that is no mapping": ({"lr_scheduler": [1]}, {}, (), "'lr_scheduler'"),
}


def _step(step):
    return {"param_groups": [{"hyperparameters": {"lr": 0.1}, "params": ["a.weight"], "step": 3},
                             {"hyperparameters": {"lr": 0.1}, "params": ["b.weight"], "step": step}]}


# values set on the live engine as they are: a step Adam's bias correction divides by, a loss
# scale the gradients are divided by, the engine's counters
HOSTILE.update({
    "a step that is a string": (_step("3"), {}, (), "param_groups[1]"),
    "a negative step": (_step(-1), {}, (), "param_groups[1]['step'] is -1"),
    "a step that is true": (_step(True), {}, (), "param_groups[1]['step'] is True"),
    "a step past float's whole numbers": (_step(10 ** 400), {}, (), "param_groups[1]['step']"),
    "a fractional step": (_step(2.5), {}, (), "param_groups[1]['step'] is 2.5"),
    "a loss scale that is a string": ({"loss_scaler": {"cur_scale": "1"}}, {}, (), "'cur_scale'"),
    "a loss scale of zero": ({"loss_scaler": {"cur_scale": 0.0}}, {}, (), "'cur_scale'"),
    "a loss scale iteration that is a list": ({"loss_scaler": {"cur_iter": [1]}}, {}, (), "'cur_iter'"),
    "global steps that are a string": ({"engine": {"global_steps": "3"}}, {}, (), "'global_steps'"),
    "negative global samples": ({"engine": {"global_samples": -4}}, {}, (), "'global_samples'"),
})


@pytest.mark.parametrize("case", HOSTILE)
def test_optimizer_files_zload_did_not_write_so_are_refused(tmp_path, case):
    metadata, tensors, drop, named = HOSTILE[case]
    index = write(tmp_path, metadata, tensors, drop)
    with pytest.raises(InvalidCheckpointError) as caught:
        saved_optimizer(str(tmp_path), "here")
    assert str(index) in str(caught.value) and named in str(caught.value), str(caught.value)


def test_plain_values_are_json_and_nothing_else():
    number = lambda value, what: value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else None  # noqa: E731
    assert plain({"betas": (0.9, 0.99), 3: [True, None, "x"], "lr": torch.tensor(0.5)}, number) == {
        "betas": [0.9, 0.99], "3": [True, None, "x"], "lr": 0.5}
    for value in (float("nan"), object(), torch.zeros(2), {(1, 2): 0}):
        with pytest.raises(NotPlain):
            plain({"x": value}, number)


def test_the_padding_of_a_flat_partition_is_what_no_slot_holds():
    """ZeRO-1/2 pad each group to an alignment, ZeRO-3 each parameter's partition: a resume zeroes
    those elements, as DeepSpeed's own flat buffers hold zeros there."""
    flat = Flat(0, torch.empty(12), (Slot(None, 0, 3, 0), Slot(None, 5, 4, 5)))
    assert _padding(flat) == [(3, 2), (9, 3)]
    assert _padding(Flat(0, torch.empty(4), (Slot(None, 0, 4, 0),))) == []


def _number(value, what):
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else None


def _schedulers(optimizer):
    from torch.optim import lr_scheduler as s

    return [s.StepLR(optimizer, 2), s.LambdaLR(optimizer, lambda step: 0.9 ** step),
            s.CosineAnnealingWarmRestarts(optimizer, 2), s.OneCycleLR(optimizer, 0.1, total_steps=10),
            s.CyclicLR(optimizer, 0.01, 0.1, step_size_up=2)]


def test_a_saved_optimizer_and_scheduler_fit_a_fresh_ones_kinds():
    """What a save writes of a torch optimizer's groups and scheduler, after steps, takes the
    place of those of a fresh one (the kinds a resume requires); hostile values do not."""
    param = torch.nn.Parameter(torch.ones(2))
    fresh = torch.optim.AdamW([param], lr=0.1)
    trained = torch.optim.AdamW([param], lr=0.1)
    pairs = list(zip(_schedulers(fresh), _schedulers(trained)))
    for _ in range(3):
        param.grad = torch.ones(2)
        trained.step()
        for _, scheduler in pairs:
            scheduler.step()
    saved = plain({k: v for k, v in trained.param_groups[0].items() if k != "params"}, _number)
    live = {k: v for k, v in fresh.param_groups[0].items() if k != "params"}
    assert _fits(saved, live)
    for live_scheduler, scheduler in pairs:
        assert _fits(plain(scheduler.state_dict(), _number), live_scheduler.state_dict()), type(scheduler).__name__
    for key, value in {"lr": "0.1", "betas": [0.9], "eps": None, "amsgrad": 0, "weight_decay": 1e400}.items():
        assert not _fits({**saved, key: value}, live), key
    assert not _fits({"last_epoch": 3}, pairs[0][0].state_dict())  # another scheduler's keys


def _engine_with(scaler):
    """Just enough of an engine for the loss-scaler functions: a ZeRO optimizer holding ``scaler``."""
    from types import SimpleNamespace
    return SimpleNamespace(optimizer=SimpleNamespace(fp32_partitioned_groups_flat=[], loss_scaler=scaler))


def _dynamic(scale=2.0 ** 16):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    return DynamicLossScaler(init_scale=scale, scale_window=1000, min_scale=1, delayed_shift=2,
                             consecutive_hysteresis=False)


def _static(scale=1.0):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    return LossScaler(scale=scale)


@pytest.mark.parametrize("saved, live, kept", [
    (_static(1.0), _dynamic(), "live"),     # bf16 checkpoint, fp16 engine: scale 1 would underflow
    (_static(128.0), _dynamic(), "live"),   # a static fp16 scale is no dynamic scaler's learning
    (_dynamic(2.0 ** 10), _static(1.0), "live"),  # bf16 engine: its scale is 1, whatever was saved
    (_dynamic(2.0 ** 10), _static(64.0), "live"),  # a configured static scale stays as configured
    (_dynamic(2.0 ** 10), _dynamic(), "saved"),  # what a dynamic scaler learnt goes on
], ids=["bf16 into fp16", "static fp16 into dynamic", "fp16 into bf16", "dynamic into static",
        "dynamic into dynamic"])
def test_a_loss_scale_is_restored_only_from_a_dynamic_scaler_into_one(saved, live, kept):
    from zload.integrations.deepspeed import loss_scale_state, set_loss_scale_state
    if saved.dynamic:
        saved.cur_iter = 700  # it has learnt something
    state = loss_scale_state(_engine_with(saved))
    before = loss_scale_state(_engine_with(live))
    set_loss_scale_state(_engine_with(live), state)
    assert loss_scale_state(_engine_with(live)) == (state if kept == "saved" else before)
