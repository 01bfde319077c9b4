"""transformers' checkpoint conversion registry, built with every transform deferred.

On first use transformers builds its registry for every model type it knows (about 1,100
transforms and their regexes) though a load needs one model's few. ``conversion_registry`` lends
it one whose transforms are built when first used. This rebuilds a private transformers function
(``_build_checkpoint_conversion_mapping``), so tests/test_load_transformers.py compares the result
with transformers' own for every model type, and any version this does not fit uses the plain path.

Kept because transformers' own registry is most of a first load's fixed cost (benchmarks/README.md,
"Warm: against DCP, stage by stage").
"""

from __future__ import annotations

import copy
import functools
import logging
import re
import types
from contextlib import contextmanager

logger = logging.getLogger("zload")


class _LazyPattern:
    """A regular expression compiled when first used; otherwise used like ``re.Pattern``."""

    __slots__ = ("_args", "_compiled")

    def __init__(self, *args):
        self._args = args
        self._compiled = None

    def __getattr__(self, name):
        if self._compiled is None:
            self._compiled = re.compile(*self._args)
        return getattr(self._compiled, name)

    def __copy__(self):
        return self  # immutable, as re.Pattern

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return re.compile, self._args


class _DeferredTransform:
    """A transformers ``WeightTransform`` constructed when first used.

    transformers hands out its registry only as deep copies (``get_checkpoint_conversion_mapping``),
    and a deep copy of this is the real transform, so a load constructs only its own model's few.
    """

    __slots__ = ("_args", "_built", "_cls", "_kwargs")

    def __init__(self, cls, *args, **kwargs):
        self._cls, self._args, self._kwargs, self._built = cls, args, kwargs, None

    def _transform(self):
        if self._built is None:
            self._built = self._cls(*self._args, **self._kwargs)
        return self._built

    def __getattr__(self, name):
        return getattr(self._transform(), name)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._transform(), memo)


_UNAVAILABLE = object()
_deferred_registry = None  # built on first use; _UNAVAILABLE where this transformers does not fit


def _build_deferred_registry(conversion_mapping, core_model_loading):
    """transformers' conversion registry, every transform in it deferred (``_DeferredTransform``).

    transformers' build function runs with its own copy of its module's namespace, in which each
    transform class makes a deferred transform instead, so no other thread sees a swapped class.
    The few transforms the build itself looks into are constructed then, with their regexes
    compiled on first use (``_LazyPattern``).
    """
    build = conversion_mapping._build_checkpoint_conversion_mapping
    namespace = dict(build.__globals__)
    for name, value in build.__globals__.items():
        if isinstance(value, type) and issubclass(value, core_model_loading.WeightTransform):
            namespace[name] = functools.partial(_DeferredTransform, value)
    deferred_build = types.FunctionType(build.__code__, namespace, build.__name__, build.__defaults__,
                                        build.__closure__)
    lazy_re = types.SimpleNamespace(**vars(re))
    lazy_re.compile = _LazyPattern
    core_model_loading.re = lazy_re  # WeightTransform.__init__ compiles through this name
    try:
        return deferred_build()
    finally:
        core_model_loading.re = re


def forget_registry() -> None:
    """Build the registry anew on next use, as a new process would (a process that runs one test
    after another, some with a patched transformers, needs each to start afresh)."""
    global _deferred_registry
    _deferred_registry = None


@contextmanager
def conversion_registry():
    """Lend transformers a conversion registry of deferred transforms for the block, if it has
    none yet; its own registry state is restored after the block, and versions lacking these
    internals use the plain path."""
    global _deferred_registry
    from transformers import conversion_mapping, core_model_loading

    if (getattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", False) is not None
            or not hasattr(conversion_mapping, "_build_checkpoint_conversion_mapping")
            or not hasattr(core_model_loading, "WeightTransform")
            or getattr(core_model_loading, "re", None) is not re):
        yield
        return
    if _deferred_registry is None:
        try:
            _deferred_registry = _build_deferred_registry(conversion_mapping, core_model_loading)
        except Exception as e:  # a transformers version this does not fit: use its own path
            logger.debug("deferred conversion registry unavailable (%r); using transformers' own", e)
            _deferred_registry = _UNAVAILABLE
    if _deferred_registry is _UNAVAILABLE:
        yield
        return
    conversion_mapping._checkpoint_conversion_mapping_cache = _deferred_registry
    try:
        yield
    finally:
        if conversion_mapping._checkpoint_conversion_mapping_cache is _deferred_registry:
            conversion_mapping._checkpoint_conversion_mapping_cache = None
