"""PEFT adapters: peft's own ``save_pretrained`` folders loaded into a ``PeftModel`` over ZeRO-3.

The references are peft's files themselves (``adapter_model.safetensors``, names without the
adapter name) and transformers' ``save_pretrained`` of the base model, compared bit for bit with
the gathered ZeRO-3 model; base weights are snapshotted before an adapter load to prove they are
left alone. The resume test trains LoRA under a ZeRO-3 engine, saves the adapter with peft, and
checks a fresh engine loaded with zload continues with exactly the same weights and loss.
"""

from __future__ import annotations

import json
import shutil

import deepspeed
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zload

from tests.support.harness import run_world
from tests.support.models import tiny_llama_config
from tests.support.zero3 import assert_bit_equal, build_zero, check_against, gathered
from tests.unit.test_peft import _lora_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402  (before any zero.Init)

BASE_PREFIX = "base_model.model."


def _is_lora(name: str) -> bool:
    return ".lora_" in name


def _lora_params(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if _is_lora(n)}


def _file_name(model_name: str, adapter: str) -> str:
    """The name peft's / transformers' ``save_pretrained`` gives a PeftModel parameter."""
    if _is_lora(model_name):
        return model_name.replace(f".{adapter}.", ".")  # lora_A.<adapter>.weight -> lora_A.weight
    return model_name.removeprefix(BASE_PREFIX).replace(".base_layer.", ".")


def _build(lora_partitioned: bool, adapter: str, seed: int, config=None):
    """A ZeRO-3 Llama wrapped by peft: LoRA built inside zero.Init (partitioned) or after (plain)."""
    torch.manual_seed(seed)
    if lora_partitioned:
        model = build_zero(lambda: get_peft_model(LlamaForCausalLM(tiny_llama_config()), _lora_config(),
                                                  adapter_name=adapter), config=config)
    else:
        model = get_peft_model(build_zero(lambda: LlamaForCausalLM(tiny_llama_config()), config=config),
                               _lora_config(), adapter_name=adapter)
    assert isinstance(model, PeftModel) and model.active_adapter == adapter
    lora = [p for n, p in model.named_parameters() if _is_lora(n)]
    base = [p for n, p in model.named_parameters() if not _is_lora(n)]
    assert len(lora) == 8 and base and all(hasattr(p, "ds_id") for p in base)
    assert all(hasattr(p, "ds_id") == lora_partitioned for p in lora)
    return model


def _own_view(model, names) -> dict[str, torch.Tensor]:
    """This rank's bytes of each named parameter (its partition, or the whole plain tensor)."""
    params = dict(model.named_parameters())
    return {n: (params[n].ds_tensor if hasattr(params[n], "ds_tensor") else params[n].data).detach().clone()
            for n in names}


def _assert_own_view_unchanged(model, before, what):
    after = _own_view(model, before)
    for name in before:
        assert_bit_equal(after[name], before[name], f"rank {dist.get_rank()}: {name} changed by {what}")


def _logits(model, input_ids):
    with deepspeed.zero.GatheredParameters(list(model.parameters())), torch.no_grad():
        return model(input_ids=input_ids).logits


# --- fixtures (parent process) ---

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A base checkpoint, a peft adapter folder for it, the same adapter missing one tensor, and
    the logits of the plain (no DeepSpeed) base + adapter from peft's own ``from_pretrained``."""
    torch.manual_seed(3)
    base_dir = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(base_dir)

    torch.manual_seed(4)
    donor = get_peft_model(LlamaForCausalLM(tiny_llama_config()), _lora_config())
    with torch.no_grad():
        for name, p in donor.named_parameters():
            if _is_lora(name):
                p.copy_(torch.randn_like(p))  # known values, none of them zero
    adapter_dir = tmp_path_factory.mktemp("adapter")
    donor.save_pretrained(adapter_dir)
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert sorted(adapter) == sorted(_file_name(n, "default") for n, _ in donor.named_parameters()
                                     if _is_lora(n))
    assert all(".default." not in n for n in adapter)

    dropped = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    incomplete_dir = tmp_path_factory.mktemp("incomplete")
    shutil.copy(adapter_dir / "adapter_config.json", incomplete_dir)
    save_file({k: v for k, v in adapter.items() if k != dropped},
              str(incomplete_dir / "adapter_model.safetensors"), metadata={"format": "pt"})

    input_ids = torch.randint(0, 53, (2, 7), generator=torch.Generator().manual_seed(5))
    reference = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), adapter_dir)
    with torch.no_grad():
        logits = reference(input_ids=input_ids).logits
    return {"base": base_dir, "adapter": adapter_dir, "incomplete": incomplete_dir, "dropped": dropped,
            "input_ids": input_ids, "logits": logits}


# --- item 5: adapter folders into a PeftModel over ZeRO-3 ---

def _adapter_body(saved, lora_partitioned, adapter):
    model = _build(lora_partitioned, adapter, seed=11)
    names = [n for n, _ in model.named_parameters()]
    lora_names = sorted(n for n in names if _is_lora(n))
    base_names = sorted(n for n in names if not _is_lora(n))
    assert all(n.startswith(BASE_PREFIX) for n in names)
    assert any(".base_layer." in n for n in base_names)

    # 1. the base checkpoint (transformers' names): base_layer / base_model.model. mapped, LoRA not required
    lora_before = _own_view(model, lora_names)
    report = zload.load_into(model, saved["base"])
    assert sorted(report.loaded) == base_names
    assert report.missing == [] and report.unexpected == []
    base_file = load_file(str(saved["base"] / "model.safetensors"))
    check_against(model, {n: base_file[_file_name(n, adapter)] for n in base_names}, names=base_names)
    _assert_own_view_unchanged(model, lora_before, "the base load")

    # 2. the adapter folder: lora_X.weight -> lora_X.<adapter>.weight, all required, base untouched
    base_before = _own_view(model, base_names)
    report = zload.load_into(model, saved["adapter"])
    assert sorted(report.loaded) == lora_names
    assert report.missing == [] and report.unexpected == []
    adapter_file = load_file(str(saved["adapter"] / "adapter_model.safetensors"))
    assert len(adapter_file) == len(lora_names)
    check_against(model, {n: adapter_file[_file_name(n, adapter)] for n in lora_names}, names=lora_names)
    _assert_own_view_unchanged(model, base_before, "the adapter load")

    # 3. end to end: the same logits as peft's own from_pretrained on a plain model
    assert_bit_equal(_logits(model, saved["input_ids"]), saved["logits"], "logits")
    return sorted(report.loaded)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("lora_partitioned", [True, False], ids=["lora-zero3", "lora-plain"])
@pytest.mark.parametrize("adapter", ["default", "mine"])
def test_adapter_folder_loads_into_peft_model(saved, world, lora_partitioned, adapter):
    results = run_world(world, _adapter_body, saved, lora_partitioned, adapter)
    assert all(r == results[0] for r in results) and len(results[0]) == 8
    assert all(f".{adapter}." in n for n in results[0])


def _incomplete_body(saved, lora_partitioned):
    model = _build(lora_partitioned, "default", seed=11)
    zload.load_into(model, saved["base"])
    before = _own_view(model, [n for n, _ in model.named_parameters()])
    with pytest.raises(zload.PlanError) as caught:
        zload.load_into(model, saved["incomplete"])
    _assert_own_view_unchanged(model, before, "a refused load")
    report = zload.load_into(model, saved["incomplete"], strict=False)  # the rest loads, one is missing
    return str(caught.value), report.missing, len(report.loaded)


@pytest.mark.parametrize("world,lora_partitioned", [(2, True), (3, False)])
def test_adapter_missing_a_tensor_is_refused_on_every_rank(saved, world, lora_partitioned):
    wanted = saved["dropped"].replace(".lora_B.", ".lora_B.default.")
    for message, missing, loaded in run_world(world, _incomplete_body, saved, lora_partitioned):
        assert "1 model tensors are not in the checkpoint" in message and wanted in message
        assert "q_proj.lora_B" not in message and "base_layer" not in message
        assert missing == [wanted] and loaded == 7  # base weights are never reported missing


# --- item 6: resume LoRA training from a peft-saved adapter ---

RESUME_STEPS = 3


def _resume_config(bf16: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3}}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _engine(saved, config, lora_partitioned, seed):
    model = _build(lora_partitioned, "default", seed=seed, config=config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 8
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(trainable, lr=1e-2))
    return engine


def _batches():
    """Different tokens on each rank (data parallel), the same on every run."""
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randint(0, 53, (2, 9), generator=g) for _ in range(RESUME_STEPS + 1)]


def _loss(engine, batch):
    return engine(input_ids=batch, labels=batch).loss


def _gathered_lora(engine) -> dict[str, torch.Tensor]:
    return gathered(_lora_params(engine.module))


def _resume_body(saved, out_dir, bf16, lora_partitioned):
    config = _resume_config(bf16)
    batches = _batches()

    # engine A: base loaded with zload, LoRA trained a few steps, saved with peft from rank 0
    a = _engine(saved, config, lora_partitioned, seed=21)
    zload.load_into(a, saved["base"])
    initial = _gathered_lora(a)
    for batch in batches[:RESUME_STEPS]:
        loss = _loss(a, batch)
        a.backward(loss)
        a.step()
    trained = _gathered_lora(a)
    assert all(not torch.equal(trained[n], initial[n]) for n in trained), "training did not move LoRA"
    if dist.get_rank() == 0:
        a.module.save_pretrained(out_dir, state_dict=trained)
    dist.barrier()
    with torch.no_grad():
        next_loss = _loss(a, batches[RESUME_STEPS]).detach().clone()
    a.destroy()
    del a

    # engine B: fresh (other LoRA init), then base + adapter loaded into the live engine
    b = _engine(saved, config, lora_partitioned, seed=22)
    assert all(not torch.equal(v, trained[n]) for n, v in _gathered_lora(b).items())
    base_report = zload.load_into(b, saved["base"])
    adapter_report = zload.load_into(b, out_dir)
    assert base_report.missing == adapter_report.missing == []
    assert base_report.unexpected == adapter_report.unexpected == []
    assert sorted(adapter_report.loaded) == sorted(trained)

    saved_file = load_file(str(out_dir / "adapter_model.safetensors"))
    assert sorted(saved_file) == sorted(_file_name(n, "default") for n in trained)
    for name, value in _gathered_lora(b).items():
        assert_bit_equal(value, trained[name], f"rank {dist.get_rank()}: {name} (vs engine A)")
        assert_bit_equal(value, saved_file[_file_name(name, "default")], f"{name} (vs peft's file)")
    for name, p in b.module.named_parameters():
        if p.requires_grad:  # the optimizer's fp32 masters hold the loaded weights too
            master = deepspeed.utils.safe_get_full_fp32_param(p)
            assert torch.equal(master, trained[name].float()), f"{name}: fp32 master not refreshed"

    with torch.no_grad():
        resumed_loss = _loss(b, batches[RESUME_STEPS]).detach().clone()
    assert_bit_equal(resumed_loss, next_loss, f"rank {dist.get_rank()}: loss after resuming")

    # and the resumed engine trains on
    loss = _loss(b, batches[RESUME_STEPS])
    b.backward(loss)
    b.step()
    assert any(not torch.equal(v, trained[n]) for n, v in _gathered_lora(b).items())
    b.destroy()
    return next_loss.item(), resumed_loss.item()


@pytest.mark.parametrize("world,bf16,lora_partitioned", [
    (2, False, True),
    (3, False, True),
    (2, True, False),
    (3, True, True),
])
def test_resume_lora_training_from_peft_adapter(saved, tmp_path, world, bf16, lora_partitioned):
    results = run_world(world, _resume_body, saved, tmp_path / "adapter", bf16, lora_partitioned)
    assert all(a == b for a, b in results)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
