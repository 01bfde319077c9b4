"""``convert``: a DeepSpeed checkpoint (``engine.save_checkpoint``) into Hugging Face safetensors.

It writes what DeepSpeed's ``zero_to_fp32.py`` returns without ever holding a tensor whole, let
alone the model: the output is planned from the checkpoint's metadata (``native``: which pieces
of the saved ranks' flat fp32 partitions hold each tensor), laid out as ``save`` lays out its
files, and each tensor's elements are read from those pieces straight to their offset in the
shard, a staging batch at a time, cast on the way (``writer.write_from_files``). Memory stays at
the staging buffers and the index, whatever the size of the model or of a shard.

Run as N processes (torchrun), each writes an equal share of the output's bytes, cut at element
boundaries. Shares of bytes rather than whole shards keep every process equally busy when the
output is one file or a few shards of unequal size, and each share is independent byte ranges of
the same files, as each rank's partitions are in a ``save``. Everything after the plan is
``save``'s own (``saving.write_checkpoint``): the staging folder, the agreement on any problem of
any rank, the digests, and rank 0's commit.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass
from math import ceil, prod

from ..checkpoint.dtypes import TORCH_DTYPES
from ..checkpoint.files import FileTable, absolute_path, open_regular
from ..checkpoint.index import SINGLE_FILE, CheckpointIndex, TensorEntry, read_json
from ..checkpoint.native import LATEST, converted_tensors, native_folder, read_native
from ..checkpoint.views import LocalView, share_index, viewed
from ..collector import collector_paused
from ..distributed import Choice, agree, agree_arguments, problems_of, rank_and_world, stage
from ..errors import ArgumentTypeError, CheckpointError, CheckpointNotFoundError, ZloadWarning
from ..loading.execute import DEFAULT_STAGING_BYTES
from ..progress import progress_for
from ..report import SaveReport, brief
from . import plan as save_plan
from . import writer
from .folder import writing
from .plan import OutFile, OutTensor, WriteItem
from .save import write_checkpoint


class Weights(Choice):
    """Which weights ``convert`` writes."""

    MASTER = "master"  # the fp32 master weights, as zero_to_fp32 returns them
    MODULE = "module"  # the module's own, 16-bit when trained so


CONFIG = "config.json"  # copied from the folder holding the tag folder (an HF Trainer checkpoint-N/)
_HUB_REPO = re.compile(r"(models|datasets|spaces)--.+")  # a repository's folder in the Hub cache


@dataclass
class _Source:
    """The checkpoint as this rank read it: its view (files open), what to write from it (each
    tensor's entry and output dtype) and, on rank 0, the config to copy or why none is (a note to
    warn about)."""

    view: LocalView
    tensors: list[tuple[TensorEntry, str]]
    config: bytes | None
    notes: list[str]


def _inside(target: str, root: str) -> bool:
    """Whether ``target`` lies in the folder ``root`` (both resolved), or, where ``root`` is in a
    Hub cache snapshot (``models--org--name/snapshots/<revision>/``), in that repository's
    ``blobs``, where the snapshot's links lead."""
    parts = root.split(os.sep)
    places = [root] + [os.sep.join(parts[:k - 1] + ["blobs"]) for k in range(2, len(parts))
                       if parts[k - 1] == "snapshots" and _HUB_REPO.fullmatch(parts[k - 2])]
    return any(os.path.commonpath([target, place]) == place for place in places)


def _config(root: str) -> tuple[bytes | None, list[str]]:
    """The bytes of the ``config.json`` in ``root`` (the folder holding the tag folder) to copy
    beside the weights, or why it is not copied. The weights are whole without it, so one that is
    not plainly the model's is left out, with a warning, rather than fail the conversion: a link
    that leads out of ``root`` (to ``~/.cache/huggingface/token``, which would be published with
    the weights), a file that is not regular (a FIFO would block) or not JSON. What is copied is
    the bytes read and checked through the one descriptor."""
    path = os.path.join(root, CONFIG)
    if not os.path.lexists(path):
        return None, []
    target, skipped = os.path.realpath(path), f"{path} is not copied beside the weights"
    if not _inside(target, os.path.realpath(root)):
        return None, [f"{skipped}: it is a link to {brief(target)}, outside {root}, and no other file of this "
                      "machine (a token, a key) may end up there; copy the model's config.json there yourself"]
    try:
        with FileTable() as table:
            return read_json(table.add(open_regular(target), CONFIG))[1], []
    except CheckpointError as e:
        return None, [f"{skipped}: {e}; copy the model's config.json there yourself"]


def _read(source: str, weights: str, with_config: bool) -> _Source:
    module_weights = Weights.of(weights, "weights") == Weights.MODULE
    folder = native_folder(source)
    if folder is None:
        where = "no such folder" if not os.path.lexists(source) else "not a folder" if not os.path.isdir(source) \
            else f"holds neither '{LATEST}' nor *_model_states.pt"
        raise CheckpointNotFoundError(f"{source}: {where}; expected a DeepSpeed checkpoint: the folder "
                                      "engine.save_checkpoint wrote, or one of its tag folders (global_stepN)",
                                      path=source)
    table = FileTable()
    try:
        layout, entries = read_native(folder, table, module_weights=module_weights)
        config = _config(os.path.dirname(absolute_path(folder))) if with_config else (None, [])
        index = CheckpointIndex(source, tuple(table.files), entries, opened=table, root=absolute_path(folder))
    except BaseException:
        table.close()
        raise
    return _Source(viewed(source, index), converted_tensors(layout, entries, module_weights), *config)


def _read_agreed(source: str, weights: str, with_config: bool) -> _Source:
    """The checkpoint read on every rank, which must all see the same whole one; raises the same
    error on every rank if any cannot."""
    refused = f"cannot convert {source}; nothing was written"
    read, problems = problems_of(f"reading {source}", lambda: _read(source, weights, with_config))
    view = read.view if read else LocalView(source, None, problems=problems)
    try:
        agreed = share_index(view, refused)
        view.forget_sampled()
        if agreed is None or agreed.sharing:  # the same on every rank
            raise CheckpointNotFoundError(f"{refused}: {source} is not on every rank; every process of a "
                                          "conversion reads the whole checkpoint", path=source)
    except BaseException:
        view.close()
        raise
    return read


def byte_share(files: list[OutFile], rank: int, world: int) -> list[WriteItem]:
    """This rank's part of the files' tensor bytes: the ``rank``-th of ``world`` equal slices of
    all of them, in file order, each element to the slice holding its first byte. Targets are
    the tensors' (``OutTensor.pieces``)."""
    total = sum(t.nbytes for f in files for t, _ in f.tensors)
    low, high, at, items = total * rank // world, total * (rank + 1) // world, 0, []
    for f in files:
        for tensor, position in f.tensors:
            size, numel = tensor.dtype.itemsize, prod(tensor.shape)
            first, last = (min(numel, max(0, ceil((bound - at) / size))) for bound in (low, high))
            if first < last:
                items.append(WriteItem(f.name, position + first * size, tensor.pieces[0][0], first,
                                       last - first, tensor.dtype))
            at += tensor.nbytes
    return items


def _plan(tensors: list[tuple[TensorEntry, str]], max_shard_size: int | str) -> save_plan.SavePlan:
    """The files, as ``save`` lays them out; each tensor whole from its entry (target ``i``)."""
    out = [OutTensor(entry.name, TORCH_DTYPES[dtype], entry.shape, ((i, 0, 0, entry.numel),))
           for i, (entry, dtype) in enumerate(tensors)]
    return save_plan.SavePlan([], save_plan.layout(out, save_plan.parse_size(max_shard_size)), SINGLE_FILE, [])


@dataclass(frozen=True)
class _ConvertSink:
    """``convert``'s sink: each rank's equal share of the output's bytes (rank 0 all of them where
    the ranks do not share the folder), read from the DeepSpeed checkpoint's files; the config
    beside its tag folder copied."""

    read: _Source
    max_shard_size: int | str
    staging_bytes: int
    progress: bool | None

    def plan(self) -> save_plan.SavePlan:
        return _plan(self.read.tensors, self.max_shard_size)

    def write(self, plan: save_plan.SavePlan, staging: str, shared: bool, failed: str) -> tuple[int, list[str]]:
        rank, world = rank_and_world()
        writers = world if shared else 1
        items = byte_share(plan.files, rank, writers) if rank < writers else []
        entries = [entry for entry, _ in self.read.tensors]
        with progress_for(sum(i.numel * entries[i.target].itemsize for i in items), rank=rank,
                          enabled=self.progress) as bar:
            written, problems = problems_of("writing", lambda: writer.write_from_files(
                items, entries, self.read.view.index.opened, staging, self.staging_bytes, bar))
        agree(problems, failed)
        return written, []

    def write_configs(self, plan: save_plan.SavePlan, folder: str) -> None:
        if self.read.config is not None:
            with writing(os.path.join(folder, CONFIG)), open(os.path.join(folder, CONFIG), "wb") as copy:
                copy.write(self.read.config)


@collector_paused()
def convert(checkpoint: str | os.PathLike, out: str | os.PathLike, *, weights: str = "master",
            max_shard_size: int | str = "5GB", progress: bool | None = None,
            staging_bytes: int = DEFAULT_STAGING_BYTES) -> SaveReport:
    """Write the DeepSpeed checkpoint ``checkpoint`` (the folder ``engine.save_checkpoint`` wrote,
    or a tag folder in it; ZeRO-1, 2 or 3, any world size) into the folder ``out`` as Hugging
    Face safetensors, laid out and committed as ``zload.save`` writes.

    ``weights="master"``: what DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` returns
    (trainable parameters as fp32 masters, frozen ones as stored, floating buffers as float32);
    ``"module"``: every tensor in the module's dtype, the engine's own 16-bit weights. Tied
    weights once, under the name DeepSpeed stored. The ``config.json`` beside the tag folder (an
    HF Trainer's ``checkpoint-N/``) is copied, unless it leads out of that folder (a link), is no
    regular file or is not JSON: then it is left out with a ``ZloadWarning``. Streamed in pieces
    of at most ``staging_bytes`` in all, whatever the model's size. Under torch.distributed every
    rank must call it and each writes a share (rank 0 all of it when the ranks do not share
    ``out``'s filesystem); a problem on any rank raises the same error on every rank, leaving
    ``out`` as it was (a ``WriteError`` where writing failed: a full disk, a spent quota).
    ``progress``: a bar on rank 0 (None: only on a terminal).
    """
    started = time.perf_counter()
    invalid = None
    try:
        source, final = os.fspath(checkpoint), absolute_path(out)
    except TypeError as e:
        source = final = "<not a path>"
        invalid = ArgumentTypeError(f"zload.convert expects paths (str or os.PathLike): {e}")
    # every argument but ``progress`` and the paths (each node may name its disk otherwise)
    agree_arguments("convert", {"weights": weights, "max_shard_size": max_shard_size, "staging_bytes": staging_bytes},
                    invalid, f"cannot convert {source}; nothing was written")
    rank = rank_and_world()[0]
    with stage(f"reading {source}", "Nothing was written."):
        read = _read_agreed(source, weights, with_config=rank == 0)  # rank 0 publishes the configs
    sink = _ConvertSink(read, max_shard_size, staging_bytes, progress)
    try:
        report, notes = write_checkpoint(final, sink, None, started)
    finally:
        read.view.close()
    for note in read.notes + notes:  # point at the caller's convert() line
        warnings.warn(note, ZloadWarning, stacklevel=3)
    return report
