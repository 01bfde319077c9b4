"""``init``: build a ZeRO-3 model that a load is about to fill, without wasted work.

``deepspeed.zero.Init`` initialises every weight on every rank and then broadcasts each parameter
from rank 0 so that the ranks agree. Both are wasted when ``load_into`` overwrites every value
right after, and the broadcast funnels the whole model through rank 0. Inside ``init`` neither
happens; each parameter is marked, and ``load_into`` refuses to leave a marked parameter unwritten
(with ``strict=True``) or warns about it (``strict=False``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

_UNLOADED = "_zload_unloaded"  # set on each parameter built by ``init`` until a load writes it
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                   "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                   "kaiming_normal_", "orthogonal_", "sparse_")


def _leave_as_is(tensor, *args, **kwargs):
    return tensor


@contextmanager
def _no_weight_init():
    """``torch.nn.init`` (and transformers' guarded copies of it) do nothing while active."""
    tables = [(torch.nn.init, name) for name in _INIT_FUNCTIONS]
    hf = sys.modules.get("transformers.initialization")
    saved_hf = dict(hf.TORCH_INIT_FUNCTIONS) if hf is not None else None
    saved = {(owner, name): getattr(owner, name) for owner, name in tables}
    try:
        for owner, name in tables:
            setattr(owner, name, _leave_as_is)
        if hf is not None:
            hf.TORCH_INIT_FUNCTIONS.update(dict.fromkeys(hf.TORCH_INIT_FUNCTIONS, _leave_as_is))
        yield
    finally:
        for (owner, name), function in saved.items():
            setattr(owner, name, function)
        if hf is not None:
            hf.TORCH_INIT_FUNCTIONS.update(saved_hf)


@contextmanager
def init(config=None, *, dtype: torch.dtype | None = None, **zero_init_kwargs):
    """Like ``deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype, ...)``, for a model that
    ``zload.load_into`` will fill completely: no weight initialisation and no broadcast from rank 0.

    Parameters hold uninitialised memory until loaded; ``load_into`` raises (``strict=True``) or
    warns (``strict=False``) if a load leaves any of them unwritten.
    """
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import Init

    def partition_without_broadcast(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()
        setattr(param, _UNLOADED, True)

    original = Init._zero_init_param
    Init._zero_init_param = partition_without_broadcast
    try:
        with _no_weight_init(), deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype,
                                                      **zero_init_kwargs):
            yield
    finally:
        Init._zero_init_param = original


def mark_loaded(param) -> None:
    if hasattr(param, _UNLOADED):
        delattr(param, _UNLOADED)


def is_unloaded(tensor) -> bool:
    return getattr(tensor, _UNLOADED, False)
