"""zload.init builds ZeRO-3 models whose parameters are born partitioned: no full-size parameter on
any rank, buffers exactly as zero.Init builds them, and a model that trains, gathers, saves and
loads exactly like one built by zero.Init."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import types
from typing import NamedTuple
from unittest import mock

import deepspeed
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zload
from zload.model import init as init_module

from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import assert_bit_equal, check_against, dtype_config, gathered, load_expected


class Wide(nn.Module):
    """Every parameter larger than any partition of another, and buffers computed in __init__."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 30, padding_idx=0)
        self.proj = nn.Linear(30, 40)
        self.norm = nn.LayerNorm(40)
        self.register_buffer("position_ids", torch.arange(8).expand((1, -1)), persistent=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        self.register_buffer("scale", torch.ones(3))
        self.cache = types.SimpleNamespace(table=torch.full((2, 3), 0.5))  # where no module looks


class _Allocations(TorchDispatchMode):
    """The shape and storage size (elements) of every tensor an operator returns off the meta
    device while active."""

    def __init__(self):
        import torch._dynamo  # noqa: F401 - a dispatch mode imports it, which fails under zero.Init's Tensor.__new__

        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.made.append((tuple(t.shape), t.untyped_storage().nbytes() // t.element_size()))
        return out


def _built(context, build):
    """``build()`` inside ``context``; returns the model and what was allocated meanwhile."""
    with _Allocations() as seen, context:
        model = build()
    return model, seen.made


def assert_no_full_parameter(model, made):
    """No tensor shaped like a (2-D or larger) parameter was made off the meta device."""
    full = {tuple(p.ds_shape) for p in model.parameters() if len(p.ds_shape) >= 2}
    assert full and not [shape for shape, _ in made if shape in full], sorted({s for s, _ in made if s in full})
    for name, p in model.named_parameters():
        assert p.data.shape == (0,) and not p.is_meta and hasattr(p, "ds_id"), name


class Largest(NamedTuple):
    """Sizes in elements, on one rank."""

    by_init: int  # of the largest tensor made off the meta device while zload.init built Wide
    by_zero_init: int  # the same, while zero.Init built it
    partition: int  # of the largest partition of a parameter


def _allocations():
    config = dtype_config(torch.bfloat16)
    model, made = _built(zload.init(config), Wide)
    assert_no_full_parameter(model, made)
    reference, zero_init_made = _built(deepspeed.zero.Init(config_dict_or_path=config), Wide)
    for name, want in [*reference.named_buffers(), ("cache.table", reference.cache.table)]:
        got = model.cache.table if name == "cache.table" else model.get_buffer(name)
        assert_bit_equal(got, want, name)
    world = dist.get_world_size()
    for name, p in model.named_parameters():
        assert p.ds_tensor.dtype == torch.bfloat16 and p.ds_tensor.numel() == -(-p.ds_numel // world), name
        assert not p.ds_tensor.any(), f"{name}: a partition built by zload.init holds zeros until loaded"
    partition = max(p.ds_tensor.numel() for p in model.parameters())
    return Largest(max(n for _, n in made), max(n for _, n in zero_init_made), partition)


@pytest.mark.parametrize("world", [2, 3])
def test_no_rank_allocates_a_full_parameter(world):
    for largest in run_world(world, _allocations):
        assert largest.by_zero_init >= 1500  # zero.Init makes the whole embedding on every rank
        assert largest.by_init <= largest.partition < 1500, largest


class _Writes(TorchDispatchMode):
    """The storage size (bytes) of every tensor an in-place operator writes while active."""

    def __init__(self):
        import torch._dynamo  # noqa: F401 - as in _Allocations

        super().__init__()
        self.written = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
            self.written.append(args[0].untyped_storage().nbytes())
        return func(*args, **(kwargs or {}))


class LargeAndSmall(nn.Module):
    def __init__(self):
        super().__init__()
        self.large = nn.Embedding(1100, 1024)  # 2.2 MB in bf16: 1.1 MB a rank at W=2
        self.small = nn.Linear(8, 8)


def _large_partitions_written_while_building():
    with _Writes() as seen, zload.init(dtype_config(torch.bfloat16)):
        model = LargeAndSmall()
    large, small = model.large.weight.ds_tensor, model.small.weight.ds_tensor
    assert large.nbytes >= init_module.FRESH_PAGES_FROM > small.nbytes
    assert not large.any() and not small.any()
    return [n for n in seen.written if n >= large.nbytes], [n for n in seen.written if n == small.nbytes]


def test_large_cpu_partitions_come_zeroed_and_are_not_written_while_building():
    """A partition of 1 MiB or more in plain CPU memory is mapped on pages the kernel zeroed, so
    building writes no zeros over it (a second pass over every byte of the model); a small one is
    still zeroed by a write."""
    for large, small in run_world(2, _large_partitions_written_while_building):
        assert large == [] and small, (large, small)


def _buffers_and_layout(model):
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    layout = {n: (tuple(p.ds_shape), p.ds_tensor.dtype, p.ds_tensor.numel(), p.requires_grad)
              for n, p in model.named_parameters()}
    return buffers, layout


def _reference(build, config):
    """The same model under zero.Init, transformers' weight init off (BERT dies in it), its
    weight tying on."""
    from transformers import PreTrainedModel

    with mock.patch.object(PreTrainedModel, "initialize_weights", lambda self: None), \
            deepspeed.zero.Init(config_dict_or_path=config):
        return build()


def _transformers_model(kind: str, through_auto: bool):
    import transformers as tf

    configs = {
        "bert": lambda: tf.BertConfig(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=37, max_position_embeddings=40, pad_token_id=0),
        "llama": lambda: models.tiny_llama_config(tie=True),
        "mixtral": lambda: tf.MixtralConfig(vocab_size=53, hidden_size=24, intermediate_size=19,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=3, num_experts_per_tok=2,
                                            max_position_embeddings=32),
        "t5": lambda: tf.T5Config(vocab_size=59, d_model=24, d_kv=6, d_ff=37, num_layers=2, num_heads=4),
        "ved": lambda: tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
            tf.ViTConfig(image_size=16, patch_size=4, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=37),
            tf.GPT2Config(vocab_size=57, n_embd=24, n_layer=2, n_head=4, n_positions=32)),
    }
    classes = {"bert": tf.BertModel, "llama": tf.LlamaForCausalLM, "mixtral": tf.MixtralForCausalLM,
               "t5": tf.T5ForConditionalGeneration, "ved": tf.VisionEncoderDecoderModel}
    config = configs[kind]()
    if through_auto:
        auto = {"bert": tf.AutoModel, "t5": tf.AutoModelForSeq2SeqLM,
                "ved": tf.AutoModelForImageTextToText}.get(kind, tf.AutoModelForCausalLM)
        return lambda: auto.from_config(config)
    return lambda: classes[kind](config)


def _build_like_zero_init(kind, through_auto, folder):
    build = _transformers_model(kind, through_auto)
    config = dtype_config(torch.bfloat16)
    model, made = _built(zload.init(config), build)
    assert_no_full_parameter(model, made)
    reference = _reference(build, config)
    buffers, layout = _buffers_and_layout(model)
    want_buffers, want_layout = _buffers_and_layout(reference)
    assert layout == want_layout, {n: (layout.get(n), want_layout.get(n)) for n in {*layout, *want_layout}
                                   if layout.get(n) != want_layout.get(n)}
    assert buffers.keys() == want_buffers.keys()
    for name in buffers:
        assert_bit_equal(buffers[name], want_buffers[name], f"buffer {name}")
    zload.load_into(model, folder)
    zload.load_into(reference, folder)
    loaded, want = gathered(dict(model.named_parameters())), gathered(dict(reference.named_parameters()))
    for name in want:
        assert_bit_equal(loaded[name], want[name], f"{name} after the load")
    return len(layout)


@pytest.fixture(scope="module")
def transformers_checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    folders = {}
    for kind in ("bert", "llama", "mixtral", "t5", "ved"):
        torch.manual_seed(5)
        model = _transformers_model(kind, False)()
        for p in model.parameters():
            p.data.normal_()
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        folders[kind] = str(folder)
    return folders


@pytest.mark.parametrize("kind", ["bert", "llama", "mixtral", "t5", "ved"])
@pytest.mark.parametrize("through_auto,world", [(False, 2), (True, 3)])  # each model at two world sizes
def test_transformers_models_build_like_zero_init(transformers_checkpoints, kind, through_auto, world):
    counts = run_world(world, _build_like_zero_init, kind, through_auto, transformers_checkpoints[kind])
    assert counts[0] > 0 and len(set(counts)) == 1


def _engine_config(hpz: int, offload: bool) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 30, "zero_hpz_partition_size": hpz}
    if offload:
        # unpinned, so that its partitions are plain host memory (pinning is DeepSpeed's default; it
        # does nothing on the CPU accelerator but would take zload.init's torch.empty path)
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu", "pin_memory": False})
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": zero}


def _zero_state(model) -> dict:
    """What DeepSpeed records on each parameter and its partition when it first partitions it."""
    def of(p):
        part = p.ds_tensor
        return (tuple(p.ds_shape), p.ds_numel, p.ds_numel_aligned, p.ds_persist, p.ds_status,
                p.ds_param_type, p.data.shape, p.data.device, p.dtype, p.requires_grad, part.dtype,
                part.shape, part.device, part.is_pinned(), part.requires_grad, part.ds_numel,
                part.status, part.final_location, getattr(p, "ds_secondary_tensor", None) is None)
    return {name: of(p) for name, p in model.named_parameters()}


def _trained(build_context, path, config):
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    # hpZ's group can be made once per process; the second model must be given it
    hpz_group = groups._get_zero_param_intra_parallel_group()
    context = build_context(config, **({"zero_param_parallel_group": hpz_group} if hpz_group else {}))
    model, made = _built(context, lambda: LlamaForCausalLM(models.tiny_llama_config(tie=True)))
    if build_context is zload.init:
        assert_no_full_parameter(model, made)
    state = _zero_state(model)
    zload.load_into(model, path)
    loaded = gathered(dict(model.named_parameters()))
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.arange(16).reshape(2, 8) % 53
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return engine, loaded, loss.item(), state


def _train_like_zero_init(path, hpz, offload, out, fresh_pages_from):
    config = _engine_config(hpz, offload)
    with mock.patch.object(init_module, "FRESH_PAGES_FROM", fresh_pages_from):
        return _train_and_save(path, config, out)


def _train_and_save(path, config, out):
    from deepspeed.utils import groups

    try:
        engine, loaded, loss, state = _trained(zload.init, path, config)
        reference, want_loaded, want_loss, want_state = _trained(
            lambda config, **kwargs: deepspeed.zero.Init(config_dict_or_path=config, **kwargs), path, config)
        assert state == want_state
        for name in want_loaded:
            assert_bit_equal(loaded[name], want_loaded[name], f"{name} after the load")
        assert loss == want_loss
        after = gathered(dict(engine.module.named_parameters()))
        for name, want in gathered(dict(reference.module.named_parameters())).items():
            assert_bit_equal(after[name], want, f"{name} after a step")
        zload.save(engine, f"{out}/init")
        zload.save(reference, f"{out}/zero-init")
    finally:
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None  # so that a later test in this world can make it
    return len(after)


@pytest.mark.parametrize("world,hpz,offload,fresh_pages_from", [
    (1, 1, False, init_module.FRESH_PAGES_FROM), (2, 2, False, init_module.FRESH_PAGES_FROM),
    (3, 1, True, 0), (4, 2, False, init_module.FRESH_PAGES_FROM)])
def test_trains_and_saves_like_zero_init(tmp_path, world, hpz, offload, fresh_pages_from):
    """deepspeed.initialize with an optimizer, a step, GatheredParameters and zload.save, with
    persistent parameters, hpZ, and parameters and optimizer offloaded to host memory; at W=3 every
    partition is on pages mapped zeroed (``FRESH_PAGES_FROM`` is 1 MiB, above this model's)."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    torch.manual_seed(9)
    model = LlamaForCausalLM(models.tiny_llama_config(tie=True))
    model.save_pretrained(tmp_path / "ckpt")
    run_world(world, _train_like_zero_init, str(tmp_path / "ckpt"), hpz, offload, str(tmp_path), fresh_pages_from)
    saved, want = load_file(tmp_path / "init/model.safetensors"), load_file(tmp_path / "zero-init/model.safetensors")
    assert saved.keys() == want.keys()
    for name in want:
        assert_bit_equal(saved[name], want[name], f"saved {name}")


def _orphans_repaired(path):
    model, made = _built(zload.init(dtype_config(torch.float32)), models.TinyViT)
    assert_no_full_parameter(model, made)
    models.patch_layerscales(model)
    report = zload.load_into(model, path)
    check_against(model, load_expected(path))
    return report.repaired_orphans


@pytest.mark.parametrize("world", [2, 3])
def test_openvla_orphans_are_repaired_in_a_model_built_by_init(tmp_path, world):
    save_file(models.state_with_seed(models.patched_tiny_vit, seed=12), str(tmp_path / "m.safetensors"))
    for repaired in run_world(world, _orphans_repaired, tmp_path / "m.safetensors"):
        assert len(repaired) == 2


# Modules written the way real __init__ code is written; each once broke zload.init (review of #14).

class InitialisedBuffers(nn.Module):
    """Buffers that nn.init fills (a constant, fixed random features) and that use each other."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ones", torch.empty(4), persistent=False)
        nn.init.constant_(self.ones, 1.0)
        self.register_buffer("features", torch.empty(3, 3), persistent=False)
        nn.init.orthogonal_(self.features)
        self.register_buffer("first", torch.randn(3))
        self.register_buffer("second", torch.randn(3))
        self.register_buffer("drawn", torch.randn(3, generator=torch.Generator().manual_seed(1)))
        self.lin = nn.Linear(3, 5)


class DevicesOfOthers(nn.Module):
    """Tensors made on another tensor's device, from a parameter's new_*, and as views."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.register_buffer("a", torch.ones(3))
        self.register_buffer("b", torch.zeros(3, device=self.a.device))
        self.register_buffer("c", torch.arange(3, device=self.lin.weight.device))
        self.register_buffer("d", self.lin.weight.new_ones(2))
        self.register_buffer("t", torch.ones(2, 3).T.contiguous())
        self.kept = (self.a, self.a.T)


class GathersInInit(nn.Module):
    """DeepSpeed's documented way to set values of a parameter while building."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        with deepspeed.zero.GatheredParameters(self.emb.weight, modifier_rank=0):
            self.emb.weight.data[0].fill_(1.0)


class ReplacesChildParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 6)
        self.head.weight = nn.Parameter(torch.empty(6, 4))


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        with zload.init(dtype_config(torch.float32)):
            self.inner = nn.Linear(5, 7)
        self.register_buffer("b", torch.ones(3))


class CastsParameter(nn.Module):
    """A weight its own ``__init__`` casts while the model builds in bf16: zero.Init's constructors
    cast its partition back to bf16."""

    config_dtype = torch.bfloat16

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.ones(6))
        self.w.data = self.w.data.float()


# Not a module that broke zload.init: a guard that DeepSpeed's fp32 buffers (keep_in_fp32.py), which
# it applies at the end of each module's __init__, come out as under zero.Init.

class _Router(nn.Module):
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]  # on the class, as transformers does

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.register_buffer("e_score_correction_bias", torch.full((3,), 7.003))


class _NamesItsOwn(nn.Module):
    def __init__(self):
        super().__init__()
        self._keep_in_fp32_modules_strict = ["scale"]  # on the instance
        self.register_buffer("scale", torch.full((2,), 1.001))
        self.register_buffer("other", torch.full((2,), 1.001))


class KeepsBuffersInFp32(nn.Module):
    """Buffers that submodules name for fp32 on their class (as DeepSeek-V3's routing bias) or on
    the instance, which DeepSpeed keeps in fp32 while the rest builds in bf16; a buffer of such a
    name elsewhere stays bf16."""

    config_dtype = torch.bfloat16

    def __init__(self):
        super().__init__()
        self.router = _Router()
        self.block = nn.Sequential(nn.Linear(4, 4), _NamesItsOwn())
        self.register_buffer("scale", torch.full((2,), 1.001))


class MaskFromParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones_like(self.lin.weight))


def _built_twice(cls, outer=None):
    """``cls()`` under zload.init and under zero.Init (inside ``outer``), from the same seed."""
    config = dtype_config(getattr(cls, "config_dtype", torch.float32))
    models = []
    for context in (lambda: zload.init(config), lambda: deepspeed.zero.Init(config_dict_or_path=config)):
        torch.manual_seed(3)
        with outer() if outer else contextlib.nullcontext(), context():
            models.append(cls())
    return models


def _builds_like_zero_init(name, path, outer):
    model, reference = _built_twice(globals()[name], {"zero.Init": lambda: deepspeed.zero.Init(
        config_dict_or_path=dtype_config(torch.float32)), None: None}[outer])
    want = {**dict(reference.named_buffers()), **{k: v for k, v in vars(reference).items() if torch.is_tensor(v)}}
    got = {**dict(model.named_buffers()), **{k: v for k, v in vars(model).items() if torch.is_tensor(v)}}
    assert got.keys() == want.keys()
    for key in want:
        assert_bit_equal(got[key], want[key], key)
    for key in ("kept",):
        for got_view, want_view in zip(getattr(model, key, ()), getattr(reference, key, ())):
            assert_bit_equal(got_view, want_view, key)
    for p_name, p in model.named_parameters():
        assert hasattr(p, "ds_id") and p.data.shape == (0,) and not p.is_meta, p_name
        want = reference.get_parameter(p_name)  # zero.Init leaves a replaced child parameter whole
        want_partition = getattr(want, "ds_tensor", want)
        assert (p.ds_tensor.device, p.ds_tensor.dtype) == (want_partition.device, want_partition.dtype), p_name
    torch.manual_seed(4)  # the same file on every rank; each writes its own copy, so none waits for another
    path = os.path.join(f"{os.path.dirname(path)}-{dist.get_rank()}", os.path.basename(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {key: torch.randn(getattr(p, "ds_shape", p.shape)) * 3 for key, p in reference.named_parameters()}
    save_file({key: t.contiguous() for key, t in {**reference.state_dict(), **state}.items()}, path)
    zload.load_into(model, path)
    zload.load_into(reference, path)
    loaded, expected = gathered(dict(model.named_parameters())), gathered(dict(reference.named_parameters()))
    assert loaded.keys() == expected.keys()
    for key in expected:
        assert_bit_equal(loaded[key], expected[key], f"{key} after the load")


@pytest.mark.parametrize("name,outer", [("InitialisedBuffers", None), ("DevicesOfOthers", None),
                                        ("GathersInInit", None), ("ReplacesChildParameter", None),
                                        ("Nested", None), ("InitialisedBuffers", "zero.Init"),
                                        ("CastsParameter", None), ("KeepsBuffersInFp32", None)])
def test_modules_build_like_zero_init(tmp_path, name, outer):
    run_world(2, _builds_like_zero_init, name, str(tmp_path / "m.safetensors"), outer)


def _refusals():
    with pytest.raises(zload.UnsupportedModelError, match=r"MaskFromParameter\.mask ended up on the meta device"):
        with zload.init(dtype_config(torch.float32)):
            MaskFromParameter()
    quantized = {**dtype_config(torch.float32), "weight_quantization": {"quantized_initialization": {
        "num_bits": 8, "group_size": 64, "group_dim": 1, "symmetric": False}}}
    with pytest.raises(zload.ZloadError, match="weight-quantized"):
        with zload.init(quantized):
            nn.Linear(128, 64)
    with zload.init(dtype_config(torch.float32), enabled=False):
        plain = nn.Linear(4, 4)
    assert not hasattr(plain.weight, "ds_id") and plain(torch.ones(1, 4)).shape == (1, 4)


def test_refuses_what_it_cannot_build_and_steps_aside_when_disabled():
    run_world(1, _refusals)


_FRESH_PROCESS = """
import os, torch, deepspeed, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
import zload
assert "torch._dynamo" not in sys.modules
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.lin.weight.data.normal_(0, 0.02)
        self.register_buffer("r", torch.randn(3, generator=torch.Generator().manual_seed(0)))
with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}):
    with zload.init({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}):
        M()
print("built")
"""


def test_meta_operations_work_in_a_process_that_never_imported_dynamo():
    """A meta operation imports torch._dynamo on first use, which fails under zero.Init's
    Tensor.__new__ (also when zload.init is opened inside zero.Init)."""
    from tests.support.harness import free_port

    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(free_port())], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "built" in done.stdout, done.stderr[-3000:]
