"""A transformers Llama checkpoint written by save_pretrained (sharded) into a ZeRO-3 rebuild."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")


def _structure(obj, seen=None):
    """A comparable form of a conversion registry: patterns by their text, objects by type and state."""
    import re

    from zload.integrations.transformers_registry import _LazyPattern

    seen = set() if seen is None else seen
    if isinstance(obj, (re.Pattern, _LazyPattern)):
        return ("re", obj.pattern, obj.flags)
    if isinstance(obj, (str, int, float, bool, type(None))):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_structure(x, seen) for x in obj]
    if isinstance(obj, dict):
        return {k: _structure(v, seen) for k, v in obj.items()}
    if callable(obj) and not hasattr(obj, "__dict__") and not hasattr(type(obj), "__slots__"):
        return repr(obj)
    if id(obj) in seen:
        return ("seen", type(obj).__name__)
    seen.add(id(obj))
    slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
    state = dict(getattr(obj, "__dict__", {}))
    state.update({s: getattr(obj, s) for s in slots if hasattr(obj, s)})
    return (type(obj).__name__, {k: _structure(v, seen) for k, v in sorted(state.items())
                                 if not callable(v) or isinstance(v, (re.Pattern, _LazyPattern))})


def test_deferred_registry_hands_out_transformers_own_transforms():
    # zload builds transformers' conversion registry with every transform deferred; what
    # transformers hands out (deep copies) must be, for every model type, what it builds itself.
    import copy
    import re

    from transformers import conversion_mapping, core_model_loading

    from zload.integrations.transformers_registry import _build_deferred_registry, _DeferredTransform, _LazyPattern

    deferred = _build_deferred_registry(conversion_mapping, core_model_loading)
    assert conversion_mapping.WeightRenaming is core_model_loading.WeightRenaming  # module untouched
    assert core_model_loading.re is re
    real = conversion_mapping._build_checkpoint_conversion_mapping()
    assert sorted(deferred) == sorted(real) and len(real) > 100
    held = [t for ts in deferred.values() for t in ts]
    assert held and all(isinstance(t, _DeferredTransform) for t in held)
    assert sum(t._built is None for t in held) > 0.9 * len(held)  # nearly all never constructed
    built_in_build = [t._built.compiled_sources for t in held if t._built is not None]
    assert built_in_build and all(isinstance(p, _LazyPattern) and p._compiled is None
                                  for p in built_in_build)
    for key in real:
        handed_out = copy.deepcopy(deferred[key])
        assert all(isinstance(t, core_model_loading.WeightTransform) for t in handed_out), key
        assert _structure(handed_out) == _structure(real[key]), key


def test_deferred_transform_is_built_once_and_copied_apart():
    import copy

    from transformers.core_model_loading import MergeModulelist, WeightConverter

    from zload.integrations.transformers_registry import _DeferredTransform

    deferred = _DeferredTransform(WeightConverter, r"experts.*.w2.weight", "experts.down_proj",
                                  operations=[MergeModulelist(dim=0)])
    assert deferred._built is None
    assert deferred.target_patterns == ["experts.down_proj"]  # attributes come from the transform
    built = deferred._built
    first, second = copy.deepcopy(deferred), copy.deepcopy(deferred)
    assert deferred._built is built and type(first) is WeightConverter
    assert first is not built and first.operations[0] is not second.operations[0]
    assert first.rename_source_key("model.layers.0.experts.3.w2.weight")[0] == \
        "model.layers.0.experts.down_proj"


def test_lazy_pattern_behaves_as_a_pattern():
    import copy
    import pickle
    import re

    from zload.integrations.transformers_registry import _LazyPattern

    lazy = _LazyPattern(r"layers\.(?P<i>\d+)\.w")
    assert copy.deepcopy(lazy) is lazy and copy.copy(lazy) is lazy and lazy._compiled is None
    assert lazy.search("model.layers.12.w").group("i") == "12" and lazy.groupindex == {"i": 1}
    restored = pickle.loads(pickle.dumps(lazy))
    assert isinstance(restored, re.Pattern) and restored.pattern == lazy.pattern


def test_registry_is_lent_only_for_the_block(monkeypatch):
    from transformers import conversion_mapping

    from zload.integrations.transformers_registry import conversion_registry

    monkeypatch.setattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", None)
    with conversion_registry():
        lent = conversion_mapping._checkpoint_conversion_mapping_cache
        assert lent is not None and conversion_mapping.get_checkpoint_conversion_mapping("legacy")
    assert conversion_mapping._checkpoint_conversion_mapping_cache is None

    def own_build():
        raise AssertionError("transformers built its own registry while one was lent")

    # the speed-up holds only while transformers answers from the lent registry
    monkeypatch.setattr(conversion_mapping, "_build_checkpoint_conversion_mapping", own_build)
    with conversion_registry():
        assert conversion_mapping.get_checkpoint_conversion_mapping("mixtral")
    own = {"legacy": []}  # a registry transformers (or its user) built: used as it is
    monkeypatch.setattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", own)
    with conversion_registry():
        assert conversion_mapping._checkpoint_conversion_mapping_cache is own
    assert conversion_mapping._checkpoint_conversion_mapping_cache is own
