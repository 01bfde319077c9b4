"""DeepSpeed: every use zload makes of DeepSpeed's internals, in one place.

zload writes ZeRO-3 partitions in place, so it reads and sets the attributes DeepSpeed keeps on its
parameters (``ds_tensor``, ``ds_shape``, ``ds_process_group``...), calls methods of an engine's
optimizer and of ``zero.Init`` that are no public API, parses configs with DeepSpeed's own models,
and patches zero.Init while ``zload.init`` builds a model. DeepSpeed promises none of that across
releases. This is the only module that touches it (tests/test_layout.py checks), through small
functions each saying what it reads or does and why; no other module imports DeepSpeed.

The installed DeepSpeed's version is checked once per process, at zload's first use of DeepSpeed
(importing zload imports no DeepSpeed): zload is tested with DeepSpeed 0.19.x (0.19.8), and
refuses a release older than 0.19.3 (``UnsupportedEnvironmentError``), the first that has the
``Init._partition_world_size`` that ``zload.init`` calls. From 0.20 on it warns (``ZloadWarning``)
once per node and goes on: the internals it uses may well still be there.

Geometry that mirrors DeepSpeed's arithmetic without touching its objects
(``checkpoint.partition``) and the reading of DeepSpeed's checkpoint files (``checkpoint.native``)
live with the checkpoint code.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..checkpoint.optimizer_state import COUNTERS, LOSS_SCALE_KEYS
from ..checkpoint.partition import Partition
from ..distributed import collective, speaks_for_node, stage
from ..errors import PeerLostError, UnsupportedEnvironmentError, UnsupportedModelError, ZloadWarning

MINIMUM_VERSION = (0, 19, 3)  # the first release with every internal used here
TESTED_VERSION = "0.19.8"  # the release the test suite runs
UNTESTED_FROM = (0, 20)  # the first minor release not tested: warned about, not refused
_TESTED = f"DeepSpeed 0.19.x ({TESTED_VERSION})"  # what this release is tested with


def check_version(version: str) -> None:
    """Refuse a DeepSpeed ``version`` older than ``MINIMUM_VERSION``; warn about one from
    ``UNTESTED_FROM`` on, or one whose number cannot be read (a local build), once per node (the
    DeepSpeed installed is the node's)."""
    number = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if number is None:
        if speaks_for_node():
            warnings.warn(f"cannot read DeepSpeed's version {version!r}; this release is tested with {_TESTED}",
                          ZloadWarning, stacklevel=2)
        return
    release = tuple(int(part or 0) for part in number.groups())
    minimum, untested = (".".join(map(str, v)) for v in (MINIMUM_VERSION, UNTESTED_FROM))
    if release < MINIMUM_VERSION:
        raise UnsupportedEnvironmentError(
            f"DeepSpeed {version} is installed, but zload needs DeepSpeed {minimum} or later: it uses DeepSpeed "
            f"internals that {minimum} introduced, and is tested with {_TESTED}. Upgrade it: "
            f"pip install 'deepspeed>={minimum}'")
    if release[:2] >= UNTESTED_FROM and speaks_for_node():
        warnings.warn(f"DeepSpeed {version} is installed, and this release is tested with {_TESTED}: the DeepSpeed "
                      "internals it uses may have changed since. If a load or save fails, install a tested "
                      f"DeepSpeed: pip install 'deepspeed>={minimum},<{untested}'", ZloadWarning, stacklevel=2)


@functools.cache
def _deepspeed():
    """The ``deepspeed`` module, its version checked: once per process (a refusal is not cached,
    so every later use raises it again)."""
    import deepspeed

    check_version(deepspeed.__version__)
    return deepspeed


def _partition_parameters():
    """``deepspeed.runtime.zero.partition_parameters``: zero.Init, its statuses and its globals."""
    _deepspeed()
    from deepspeed.runtime.zero import partition_parameters

    return partition_parameters


# ---- the model: a ZeRO-3 parameter and its partition


def is_zero3(tensor) -> bool:
    """Whether ``tensor`` is a ZeRO-3 parameter (DeepSpeed numbers each one, ``ds_id``)."""
    return hasattr(tensor, "ds_id")


def zero3_shape(param) -> tuple[int, ...]:
    """The full shape of ZeRO-3 parameter ``param``; its ``data`` is empty while partitioned."""
    return tuple(param.ds_shape)


def zero3_numel(param) -> int:
    """The elements of the full (unpartitioned) ZeRO-3 parameter ``param``."""
    return param.ds_numel


def zero3_group(param):
    """The process group ``param`` is partitioned over (smaller than the world under expert
    parallelism or an explicit ``data_parallel_group``)."""
    return param.ds_process_group


def partition_size(param) -> int:
    """The elements of this rank's partition of ``param``, padding included."""
    return param.ds_tensor.ds_numel


def partition_dtype(param) -> torch.dtype:
    """The dtype this rank's partition is stored in: what a load writes (not necessarily the
    dtype zero.Init was asked for)."""
    return param.ds_tensor.dtype


def flat_partition(param) -> torch.Tensor:
    """This rank's partition of ``param``, flat, to write into in place: under a live engine it is
    a view into the optimizer's flat buffer, which must not be replaced."""
    return param.ds_tensor.data.view(-1)


def gathered_status(param) -> str | None:
    """The name of ``param``'s status if it is gathered (or being gathered), else None: a write
    into the partition of a gathered parameter would be overwritten when it is released."""
    status = _partition_parameters().ZeroParamStatus
    return None if param.ds_status == status.NOT_AVAILABLE else param.ds_status.name


def swapped_to_nvme(param) -> bool:
    """Whether ``param``'s partition is swapped out to NVMe (its ``ds_tensor`` is a placeholder)."""
    return getattr(param.ds_tensor, "final_location", None) == "nvme"


def stored_quantized(param) -> bool:
    """Whether ``param``'s partition is stored quantised (``zero_quantized_nontrainable_weights``)."""
    return hasattr(param.ds_tensor, "ds_quant_scale")


def drop_secondary(param) -> None:
    """Drop ``param``'s ZeRO++ hpZ secondary partition after its primary one was written: it would
    be stale; DeepSpeed rebuilds it at the next partitioning."""
    param.ds_secondary_tensor = None


def convert_like(sibling, param) -> None:
    """Make plain parameter ``param`` a ZeRO-3 parameter in ZeRO-3 parameter ``sibling``'s process
    group, broadcast from its first rank (a collective)."""
    sibling.convert_to_zero_parameters([param])


# ---- the engine


def as_engine(model):
    """``model`` if it is a ``DeepSpeedEngine``, else None. DeepSpeed is not imported for this:
    an engine exists only once its user imported DeepSpeed."""
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is None or not isinstance(model, deepspeed.DeepSpeedEngine):
        return None
    _deepspeed()
    return model


@dataclass(frozen=True)
class Masters:
    """Where DeepSpeed keeps the fp32 master weights of a module's parameters (``masters_of``): a
    write into the weights must refresh them, or the next optimizer step writes the old weights
    back."""

    optimizers: tuple = ()  # each refreshes all its masters (``refresh_fp32_params``)
    fragments: tuple = ()  # ZeRO-1/2 parameters, each linked to its own fragment of the masters

    def misplaced_groups(self) -> list[int]:
        """The parameter groups whose ZeRO-1/2 links (``fragments``) point elsewhere in the masters
        than where the weights lie in the group's flat buffer: DeepSpeed 0.19.8 links parameters in
        the group's order, while ``round_robin_gradients`` lays the buffer out in another. A link
        maps element ``lp_fragment_address.start`` of a weight to element
        ``hp_fragment_address.start`` of this rank's partition, so every weight of a group that is
        linked right gives the same start of the partition in the flat buffer."""
        starts: dict[int, set[int]] = {}
        for param in self.fragments:
            link = param._hp_mapping
            if link is None:  # no fragment on this rank
                continue
            starts.setdefault(link.param_group_index, set()).add(
                param.data.storage_offset() + link.lp_fragment_address.start - link.hp_fragment_address.start)
        return sorted(group for group, found in starts.items() if len(found) > 1)

    def refresh(self) -> None:
        """Every master <- the weight it is the master of (a local copy on each rank)."""
        refreshing = [o for o in self.optimizers if hasattr(o, "refresh_fp32_params")]
        for optimizer in refreshing:
            optimizer.refresh_fp32_params()
        if not refreshing and self.fragments:
            from deepspeed.utils import safe_set_full_fp32_param

            for param in self.fragments:
                safe_set_full_fp32_param(param, param.data)


def masters_of(module, engine) -> Masters | None:
    """The fp32 masters of ``module``'s parameters: those of ``engine``'s optimizer where the
    DeepSpeedEngine is passed; where its module is passed alone (``engine.module``, a Trainer's
    ``trainer.model``), found by the links DeepSpeed's own ``safe_get_full_fp32_param`` follows from
    a parameter: ZeRO-3's optimizer (``_z3_optimizer``), ZeRO-1/2's fragment of the masters
    (``_hp_mapping``). None for a module no DeepSpeed optimizer holds. Not found alone: the masters
    of an fp16/bf16 optimizer without ZeRO (stage 0), which link no parameter to them."""
    params = list(module.parameters())
    fragments = tuple(p for p in params if hasattr(p, "_hp_mapping"))
    if engine is not None:
        return Masters(() if engine.optimizer is None else (engine.optimizer,), fragments)
    linked = {id(o): o for p in params if (o := getattr(p, "_z3_optimizer", None)) is not None}
    return Masters(tuple(linked.values()), fragments) if linked or fragments else None


@contextmanager
def engine_writes(masters: Masters | None, resumed=None):
    """Keep the engine that keeps ``masters`` (None: no engine) consistent around in-place writes
    into its (partitioned) parameters.

    ZeRO-3 needs persistent parameters partitioned first and re-gathered after; every optimizer
    that keeps fp32 masters (ZeRO-1/2/3, bf16, fp16) must refresh them, or its next step would
    write the old weights back. ``resumed``: the engine whose masters the writes set too (a resume),
    whose 16-bit weights are set from them instead (``weights_from_masters``).
    """
    zero3 = [o for o in getattr(masters, "optimizers", ()) if hasattr(o, "checkpoint_event_prologue")]
    with collective():
        for optimizer in zero3:
            optimizer.checkpoint_event_prologue()  # partition persistent (replicated) parameters
    try:
        yield
    except PeerLostError:
        raise  # a peer is gone: no collective can set the engine right again
    except BaseException:
        with collective():
            for optimizer in zero3:
                optimizer.checkpoint_event_epilogue()
        raise
    with stage("updating the engine after the load", "The weights are written, but the engine's "
               "fp32 masters or persistent parameters may not be: do not train on with it."), collective():
        if resumed is not None:
            weights_from_masters(resumed)
        elif masters is not None:
            masters.refresh()  # fp32 masters <- the weights just written
        for optimizer in zero3:
            optimizer.checkpoint_event_epilogue()  # drop hpZ secondaries, re-gather persistent params


def local_master(param) -> torch.Tensor:
    """This rank's partition of ``param``'s fp32 master weights, kept by the engine's optimizer."""
    _deepspeed()
    from deepspeed.utils import safe_get_local_fp32_param

    return safe_get_local_fp32_param(param)


def full_master(param) -> torch.Tensor | None:
    """``param``'s whole fp32 master weights (None if the optimizer keeps none), gathered: a
    collective, inside ``gathered_parameters``."""
    _deepspeed()
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)


def gathered_parameters(params, modifier_rank: int | None = None):
    """DeepSpeed's ``GatheredParameters``: ``params`` whole on every rank while active; with
    ``modifier_rank``, what that rank wrote into them is broadcast and partitioned on exit (a
    collective even where the body raised)."""
    return _deepspeed().zero.GatheredParameters(params, modifier_rank=modifier_rank)


# ---- the config


def config_model(section: str):
    """DeepSpeed's own pydantic model of config ``section`` ("zero_optimization", "bf16", "fp16" or
    "weight_quantization"): parsing the section with it accepts exactly what DeepSpeed accepts."""
    _deepspeed()
    if section == "zero_optimization":
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig as model
    elif section == "weight_quantization":
        from deepspeed.inference.config import WeightQuantConfig as model
    else:
        from deepspeed.runtime import precision_config

        model = {"bf16": precision_config.DeepSpeedBF16Config, "fp16": precision_config.DeepSpeedFP16Config}[section]
    return model


# ---- zero.Init, as zload.init builds under it


def make_zero_init(config, dtype, **kwargs):
    """``deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype, **kwargs)``, in a world of
    one process where no launcher started this one (``join_world_of_one``)."""
    join_world_of_one()
    return _deepspeed().zero.Init(config_dict_or_path=config, dtype=dtype, **kwargs)


# What a launcher leaves in a process's environment: torchrun's and the DeepSpeed launcher's
# variables; MPI's, Azure ML's and SageMaker's, from which DeepSpeed finds the world itself.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE",
                      "PMI_SIZE", "PMIX_RANK", "AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV")


def launched() -> bool:
    """Whether a launcher started this process (one of ``LAUNCHER_VARIABLES`` is set, or Slurm
    runs several tasks): then its world is the launcher's to define."""
    return any(v in os.environ for v in LAUNCHER_VARIABLES) or os.environ.get("SLURM_NTASKS", "1") != "1"


def join_world_of_one() -> None:
    """A script started with plain ``python`` (no process group, no launcher) gets a process group
    of one, set up as torchrun sets up one process: its variables (a free port on 127.0.0.1), then
    DeepSpeed's ``init_distributed``, which without them would look for an MPI world (and fail
    without ``mpi4py``)."""
    import torch.distributed as dist

    if dist.is_initialized() or launched():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    _deepspeed().init_distributed(verbose=False)


def library_dir() -> str:
    """DeepSpeed's package folder: a call made from a file under it is DeepSpeed's own."""
    return os.path.dirname(_deepspeed().__file__)


def build_device(zero_init):
    """The device ``zero_init`` builds parameters on, and the tensors it constructs."""
    return zero_init.local_device


def outer_tensor_new():
    """torch's own ``Tensor.__new__`` while an outer zero.Init has replaced it (DeepSpeed keeps
    it as ``__old_new__``), else None."""
    return torch.Tensor.__old_new__ if _partition_parameters().zero_init_context > 0 else None


def plain_module_apply():
    """``nn.Module.apply`` as it was before zero.Init replaced it by one that gathers each
    parameter first (None where it has not)."""
    return getattr(torch.nn.Module, "_old_apply", None)


def zero_init_patches(init_param, post_init) -> list[tuple[object, str, object]]:
    """(owner, name, replacement) that ``zload.init`` puts in place while its zero.Init is
    active: ``init_param(zero_init, param)`` makes each new parameter ZeRO-3 in place of
    ``Init._zero_init_param`` (which broadcasts it first); ``post_init(zero_init, module,
    convert)`` runs in place of ``Init._post_init_method`` after each module's ``__init__``,
    ``convert()`` being DeepSpeed's conversion of the module's own parameters; and DeepSpeed's
    ``print_rank_0`` formats no message it drops."""
    partition_parameters = _partition_parameters()
    init = partition_parameters.Init
    convert = init._post_init_method

    def post_init_method(self, module):
        post_init(self, module, lambda: convert(self, module))

    return [(init, "_zero_init_param", init_param), (init, "_post_init_method", post_init_method),
            (partition_parameters, "print_rank_0", _print_only_if_asked(partition_parameters.print_rank_0))]


def _print_only_if_asked(print_rank_0):
    """DeepSpeed's ``print_rank_0`` prints only when asked (``debug``/``force``), but asks
    torch.distributed for the rank first, thousands of times while a model builds."""
    def print_if_asked(message, debug=False, force=False):
        if debug or force:
            print_rank_0(message, debug=debug, force=force)
    return print_if_asked


def convert_to_zero3(zero_init, param) -> None:
    """Give ``param`` the attributes and methods of a ZeRO-3 parameter, not yet partitioned."""
    zero_init._convert_to_deepspeed_param(param)


def partition_by_deepspeed(param) -> None:
    """DeepSpeed's own partitioning of ZeRO-3 parameter ``param`` (its full data copied in)."""
    param.partition()


def first_partition_is_plain(zero_init) -> bool:
    """No hpZ secondary partition and no NVMe swapping: ``first_partition_layout`` and
    ``attach_first_partition`` do all that DeepSpeed's first partitioning of a parameter would."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    return zero_init.zero_param_process_group is None and zero_init.remote_device != OffloadDeviceEnum.nvme


def first_partition_layout(zero_init, param) -> tuple[int, int, object, bool]:
    """(elements of ``param`` padded to a multiple of the world, that world, device, pinned) of
    the partition that DeepSpeed's ``Init._partition_param`` allocates the first time it
    partitions ``param``."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    world = zero_init._partition_world_size(param)
    aligned = zero_init._aligned_size(param)
    device = zero_init.local_device if param.ds_persist else zero_init.remote_device
    pinned = device == OffloadDeviceEnum.cpu and zero_init.pin_memory
    return aligned, world, device, pinned


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in pinned memory, as DeepSpeed pins offloaded partitions."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().pin_memory(tensor)


def attach_first_partition(param, partition: torch.Tensor, aligned: int) -> None:
    """Make ``partition`` (allocated as ``first_partition_layout`` says) ``param``'s partition,
    with every attribute ``Init._partition_param`` sets; the bit-exact tests against zero.Init
    compare them all."""
    statuses = _partition_parameters()
    partition.requires_grad = False
    partition.ds_numel = partition.numel()
    partition.status = statuses.PartitionedParamStatus.AVAILABLE
    partition.final_location = None
    param.ds_tensor = partition
    param.ds_numel_aligned = aligned
    param.ds_status = statuses.ZeroParamStatus.NOT_AVAILABLE


# ---- the engine's optimizer: fp32 masters, optimizer states, parameter groups (a resume)


@dataclass(frozen=True)
class Slot:
    """Elements ``[first, first + count)`` of parameter ``param`` (flat, row-major) that this rank's
    optimizer holds at element ``offset`` of a flat partition (``Flat``)."""

    param: object
    first: int
    count: int
    offset: int


@dataclass(frozen=True)
class Flat:
    """One flat fp32 partition of this rank's optimizer (a ZeRO-3 sub-group, a ZeRO-1/2 group):
    ``master`` holds the fp32 master weights of ``slots``, the rest of it is padding; the optimizer
    keeps a state per flat (Adam's ``exp_avg``... laid out like ``master``, and a step count)."""

    group: int  # the index of its parameter group in the optimizer's param_groups
    master: torch.Tensor
    slots: tuple[Slot, ...]


def _zero_optimizer(engine):
    """The engine's ZeRO optimizer, refused where its states cannot be written in memory."""
    optimizer = getattr(engine, "optimizer", None)
    if not hasattr(optimizer, "fp32_partitioned_groups_flat") and not hasattr(
            optimizer, "single_partition_of_fp32_groups"):
        raise UnsupportedModelError(f"the engine's optimizer is a {type(optimizer).__name__}, not a ZeRO optimizer "
                                    "(stage 1, 2 or 3): zload restores the optimizer states of ZeRO only")
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "fp16_partitioned_groups_flat", [0]).count(
            None):
        raise UnsupportedModelError("the engine swaps its optimizer states or parameters to NVMe, which zload "
                                    "does not restore optimizer states into yet")
    return optimizer


def optimizer_flats(engine) -> tuple[list[Flat], int]:
    """This rank's flat fp32 partitions and which parameter elements each holds, and the number of
    parameter groups; raises ``UnsupportedModelError`` for an optimizer zload cannot restore.

    ZeRO-3 holds, per sub-group, each parameter's partition (``ceil(numel / world)`` elements, its
    padding included) one after another; ZeRO-1/2 holds, per group, this rank's equal slice of the
    group's flat buffer, which holds the parameters in ``round_robin_bit16_groups`` order at their
    ``round_robin_bit16_offsets``. Not DeepSpeed's own links from a parameter to its fragment
    (``_hp_mapping``): they take the parameters in the group's order, which ``round_robin_gradients``
    changes (DeepSpeed 0.19.8)."""
    import torch.distributed as dist

    optimizer = _zero_optimizer(engine)
    flats = []
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        for sub_group, params in enumerate(optimizer.fp16_groups):
            slots, offset = [], 0
            for param in params:
                group = zero3_group(param)
                part = Partition(param.ds_numel, dist.get_world_size(group=group), dist.get_rank(group=group))
                slots.append(Slot(param, part.start, part.valid, offset))
                offset += partition_size(param)
            flats.append(Flat(optimizer.sub_group_to_group_id[sub_group],
                              optimizer.fp32_partitioned_groups_flat[sub_group], tuple(slots)))
    else:
        for group, params in enumerate(optimizer.round_robin_bit16_groups):
            ranks = optimizer.real_dp_process_group[group]
            size = optimizer.bit16_groups_flat[group].numel() // dist.get_world_size(group=ranks)
            start = dist.get_rank(group=ranks) * size
            slots = []
            for param, offset, meta in zip(params, optimizer.round_robin_bit16_offsets[group],
                                           optimizer.round_robin_bit16_meta[group]):
                low, high = max(start, offset), min(start + size, offset + meta.numel())
                if low < high:
                    slots.append(Slot(param, low - offset, high - low, low - start))
            flats.append(Flat(group, optimizer.single_partition_of_fp32_groups[group], tuple(slots)))
    return flats, len(optimizer.optimizer.param_groups)


def optimized_parameters(engine) -> list[list]:
    """The parameters each of the engine's parameter groups optimizes (frozen ones are in none)."""
    optimizer = _zero_optimizer(engine)
    groups: list[list] = [[] for _ in optimizer.optimizer.param_groups]
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        for sub_group, params in enumerate(optimizer.fp16_groups):
            groups[optimizer.sub_group_to_group_id[sub_group]].extend(params)
    else:
        for group, params in enumerate(optimizer.bit16_groups):
            groups[group].extend(params)
    return groups


def hyperparameters(engine) -> list[dict]:
    """Each parameter group's hyperparameters (a copy of its dict, but its ``params``)."""
    groups = _zero_optimizer(engine).optimizer.param_groups
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def flat_states(engine, flats: list[Flat]) -> list[dict]:
    """The optimizer's state of each of ``flats`` (its dict: Adam's ``exp_avg``, ``exp_avg_sq``,
    ``step``...; empty before its first step). Raises ``UnsupportedModelError`` for a state zload
    cannot read or write element by element: not a dict, or holding a tensor not laid out like the
    flat's masters (a factored or quantised state: an optimizer that is not Adam-like)."""
    optimizer = _zero_optimizer(engine).optimizer
    states = [optimizer.state[flat.master] if flat.master in optimizer.state else {} for flat in flats]
    for k, (flat, state) in enumerate(zip(flats, states)):
        odd = f"is a {type(state).__name__}, not a dict" if not isinstance(state, dict) else next(
            (f"holds {key!r}, a {value.dtype} tensor of shape {list(value.shape)}" for key, value in state.items()
             if isinstance(value, torch.Tensor) and value.dim() > 0
             and (value.shape, value.dtype) != (flat.master.shape, flat.master.dtype)), None)
        if odd:
            raise UnsupportedModelError(
                f"the state that the engine's optimizer ({type(optimizer).__name__}) keeps of its flat fp32 partition "
                f"{k} (parameter group {flat.group}) {odd}, where zload expects a dict of tensors laid out like the "
                f"partition's masters ({flat.master.dtype}, shape {list(flat.master.shape)}), as Adam's: zload "
                "saves and restores the optimizer states of Adam-like optimizers only")
    return states


def set_optimizer_state(engine, flats: list[Flat], states: list[dict], groups: list[dict]) -> None:
    """Make ``states[i]`` the optimizer's whole state of ``flats[i]`` (what it held is dropped)
    and set each parameter group's hyperparameters from ``groups`` (``params`` left alone)."""
    optimizer = _zero_optimizer(engine).optimizer
    for flat, state in zip(flats, states):
        optimizer.state[flat.master] = state
    for group, values in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in values.items() if k != "params"})


def weights_from_masters(engine) -> None:
    """Set this rank's 16-bit weights from the fp32 masters, as the optimizer does after a step
    (no collective: ZeRO-1/2 update this rank's slice of each group's flat 16-bit buffer; the rest
    is other ranks' to keep)."""
    import torch.distributed as dist

    optimizer = _zero_optimizer(engine)
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):
        pairs = zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat)
    else:
        pairs = ((partitions[dist.get_rank(group=ranks)], master) for partitions, ranks, master in zip(
            optimizer.parallel_partitioned_bit16_groups, optimizer.real_dp_process_group,
            optimizer.single_partition_of_fp32_groups))
    for low, master in pairs:
        if master.numel():
            low.data.copy_(master.data)


def loss_scale_state(engine) -> dict:
    """What the engine's loss scaler has learnt (fp16's dynamic scale, its iteration counts)."""
    scaler = getattr(_zero_optimizer(engine), "loss_scaler", None)
    return {k: getattr(scaler, k) for k in LOSS_SCALE_KEYS if isinstance(getattr(scaler, k, None), (int, float))}


def set_loss_scale_state(engine, state: dict) -> None:
    """Restore ``loss_scale_state`` when it and the engine's scaler are both dynamic. A static
    scale is configuration, not learning: bf16's 1 would make an fp16 engine's gradients
    underflow, and a bf16 or static fp16 engine keeps the scale its config gives."""
    scaler = getattr(_zero_optimizer(engine), "loss_scaler", None)
    if not getattr(scaler, "dynamic", False) or "cur_iter" not in state:
        return
    for key in LOSS_SCALE_KEYS:
        if key in state and hasattr(scaler, key):
            setattr(scaler, key, state[key])


def training_counters(engine) -> dict:
    """The engine's step and sample counts (``global_steps``...), which ``save_checkpoint`` saves."""
    return {k: getattr(engine, k) for k in COUNTERS}


def set_training_counters(engine, counters: dict) -> None:
    for key in COUNTERS:
        if key in counters:
            setattr(engine, key, counters[key])


def lr_scheduler(engine):
    """The engine's learning-rate scheduler (``engine.lr_scheduler``), or None."""
    return getattr(engine, "lr_scheduler", None)
