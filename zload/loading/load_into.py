"""``load_into``: index -> targets -> plan -> agree -> execute -> report.

Nothing is written into the model until every rank has planned without a problem; a failure while
writing is agreed on as well, so no rank is left waiting in a collective another rank never reaches.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

import torch

from ..checkpoint.files import FileTable
from ..checkpoint.native import native_folder
from ..checkpoint.optimizer_state import OPTIMIZER_INDEX
from ..checkpoint.quantized import FP8
from ..checkpoint.views import SharedIndex, Verify
from ..collector import collector_paused
from ..distributed import Arguments, agree, collective, problems_of, rank_and_world, speaks_for_all, stage, warn_for_all
from ..errors import ArgumentTypeError, ArgumentValueError, ZloadError
from ..integrations.deepspeed import Masters, convert_like, drop_secondary, engine_writes, flat_partition, masters_of
from ..kernels import scatter_cast, zero_segment
from ..model.init import is_unloaded, mark_loaded
from ..model.names import KeyMap, match
from ..model.targets import ORPHAN, PARTITION, collect_targets, unwrap, zero_partition, zero_sibling
from ..progress import progress_for
from ..report import LoadReport, shortened
from .agree import open_agreed
from .execute import DEFAULT_STAGING_BYTES, execute
from .optimizer import OptimizerPlan, plan_optimizer, restore_optimizer
from .peers import fetch_remote
from .plan import LoadPlan, ReadItem, make_plan, staging_problems
from .slow_path import load_converted

logger = logging.getLogger("zload")


def _destinations(plan: LoadPlan) -> list[torch.Tensor | None]:
    """Flat tensors the executor writes into, one per target (None where nothing is loaded)."""
    dests: list[torch.Tensor | None] = [None] * len(plan.targets)
    for i, source in plan.sources.items():
        target = plan.targets[i]
        if target.kind == PARTITION:
            dests[i] = flat_partition(target.tensor)
        elif target.kind == ORPHAN:
            dests[i] = torch.empty(source.shape, dtype=target.dtype).view(-1)
        else:
            dests[i] = target.tensor.data.view(-1)
    return dests


def _finish_partitions(plan: LoadPlan, dests) -> None:
    """Zero every loaded partition's padding (uninitialised memory) in one batched kernel call,
    drop stale hpZ copies (rebuilt on the next partition) and clear ``zload.init`` marks."""
    padding = []
    for i in plan.sources:
        target = plan.targets[i]
        if target.kind == PARTITION:
            part = target.partition
            if part.size > part.valid:
                padding.append(zero_segment(i, part.valid, part.size - part.valid))
            drop_secondary(target.tensor)
            mark_loaded(target.tensor)
    scatter_cast(torch.empty(0, dtype=torch.uint8), padding, dests)


def _repair_orphans(module, plan: LoadPlan, dests) -> None:
    """Turn loaded orphans into ZeRO-3 parameters (a broadcast in the sibling's group)."""
    for i, source in sorted(plan.sources.items()):
        target = plan.targets[i]
        if target.kind != ORPHAN:
            continue
        param = target.tensor
        param.data = dests[i].view(source.shape)
        with collective():
            convert_like(zero_sibling(module, target.name), param)
        _zero_padding(param)


def _zero_padding(param) -> None:
    """DeepSpeed allocates partition padding uninitialised; make it zeros."""
    flat_partition(param)[zero_partition(param).valid:].zero_()


@dataclass(frozen=True)
class _LoadPlanner:
    """``load_into``'s ``Planner``: the model's targets matched to the checkpoint's tensors, and
    what stands in the way of loading them."""

    module: torch.nn.Module
    live_engine: bool
    strict: bool
    key_map: KeyMap | None
    staging_bytes: int
    resumed: object = None  # the engine whose optimizer a resume restores (optimizer=True)
    # every optimizer plan made (``open_agreed`` may plan twice): their files are closed by ``close``
    optimizer_plans: list[OptimizerPlan] = field(default_factory=list)

    def plan(self, shared: SharedIndex) -> LoadPlan:
        index = shared.index
        targets = collect_targets(self.module, self.live_engine)
        matching = match(index, targets, self.module, self.key_map, shared.quantization)
        plan = make_plan(index, targets, strict=self.strict, matching=matching)
        plan.problems += staging_problems(plan, self.staging_bytes)
        lacked = sorted(n for n, e in index.tensors.items() if e.dtype in FP8 and set(e.files) & shared.remote_files)
        if lacked:  # first: it is why they are refused, whatever else this rank finds
            plan.problems.insert(0, f"FP8 weights in files this rank lacks cannot be sent to it yet: "
                                    f"{shortened(lacked, 5)}; put the checkpoint where every node sees it")
        if self.resumed is not None:
            plan.optimizer = OptimizerPlan(engine=self.resumed)
            self.optimizer_plans.append(plan.optimizer)
            plan_optimizer(plan.optimizer, targets, index)
            plan.problems += plan.optimizer.problems
            restored = {i for i, t in enumerate(targets) if id(t.tensor) in plan.optimizer.from_masters}
            plan.items = [item for item in plan.items if item.target not in restored]  # read as masters
        left = [t.name for i, t in enumerate(targets) if i not in plan.sources and is_unloaded(t.tensor)]
        if self.strict and left:
            plan.problems.append(f"{len(left)} parameters built by zload.init (no trained values until "
                                 f"loaded) would stay unwritten (strict=True): {shortened(left, 20)}")
        return plan

    def close(self) -> None:
        """Close the optimizer files the plans opened, whether the load went ahead or not."""
        for plan in self.optimizer_plans:
            plan.close()


@dataclass(frozen=True)
class Moved:
    """The bytes a load moved on this rank."""

    read: int = 0  # from files here, for this rank or for the ranks it served
    sent: int = 0  # to ranks that lack a file
    received: int = 0  # from ranks that hold the files this rank lacks

    def __add__(self, other: Moved) -> Moved:
        return Moved(self.read + other.read, self.sent + other.sent, self.received + other.received)


class ByteSource(Protocol):
    """One way a load's bytes reach the model. Every rank delivers every source in the same order,
    inside the source's ``stage`` (what the error of a peer lost meanwhile names); a source makes
    the same collectives on every rank and agrees on its own problems, so a failure on any rank
    raises the same error on all."""

    @property
    def stage(self) -> str: ...

    def deliver(self, dests: list[torch.Tensor | None]) -> Moved:
        """Write this source's bytes into ``dests`` (flat, one per target); what it moved here."""


def _failed(source: str) -> str:
    return f"loading {source} failed part-way; the model is partly written"


@dataclass(frozen=True)
class _LocalFiles:
    """The checkpoint's files this rank reads itself, under the progress bar."""

    source: str
    files: FileTable
    items: list[ReadItem]
    staging_bytes: int
    progress: bool | None

    @property
    def stage(self) -> str:
        return f"reading {self.source}"

    def deliver(self, dests: list[torch.Tensor | None]) -> Moved:
        rank = rank_and_world()[0]
        with progress_for(sum(i.nbytes for i in self.items), rank=rank, enabled=self.progress) as bar:
            read, problems = problems_of("reading", lambda: execute(self.files, self.items, dests,
                                                                     self.staging_bytes, bar))
        agree(problems, _failed(self.source))
        return Moved(read=read)


@dataclass(frozen=True)
class _Peers:
    """The byte ranges of the files this rank lacks, sent by ranks that hold them, while it serves
    the ranges it holds to the ranks that lack them."""

    source: str
    shared: SharedIndex
    items: list[ReadItem]
    staging_bytes: int

    @property
    def stage(self) -> str:
        return f"sending and receiving the parts of {self.source} some ranks lack"

    def deliver(self, dests: list[torch.Tensor | None]) -> Moved:
        served, sent, received, problems = fetch_remote(self.shared, self.items, dests, self.staging_bytes)
        agree(problems, _failed(self.source))
        return Moved(served, sent, received)


@dataclass(frozen=True)
class _Converted:
    """The slow path: each converted target built on one rank and sent to those that need it (one
    agreement per conversion)."""

    source: str
    plan: LoadPlan
    shared: SharedIndex

    @property
    def stage(self) -> str:
        return f"converting the tensors of {self.source} that one rank builds"

    def deliver(self, dests: list[torch.Tensor | None]) -> Moved:
        return Moved(read=load_converted(self.plan, dests, self.shared))


@dataclass(frozen=True)
class _Optimizer:
    """A resume's optimizer state, after the weights: each flat partition's masters and states
    (``loading.optimizer``)."""

    source: str
    plan: OptimizerPlan
    files: FileTable
    staging_bytes: int

    @property
    def stage(self) -> str:
        return f"restoring the optimizer state of {self.source}"

    def deliver(self, dests: list[torch.Tensor | None]) -> Moved:
        return Moved(read=restore_optimizer(self.plan, self.files, self.staging_bytes, self.source))


def _byte_sources(plan: LoadPlan, shared: SharedIndex, source: str, staging_bytes: int,
                  progress: bool | None) -> list[ByteSource]:
    """Where the load's bytes come from, in the order every rank delivers them."""
    local = [i for i in plan.items if i.file not in shared.remote_files]
    sources: list[ByteSource] = [_LocalFiles(source, shared.index.opened, local, staging_bytes, progress)]
    if shared.sharing:  # the same on every rank
        remote = [i for i in plan.items if i.file in shared.remote_files]
        sources.append(_Peers(source, shared, remote, staging_bytes))
    sources.append(_Converted(source, plan, shared))
    if plan.optimizer is not None:
        sources.append(_Optimizer(source, plan.optimizer, shared.index.opened, staging_bytes))
    return sources


_UNCHANGED = "The model was not changed."
_PARTLY = "The model is partly written: load it again before using it."


@collector_paused()
def load_into(model, path: str | os.PathLike, *, strict: bool = True, key_map: KeyMap | None = None,
              revision: str | None = None, progress: bool | None = None,
              staging_bytes: int = DEFAULT_STAGING_BYTES, verify: str = "sample",
              optimizer: bool = False, _initialises_missing: bool = False) -> LoadReport:
    """Load a safetensors checkpoint into ``model`` in place, each rank reading only its bytes.

    ``model`` is an ``nn.Module`` (built under ``deepspeed.zero.Init`` or not), a
    ``DeepSpeedEngine``, or an engine's module (``engine.module``, a Trainer's ``trainer.model``):
    the engine's fp32 master weights are refreshed from what is loaded either way. ``path`` is a
    ``.safetensors`` file, an index ``.json``, or a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` with its shards, or a Hub repo id (at ``revision``),
    downloaded once per node into the Hugging Face cache; or a DeepSpeed checkpoint (the folder
    ``engine.save_checkpoint`` wrote, or its ``global_stepN``), saved at any world size, whose fp32
    master weights are read from the saved partitions.
    With ``strict`` model tensors missing from the checkpoint are an error; checkpoint tensors the
    model lacks are only reported. ``key_map`` renames checkpoint tensors before matching: a dict
    of regex -> replacement applied in order, or a callable (returning None drops a tensor).
    Names are also matched through transformers' conversion mapping (for a ``PreTrainedModel``),
    PEFT adapter names (for a ``PeftModel``) and one added or removed leading module prefix.
    ``progress``: a progress bar on rank 0 for loads longer than a second (None: only on a
    terminal), unless huggingface_hub's progress bars are disabled. ``verify``: how ranks make
    sure they read the same bytes: "sample" compares the headers and a sample of each file's data
    across ranks; "full" digests every byte, once per node, and checks files ``zload.save`` wrote
    against the digest it recorded. Must be called by every rank, with the same arguments (but
    ``progress``, and ``path`` where nodes hold their own copies) and models built the same way;
    otherwise every rank raises ``ArgumentValueError`` or ``PlanError``. Raises ``ZloadError`` (the
    same on every rank) and leaves the model untouched when the checkpoint does not fit the model.
    ``optimizer=True`` (``model`` a ``DeepSpeedEngine`` with a ZeRO-1/2/3 optimizer) resumes training:
    from a DeepSpeed checkpoint saved at any world size, or a folder ``zload.save(engine, path,
    optimizer=True)`` wrote, it also restores each parameter group's fp32 masters, optimizer states
    (Adam's ``exp_avg``, ``exp_avg_sq``), step count and hyperparameters, the loss scaler, the
    engine's step counters and its LR scheduler, and sets the 16-bit weights from the masters;
    parameter groups that differ from the checkpoint's are a ``PlanError``, before anything is written.
    A folder holding both safetensors weights without zload's optimizer files and a DeepSpeed
    checkpoint (an HF Trainer's ``checkpoint-N``) resumes from the DeepSpeed checkpoint.
    (``_initialises_missing``: the caller, ``from_pretrained``, initialises what is missing and
    warns about it; this call does not.)
    """
    started = time.perf_counter()
    rank, world = rank_and_world()
    module, engine, masters, path, verify, arguments = _call(model, path, strict, key_map, revision, staging_bytes,
                                                             verify, optimizer)
    if optimizer is True and isinstance(path, str):
        path = _resume_source(path)
    planner = _LoadPlanner(module, masters is not None, strict, key_map, staging_bytes,
                           engine if optimizer is True else None)
    try:
        with stage(f"indexing and planning the load of {path}", _UNCHANGED):
            source, shared, plan = open_agreed(path, revision, verify, arguments, planner)
        with shared.index:
            moved = _execute(plan, shared, masters, module, source, staging_bytes, progress)
    finally:
        planner.close()

    report = LoadReport(source=source, rank=rank, world_size=world, loaded=plan.loaded, missing=plan.missing,
                        unexpected=plan.unexpected, conversions=plan.conversions, repaired_orphans=plan.orphans,
                        slow_path=[plan.targets[i].name for i in plan.slow], bytes_read=moved.read,
                        bytes_sent=moved.sent, bytes_received=moved.received,
                        checkpoint_bytes=plan.checkpoint_bytes, seconds=time.perf_counter() - started)
    if _initialises_missing:
        _warn(replace(report, missing=[]), [])
    else:
        _warn(report, [t.name for t in plan.targets if is_unloaded(t.tensor)])
    if speaks_for_all():
        logger.info("%s", report)
    return report


def _resume_source(path):
    """Where a resume reads from: the DeepSpeed checkpoint in the folder ``path`` where zload saved
    no optimizer state there (an HF Trainer's ``checkpoint-N`` holds safetensors weights beside
    ``engine.save_checkpoint``'s files, which hold the optimizer), else ``path``. Raises nothing:
    what cannot be read is named by the load, on every rank."""
    try:
        if not os.path.isdir(path) or os.path.lexists(os.path.join(path, OPTIMIZER_INDEX)):
            return path
        return native_folder(path) or path
    except (OSError, ValueError, ZloadError):
        return path


def _call(model, path, strict, key_map, revision, staging_bytes, verify, optimizer) -> tuple:
    """(module, engine or None, its ``Masters`` or None, path, ``Verify``, ``Arguments``) of a
    ``load_into`` call. The ranks compare every argument but ``progress`` (a bar on rank 0 alone) and where
    ``path`` leads (node-local copies may lie at different paths; their views are compared
    instead): the model and a callable ``key_map`` by kind (what the model makes of the call is
    compared as the plans' collectives), a mode by its string. An invalid argument is not raised here but once the ranks
    know they all passed it."""
    module = engine = masters = invalid = None
    try:
        module, engine = unwrap(model, "zload.load_into")
        masters = masters_of(module, engine)
        if engine is None and masters is not None and (groups := masters.misplaced_groups()):
            raise ArgumentTypeError(f"zload.load_into: DeepSpeed links this module's weights to other fp32 masters "
                                    f"than their own (parameter groups {groups}: ZeRO-1/2 with "
                                    "round_robin_gradients), so loading into the module alone would leave the "
                                    "masters wrong; pass the engine (a Trainer's trainer.model_wrapped), whose "
                                    "masters zload refreshes from its flat buffers")
    except ArgumentTypeError as e:
        invalid = e
    try:
        path = os.fspath(path)
    except TypeError:
        invalid = invalid or ArgumentTypeError(f"zload.load_into expects a path (str or os.PathLike), got "
                                               f"{type(path).__name__}")
    try:
        verify = Verify.of(verify, "verify")
    except ArgumentValueError as e:
        invalid = invalid or e
    if not isinstance(optimizer, bool):
        invalid = invalid or ArgumentTypeError(f"zload.load_into: optimizer must be True or False, got "
                                               f"{type(optimizer).__name__}")
    elif optimizer and module is not None and engine is None:
        invalid = invalid or ArgumentTypeError("zload.load_into(optimizer=True) restores a DeepSpeedEngine's "
                                               "optimizer: pass the engine, not its module")

    def kind(value) -> str:
        return f"a {type(value).__name__}"

    def plain(value):  # what any rank can repr and send, and another compare
        if isinstance(value, Enum):
            return value.value
        return value if value is None or isinstance(value, (bool, int, float, str)) else kind(value)

    model_kind = "a DeepSpeedEngine" if engine is not None else "an nn.Module" if module is not None else kind(model)
    key_map_kind = "a callable" if callable(key_map) else {plain(k): plain(v) for k, v in key_map.items()} \
        if isinstance(key_map, Mapping) else plain(key_map)
    values = {"model": model_kind, "path": kind(path), "strict": plain(strict), "key_map": key_map_kind,
              "revision": plain(revision), "staging_bytes": plain(staging_bytes), "verify": plain(verify),
              "optimizer": plain(optimizer)}
    return module, engine, masters, path, verify, Arguments("load_into", values, invalid)


def _execute(plan: LoadPlan, shared: SharedIndex, masters: Masters | None, module, source: str,
             staging_bytes: int, progress: bool | None) -> Moved:
    """Everything that writes into the model; what it moved on this rank."""
    dests = _destinations(plan)
    moved = Moved()
    with engine_writes(masters, plan.optimizer.engine if plan.optimizer is not None else None):
        for byte_source in _byte_sources(plan, shared, source, staging_bytes, progress):
            with stage(byte_source.stage, _PARTLY):
                moved += byte_source.deliver(dests)
        with stage(f"finishing the tensors of {source}", _PARTLY):
            _finish_partitions(plan, dests)
            _repair_orphans(module, plan, dests)
    return moved


def _warn(report: LoadReport, never_loaded: list[str]) -> None:
    """Warnings about the model and the checkpoint, the same on every rank (rank 0 tells them),
    pointing at the caller's ``load_into`` line: _warn, load_into, the collector_paused wrapper,
    the caller (stacklevel 4)."""
    if never_loaded:
        warn_for_all(f"{len(never_loaded)} parameters built by zload.init were never loaded: they hold zeros "
                     f"or their constructor's values, not weights: {shortened(never_loaded, 20)}", stacklevel=4)
    if report.unexpected:
        warn_for_all(f"{len(report.unexpected)} checkpoint tensors are not in the model and were skipped: "
                     f"{shortened(report.unexpected, 20)}", stacklevel=4)
    if report.missing:
        warn_for_all(f"{len(report.missing)} model tensors are not in the checkpoint and were left as they "
                     f"were: {shortened(report.missing, 20)}", stacklevel=4)
    if report.repaired_orphans:
        warn_for_all(f"{shortened(report.repaired_orphans, 20)}: plain [0]-shaped parameters (re-created after "
                     "zero.Init); loaded and converted to ZeRO-3 parameters", stacklevel=4)
