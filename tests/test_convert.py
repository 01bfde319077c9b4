"""``zload.convert`` / ``zload convert``: DeepSpeed's own checkpoints into Hugging Face safetensors.

Checkpoints are real: ``deepspeed.initialize``, one training step, ``engine.save_checkpoint``. The
reference is DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``: every tensor written
must equal it bit for bit, in name and dtype, a tied alias written once under the name stored.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import zload
from zload.converting import byte_share
from zload.save_plan import OutTensor, layout

from .checkpoints import read_all
from .harness import run_world
from .zero3 import assert_bit_equal

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# Native checkpoints. A minimal builder until tests/native_checkpoints.py (same names) lands.

class WithBuffers(torch.nn.Module):
    """Tied embeddings, a frozen layer, and persistent buffers: floating ones (one kept in bf16
    whatever the engine does, which zero_to_fp32 restores to fp32) and an integer one (kept as it is)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 7)
        self.out = torch.nn.Linear(7, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("shift", torch.linspace(-1, 1, 6).bfloat16())

    def forward(self, input_ids, labels):
        hidden = self.out(self.mid(self.embed(input_ids)))
        hidden = hidden * self.scale.to(hidden.dtype) + self.shift.to(hidden.dtype)
        return torch.nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


class NativeCheckpoint(NamedTuple):
    folder: str  # what save_checkpoint wrote (holds `latest`)
    tag_folder: str
    module_weights: dict[str, torch.Tensor]  # the engine's own (16-bit) weights, gathered, every name
    masters: dict[str, torch.Tensor]  # trainable parameters' fp32 masters, gathered


def _native_body(root, stage, dtype, frozen, tied, offload_optimizer, sub_group_size, model) -> NativeCheckpoint:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from .models import tiny_llama_config
    from .zero3 import full_state

    zero = {"stage": stage}
    if sub_group_size:
        zero["sub_group_size"] = sub_group_size
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False, "zero_optimization": zero,
              "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}}
    torch.manual_seed(11)
    llama = transformers.LlamaForCausalLM  # imported before zero.Init, which its import fails under
    factory = (lambda: llama(tiny_llama_config(tie=tied))) if model == "llama" else WithBuffers
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            module = factory()
    else:
        module = factory()
    if frozen:
        for name, p in module.named_parameters():
            p.requires_grad_(not name.startswith(("model.layers.0.mlp.", "mid.")))
    trainable = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, config=config,
                                      optimizer=torch.optim.AdamW(trainable, lr=1e-2))
    ids = torch.randint(0, 11, (1, 8), generator=torch.Generator().manual_seed(3))
    loss = engine(input_ids=ids, labels=ids)
    engine.backward(loss.loss if hasattr(loss, "loss") else loss)
    engine.step()
    engine.save_checkpoint(root)
    if model == "llama" and engine.global_rank == 0:
        module.config.to_json_file(os.path.join(root, "config.json"))  # as an HF Trainer checkpoint-N/
    weights = full_state(engine.module)
    masters = {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()
               if p.requires_grad}  # a collective: every rank, in the same order
    tag = open(os.path.join(root, "latest")).read().strip()
    return NativeCheckpoint(str(root), os.path.join(root, tag), weights, masters)


def make_native_checkpoint(root, *, world: int = 2, stage: int = 3, dtype: str = "bf16", frozen: bool = True,
                           tied: bool = True, offload_optimizer: bool = False, sub_group_size: int | None = None,
                           model: str = "llama") -> NativeCheckpoint:
    """A real DeepSpeed checkpoint in ``root`` (saved by ``world`` ranks after one step)."""
    return run_world(world, _native_body, str(root), stage, dtype, frozen, tied, offload_optimizer,
                     sub_group_size, model)[0]


def deepspeed_reference(folder) -> dict[str, torch.Tensor]:
    """DeepSpeed's own conversion, every tensor contiguous."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(folder)).items()}


# ---------------------------------------------------------------------------------------------
# helpers

def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def _aliases(folder) -> dict[str, str]:
    tag = Path(folder, "latest").read_text().strip()
    rank0 = sorted(Path(folder, tag).glob("*mp_rank_00_model_states.pt"))[0]  # rank 0's records them
    state = torch.load(rank0, map_location="cpu", weights_only=False)
    return state["shared_params"]


def _check_master(out, folder) -> dict[str, torch.Tensor]:
    """``out`` holds DeepSpeed's reference, names, dtypes and bits, each tied alias once under the
    name stored."""
    reference, written, aliases = deepspeed_reference(folder), read_all(out), _aliases(folder)
    assert set(aliases) <= set(reference)
    assert sorted(written) == sorted(set(reference) - set(aliases))
    for name, tensor in written.items():
        assert_bit_equal(tensor, reference[name], name)
    assert zload.open_checkpoint(out).tensors.keys() == written.keys()
    return written


def _converted(folder, out, **kwargs) -> Path:
    zload.convert(folder, out, **kwargs)
    return Path(out)


def _convert_body(folder, out, kwargs) -> list[str]:
    return zload.convert(folder, out, **kwargs).files


# ---------------------------------------------------------------------------------------------
# master weights: DeepSpeed's reference

@pytest.fixture(scope="module")
def zero3_w2(tmp_path_factory) -> NativeCheckpoint:
    """A bf16 tiny Llama, ZeRO-3 on 2 ranks, frozen parameters and tied embeddings."""
    return make_native_checkpoint(tmp_path_factory.mktemp("z3w2") / "checkpoint-1", world=2)


def test_zero3_bf16_masters_as_deepspeed_writes_them(zero3_w2, tmp_path):
    written = _check_master(_converted(zero3_w2.folder, tmp_path / "out"), zero3_w2.folder)
    assert written["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # frozen: as stored
    assert written["model.embed_tokens.weight"].dtype == torch.float32
    assert not torch.equal(written["model.embed_tokens.weight"],
                           zero3_w2.module_weights["model.embed_tokens.weight"].float()), "masters are fp32"
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert (tmp_path / "out" / "config.json").read_bytes() == Path(zero3_w2.folder, "config.json").read_bytes()


def test_the_output_loads_with_transformers_alone(zero3_w2, tmp_path):
    """``from_pretrained`` without DeepSpeed gets every tensor, the tied head included, equal to
    DeepSpeed's reference: nothing missing, unexpected or re-initialised."""
    zload.convert(zero3_w2.tag_folder, tmp_path / "out")
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                                output_loading_info=True)
    assert not any(info.values()), info
    reference = deepspeed_reference(zero3_w2.folder)
    state = model.state_dict()
    assert sorted(state) == sorted(reference)
    for name, tensor in state.items():
        assert_bit_equal(tensor, reference[name].float(), name)


@pytest.mark.parametrize("stage,world,groups,offload", [(3, 3, None, False), (3, 2, 300, False), (3, 2, None, True),
                                                        (2, 2, None, False), (2, 2, None, True)])
def test_other_world_sizes_stages_and_layouts(tmp_path, stage, world, groups, offload):
    """ZeRO-3 saved by 3 ranks; ZeRO-3 with several fp32 flat groups (a small sub_group_size);
    ZeRO-2 (parameters crossing the ranks' partitions, the last partition saved without its
    padding); ZeRO-3 and ZeRO-2 with the optimizer offloaded to the CPU.
    A model with buffers: the floating one comes out as float32, the integer one as it is."""
    case = make_native_checkpoint(tmp_path / "ckpt", world=world, stage=stage, sub_group_size=groups,
                                  offload_optimizer=offload, model="buffers")
    written = _check_master(_converted(case.folder, tmp_path / "out"), case.folder)
    assert case.module_weights["shift"].dtype == torch.bfloat16  # saved in bf16, restored to float32
    assert written["scale"].dtype == written["shift"].dtype == torch.float32
    assert written["steps"].dtype == torch.int64
    assert "head.weight" not in written and "embed.weight" in written


def test_fp32_zero1_from_one_rank(tmp_path):
    case = make_native_checkpoint(tmp_path / "ckpt", world=1, stage=1, dtype="fp32", model="buffers")
    written = _check_master(_converted(case.folder, tmp_path / "out"), case.folder)
    assert all(t.dtype in (torch.float32, torch.int64) for t in written.values())


# ---------------------------------------------------------------------------------------------
# module weights: the engine's own

def test_module_weights_are_the_engines_16_bit_weights(zero3_w2, tmp_path):
    """ZeRO-3 stores only fp32 masters; cast to bf16 they are bit for bit the live engine's
    gathered weights (frozen ones too)."""
    zload.convert(zero3_w2.folder, tmp_path / "out", weights="module")
    written = read_all(tmp_path / "out")
    assert sorted(written) == sorted(set(zero3_w2.module_weights) - {"lm_head.weight"})
    for name, tensor in written.items():
        assert_bit_equal(tensor, zero3_w2.module_weights[name], name)


def test_zero2_module_weights_as_stored(tmp_path):
    case = make_native_checkpoint(tmp_path / "ckpt", world=2, stage=2, model="buffers")
    zload.convert(case.folder, tmp_path / "out", weights="module")
    written = read_all(tmp_path / "out")
    assert sorted(written) == sorted(set(case.module_weights) - {"head.weight"})
    for name, tensor in written.items():
        assert_bit_equal(tensor, case.module_weights[name], name)
    assert written["shift"].dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# layout and processes

def test_sharded_as_save_pretrained_shards(zero3_w2, tmp_path):
    """A small max_shard_size: huggingface_hub's splitter over the tensors in module order, the
    index naming every tensor, each file's digest recorded (``verify="full"`` checks it)."""
    report = zload.convert(zero3_w2.folder, tmp_path / "out", max_shard_size="8KB")
    n = len(report.files)
    assert n > 2 and report.files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    written = _check_master(tmp_path / "out", zero3_w2.folder)
    assert list(index["weight_map"]) == list(written) or sorted(index["weight_map"]) == sorted(written)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    assert os.listdir(tmp_path / "out").count("config.json") == 1
    done = subprocess.run([sys.executable, "-m", "zload", "validate", "--full", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and f"{n} files matched the digest" in done.stdout, done.stderr


@pytest.mark.parametrize("world", [2, 3])
def test_processes_write_the_same_bytes_as_one(zero3_w2, tmp_path, world):
    for shard in ("5GB", "6KB"):
        zload.convert(zero3_w2.folder, tmp_path / f"one-{shard}", max_shard_size=shard)
        files = run_world(world, _convert_body, zero3_w2.folder, str(tmp_path / f"many-{shard}"),
                          {"max_shard_size": shard, "staging_bytes": 4096})
        assert files[0] == files[-1] and len(files[0]) == (1 if shard == "5GB" else len(files[0]))
        assert _files(tmp_path / f"many-{shard}") == _files(tmp_path / f"one-{shard}")


def test_byte_shares_cover_every_element_once():
    """Each element goes to exactly one rank, and the ranks' shares differ by an element at most."""
    shapes = [("float32", (7, 3)), ("bfloat16", (5,)), ("int64", ()), ("float32", (0, 4)), ("bfloat16", (13,))]
    tensors = [OutTensor(f"t{i}", dtype, shape, ((i, 0, 0, 0),)) for i, (dtype, shape) in enumerate(shapes)]
    files = layout(tensors, 40)
    everything = sorted((i, k) for i, (_, shape) in enumerate(shapes) for k in range(torch.Size(shape).numel()))
    for world in (1, 2, 3, 7, 200):
        shares = [byte_share(files, rank, world) for rank in range(world)]
        assert sorted((i.target, i.src_offset + k) for share in shares for i in share for k in range(i.numel)) \
            == everything
        sizes = [sum(i.nbytes for i in share) for share in shares]
        assert max(sizes) - min(sizes) <= 2 * 8


# ---------------------------------------------------------------------------------------------
# failures: every rank raises the same error, OUT keeps what it held

def _convert_failing_on(rank_failing, folder, out, corrupt, how) -> tuple[str, str] | list[str]:
    import torch.distributed as dist

    import zload.writer

    rank, original = dist.get_rank(), zload.writer._pwrite_all
    if rank == rank_failing and how == "disk":
        def disk_full(*args):
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        zload.writer._pwrite_all = disk_full
    try:
        return zload.convert(corrupt if rank == rank_failing and how == "corrupt" else folder, out,
                             staging_bytes=4096).files
    except zload.ZloadError as e:
        return type(e).__name__, str(e)
    finally:
        zload.writer._pwrite_all = original


@pytest.mark.parametrize("how,world", [("corrupt", 2), ("disk", 3)])
def test_a_failure_on_one_rank_fails_every_rank_and_leaves_out_as_it_was(zero3_w2, tmp_path, how, world):
    """A corrupt optimizer state file that one rank reads (its own copy), or a full disk on one
    rank while writing: the same error on every rank, naming the rank; OUT as it was."""
    corrupt = tmp_path / "corrupt"
    shutil.copytree(zero3_w2.folder, corrupt)
    victim = next((corrupt / "global_step1").glob("*rank_1_mp_rank_00_optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-1000])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone's notes")
    results = run_world(world, _convert_failing_on, 1, zero3_w2.folder, str(out), str(corrupt), how)
    assert all(isinstance(r, tuple) for r in results), results
    # the same error, but for the heading, where each rank names the checkpoint it was given
    assert len({(kind, message.split("\n", 1)[1]) for kind, message in results}) == 1, results
    kind, message = results[0]
    expected = {"corrupt": ("InvalidCheckpointError", "nothing was written"),
                "disk": ("ZloadError", "still holds what it held before")}[how]
    assert kind == expected[0] and expected[1] in message and "[rank 1]" in message, message
    assert _files(out) == {"notes.txt": b"someone's notes"}


def test_not_a_deepspeed_checkpoint(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(zload.CheckpointNotFoundError, match="(?s)nothing was written.*holds neither 'latest'"):
        zload.convert(tmp_path / "plain", tmp_path / "out")
    with pytest.raises(zload.ArgumentValueError, match="weights='fp16'"):
        zload.convert(tmp_path / "plain", tmp_path / "out", weights="fp16")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# the command line

def test_cli(zero3_w2, tmp_path):
    from zload.cli import main

    assert main(["convert", zero3_w2.folder, str(tmp_path / "cli"), "--max-shard-size", "10KB"]) == 0
    zload.convert(zero3_w2.folder, tmp_path / "api", max_shard_size="10KB")
    assert _files(tmp_path / "cli") == _files(tmp_path / "api")
    assert main(["convert", zero3_w2.tag_folder, str(tmp_path / "module"), "--module-weights"]) == 0
    assert read_all(tmp_path / "module")["model.norm.weight"].dtype == torch.bfloat16
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2


def test_cli_under_torchrun(zero3_w2, tmp_path):
    """``torchrun -m zload convert``: the processes join one group, each writes its share."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "zload", "convert", zero3_w2.folder, str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("zload: saved") == 2
    zload.convert(zero3_w2.folder, tmp_path / "one")
    assert _files(tmp_path / "out") == _files(tmp_path / "one")
