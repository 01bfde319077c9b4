"""``init``: build a ZeRO-3 model whose parameters are born partitioned.

Under ``deepspeed.zero.Init`` every rank creates every parameter at full size, initialises it,
casts it, broadcasts it from rank 0 and keeps 1/W of it: each rank allocates and writes the whole
model once. For a model that ``load_into`` fills right after, all of that is waste. Inside
``init``:

- the tensor constructors that make parameters (``torch.empty``, ``zeros``, ``ones``, ``full``,
  ``rand``, ``randn``), called while a module's ``__init__`` runs, return *deferred* tensors: meta tensors
  that remember the call that makes them;
- a parameter made from one becomes a ZeRO-3 parameter whose partition DeepSpeed allocates (final
  dtype, device, pinning, NVMe) and zload zeroes. Until the context exits its ``data`` is a meta
  tensor of full shape, so initialisation code that touches it (``nn.init``, ``weight[pad] = 0``)
  does nothing and costs nothing;
- any operation on a deferred tensor makes it first, by the very call a normal construction runs,
  and so does the end of the context for every one still held (a buffer no operation used yet),
  so buffers computed in ``__init__`` (rotary ``inv_freq``, position ids) come out exactly as under
  ``zero.Init``;
- nothing initialises parameters (``torch.nn.init`` skips them, transformers'
  ``initialize_weights`` is off) and nothing is broadcast or gathered;
- until then a parameter answers ``device`` and ``new_*`` as its partitioned self will, so
  tensors made "on the weight's device" are real; moving one (``module.to``) or DeepSpeed
  gathering it (``GatheredParameters`` in ``__init__``) first gives it its empty real data.

Each parameter is marked until a load writes it; ``load_into`` refuses to leave a marked parameter
unwritten (``strict=True``) or warns about it (``strict=False``).
"""

from __future__ import annotations

import importlib
import mmap
import sys
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch.overrides import TorchFunctionMode

from ..collector import collector_paused
from ..errors import UnsupportedModelError
from ..integrations.deepspeed import (
    attach_first_partition,
    build_device,
    convert_to_zero3,
    first_partition_is_plain,
    first_partition_layout,
    flat_partition,
    is_zero3,
    library_dir,
    make_zero_init,
    outer_tensor_new,
    partition_by_deepspeed,
    pin,
    plain_module_apply,
    swapped_to_nvme,
    zero3_shape,
    zero_init_patches,
)
from ..integrations.transformers import skip_weight_init
from ..report import shortened
from .ds_config import read_ds_config, refuse_weight_quantization, resolve_auto

_UNLOADED = "_zload_unloaded"  # set on each parameter built by ``init`` until a load writes it
_RECIPE = "_zload_recipe"  # on a deferred tensor: (constructor, args, kwargs, device it will be on)
_DEFERRED_CONSTRUCTORS = ("empty", "zeros", "ones", "full", "randn", "rand")
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                   "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                   "kaiming_normal_", "orthogonal_", "sparse_")
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
             torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.requires_grad_,
             torch.Tensor.__len__}
# attributes that a meta tensor answers exactly as the real one will (``device`` is answered apart)
_SHAPE_ATTRIBUTES = {"shape", "dtype", "ndim", "layout", "requires_grad", "is_leaf", "grad_fn",
                     "grad", "names", "itemsize", "nbytes"}
_NEW_LIKE = {torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
             torch.Tensor.new_full, torch.Tensor.new_tensor}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
_active = False  # an ``init`` is open in this process: a nested one adds nothing


@contextmanager
def _replaced(owner, name, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _has_no_values(tensor) -> bool:
    """A parameter built by ``init`` (meta until the context exits, or partitioned): initialising
    it would only be discarded by the load."""
    return is_zero3(tensor) or (_RECIPE not in tensor.__dict__ and tensor.is_meta)


def _skipping_parameters(initialise):
    def initialise_unless_parameter(tensor, *args, **kwargs):
        return tensor if _has_no_values(tensor) else initialise(tensor, *args, **kwargs)
    return initialise_unless_parameter


@contextmanager
def _no_weight_init():
    """``torch.nn.init`` (and transformers' guarded copies of it) leave parameters alone while
    active; a buffer they initialise (fixed random features, a constant) is made and initialised
    as usual."""
    with ExitStack() as stack:
        for name in _INIT_FUNCTIONS:
            stack.enter_context(_replaced(torch.nn.init, name, _skipping_parameters(getattr(torch.nn.init, name))))
        skip_weight_init(stack, _skipping_parameters)
        yield


def _make_deferred_in(values) -> None:
    """Make every deferred tensor among ``values`` (arguments: tensors, nested lists, tuples and
    dicts). A loop, not a generator: it runs on every torch call while a model builds."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if _RECIPE in value.__dict__:
                _make(value)
        elif isinstance(value, (list, tuple)):
            _make_deferred_in(value)
        elif isinstance(value, dict):
            _make_deferred_in(value.values())


def _holds_tensor(values) -> bool:
    for value in values:
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, (list, tuple)) and _holds_tensor(value):
            return True
        if isinstance(value, dict) and _holds_tensor(value.values()):
            return True
    return False


def _make(tensor: torch.Tensor) -> None:
    """Turn a deferred tensor into the real one, in place (same Python object), by the call a
    normal construction makes."""
    construct, args, kwargs, _ = tensor.__dict__.pop(_RECIPE)
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
    """Makes a deferred tensor before any operation but a shape query uses it; a parameter waiting
    for its partition answers ``device`` and ``new_*`` as its partitioned self will. While
    DeepSpeed partitions a parameter that has no values yet (``partitioning``), its copies from
    that parameter into the partition are skipped."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device  # where zero.Init puts parameters and the tensors it constructs
        self.partitioning = False
        self.deferred = []  # in creation order: the ones something else still holds at the end are made

    def _device_of(self, tensor):
        """The device ``tensor`` has under zero.Init, or None if it is what it looks like (or
        DeepSpeed is partitioning, and must see parameters as they are)."""
        if self.partitioning:
            return None
        if _RECIPE in tensor.__dict__:
            return tensor.__dict__[_RECIPE][3]
        if isinstance(tensor, torch.nn.Parameter) and tensor.is_meta:
            return self.device
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.partitioning:  # DeepSpeed's own work on a parameter: it must see it as it is
            if func is torch.Tensor.copy_ and args[1].is_meta and not args[0].is_meta:
                return args[0]
            attribute = None
        else:
            attribute = func.__self__.__name__ if getattr(func, "__name__", "") in ("__get__", "__set__") else None
            if attribute == "device" and self._device_of(args[0]) is not None:
                return self._device_of(args[0])
            if args and is_zero3(args[0]) and args[0].is_meta and (
                    func in _MOVES or (attribute == "data" and func.__name__ == "__set__" and not args[1].is_meta)):
                # moved (module.to) or gathered (GatheredParameters), as under zero.Init
                _leave_meta(args[0], self.device)
            if func in _NEW_LIKE and self._device_of(args[0]) is not None and _RECIPE not in args[0].__dict__:
                args = (torch.empty(0, dtype=args[0].dtype, device=self.device), *args[1:])
        if func not in _METADATA and attribute not in _SHAPE_ATTRIBUTES:
            _make_deferred_in(args)
            if kwargs:
                _make_deferred_in(kwargs.values())
        return func(*args, **kwargs)

    def deferring(self, construct, library_dir: str):
        """``construct`` (a torch constructor, as zero.Init has wrapped it), returning a deferred
        tensor where a module's ``__init__`` calls it (not where DeepSpeed or this module does,
        e.g. to gather parameters)."""
        def construct_or_defer(*args, **kwargs):
            if (self.partitioning or str(kwargs.get("device")) == "meta"
                    or sys._getframe(1).f_code.co_filename.startswith((library_dir, __file__))
                    or _holds_tensor(args) or _holds_tensor(kwargs.values()) or not _in_module_init()):
                return construct(*args, **kwargs)
            with torch._C.DisableTorchFunction():  # no tensor among the arguments: nothing to make
                tensor = construct(*args, **{**kwargs, "device": "meta"})
            tensor.__dict__[_RECIPE] = (construct, args, kwargs, self._future_device(kwargs.get("device")))
            self.deferred.append(tensor)
            return tensor
        return construct_or_defer

    def _future_device(self, requested) -> torch.device:
        if requested is None:
            return self.device
        device = torch.device(requested)
        return self.device if device.type == self.device.type and device.index is None else device

    def make_the_held(self) -> None:
        """Make, in creation order, every deferred tensor that something besides this list still
        holds (a buffer or attribute no operation has used yet); the others were only ever the
        data of parameters. (Not weak references: ``swap_tensors`` refuses a tensor that has one.)"""
        deferred, self.deferred = self.deferred, []
        for i in range(len(deferred)):
            tensor, deferred[i] = deferred[i], None
            if _RECIPE in tensor.__dict__ and sys.getrefcount(tensor) > 2:  # 2: ``tensor``, the argument
                _make(tensor)


def _import_dynamo() -> None:
    """Meta operations import ``torch._dynamo`` on first use, and that import fails while zero.Init's
    ``Tensor.__new__`` is in place: import it beforehand, under torch's own."""
    if "torch._dynamo" in sys.modules:
        return
    torch_new = outer_tensor_new()  # an outer zero.Init has patched it
    with _replaced(torch.Tensor, "__new__", torch_new) if torch_new else nullcontext():
        importlib.import_module("torch._dynamo")


FRESH_PAGES_FROM = 1 << 20  # bytes: a plain CPU partition this large gets pages the kernel zeroed


def _fresh_zeroed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor on newly mapped anonymous pages, which the kernel hands out zeroed and maps in
    with one call (``MAP_POPULATE``; elsewhere than Linux, at the first write). ``torch.empty``
    may hand back memory that held other data, which then needs a second pass writing zeros over
    the whole partition. The pages go with the last tensor on them. Their storage
    cannot grow (``resize_`` raises; DeepSpeed never resizes a partition, it replaces its
    ``data``). In a process that has just freed much memory, ``torch.empty`` could reuse it and
    zeroing it would be quicker than faulting in new pages; this path does not look for that."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    pages = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    return torch.frombuffer(pages, dtype=dtype, count=numel)


def _allocate_partition(zero_init, param) -> bool:
    """What DeepSpeed's ``Init._partition_param`` does the first time it partitions a parameter,
    less the copy from the full tensor that a parameter built here does not have. DeepSpeed's
    path (tensor calls through the deferral, log messages formatted and dropped, the full data
    freed) was a large part of building a model (benchmarks/README.md, the zload.init targets); the bit-exact tests
    against ``zero.Init`` compare every attribute set here. Returns whether the partition already
    holds zeros (a large one in plain CPU memory: ``_fresh_zeroed``)."""
    aligned, world, device, pinned = first_partition_layout(zero_init, param)
    # the call DeepSpeed makes: inside zero.Init ``torch.empty`` casts a floating tensor to its dtype
    partition = torch.empty(aligned // world, dtype=param.dtype, device=device)
    zeroed = (not pinned and partition.device.type == "cpu" and partition.nbytes >= max(FRESH_PAGES_FROM, 1)
              and hasattr(mmap, "MAP_ANONYMOUS"))  # a mapping is never empty; none on Windows
    if zeroed:  # the same tensor on zeroed pages (torch.empty's were never touched: freeing them is cheap)
        partition = _fresh_zeroed(partition.numel(), partition.dtype)
    if pinned:
        partition = pin(partition)
    attach_first_partition(param, partition, aligned)
    return zeroed


def _meta_leftovers(modules) -> list[str]:
    """Buffers and parameters still on the meta device: computed from a parameter inside ``init``,
    where parameters have no values."""
    return [f"{type(module).__name__}.{name}" for module in modules
            for table in (module._buffers, module._parameters)
            for name, tensor in table.items() if tensor is not None and tensor.is_meta]


@contextmanager
def init(config=None, *, dtype: torch.dtype | None = None, hidden_size: int | None = None, enabled: bool = True,
         **zero_init_kwargs):
    """Like ``deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype, ...)``, for a model that
    ``zload.load_into`` will fill completely: no full-size parameter is ever allocated, no weight
    initialised, nothing broadcast.

    Parameters hold zeros until loaded; ``load_into`` raises (``strict=True``) or warns
    (``strict=False``) if a load leaves any of them unwritten. Buffers are made by the calls a
    normal construction makes, but after the module's parameters, so a buffer drawn from the
    global random generator gets other values than under ``zero.Init`` (which also draws every
    parameter's initialisation from it). A parameter made by any other call (``torch.arange``,
    ``torch.eye``, arithmetic) is built at full size and then partitioned, as under ``zero.Init``.
    ``config`` (a dict or a JSON file's path) is checked first (``zload.ds_config``), and weight
    quantization refused, before DeepSpeed reads either. Its "auto" values are filled in as
    transformers' Trainer fills them (``ds_config.resolve_auto``): ``"enabled": "auto"`` from
    ``dtype``, the batch sizes with what building needs, and the ZeRO bucket sizes and persistence
    threshold from ``hidden_size``, the model config's (``hidden_size=config.hidden_size``);
    without it those are left out (``zero.Init`` reads none of them; the engine does).
    """
    global _active
    checked = None if config is None else resolve_auto(
        read_ds_config(config, "config"), dtype=dtype, hidden_size=hidden_size)
    config = None if checked is None else checked.values  # read once: DeepSpeed is given what was checked
    if _active or not enabled:  # zero.Init nests the same way: the outermost one decides
        with make_zero_init(config, dtype, enabled=enabled, **zero_init_kwargs):
            yield
        return
    refuse_weight_quantization(checked, zero_init_kwargs)
    _import_dynamo()

    zero_init = make_zero_init(config, dtype, **zero_init_kwargs)
    deferral = _Deferral(build_device(zero_init))
    built = []  # (parameter, device its empty data lives on once partitioned)
    modules = []  # every module built, to check that nothing was left on meta

    def partition_without_broadcast(self, param):
        convert_to_zero3(self, param)
        partition_by_deepspeed(param)
        setattr(param, _UNLOADED, True)

    def partition_without_values(self, param):
        """A parameter made from a deferred tensor: its partition is allocated and zeroed, not
        computed (zeros, so that one a non-strict load leaves unwritten is not whatever memory
        held; the load would fault the pages in anyway)."""
        zeroed = False
        if first_partition_is_plain(self):
            with torch._C.DisableTorchFunction():  # nothing here is a deferred tensor: skip the mode's checks
                convert_to_zero3(self, param)
                zeroed = _allocate_partition(self, param)
        else:  # DeepSpeed's own partitioning; the deferral skips its copies from the meta data
            convert_to_zero3(self, param)
            partition_by_deepspeed(param)
        with torch._C.DisableTorchFunction():
            if not zeroed and not swapped_to_nvme(param):
                flat_partition(param).zero_()
            param.data = torch.empty(zero3_shape(param), dtype=param.dtype, device="meta")
        setattr(param, _UNLOADED, True)
        built.append((param, build_device(self)))

    def post_init_after_deferral(self, module, convert):
        """Also a child's parameter that this module's ``__init__`` replaced (``self.head.weight
        = nn.Parameter(...)``): DeepSpeed only looks at a module's own."""
        modules.append(module)
        deferral.partitioning = True
        try:
            with torch._C.DisableTorchFunction():
                unbuilt = [param for child in module.modules() for param in child._parameters.values()
                           if param is not None and param.is_meta and not is_zero3(param)]
            for param in unbuilt:
                if not is_zero3(param):  # a tied parameter is listed once per module holding it
                    partition_without_values(self, param)
            convert()
        finally:
            deferral.partitioning = False

    _active = True
    try:
        with ExitStack() as stack:
            stack.enter_context(collector_paused())
            for owner, name, value in zero_init_patches(partition_without_broadcast, post_init_after_deferral):
                stack.enter_context(_replaced(owner, name, value))
            stack.enter_context(_no_weight_init())
            stack.enter_context(zero_init)
            old_apply = plain_module_apply()
            if old_apply is not None:  # zero.Init's gathering apply: there is nothing to gather yet
                stack.enter_context(_replaced(torch.nn.Module, "apply", old_apply))
            for name in _DEFERRED_CONSTRUCTORS:
                stack.enter_context(_replaced(torch, name, deferral.deferring(
                    getattr(torch, name), library_dir())))
            stack.enter_context(deferral)
            yield
    finally:
        _active = False
        deferral.make_the_held()
        for param, device in built:
            _leave_meta(param, device)
    leftovers = _meta_leftovers(modules)
    if leftovers:
        raise UnsupportedModelError(
            f"zload.init: {shortened(leftovers)} ended up on the meta device: computed in __init__ "
            "from a parameter, which has no values inside zload.init. Compute it in forward() or "
            "after loading, or build this model with deepspeed.zero.Init")


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
