"""``save``: write a (ZeRO-3) model as Hugging Face-style safetensors, without gathering it.

Every rank computes the same file layout (names, shapes, dtypes, offsets) from metadata it already
has (``save_plan``); then each rank writes the elements of its own partitions straight to their
offsets in the shared files (``writer``). The files are written into a staging folder inside
``path``, read back for their digests, and put in place by rank 0 only once every rank has finished
(``savedir``), so a failed or killed save leaves the checkpoint in ``path`` as it was, and nothing
else there is touched.
"""

from __future__ import annotations

import os
import secrets
import time
import warnings
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import torch

from ..checkpoint.files import absolute_path
from ..collector import collector_paused
from ..distributed import (
    agree,
    agree_arguments,
    exchange,
    problems_of,
    raise_for,
    rank_and_world,
    stage,
    warn_for_all,
)
from ..errors import ArgumentTypeError, ArgumentValueError, ZloadWarning
from ..integrations.deepspeed import Masters, masters_of
from ..loading.execute import DEFAULT_STAGING_BYTES
from ..model.targets import collect_targets, unwrap
from ..progress import progress_for
from ..report import SaveReport, brief
from . import plan as save_plan
from . import writer
from .folder import LOCK, STAGING_PREFIX, SaveFolder
from .optimizer import with_optimizer


@collector_paused()
def save(model, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
         dtype: torch.dtype | str | None = None, master_weights: bool = False,
         shared_filesystem: bool | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
         progress: bool | None = None, buffer_bytes: int | None = None, optimizer: bool = False) -> SaveReport:
    """Write ``model`` (an nn.Module, ZeRO-3 or not, or a DeepSpeedEngine) to the folder ``path``.

    Layout as transformers writes it: ``model.safetensors``, or shards of at most
    ``max_shard_size`` with ``model.safetensors.index.json``; names in the form transformers
    expects for a ``PreTrainedModel`` (its config is saved too). A ``PeftModel`` saves its active
    adapter alone, as peft does (``adapter_model.safetensors`` + ``adapter_config.json``).
    Every parameter (trainable or frozen) and persistent buffer is written at full shape, tied
    weights once. No rank gathers anything: each writes its own partitions, in pieces of at most
    ``staging_bytes``. ``dtype`` (a ``torch.dtype`` or its name) converts on the way;
    ``master_weights`` writes the fp32 master weights a ZeRO-3 engine keeps of trainable parameters
    (``model`` being the engine or its module).
    ``shared_filesystem=None`` detects whether all ranks see the same folder; if not, ranks stream
    their slices to rank 0. Must be called by every rank.
    Only zload's own files in ``path`` are written or removed (see ``zload.savedir``); a checkpoint
    already there is replaced only once every rank has succeeded, in one rename; a write that fails
    (a full disk, a spent quota) raises a ``WriteError`` naming the file on every rank.
    ``progress``: a bar on rank 0 counting the bytes it writes, as ``load_into``'s counts those it
    reads (None: only on a terminal).
    ``buffer_bytes`` is the former name of ``staging_bytes`` (as ``load_into`` calls it).
    ``optimizer=True`` (``model`` a ``DeepSpeedEngine`` with a ZeRO-1/2/3 optimizer) also writes the
    optimizer state beside the weights, each rank its own partitions (docs/optimizer-format.md):
    ``load_into(engine, path, optimizer=True)`` resumes from it at any world size. A save without it
    removes the optimizer state an earlier save left in ``path``.
    """
    if buffer_bytes is not None:
        warn_for_all("zload.save(buffer_bytes=...) is now staging_bytes=..., as in load_into; buffer_bytes "
                     "will be removed", stacklevel=3, category=FutureWarning)
        staging_bytes = buffer_bytes
    started = time.perf_counter()
    module = engine = invalid = None
    try:
        module, engine = unwrap(model, "zload.save")
    except ArgumentTypeError as e:
        invalid = e
    try:
        final = absolute_path(path)
    except TypeError:
        final = f"<a {type(path).__name__}>"
        invalid = invalid or ArgumentTypeError(f"zload.save expects a path (str or os.PathLike), got "
                                               f"{type(path).__name__}")
    # every argument but ``progress`` (a bar on rank 0 alone) and ``path`` (without a shared
    # filesystem rank 0's alone is written, and each node may name its local disk otherwise), the
    # model by its kind: before anything else, so that no rank plans, let alone writes, another
    # save than the others
    values = {"model": f"a {type(model).__name__}", "max_shard_size": max_shard_size,
              "dtype": dtype, "master_weights": master_weights, "shared_filesystem": shared_filesystem,
              "staging_bytes": staging_bytes, "optimizer": optimizer}
    agree_arguments("save", values, invalid, f"cannot save to {final}; nothing was written")
    sink = _ModelSink(module, masters_of(module, engine), dtype, master_weights, max_shard_size, staging_bytes,
                      progress)
    if optimizer is not False:
        sink = with_optimizer(sink, engine, optimizer, max_shard_size, staging_bytes)
    report, notes = write_checkpoint(final, sink, shared_filesystem, started)
    for note in notes:  # point at the caller's save() line
        warnings.warn(note, ZloadWarning, stacklevel=3)
    return report


class Sink(Protocol):
    """What one save writes, as ``write_checkpoint`` drives it on every rank. ``write_checkpoint``
    owns the folder (the staging folder, the agreements, the digests, the commit); a sink says what
    the checkpoint holds, writes this rank's bytes of it and the configs that go beside it."""

    def plan(self) -> save_plan.SavePlan:
        """The checkpoint's ``files``, ``single`` (the name of a one-file checkpoint) and what this
        rank writes; raises if the checkpoint cannot be written."""

    def write(self, plan: save_plan.SavePlan, staging: str, shared: bool, failed: str) -> tuple[int, list[str]]:
        """Write this rank's bytes into ``plan``'s files in the folder ``staging`` (``shared``:
        whether every rank sees it), agreeing on its own problems (raising ``failed``); returns
        (the bytes this rank wrote or sent, the tensors gathered to be written)."""

    def write_configs(self, plan: save_plan.SavePlan, folder: str) -> None:
        """Rank 0: write into ``folder`` the configs that go beside the weights."""


@dataclass(frozen=True)
class _ModelSink:
    """``save``'s sink: each rank's own partitions (and its share of the other tensors), written in
    place where every rank sees the folder, else streamed to rank 0; then the tensors whose
    transformers conversion is no byte layout, gathered and converted on one rank."""

    module: torch.nn.Module
    masters: Masters | None
    dtype: torch.dtype | str | None
    master_weights: bool
    max_shard_size: int | str
    staging_bytes: int
    progress: bool | None

    def plan(self) -> save_plan.SavePlan:
        if self.master_weights and self.masters is None:
            raise ArgumentTypeError("master_weights=True: no DeepSpeed optimizer keeps fp32 master weights of this "
                                    "model; pass the DeepSpeedEngine, or its module, after deepspeed.initialize")
        if self.master_weights and self.masters.fragments:
            raise ArgumentValueError("master_weights=True: zload saves the fp32 masters of ZeRO-3 only, and this "
                                     "engine's are ZeRO-1/2's; save its 16-bit weights (master_weights=False), or "
                                     "its engine.save_checkpoint folder with zload.convert")
        dtype = torch.float32 if self.master_weights and self.dtype is None else _dtype(self.dtype)
        return save_plan.make_save_plan(self.module, collect_targets(self.module, live_engine=True), dtype,
                                        self.max_shard_size, *rank_and_world())

    def write(self, plan: save_plan.SavePlan, staging: str, shared: bool, failed: str) -> tuple[int, list[str]]:
        sources, problems = problems_of("finding the partitions to write",
                                        lambda: writer.partition_sources(plan.targets, self.master_weights))
        total = writer.bytes_written_here(plan.items, plan.files, shared)
        with progress_for(total, rank=rank_and_world()[0], enabled=self.progress) as bar:
            written = writer.write_own(plan.items, sources, staging, shared, self.staging_bytes, problems, failed,
                                       bar)
            converted_bytes, gathered = writer.write_converted(self.module, plan.targets, plan.files, staging,
                                                               shared, self.master_weights, failed, bar)
        return written + converted_bytes, gathered

    def write_configs(self, plan: save_plan.SavePlan, folder: str) -> None:
        writer.write_model_configs(self.module, folder)


def _dtype(dtype) -> torch.dtype | None:
    """``save``'s ``dtype``, a ``torch.dtype`` or its name (``"bfloat16"``), as a ``torch.dtype``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(resolved, torch.dtype):
        raise ArgumentValueError(f"dtype={brief(dtype)}: expected a torch.dtype, such as torch.bfloat16")
    return resolved


def write_checkpoint(final: str, sink: Sink, shared_filesystem: bool | None,
                     started: float) -> tuple[SaveReport, list[str]]:
    """Write ``sink``'s checkpoint into the folder ``final`` as every save does, on every rank;
    returns this rank's report (its time counted from ``started``) and the notes to warn about.

    The sink plans what to write; rank 0 creates the files in a staging folder; each rank writes
    its bytes there (``shared``: whether every rank sees the staging folder, ``shared_filesystem``
    or, when None, found out); the files' digests are recorded; rank 0 commits them with the
    sink's configs. A problem on any rank at any step raises the same error on every rank, and
    ``final`` keeps what it held.
    """
    rank, world = rank_and_world()
    refused = f"cannot save to {final}; nothing was written"
    with stage(f"planning the save to {final}", "Nothing was written."):
        plan, problems = problems_of("planning the save", sink.plan)
        agree(problems, refused)
        token = exchange(secrets.token_hex(8) if rank == 0 else None)[0]
    files = plan.written
    folder = SaveFolder(final, token) if rank == 0 else None
    staging = os.path.join(final, STAGING_PREFIX + token)
    as_it_was = f"{final} still holds what it held before"
    failed = f"saving to {final} failed; {as_it_was} (rank 0 removes the partial files)"
    try:
        with stage(f"saving to {final}", f"{as_it_was}; the partial files in {staging} are "
                   f"removed by rank 0, or by the next save into {final} if rank 0 is gone."):
            _, problems = problems_of("creating the files",
                                      lambda: rank == 0 and (folder.begin(), writer.create_files(files, staging)))
            agree(problems, refused)
            shared = all(exchange(writer.sees(os.path.join(staging, LOCK), token))) \
                if shared_filesystem is None else shared_filesystem
            written, gathered = sink.write(plan, staging, shared, failed)
            writer.record_digests(files, staging, world if shared else 1, failed)
        with stage(f"putting the new files in place in {final}", "Rank 0 does that alone: "
                   f"depending on how far it got, {final} holds the old or the new checkpoint, never "
                   "a mix of both; the next save into it removes what is left over."):
            renamed, problems = problems_of("publishing", lambda: rank == 0 and writer.publish(
                folder, plan.single, plan.files, partial(sink.write_configs, plan), plan.beside))
            if problems:  # rank 0's: say what the folder holds now
                outcome = folder.abort()
                problems = [replace(p, message=f"{p.message} ({outcome})") for p in problems]
            # agreed with the names in the folder, in one exchange that leaves nothing to wait
            # for after the commit: a shard's standard name may be taken (by an earlier
            # checkpoint, a user's file), and then rank 0 tagged it with the save's token
            outcomes = exchange((problems, renamed if rank == 0 else None))
            raise_for([p for p, _ in outcomes], f"saving to {final} failed while putting the new files in place")
            renamed = outcomes[0][1]
    except BaseException:
        if rank == 0:
            folder.abort()
        raise
    report = SaveReport(path=final, files=[renamed.get(f.name, f.name) for f in files],
                        total_bytes=sum(f.size for f in files),
                        bytes_written=written, gathered=gathered, seconds=time.perf_counter() - started)
    return report, folder.notes if folder else []
