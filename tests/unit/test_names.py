"""Name matching: user key maps, prefix alignment, PEFT names (pure), and their use in a load."""

from __future__ import annotations

import pytest
import torch

from zload.checkpoint.index import CheckpointIndex, TensorEntry
from zload.integrations.peft import peft_role
from zload.model.names import align_prefix, apply_key_map, match
from zload.model.targets import FULL, Target, collect_targets

from tests.support import models


def test_key_map_regexes_apply_in_order():
    renamed, problems = apply_key_map(["backbone.l1.w", "head.w"],
                                      {r"^backbone\.": "encoder.", r"\.l(\d)\.": r".layer\1."})
    assert renamed == {"backbone.l1.w": "encoder.layer1.w", "head.w": "head.w"} and problems == []


def test_key_map_callable_can_drop_tensors():
    renamed, _ = apply_key_map(["a", "drop.me"], lambda n: None if n.startswith("drop") else "x." + n)
    assert renamed == {"a": "x.a"}


def test_key_map_collision_is_a_problem():
    _, problems = apply_key_map(["a.w", "b.w"], {r"^[ab]\.": ""})
    assert problems == ["key_map maps both 'a.w' and 'b.w' to 'w'"]


MODEL = dict.fromkeys(["bert.embeddings.word.weight", "bert.encoder.0.weight", "classifier.weight"], 0)


def test_prefix_is_added_for_a_base_checkpoint_into_a_model_with_a_head():
    assert align_prefix(["embeddings.word.weight", "encoder.0.weight"], MODEL) == {
        "embeddings.word.weight": "bert.embeddings.word.weight",
        "encoder.0.weight": "bert.encoder.0.weight"}


def test_prefix_is_stripped_for_a_head_checkpoint_into_a_base_model():
    base = {"embeddings.word.weight": 0, "encoder.0.weight": 1}
    assert align_prefix(["bert.embeddings.word.weight", "bert.encoder.0.weight"], base) == {
        "bert.embeddings.word.weight": "embeddings.word.weight",
        "bert.encoder.0.weight": "encoder.0.weight"}


def test_ambiguous_prefix_is_not_guessed():
    model = {"student.w": 0, "teacher.w": 1}
    assert align_prefix(["w"], model) == {}
    assert align_prefix(["nothing.like.it"], MODEL) == {}


@pytest.mark.parametrize("name,role,aliases", [
    ("base_model.model.q.lora_A.default.weight", "adapter", ["base_model.model.q.lora_A.weight"]),
    ("base_model.model.e.lora_embedding_A.default", "adapter", ["base_model.model.e.lora_embedding_A"]),
    ("base_model.model.q.lora_A.other.weight", "other", []),
    ("base_model.model.q.base_layer.weight", "base", ["base_model.model.q.weight"]),
    ("base_model.model.norm.weight", "base", []),
])
def testpeft_roles_and_saved_names(name, role, aliases):
    assert peft_role(name, "default", "lora_") == (role, aliases)


def test_only_the_integrations_touch_transformers_or_peft():
    """Name matching, building, saving and the rest work without either library; what they add
    lives in zload/integrations/, which imports them only inside its functions."""
    import ast
    from pathlib import Path

    from zload.model import names
    from zload.integrations import peft, transformers

    for path in Path(names.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        used = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        used |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
        used |= {node.value for node in ast.walk(tree)  # sys.modules.get("transformers.x")
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        touched = {name for name in used for lib in ("transformers", "peft")
                   if name == lib or name.startswith(lib + ".")}
        assert not touched, f"{path.name} uses {sorted(touched)}: that belongs in zload/integrations/"
    assert callable(peft.peft_role) and callable(transformers.apply_conversion_mapping)


def test_two_checkpoint_tensors_for_one_model_tensor_is_a_problem():
    """`w` gets the prefix `x.` and so collides with the checkpoint's own `x.w`."""
    entries = {n: TensorEntry(n, "f", "F32", (2,), 8 * i, 8) for i, n in enumerate(["w", "x.w"])}
    index = CheckpointIndex("f", ("f",), entries)
    matching = match(index, [Target(("x.w",), FULL, (2,), torch.float32, True)])
    assert matching.problems == ["model tensor 'x.w' is fed by both ['w'] and ['x.w']"]


def test_a_tied_weight_is_read_under_its_first_name_in_transformers_order():
    """transformers visits checkpoint names in number order (layers.2 before layers.10, unlike a
    plain sort) and its stateful renames depend on it; a weight tied across two layers is read
    from the first name in that order."""
    from transformers import LlamaForCausalLM

    config = models.tiny_llama_config()
    config.num_hidden_layers = 11
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    layers = model.model.layers
    layers[10].mlp.up_proj.weight = layers[2].mlp.up_proj.weight
    entries = {n: TensorEntry(n, "f", "F32", tuple(t.shape), 0, 0)
               for n, t in model.state_dict(keep_vars=True).items()}
    targets = collect_targets(model)
    matching = match(CheckpointIndex("ckpt", ("f",), entries), targets, model)
    (tied,) = [i for i, t in enumerate(targets) if "model.layers.10.mlp.up_proj.weight" in t.names]
    assert matching.sources[tied].names == ("model.layers.2.mlp.up_proj.weight",)
