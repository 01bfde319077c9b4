"""Elastic resume: ``load_into(engine, path, optimizer=True)`` from DeepSpeed's own checkpoints and
from ``save(engine, path, optimizer=True)``, at another world size than the save's.

The reference is DeepSpeed's own elastic resume (``ds_to_universal``, then ``load_universal``):
both resumed engines must hold bit-identical fp32 masters, optimizer states, step counts,
hyperparameters, 16-bit weights, loss scale, scheduler and counters, and take identical next
steps. DeepSpeed's universal resume of ZeRO-3 gives every parameter group group 0's
hyperparameters and one step count object that each of a group's sub-groups advances at every
step: ZeRO-3 is compared with it on one parameter group, and several groups are checked against
the run that saved, resumed at the world size it saved at (``test_resume_with_groups_goes_on_as_
the_run_did``).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import resume_worlds as worlds
from tests.support.harness import run_world

# the checkpoints the tests share: made once per (world, stage, dtype, offload, groups)
_saved: dict[tuple, tuple] = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    def get(world: int, stage: int, dtype: str = "bf16", offload: bool = False, groups: str = "decay",
            round_robin: bool = False):
        key = (world, stage, dtype, offload, groups, round_robin)
        if key not in _saved:
            folder = tmp_path_factory.mktemp("-".join(map(str, key)))
            _saved[key] = folder, worlds.save(folder, world, stage, dtype, offload, groups=groups,
                                              round_robin=round_robin)
        return _saved[key]

    return get


# ZeRO-3 on one parameter group: DeepSpeed's universal resume of several is not a reference
CASES = [pytest.param(3, 2, 3, "one", id="zero3-3to2"), pytest.param(2, 4, 3, "one", id="zero3-2to4", marks=pytest.mark.slow),
         pytest.param(2, 1, 3, "one", id="zero3-2to1"), pytest.param(1, 3, 3, "one", id="zero3-1to3", marks=pytest.mark.slow),
         pytest.param(3, 2, 2, "decay", id="zero2-3to2", marks=pytest.mark.slow), pytest.param(2, 4, 2, "decay", id="zero2-2to4", marks=pytest.mark.slow),
         pytest.param(2, 1, 2, "decay", id="zero2-2to1"), pytest.param(1, 3, 2, "decay", id="zero2-1to3"),
         pytest.param(2, 3, 1, "decay", id="zero1-2to3", marks=pytest.mark.slow)]


@pytest.mark.parametrize("world, resumed_world, stage, groups", CASES)
def test_resume_matches_deepspeeds_universal_resume(saved, world, resumed_world, stage, groups):
    folder, _ = saved(world, stage, groups=groups)
    reference = worlds.resume(folder, resumed_world, stage, "bf16", how="universal", groups=groups)
    worlds.assert_same(worlds.resume(folder, resumed_world, stage, "bf16", how="native", groups=groups), reference,
                       "zload from DeepSpeed's checkpoint")
    worlds.assert_same(worlds.resume(folder, resumed_world, stage, "bf16", how="zload", groups=groups), reference,
                       "zload from zload.save")


@pytest.mark.parametrize("stage, dtype, offload", [pytest.param(2, "fp16", False, id="zero2-fp16"),
                                                   pytest.param(3, "bf16", True, id="zero3-offload"),
                                                   pytest.param(2, "bf16", True, id="zero2-offload")])
def test_resume_matches_deepspeeds_universal_resume_fp16_and_offload(saved, stage, dtype, offload):
    groups = "one" if stage == 3 else "decay"
    folder, _ = saved(2, stage, dtype, offload, groups)
    reference = worlds.resume(folder, 1, stage, dtype, offload, how="universal", groups=groups)
    for how in ("native", "zload"):
        worlds.assert_same(worlds.resume(folder, 1, stage, dtype, offload, how=how, groups=groups), reference, how)
    if dtype == "fp16":
        assert reference[0].loss_scale == saved(2, stage, dtype, offload, groups)[1][0].loss_scale


@pytest.mark.parametrize("how", ["native", "zload"])
def test_a_bf16_run_resumed_in_fp16_keeps_the_engines_loss_scale(saved, how):
    """bf16's loss scale is a static 1: set on an fp16 engine's dynamic scaler, fp16 gradients
    would underflow. The engine keeps its configured first scale (2**4 here), and trains on."""
    folder, _ = saved(2, 2, "bf16")
    resumed = worlds.resume(folder, 2, 2, "fp16", how=how, steps=1)
    assert [r.loss_scale for r in resumed] == [2.0 ** 4] * 2
    assert all(len(r.losses) == 1 and r.losses[0] == r.losses[0] for r in resumed)  # a finite loss, not NaN


def test_resume_with_groups_goes_on_as_the_run_did(saved):
    """ZeRO-3 with decay and no-decay groups, resumed at the world size it saved at: what the run
    held when it saved, and the same next losses as the run that went on."""
    folder, run = saved(2, 3, groups="decay")
    assert run[0].groups[0]["weight_decay"] != run[0].groups[1]["weight_decay"]
    for how in ("native", "zload"):
        worlds.assert_same(worlds.resume(folder, 2, 3, "bf16", how=how), run, f"{how} at the save's world size")


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_with_round_robin_gradients_goes_on_as_the_run_did(saved, stage):
    """ZeRO-1/2 with ``round_robin_gradients`` lay each group's parameters out in its flat buffer
    in round-robin order, which DeepSpeed's own links from a parameter to its masters
    (``_hp_mapping``) do not follow: zload's save holds each parameter's own masters, and a resume
    at the save's world size holds what the run held and takes its next steps."""
    from safetensors.torch import load_file

    folder, run = saved(2, stage, groups="decay", round_robin=True)
    masters = {}
    for file in (folder / worlds.ZLOAD).glob("optimizer-*.safetensors"):
        masters.update(load_file(file))
    for name, weight in run[0].weights.items():
        if f"{name}.fp32" in masters:
            assert torch.equal(masters[f"{name}.fp32"].to(weight.dtype), weight), name
    for how in ("native", "zload"):
        worlds.assert_same(worlds.resume(folder, 2, stage, "bf16", how=how, round_robin=True), run, how)


def _weights_then_a_step_body(folder, module_only):
    """Load the weights alone into a ZeRO-2 round-robin engine (or its module), then take a step
    at WarmupLR's first learning rate, 0: the weights it holds after, or the error refusing the
    load and whether the engine was left as it was."""
    import zload
    from tests.support.zero3 import full_state
    from zload.errors import ZloadError

    made = worlds.engine(2, "bf16", False, seed=1, round_robin=True)
    before = worlds.held_now(made)
    try:
        zload.load_into(made.module if module_only else made, folder)
    except ZloadError as e:
        return type(e).__name__, str(e), worlds.same_held(worlds.held_now(made), before)
    worlds.train(made, 1, 0)
    return full_state(made.module)


@pytest.mark.parametrize("module_only", [False, True])
def test_weights_loaded_into_a_round_robin_engine_are_its_masters(saved, module_only):
    """DeepSpeed 0.19.8's links from a parameter to its masters (``_hp_mapping``, which
    ``safe_set_full_fp32_param`` follows) ignore ``round_robin_gradients``' order: a load into the
    module alone, which can only follow them, is refused on every rank, the engine untouched."""
    folder, run = saved(2, 2, groups="decay", round_robin=True)
    results = run_world(2, _weights_then_a_step_body, str(folder / worlds.ZLOAD), module_only)
    if module_only:
        assert {r[0] for r in results} == {"ArgumentTypeError"} and len({r[1] for r in results}) == 1, results
        assert "pass the engine" in results[0][1] and all(r[2] for r in results), results
        return
    for weights in results:
        for name, weight in run[0].weights.items():
            assert torch.equal(weights[name], weight), name


def test_resume_with_groups_at_another_world_size(saved):
    """ZeRO-3 with two groups at another world size: each group's own hyperparameters and step
    count, and the masters and states DeepSpeed's universal resume restores."""
    folder, run = saved(2, 3, groups="decay")
    reference = worlds.resume(folder, 3, 3, "bf16", how="universal", steps=0)
    for how in ("native", "zload"):
        resumed = worlds.resume(folder, 3, 3, "bf16", how=how, steps=0)
        for rank, (ours, theirs) in enumerate(zip(resumed, reference)):
            worlds.assert_same([ours._replace(groups=[], steps_after=[])], [theirs._replace(groups=[], steps_after=[])],
                               f"{how}, rank {rank}")
            assert ours.groups == run[0].groups, how  # DeepSpeed's gives group 1 group 0's weight decay


def test_resume_from_a_trainer_checkpoint_reads_its_deepspeed_checkpoint(saved, tmp_path):
    """An HF Trainer's ``checkpoint-N`` holds safetensors weights beside ``save_checkpoint``'s
    files: the resume reads the DeepSpeed checkpoint, which holds the optimizer state."""
    import shutil

    folder, _ = saved(2, 3, groups="one")
    trainer = tmp_path / worlds.NATIVE
    shutil.copytree(folder / worlds.NATIVE, trainer)
    for name in (folder / worlds.ZLOAD).iterdir():
        if not name.name.startswith("optimizer"):
            shutil.copy(name, trainer / name.name)
    assert (trainer / "model.safetensors").exists() or (trainer / "model.safetensors.index.json").exists()
    worlds.assert_same(worlds.resume(tmp_path, 2, 3, "bf16", how="native", groups="one", steps=1),
                       worlds.resume(folder, 2, 3, "bf16", how="native", groups="one", steps=1), "a Trainer's folder")


def _bytes_read_body(folder):
    """(the bytes this rank's resume read, those of its own partitions: each trainable parameter's
    masters and two Adam states in fp32, each frozen one's 16-bit weights)."""
    import torch.distributed as dist

    import zload

    made = worlds.engine(3, "bf16", False, seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    own = 0
    for param in made.module.parameters():
        size = param.ds_tensor.numel()
        valid = max(0, min(size, param.ds_numel - rank * size))
        own += valid * (3 * 4 if param.requires_grad else param.ds_tensor.element_size())
    return zload.load_into(made, folder, optimizer=True).bytes_read, own, world


@pytest.mark.parametrize("how", ["native", "zload"])
def test_each_rank_reads_only_its_own_partitions(saved, how):
    """ZeRO-3 saved at 2 ranks, resumed at 3: the masters, states and frozen weights of each
    rank's new partitions, nothing more (the 16-bit weights of trained parameters are set from
    their masters, not read)."""
    folder, _ = saved(2, 3, groups="decay")
    for read, own, world in run_world(3, _bytes_read_body, str(folder / how)):
        assert world == 3 and read == own, (read, own)


# ---- what does not fit: refused on every rank, the engine untouched


def _refused_body(folder, stage, groups, freeze_more, module_only, thawed):
    """Resume from ``folder`` into an engine that does not fit it; (error class, message) and
    whether the engine was left as it was."""
    import zload
    from zload.errors import ZloadError

    made = worlds.engine(stage, "bf16", False, seed=1, groups=groups, also_frozen="layers.1.mlp." if freeze_more else None,
                         thawed=thawed)
    before = worlds.held_now(made)
    try:
        zload.load_into(made.module if module_only else made, folder, optimizer=True)
    except ZloadError as e:
        return type(e).__name__, str(e), worlds.same_held(worlds.held_now(made), before)
    return None


def _refusals(folder, world=2, stage=3, groups="decay", freeze_more=False, module_only=False, thawed=False):
    results = run_world(world, _refused_body, str(folder), stage, groups, freeze_more, module_only, thawed)
    assert all(r is not None for r in results), results
    assert len({r[:2] for r in results}) == 1, results  # the same error on every rank
    assert all(r[2] for r in results), "the engine was changed"
    return results[0][:2]


@pytest.mark.parametrize("how", ["native", "zload"])
def test_groups_in_another_order_are_refused(saved, how):
    folder, _ = saved(2, 3, groups="decay")
    kind, message = _refusals(folder / how, groups="swapped")
    assert kind == "PlanError"
    assert "in other parameter groups than in the checkpoint" in message
    assert "'model.layers.1.input_layernorm.weight' (group 1 in the checkpoint, 0 in the engine)" in message, message


def test_other_groups_are_refused(saved):
    folder, _ = saved(2, 2, groups="decay")
    kind, message = _refusals(folder / worlds.ZLOAD, stage=2, groups="one")
    assert kind == "PlanError"
    assert "the checkpoint's optimizer has 2 parameter groups, the engine's 1" in message


def test_parameters_the_checkpoint_did_not_train_are_refused(saved):
    folder, _ = saved(2, 3, groups="decay")
    kind, message = _refusals(folder / worlds.NATIVE, freeze_more=True)
    assert kind == "PlanError"
    assert "not optimized by the engine (frozen, or not in the model)" in message
    assert "'model.layers.1.mlp.down_proj.weight'" in message


@pytest.mark.parametrize("how", ["native", "zload"])
def test_parameters_the_checkpoint_did_not_train_but_the_engine_does_are_refused(saved, how):
    """Unfrozen since the save: no state to restore them with."""
    folder, _ = saved(2, 3, groups="decay")
    kind, message = _refusals(folder / how, thawed=True)
    assert kind == "PlanError"
    assert "have no optimizer state in the checkpoint" in message
    assert "'model.layers.0.mlp.down_proj.weight' (group 0)" in message, message


def test_an_optimizer_index_of_another_format_version_is_refused(saved, tmp_path):
    """zload's optimizer index, hostile or of a later zload: refused on every rank, naming it."""
    import json
    import shutil

    folder, _ = saved(2, 3, groups="decay")
    shutil.copytree(folder / worlds.ZLOAD, tmp_path / "out")
    index = tmp_path / "out" / "optimizer.safetensors.index.json"
    document = json.loads(index.read_text())
    document["metadata"]["version"] = 2
    index.write_text(json.dumps(document))
    kind, message = _refusals(tmp_path / "out")
    assert kind == "InvalidCheckpointError"
    assert str(index) in message and "format version 2" in message, message


def _each_refused_body(folders):
    """Resume from each of ``folders`` in turn into one engine; per folder (error class, message,
    whether the engine was left as it was)."""
    import zload
    from zload.errors import ZloadError

    made = worlds.engine(3, "bf16", False, seed=1)
    results = []
    for folder in folders:
        before = worlds.held_now(made)
        try:
            zload.load_into(made, folder, optimizer=True)
            results.append(None)
        except ZloadError as e:
            results.append((type(e).__name__, str(e), worlds.same_held(worlds.held_now(made), before)))
    return results


# values a hostile index would have set on the live optimizer, loss scaler and LR scheduler as they
# are (what training would then have done with them: a TypeError at the next step, Adam with one
# beta or a negative step count): (change, error class, what the message names)
UNSET = {
    "an lr that is a string": (lambda m: m["param_groups"][0]["hyperparameters"].update(lr="0.01"),
                               "PlanError", "'lr' is '0.01', the engine's "),
    "betas that are strings": (lambda m: m["param_groups"][1]["hyperparameters"].update(betas=["a", "b"]),
                               "PlanError", "'betas'"),
    "one beta": (lambda m: m["param_groups"][0]["hyperparameters"].update(betas=[0.9]), "PlanError", "'betas'"),
    "a weight decay that is null": (lambda m: m["param_groups"][0]["hyperparameters"].update(weight_decay=None),
                                    "PlanError", "'weight_decay'"),
    "a scheduler iteration that is a string": (lambda m: m["lr_scheduler"].update(last_batch_iteration="2"),
                                               "PlanError", "the LR scheduler's state"),
    "a scheduler state of another scheduler": (lambda m: m.update(lr_scheduler={"base_lrs": [0.1, 0.1]}),
                                               "PlanError", "the LR scheduler's state"),
    "a negative step": (lambda m: m["param_groups"][1].update(step=-2), "InvalidCheckpointError", "'step'"),
    "a loss scale that is a list": (lambda m: m["loss_scaler"].update(cur_scale=[1.0]), "InvalidCheckpointError",
                                    "'cur_scale'"),
}


def test_optimizer_state_that_cannot_be_set_on_the_engine_is_refused(saved, tmp_path):
    """zload's optimizer index with values that are no count or of other types than the engine's
    (hyperparameters, loss scale, LR scheduler state): refused on every rank before anything is
    written, naming the index and the value."""
    import json
    import shutil

    folder, _ = saved(2, 3, groups="decay")
    indexes = []
    for k, (change, *_) in enumerate(UNSET.values()):
        shutil.copytree(folder / worlds.ZLOAD, tmp_path / str(k))
        index = tmp_path / str(k) / "optimizer.safetensors.index.json"
        document = json.loads(index.read_text())
        change(document["metadata"])
        index.write_text(json.dumps(document))
        indexes.append(index)
    results = run_world(2, _each_refused_body, [str(i.parent) for i in indexes])
    for (case, (_, kind, named)), index, ours, theirs in zip(UNSET.items(), indexes, *results):
        assert ours is not None and ours[:2] == theirs[:2], (case, ours, theirs)
        assert ours[0] == kind and ours[2], (case, ours)
        assert str(index) in ours[1] and named in ours[1], (case, ours[1])


def _resume_warnings_body(folder):
    """The ZloadWarnings a resume from ``folder`` gives on this rank."""
    import warnings

    import zload

    made = worlds.engine(3, "bf16", False, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zload.load_into(made, folder, optimizer=True)
    return [str(w.message) for w in caught if issubclass(w.category, zload.ZloadWarning)]


def test_an_engine_scheduler_the_checkpoint_has_no_state_for_is_warned_about(saved, tmp_path):
    """A checkpoint saved without an LR scheduler, resumed into an engine with one: the scheduler
    starts afresh (DeepSpeed's own load raises), and rank 0 says so."""
    import json
    import shutil

    folder, _ = saved(2, 3, groups="decay")
    shutil.copytree(folder / worlds.ZLOAD, tmp_path / "saved")
    index = tmp_path / "saved" / "optimizer.safetensors.index.json"
    document = json.loads(index.read_text())
    document["metadata"]["lr_scheduler"] = None
    index.write_text(json.dumps(document))
    first, second = run_world(2, _resume_warnings_body, str(tmp_path / "saved"))
    assert [m for m in first if "holds no LR scheduler state" in m and "WarmupLR starts afresh" in m], first
    assert second == []  # rank 0 alone speaks
    assert run_world(2, _resume_warnings_body, str(folder / worlds.ZLOAD)) == [[], []]


def test_deepspeeds_optimizer_state_with_steps_that_are_no_counts_is_refused(saved, tmp_path):
    """DeepSpeed's optimizer states whose step count (which Adam's bias correction raises betas to)
    is negative or NaN: refused on every rank, naming the file, before anything is written."""
    import shutil

    folder, _ = saved(2, 3, groups="decay")
    files = []
    for k, step in enumerate((-3.0, float("nan"))):
        shutil.copytree(folder / worlds.NATIVE, tmp_path / str(k))
        for file in sorted((tmp_path / str(k)).glob("global_step*/*_optim_states.pt")):
            state = torch.load(file, weights_only=False)
            for flat in state["optimizer_state_dict"]["optimizer_state_dict"]["state"].values():
                flat["step"] = torch.tensor(step)
            torch.save(state, file)
        files.append(next((tmp_path / str(k)).glob("global_step*/*zero_pp_rank_0_mp_rank_00_optim_states.pt")))
    results = run_world(2, _each_refused_body, [str(f.parent.parent) for f in files])
    for file, ours, theirs in zip(files, *results):
        assert ours is not None and ours[:2] == theirs[:2], (ours, theirs)
        assert ours[0] == "PlanError" and ours[2], ours  # as every problem of DeepSpeed's files
        assert str(file) in ours[1] and "step is" in ours[1], ours[1]


def test_a_checkpoint_without_optimizer_state_is_refused(tmp_path):
    run_world(2, _save_weights_body, str(tmp_path / "weights"))
    kind, message = _refusals(tmp_path / "weights")
    assert kind == "PlanError"
    assert "holds no optimizer state (saved without optimizer=True?)" in message


def _save_weights_body(out):
    """A zload.save of the weights alone (other weights than the run's)."""
    import zload

    zload.save(worlds.engine(3, "bf16", False, seed=1), out)


def _odd_state_body(folder, odd, call):
    """Resume from ``folder`` (``call="load"``), or save into it, with an engine whose optimizer
    keeps, on rank 0, a state of its first flat partition that is not Adam's (``odd``); (error
    class, message) and whether the engine was left as it was."""
    import torch.distributed as dist

    import zload
    from zload.errors import ZloadError

    made = worlds.engine(3, "bf16", False, seed=1)
    worlds.train(made, 1, 0)
    before = worlds.held_now(made)
    state, flat = made.optimizer.optimizer.state, worlds.optimizer_flats(made)[0]
    kept = state[flat]
    if dist.get_rank() == 0:
        # a list of its items; an Adafactor-like factored second moment (one value per row)
        state[flat] = list(kept.items()) if odd == "list" else {**kept, "exp_avg_sq": kept["exp_avg_sq"][:3].clone()}
    try:
        if call == "load":
            zload.load_into(made, folder, optimizer=True)
        else:
            zload.save(made, folder, optimizer=True)
        refused = None
    except ZloadError as e:
        refused = type(e).__name__, str(e)
    state[flat] = kept
    return refused, worlds.same_held(worlds.held_now(made), before)


@pytest.mark.parametrize("odd, held, call", [("list", "is a list, not a dict", "load"),
                                             ("factored", "holds 'exp_avg_sq', a torch.float32 tensor of shape [3]",
                                              "load"),
                                             ("factored", "holds 'exp_avg_sq', a torch.float32 tensor of shape [3]",
                                              "save")])
def test_an_optimizer_state_that_is_not_adams_is_refused(saved, tmp_path, odd, held, call):
    """On every rank, before anything is written (into the engine, or a folder), naming the
    partition and what its state holds."""
    folder, _ = saved(2, 3, groups="decay")
    where = folder / worlds.NATIVE if call == "load" else tmp_path / "out"
    results = run_world(2, _odd_state_body, str(where), odd, call)
    assert call == "load" or not where.exists()
    assert all(unchanged for _, unchanged in results), "the engine was changed"
    assert len({refused for refused, _ in results}) == 1, results  # the same error on every rank
    kind, message = results[0][0]
    assert kind == "UnsupportedModelError", message
    assert f"its flat fp32 partition 0 (parameter group 0) {held}" in message and "rank 0" in message, message


def test_the_module_is_refused(saved):
    folder, _ = saved(2, 3, groups="decay")
    kind, message = _refusals(folder / worlds.NATIVE, module_only=True)
    assert kind == "ArgumentTypeError"
    assert "pass the engine, not its module" in message


def test_optimizer_state_of_other_weights_is_refused(saved, tmp_path):
    """The optimizer files of one save beside the weights of another: refused (their index
    records the digests of the weights they were saved with)."""
    import shutil

    folder, _ = saved(2, 3, groups="decay")
    run_world(2, _save_weights_body, str(tmp_path / "weights"))
    for name in (folder / worlds.ZLOAD).iterdir():
        if name.name.startswith("optimizer"):
            shutil.copy(name, tmp_path / "weights" / name.name)
    kind, message = _refusals(tmp_path / "weights")
    assert kind == "PlanError"
    assert "saved with other weights" in message


def test_a_save_without_optimizer_removes_the_earlier_optimizer_state(saved, tmp_path):
    import shutil

    folder, _ = saved(2, 3, groups="decay")
    shutil.copytree(folder / worlds.ZLOAD, tmp_path / "out")
    assert (tmp_path / "out" / "optimizer.safetensors.index.json").exists()
    run_world(2, _save_weights_body, str(tmp_path / "out"))
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("optimizer")]


def test_zload_optimizer_files_are_plain_safetensors(saved):
    """What docs/optimizer-format.md says: one tensor per parameter and state, whole, and the
    groups in the index's metadata."""
    import json

    from safetensors import safe_open

    folder, run = saved(2, 3, groups="decay")
    index = json.loads((folder / worlds.ZLOAD / "optimizer.safetensors.index.json").read_text())
    metadata = index["metadata"]
    assert metadata["format"] == "zload-optimizer" and metadata["version"] == 1
    assert metadata["states"] == ["fp32", "exp_avg", "exp_avg_sq"]
    assert [g["step"] for g in metadata["param_groups"]] == [2, 2]
    assert [g["hyperparameters"]["weight_decay"] for g in metadata["param_groups"]] == [0.1, 0.0]
    assert metadata["engine"]["global_steps"] == 2
    masters = {}
    for name, file in index["weight_map"].items():
        with safe_open(folder / worlds.ZLOAD / file, "pt") as f:
            masters[name] = f.get_tensor(name)
    members = [n for g in metadata["param_groups"] for n in g["params"]]
    assert sorted(index["weight_map"]) == sorted(f"{n}.{s}" for n in members for s in metadata["states"])
    # the fp32 masters, whole, are what the run's 16-bit weights were cast from
    for name in members:
        assert torch.equal(masters[f"{name}.fp32"].to(torch.bfloat16), run[0].weights[name]), name
