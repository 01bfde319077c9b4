"""zload.init builds ZeRO-3 models whose parameters are born partitioned: no full-size parameter on
any rank, buffers exactly as zero.Init builds them, and a model that trains, gathers, saves and
loads exactly like one built by zero.Init."""

from __future__ import annotations

import types
from unittest import mock

import deepspeed
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zload

from . import models
from .harness import run_world
from .zero3 import assert_bit_equal, check_against, dtype_config, gathered, load_expected


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
    return max(n for _, n in made), max(n for _, n in zero_init_made), partition


@pytest.mark.parametrize("world", [2, 3])
def test_no_rank_allocates_a_full_parameter(world):
    for largest, zero_init_largest, partition in run_world(world, _allocations):
        assert zero_init_largest >= 1500  # zero.Init makes the whole embedding on every rank
        assert largest <= partition < 1500, (largest, partition)


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
@pytest.mark.parametrize("through_auto", [False, True])
def test_transformers_models_build_like_zero_init(transformers_checkpoints, kind, through_auto):
    counts = run_world(2, _build_like_zero_init, kind, through_auto, transformers_checkpoints[kind])
    assert counts[0] > 0 and len(set(counts)) == 1


def _engine_config(hpz: int, offload: bool) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 30, "zero_hpz_partition_size": hpz}
    if offload:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": zero}


def _trained(build_context, path, config):
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    # hpZ's group can be made once per process; the second model must be given it
    hpz_group = groups._get_zero_param_intra_parallel_group()
    context = build_context(config, **({"zero_param_parallel_group": hpz_group} if hpz_group else {}))
    model, made = _built(context, lambda: LlamaForCausalLM(models.tiny_llama_config(tie=True)))
    if build_context is zload.init:
        assert_no_full_parameter(model, made)
    zload.load_into(model, path)
    loaded = gathered(dict(model.named_parameters()))
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.arange(16).reshape(2, 8) % 53
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return engine, loaded, loss.item()


def _train_like_zero_init(path, hpz, offload, out):
    from deepspeed.utils import groups

    config = _engine_config(hpz, offload)
    try:
        engine, loaded, loss = _trained(zload.init, path, config)
        reference, want_loaded, want_loss = _trained(
            lambda config, **kwargs: deepspeed.zero.Init(config_dict_or_path=config, **kwargs), path, config)
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


@pytest.mark.parametrize("world,hpz,offload", [(1, 1, False), (2, 2, False), (3, 1, True), (4, 2, False)])
def test_trains_and_saves_like_zero_init(tmp_path, world, hpz, offload):
    """deepspeed.initialize with an optimizer, a step, GatheredParameters and zload.save, with
    persistent parameters, hpZ, and parameters and optimizer offloaded to host memory."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    torch.manual_seed(9)
    model = LlamaForCausalLM(models.tiny_llama_config(tie=True))
    model.save_pretrained(tmp_path / "ckpt")
    run_world(world, _train_like_zero_init, str(tmp_path / "ckpt"), hpz, offload, str(tmp_path))
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
    def patched():
        model = models.TinyViT()
        models.patch_layerscales(model)
        return model

    save_file(models.state_with_seed(patched, seed=12), str(tmp_path / "m.safetensors"))
    for repaired in run_world(world, _orphans_repaired, tmp_path / "m.safetensors"):
        assert len(repaired) == 2
