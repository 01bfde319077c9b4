"""``init``: build a ZeRO-3 model whose parameters are born partitioned.

Under ``deepspeed.zero.Init`` every rank creates every parameter at full size, initialises it,
casts it, broadcasts it from rank 0 and keeps 1/W of it: each rank allocates and writes the whole
model once. For a model that ``load_into`` fills right after, all of that is waste. Inside
``init``:

- the tensor constructors that make parameters (``torch.empty``, ``zeros``, ``ones``, ``full``,
  ``randn``), called while a module's ``__init__`` runs, return *deferred* tensors: meta tensors
  that remember the call that makes them;
- a parameter made from one becomes a ZeRO-3 parameter whose partition DeepSpeed allocates (final
  dtype, device, pinning, NVMe) and zload zeroes. Until the context exits its ``data`` is a meta
  tensor of full shape, so initialisation code that touches it (``nn.init``, ``weight[pad] = 0``)
  does nothing and costs nothing;
- any operation on a deferred tensor makes it first, by the very call a normal construction runs,
  and so does the end of the context for every one still held (a buffer no operation used yet),
  so buffers computed in ``__init__`` (rotary ``inv_freq``, position ids) come out exactly as under
  ``zero.Init``;
- nothing initialises weights (``torch.nn.init``, transformers' ``initialize_weights``) and nothing
  is broadcast or gathered.

Each parameter is marked until a load writes it; ``load_into`` refuses to leave a marked parameter
unwritten (``strict=True``) or warns about it (``strict=False``).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager

import torch
from torch.overrides import TorchFunctionMode

_UNLOADED = "_zload_unloaded"  # set on each parameter built by ``init`` until a load writes it
_RECIPE = "_zload_recipe"  # on a deferred tensor: (constructor, args, kwargs) that make it
_DEFERRED_CONSTRUCTORS = ("empty", "zeros", "ones", "full", "randn")
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                   "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                   "kaiming_normal_", "orthogonal_", "sparse_")
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
             torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.requires_grad_,
             torch.Tensor.__len__}


def _leave_as_is(tensor, *args, **kwargs):
    return tensor


@contextmanager
def _replaced(owner, name, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextmanager
def _no_weight_init():
    """``torch.nn.init`` (and transformers' guarded copies of it) do nothing while active."""
    with ExitStack() as stack:
        for name in _INIT_FUNCTIONS:
            stack.enter_context(_replaced(torch.nn.init, name, _leave_as_is))
        hf = sys.modules.get("transformers.initialization")
        if hf is not None:
            saved = dict(hf.TORCH_INIT_FUNCTIONS)
            hf.TORCH_INIT_FUNCTIONS.update(dict.fromkeys(hf.TORCH_INIT_FUNCTIONS, _leave_as_is))
            stack.callback(hf.TORCH_INIT_FUNCTIONS.update, saved)
        modeling = sys.modules.get("transformers.modeling_utils")  # optional: transformers models
        if modeling is not None:  # their initialize_weights; tie_weights still runs
            stack.enter_context(_replaced(modeling.PreTrainedModel, "initialize_weights", _leave_as_is))
        yield


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def _make(tensor: torch.Tensor) -> None:
    """Turn a deferred tensor into the real one, in place (same Python object), by the call a
    normal construction makes."""
    construct, args, kwargs = tensor.__dict__.pop(_RECIPE)
    torch.utils.swap_tensors(tensor, construct(*args, **kwargs))


def _in_module_init() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if (code.co_name == "__init__" and code.co_argcount
                and isinstance(frame.f_locals.get(code.co_varnames[0]), torch.nn.Module)):
            return True
        frame = frame.f_back
    return False


class _Deferral(TorchFunctionMode):
    """Makes a deferred tensor before any operation but a metadata query uses it; while DeepSpeed
    partitions a parameter that has no values yet (``partitioning``), its copies from that
    parameter into the partition are skipped."""

    def __init__(self):
        super().__init__()
        self.partitioning = False
        self.deferred = []  # every deferred tensor, so that the ones still held at the end are made

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.partitioning and func is torch.Tensor.copy_ and args[1].is_meta and not args[0].is_meta:
            return args[0]
        if func not in _METADATA and not (getattr(func, "__name__", "") in ("__get__", "__set__")
                                          and getattr(func.__self__, "__name__", "") != "data"):
            for tensor in _tensors_in((args, kwargs)):
                if _RECIPE in tensor.__dict__:
                    _make(tensor)
        return func(*args, **kwargs)

    def deferring(self, construct):
        """``construct`` (a torch constructor, as zero.Init has wrapped it), returning a deferred
        tensor where a module's ``__init__`` calls it."""
        def construct_or_defer(*args, **kwargs):
            if (self.partitioning or str(kwargs.get("device")) == "meta"
                    or any(True for _ in _tensors_in((args, kwargs))) or not _in_module_init()):
                return construct(*args, **kwargs)
            tensor = construct(*args, **{**kwargs, "device": "meta"})
            tensor.__dict__[_RECIPE] = (construct, args, kwargs)
            self.deferred.append(tensor)
            return tensor
        return construct_or_defer

    def make_the_held(self) -> None:
        """Make every deferred tensor that something besides this list still holds (a buffer or
        attribute no operation has used yet); the others were only ever the data of parameters."""
        deferred, self.deferred = self.deferred, []
        while deferred:
            tensor = deferred.pop()
            if _RECIPE in tensor.__dict__ and sys.getrefcount(tensor) > 2:  # 2: ``tensor``, the argument
                _make(tensor)


@contextmanager
def init(config=None, *, dtype: torch.dtype | None = None, **zero_init_kwargs):
    """Like ``deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype, ...)``, for a model that
    ``zload.load_into`` will fill completely: no full-size parameter is ever allocated, no weight
    initialised, nothing broadcast.

    Parameters hold zeros (or, if computed rather than constructed, their constructor's values)
    until loaded; ``load_into`` raises (``strict=True``) or warns (``strict=False``) if a load
    leaves any of them unwritten.
    """
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import Init

    deferral = _Deferral()
    built = []  # (parameter, device its empty data lives on once partitioned)

    def partition_without_broadcast(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()
        setattr(param, _UNLOADED, True)

    def partition_without_values(self, param):
        """A parameter made from a deferred tensor: its partition is allocated and zeroed (the
        load's reads would fault its pages in anyway, and do so slower: measured), not computed."""
        self._convert_to_deepspeed_param(param)
        param.partition()
        if param.ds_tensor.final_location is None:  # not swapped out to NVMe
            param.ds_tensor.zero_()
        param.data = torch.empty(param.ds_shape, dtype=param.dtype, device="meta")
        setattr(param, _UNLOADED, True)
        built.append((param, self.local_device))

    post_init = Init._post_init_method

    def post_init_after_deferral(self, module):
        deferral.partitioning = True
        try:
            for param in module.parameters(recurse=False):
                if param.is_meta and not hasattr(param, "ds_id"):
                    partition_without_values(self, param)
            post_init(self, module)
        finally:
            deferral.partitioning = False

    try:
        with ExitStack() as stack:
            stack.enter_context(_replaced(Init, "_zero_init_param", partition_without_broadcast))
            stack.enter_context(_replaced(Init, "_post_init_method", post_init_after_deferral))
            stack.enter_context(_no_weight_init())
            stack.enter_context(deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype,
                                                    **zero_init_kwargs))
            old_apply = getattr(torch.nn.Module, "_old_apply", None)
            if old_apply is not None:  # zero.Init's gathering apply: there is nothing to gather yet
                stack.enter_context(_replaced(torch.nn.Module, "apply", old_apply))
            for name in _DEFERRED_CONSTRUCTORS:
                stack.enter_context(_replaced(torch, name, deferral.deferring(getattr(torch, name))))
            stack.enter_context(deferral)
            yield
    finally:
        deferral.make_the_held()
        for param, device in built:
            _leave_meta(param, device)


def _leave_meta(param: torch.nn.Parameter, device) -> None:
    """Give a parameter built on meta the data zero.Init leaves a partitioned parameter: empty, on
    its device. A meta tensor cannot take other data, so its contents are swapped for a real one's
    (the same Python object, with the same attributes, stays in its module)."""
    if param.is_meta:
        real = torch.nn.Parameter(torch.empty(0, dtype=param.dtype, device=device),
                                  requires_grad=param.requires_grad)
        real.__dict__.update(param.__dict__)
        torch.utils.swap_tensors(param, real)


def mark_loaded(param) -> None:
    if hasattr(param, _UNLOADED):
        delattr(param, _UNLOADED)


def is_unloaded(tensor) -> bool:
    return getattr(tensor, _UNLOADED, False)
