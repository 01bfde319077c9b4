"""zload.save from live engines and transformers models: frozen parameters, master weights, dtype,
the Hugging Face layout (read back by safetensors and by transformers without DeepSpeed), loading
at another world size, ranks without a shared filesystem, and ``max_shard_size``.

References are always DeepSpeed's ``GatheredParameters`` (bit for bit), and for file names
transformers' own ``save_pretrained`` of a plain model holding the gathered weights.
"""

from __future__ import annotations

import json
import os
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

import zload
from zload.saving.plan import parse_size

from tests.support.checkpoints import metadata_with_digest, read_all
from tests.support.harness import run_world
from tests.support.models import tiny_llama_config
from tests.support.zero3 import assert_bit_equal, check_against, full_state, randomize

transformers = pytest.importorskip("transformers")
from tests.distributed.test_load_converted import MODELS, _build_nested_zero3

SHARD = "20KB"
ENGINE_CONFIG = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                 "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}}


KINDS = {
    "llama": (transformers.LlamaForCausalLM, tiny_llama_config),
    "llama_tied": (transformers.LlamaForCausalLM, lambda: tiny_llama_config(tie=True)),
    "vision_encoder_decoder": MODELS["vision_encoder_decoder"],
    "mixtral": MODELS["mixtral"],
}


# ---------------------------------------------------------------------------------------------
# helpers (both sides)


def _check_layout(folder, max_bytes: int) -> list[str]:
    """The HF sharded layout, as transformers writes it; returns the shard names."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    n = len(files)
    assert n > 1, f"expected a sharded checkpoint, got {files}"
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert (folder / "config.json").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    total = 0
    for name in files:
        raw = (folder / name).read_bytes()
        header_len = int.from_bytes(raw[:8], "little")
        assert header_len % 8 == 0, f"{name}: header length {header_len} not a multiple of 8"
        header = json.loads(raw[8:8 + header_len])
        header.pop("__metadata__")
        assert metadata_with_digest(folder / name) == {"format": "pt"}
        data = sorted(tuple(h["data_offsets"]) for h in header.values())
        assert data[0][0] == 0 and all(a[1] == b[0] for a, b in pairwise(data))
        assert 8 + header_len + data[-1][1] == len(raw), f"{name}: trailing or missing bytes"
        with safe_open(str(folder / name), "pt") as f:
            keys = set(f.keys())
        assert keys == {k for k, v in index["weight_map"].items() if v == name}
        assert len(keys) == 1 or data[-1][1] <= max_bytes, f"{name}: {data[-1][1]} > {max_bytes} bytes"
        total += data[-1][1]
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == total
    assert total == sum(t.numel() * t.element_size() for t in read_all(folder).values())
    return files


# ---------------------------------------------------------------------------------------------
# A + D (master weights): a bf16 engine with only lm_head trainable, after one real step

def _frozen_engine_body(root, offload):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    ds_config = ENGINE_CONFIG
    if offload:  # parameters and optimizer (with its fp32 masters) in host memory
        ds_config = {**ENGINE_CONFIG, "zero_force_ds_cpu_optimizer": False, "zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    llama, config = transformers.LlamaForCausalLM, tiny_llama_config()
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = llama(config)
    randomize(model, seed=5)
    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")
    before = full_state(model)
    assert before["lm_head.weight"].dtype == torch.bfloat16
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      optimizer=torch.optim.AdamW([model.lm_head.weight], lr=1e-2))
    assert bool(engine.zero_offload_optimizer()) == bool(engine.zero_offload_param()) == offload
    ids = torch.randint(0, 53, (2, 8), generator=torch.Generator().manual_seed(3))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()

    out, master = Path(root) / "out", Path(root) / "master"
    report = zload.save(engine, out)
    zload.save(engine, master, master_weights=True)
    after = full_state(engine.module)
    names = [n for n, _ in engine.module.named_parameters()]
    saved = read_all(out)
    assert report.files == ["model.safetensors"] and sorted(saved) == sorted(names)
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"]), "the step did nothing"
    for name in names:
        assert_bit_equal(saved[name], after[name], f"rank {dist.get_rank()}: {name}")
        if name != "lm_head.weight":  # frozen: present, full and as it was before the step
            assert_bit_equal(saved[name], before[name], f"{name} (frozen)")

    saved_master = read_all(master)
    assert sorted(saved_master) == sorted(names)
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            want = safe_get_full_fp32_param(p)  # a collective: every rank, same order
            assert want.dtype == torch.float32
            assert not torch.equal(want, after[name].float()), "master equals its bf16 rounding?"
        else:
            want = after[name].float()
        assert_bit_equal(saved_master[name], want, f"master: {name}")
    return len(saved)


@pytest.mark.parametrize("world,offload", [(1, False), (3, False), (3, True)])
def test_frozen_params_and_master_weights_from_bf16_engine(tmp_path, world, offload):
    assert run_world(world, _frozen_engine_body, str(tmp_path), offload) == [21] * world


def _transposed_master_body(root):
    """master_weights reaches tensors whose conversion is no byte layout (gathered and converted
    by one rank) as well as the partition-written ones."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    cls, make_config = MODELS["transposed_llama"]
    with deepspeed.zero.Init(config_dict_or_path=ENGINE_CONFIG):
        model = cls(make_config())
    randomize(model, seed=9)
    engine, *_ = deepspeed.initialize(model=model, config=ENGINE_CONFIG,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 53, (2, 8), generator=torch.Generator().manual_seed(4))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    report = zload.save(engine, Path(root) / "master", master_weights=True)
    saved = read_all(Path(root) / "master")
    for name, p in engine.module.named_parameters():
        want = safe_get_full_fp32_param(p)  # a collective: every rank, same order
        if name.endswith("mlp.up_proj.weight"):
            want = want.t()  # the checkpoint stores it transposed
        assert_bit_equal(saved[name], want, f"master: {name}")
    return report.gathered


@pytest.mark.parametrize("world", [1, 2])
def test_master_weights_of_converted_tensors(tmp_path, world):
    for gathered in run_world(world, _transposed_master_body, str(tmp_path)):
        assert gathered == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"]

# ---------------------------------------------------------------------------------------------
# B, D (dtype), E (shared vs streamed), F (bad size, big tensor): one world-3 save per model

class RankSaves(NamedTuple):
    gathered: dict[str, torch.Tensor] | None  # the model's weights by model name, on rank 0 only
    reports: dict[str, zload.SaveReport]  # this rank's, by the folder under root
    bad_size_error: str | None  # what max_shard_size="twenty kilobytes" raised


def _save_body(kind, root):
    cls, make_config = KINDS[kind]
    config = make_config()
    model = _build_nested_zero3(cls, config, torch.float32)
    randomize(model, seed=len(kind))
    root = Path(root)
    reports = {
        "out": zload.save(model, root / "out", max_shard_size=SHARD),
        "bf16": zload.save(model, root / "bf16", max_shard_size="8KB", dtype=torch.bfloat16),
        "shared": zload.save(model, root / "shared", max_shard_size=SHARD, shared_filesystem=True,
                             staging_bytes=100),
        "stream": zload.save(model, root / "stream", max_shard_size=SHARD, shared_filesystem=False,
                             staging_bytes=100),
        "big": zload.save(model, root / "big", max_shard_size=3000),
    }
    try:
        zload.save(model, root / "bad", max_shard_size="twenty kilobytes")
    except zload.ZloadError as e:
        bad = str(e)
    else:
        bad = None
    gathered = full_state(model)
    return RankSaves(gathered if dist.get_rank() == 0 else None, reports, bad)


class SavedAt3(NamedTuple):
    root: Path  # one folder per save of _save_body
    gathered: dict[str, torch.Tensor]  # the model's weights by model name
    reports: list[dict[str, zload.SaveReport]]  # per rank, by the folder under root


@pytest.fixture(scope="module")
def saved_at_3(tmp_path_factory):
    """kind -> SavedAt3: each model saved at world 3 in every way _save_body saves it."""
    saved = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(kind)
        results = run_world(3, _save_body, kind, str(root))
        for rank in results:
            assert "max_shard_size" in (rank.bad_size_error or ""), rank.bad_size_error
        assert not (root / "bad").exists()
        saved[kind] = SavedAt3(root, results[0].gathered, [rank.reports for rank in results])
    return saved


def _reference_files(kind, gathered, folder) -> dict[str, torch.Tensor]:
    """What transformers' save_pretrained writes for a plain model holding ``gathered``."""
    cls, make_config = KINDS[kind]
    plain = cls(make_config())
    plain.load_state_dict(gathered, strict=True)
    plain.save_pretrained(folder, max_shard_size=SHARD)
    return read_all(folder)


@pytest.mark.parametrize("kind", list(KINDS))
def test_hf_layout_read_back_without_deepspeed(saved_at_3, tmp_path, kind):
    root, gathered, reports = saved_at_3[kind]
    out = root / "out"
    files = _check_layout(out, parse_size(SHARD))
    assert all(r["out"].files == files for r in reports)
    assert sum(r["out"].bytes_written for r in reports) == sum(
        t.numel() * t.element_size() for t in read_all(out).values())  # each byte written once

    # names, shapes, dtypes and values exactly as transformers writes them (tied weights once)
    reference = _reference_files(kind, gathered, tmp_path / "reference")
    saved = read_all(out)
    assert sorted(saved) == sorted(reference)
    for name in reference:
        assert_bit_equal(saved[name], reference[name], f"{kind}: {name}")
    if kind in ("llama", "llama_tied"):  # model names are checkpoint names: compare directly too
        for name, tensor in saved.items():
            assert_bit_equal(tensor, gathered[name], name)
    if kind == "llama_tied":
        assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved
    if kind == "vision_encoder_decoder":
        assert "decoder.transformer.wte.weight" in saved and "decoder.lm_head.weight" not in saved

    # transformers alone, no DeepSpeed
    cls, _ = KINDS[kind]
    model, info = cls.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set())
    assert info["mismatched_keys"] in ([], set()), info
    state = model.state_dict()
    assert set(gathered) <= set(state)
    for name in gathered:
        actual = state[name]
        assert_bit_equal(actual, gathered[name].to(actual.dtype), f"from_pretrained {kind}: {name}")
    if kind == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if kind == "vision_encoder_decoder":
        assert model.decoder.lm_head.weight is model.decoder.transformer.wte.weight


@pytest.mark.parametrize("kind", ["llama", "vision_encoder_decoder", "mixtral"])
def test_dtype_and_streaming_and_big_tensors(saved_at_3, tmp_path, kind):
    root, gathered, reports = saved_at_3[kind]
    reference = _reference_files(kind, gathered, tmp_path / "reference")

    # D: dtype=bf16 on an fp32 model
    bf16 = read_all(root / "bf16")
    assert sorted(bf16) == sorted(reference)
    for name in reference:
        assert reference[name].dtype == torch.float32
        assert_bit_equal(bf16[name], reference[name].to(torch.bfloat16), f"bf16 {name}")
    _check_layout(root / "bf16", 8000)

    # E: streaming to rank 0 in 100-byte batches writes the same bytes as a shared filesystem
    names = sorted(os.listdir(root / "shared"))
    assert names == sorted(os.listdir(root / "stream")) == sorted(os.listdir(root / "out"))
    for name in names:
        shared = (root / "shared" / name).read_bytes()
        assert shared == (root / "stream" / name).read_bytes(), name
        assert shared == (root / "out" / name).read_bytes(), name
    total = sum(t.numel() * t.element_size() for t in reference.values())
    shared, stream = ([r[save].bytes_written for r in reports] for save in ("shared", "stream"))
    assert sum(shared) == total  # every byte written once, by its owner
    assert stream[0] == total  # rank 0 wrote everything; the others sent their own share
    assert stream[1:] == shared[1:]

    # F: a tensor larger than max_shard_size gets a shard of its own
    files = _check_layout(root / "big", 3000)
    alone = 0
    for name in files:
        with safe_open(str(root / "big" / name), "pt") as f:
            sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        for k, shape in sizes.items():
            nbytes = 4 * int(torch.tensor(shape).prod()) if shape else 4
            if nbytes > 3000:
                assert len(sizes) == 1, f"{k} ({nbytes} bytes) shares {name} with {sorted(sizes)}"
                alone += 1
    assert alone >= 1
    big = read_all(root / "big")
    for name in reference:
        assert_bit_equal(big[name], reference[name], f"big {name}")


# ---------------------------------------------------------------------------------------------
# C: saved at world 3, loaded by zload at 2 and 4

class LoadedBack(NamedTuple):
    compared: int  # tensors equal to the gathered weights
    report: zload.LoadReport
    tied: bool  # tied weights are still one parameter


def _load_body(kind, folder, gathered):
    cls, make_config = KINDS[kind]
    model = _build_nested_zero3(cls, make_config(), torch.float32)  # sentinel-filled partitions
    report = zload.load_into(model, folder)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    compared = check_against(model, gathered, names=names)
    if kind.startswith("llama"):  # checkpoint names are model names: against the files themselves
        check_against(model, read_all(folder))
    tied = (model.lm_head.weight is model.model.embed_tokens.weight if kind == "llama_tied" else
            model.decoder.lm_head.weight is model.decoder.transformer.wte.weight
            if kind == "vision_encoder_decoder" else True)
    return LoadedBack(compared, report, tied)


@pytest.mark.parametrize("kind,world", [("llama", 2), ("llama_tied", 4), ("mixtral", 2), ("mixtral", 4),
                                        ("vision_encoder_decoder", 4)])
def test_saved_at_3_loaded_at_other_world_sizes(saved_at_3, kind, world):
    saved = saved_at_3[kind]
    for loaded in run_world(world, _load_body, kind, str(saved.root / "out"), saved.gathered):
        assert loaded.compared > 10 and loaded.tied
        assert loaded.report.missing == loaded.report.unexpected == loaded.report.slow_path == []


# ---------------------------------------------------------------------------------------------
# E: detection, when each rank sees its own directory at the same path

class SavedOnNode(NamedTuple):
    saved: zload.SaveReport  # the save into the rank's own "out"
    loaded: zload.LoadReport  # the load of it back into a fresh model


def _save_on_node(node_dirs, staging_bytes):
    cls, make_config = KINDS["llama"]
    model = _build_nested_zero3(cls, make_config(), torch.float32)
    randomize(model, seed=len("llama"))  # the same weights as saved_at_3["llama"]
    fresh = _build_nested_zero3(cls, make_config(), torch.float32)
    cwd = os.getcwd()
    try:
        os.chdir(node_dirs[dist.get_rank()])
        report = zload.save(model, "out", max_shard_size=SHARD, staging_bytes=staging_bytes)
        loaded = zload.load_into(fresh, "out")  # only rank 0 has it: the others are sent their bytes
    finally:
        os.chdir(cwd)
    gathered = full_state(model)
    check_against(fresh, gathered, names=[n for n, _ in fresh.named_parameters()])
    return SavedOnNode(report, loaded)


def test_no_shared_filesystem_is_detected(saved_at_3, tmp_path):
    nodes = [tmp_path / f"node{r}" for r in range(3)]
    for node in nodes:
        node.mkdir()
    results = run_world(3, _save_on_node, [str(n) for n in nodes], 100)
    for node in nodes[1:]:
        assert os.listdir(node) == [], f"{node}: {os.listdir(node)}"
    assert sorted(os.listdir(nodes[0])) == ["out"]
    files = _check_layout(nodes[0] / "out", parse_size(SHARD))
    assert all(r.saved.files == files for r in results)
    assert results[0].loaded.bytes_received == 0 and all(r.loaded.bytes_received > 0 for r in results[1:])
    # the same weights as the shared-filesystem save of saved_at_3: the same bytes
    shared = saved_at_3["llama"].root / "out"
    assert sorted(os.listdir(nodes[0] / "out")) == sorted(os.listdir(shared))
    for name in os.listdir(shared):
        assert (nodes[0] / "out" / name).read_bytes() == (shared / name).read_bytes(), name
