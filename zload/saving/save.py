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
from dataclasses import replace
from functools import partial

import torch

from ..collector import collector_paused
from ..distributed import agree, exchange, problems_of, rank_and_world, stage
from ..errors import ArgumentTypeError, ArgumentValueError, ZloadWarning
from ..loading.execute import DEFAULT_STAGING_BYTES
from ..model.targets import collect_targets, unwrap
from ..report import SaveReport, brief
from . import plan as save_plan
from . import writer
from .folder import LOCK, STAGING_PREFIX, SaveFolder


@collector_paused()
def save(model, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
         dtype: torch.dtype | str | None = None, master_weights: bool = False,
         shared_filesystem: bool | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
         buffer_bytes: int | None = None) -> SaveReport:
    """Write ``model`` (an nn.Module, ZeRO-3 or not, or a DeepSpeedEngine) to the folder ``path``.

    Layout as transformers writes it: ``model.safetensors``, or shards of at most
    ``max_shard_size`` with ``model.safetensors.index.json``; names in the form transformers
    expects for a ``PreTrainedModel`` (its config is saved too). A ``PeftModel`` saves its active
    adapter alone, as peft does (``adapter_model.safetensors`` + ``adapter_config.json``).
    Every parameter (trainable or frozen) and persistent buffer is written at full shape, tied
    weights once. No rank gathers anything: each writes its own partitions, in pieces of at most
    ``staging_bytes``. ``dtype`` (or its name) converts on the way; ``master_weights`` writes a live engine's fp32
    master weights of trainable parameters. ``shared_filesystem=None`` detects whether all ranks
    see the same folder; if not, ranks stream their slices to rank 0. Must be called by every rank.
    Only zload's own files in ``path`` are written or removed (see ``zload.savedir``); a checkpoint
    already there is replaced only once every rank has succeeded, in one rename; a write that fails
    (a full disk, a spent quota) raises a ``WriteError`` naming the file on every rank.
    ``buffer_bytes`` is the former name of ``staging_bytes`` (as ``load_into`` calls it).
    """
    if buffer_bytes is not None:
        warnings.warn("zload.save(buffer_bytes=...) is now staging_bytes=..., as in load_into; "
                      "buffer_bytes will be removed", FutureWarning, stacklevel=3)
        staging_bytes = buffer_bytes
    started = time.perf_counter()
    rank, world = rank_and_world()
    module, engine = unwrap(model)
    final = os.path.abspath(os.fspath(path))

    def plan_save():
        if master_weights and engine is None:
            raise ArgumentTypeError("master_weights=True needs the DeepSpeedEngine, not its module")
        return save_plan.make_save_plan(module, collect_targets(module, live_engine=True),
                                        torch.float32 if master_weights and dtype is None else _dtype(dtype),
                                        max_shard_size, rank, world)

    def write(plan, staging: str, shared: bool, failed: str) -> tuple[int, list[str]]:
        sources, problems = problems_of("finding the partitions to write",
                                        lambda: writer.partition_sources(plan.targets, master_weights))
        if not shared:
            written, problems = writer.stream_to_rank0(plan.items, sources, staging, staging_bytes, problems)
        elif not problems:
            written, problems = problems_of(
                "writing", lambda: writer.write_local(plan.items, sources, staging, staging_bytes))
        agree(problems, failed)
        converted_bytes, gathered = writer.write_converted(module, plan.targets, plan.files, staging, shared,
                                                           master_weights, failed)
        return written + converted_bytes, gathered

    plan, (written, gathered), notes = write_checkpoint(
        final, plan_save, write, lambda plan, folder: writer.write_model_configs(module, folder), shared_filesystem)
    files = plan.files
    for note in notes:  # point at the caller's save() line
        warnings.warn(note, ZloadWarning, stacklevel=3)
    return SaveReport(final, [f.name for f in files], sum(f.size for f in files), written, gathered,
                      time.perf_counter() - started)


def _dtype(dtype) -> torch.dtype | None:
    """``save``'s ``dtype``, a ``torch.dtype`` or its name (``"bfloat16"``), as a ``torch.dtype``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(resolved, torch.dtype):
        raise ArgumentValueError(f"dtype={brief(dtype)}: expected a torch.dtype, such as torch.bfloat16")
    return resolved


def write_checkpoint(final: str, make_plan, write, write_configs, shared_filesystem: bool | None):
    """Write a checkpoint into the folder ``final`` as every save does, on every rank; returns the
    plan, what ``write`` returned and the notes to warn about.

    ``make_plan()`` says what to write (its ``files``, and ``single``, the name of a one-file
    checkpoint); rank 0 creates the files in a staging folder; ``write(plan, staging, shared,
    failed)`` writes this rank's bytes there (``shared``: whether every rank sees the staging
    folder; it agrees on its own problems, raising ``failed``); the files' digests are recorded;
    rank 0 commits them with the configs that ``write_configs(plan, folder)`` writes. A problem on
    any rank at any step raises the same error on every rank, and ``final`` keeps what it held.
    """
    rank, world = rank_and_world()
    refused = f"zload: cannot save to {final}; nothing was written"
    with stage(f"planning the save to {final}", "Nothing was written."):
        plan, problems = problems_of("planning the save", make_plan)
        agree(problems, refused)
        token = exchange(secrets.token_hex(8) if rank == 0 else None)[0]
    files = plan.files
    folder = SaveFolder(final, token) if rank == 0 else None
    staging = os.path.join(final, STAGING_PREFIX + token)
    as_it_was = f"{final} still holds what it held before"
    failed = f"zload: saving to {final} failed; {as_it_was} (rank 0 removes the partial files)"
    try:
        with stage(f"saving to {final}", f"{as_it_was}; the partial files in {staging} are "
                   f"removed by rank 0, or by the next save into {final} if rank 0 is gone."):
            _, problems = problems_of("creating the files",
                                      lambda: rank == 0 and (folder.begin(), writer.create_files(files, staging)))
            agree(problems, refused)
            shared = all(exchange(writer.sees(os.path.join(staging, LOCK), token))) \
                if shared_filesystem is None else shared_filesystem
            result = write(plan, staging, shared, failed)
            writer.record_digests(files, staging, world if shared else 1, failed)
        with stage(f"putting the new files in place in {final}", "Rank 0 does that alone: "
                   f"depending on how far it got, {final} holds the old or the new checkpoint, never "
                   "a mix of both; the next save into it removes what is left over."):
            _, problems = problems_of("publishing", lambda: rank == 0 and writer.publish(
                folder, plan.single, files, partial(write_configs, plan)))
            if problems:  # rank 0's: say what the folder holds now
                outcome = folder.abort()
                problems = [replace(p, message=f"{p.message} ({outcome})") for p in problems]
            agree(problems, f"zload: saving to {final} failed while putting the new files in place")
    except BaseException:
        if rank == 0:
            folder.abort()
        raise
    return plan, result, folder.notes if folder else []
