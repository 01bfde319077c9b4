"""The ``zload`` command: look at a checkpoint before a job spends GPU hours loading it.

    zload inspect PATH [--json] [--limit N | --all | --no-tensors]
    zload plan PATH (--world-size N | -n N) [--json]
    zload validate PATH [--full]
    zload convert DS_CHECKPOINT OUT [--module-weights] [--max-shard-size SIZE] [--single-process]

PATH is what ``load_into`` takes: a file, an index, a folder, or a Hub repo id (``--revision``),
found the same way (``checkpoint.open_source``). Every command validates the checkpoint exactly as
``load_into`` does (every header is read and checked, no tensor data); on a Hub repo id, the
commands that read no tensor data fetch only the headers (HTTP range requests), never the weights.
A bad checkpoint prints ``zload: error: ...`` with the file and tensor at fault and exits 2,
without a traceback; ``validate`` exits 1 instead, so a CI script can tell "invalid checkpoint"
from "bad command line". Each command builds one plain dict, which ``--json`` prints as is and the
text output renders, so the two cannot disagree. ``convert`` writes a DeepSpeed checkpoint as
safetensors (``zload.convert``); launched by torchrun (``torchrun --nproc_per_node N -m zload
convert ...``), its processes join one gloo group and each writes a share (``_join``).

torch and the checkpoint modules are imported inside the commands: ``--version`` and ``--help``
answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections import Counter
from typing import TYPE_CHECKING

from . import __version__
from .checkpoint.partition import Partition
from .errors import InvalidCheckpointError, PeerLostError, ZloadError
from .report import plural, shortened

if TYPE_CHECKING:
    from .checkpoint.index import CheckpointIndex

DEFAULT_LIMIT = 50
_BYTE_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))


def human_bytes(nbytes: float) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units, as disk and download tools count); whole bytes
    below 1 KB."""
    for scale, label in _BYTE_UNITS:
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {label}"
    return f"{int(nbytes)} B"


def _natural(name: str) -> list:
    """Sort key that puts ``layers.2`` before ``layers.10``, as a reader expects."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def inspect_summary(index: CheckpointIndex) -> dict:
    """Files, totals, dtype histogram and every tensor (in name order) of a valid checkpoint.

    A tensor of a DeepSpeed checkpoint lies in pieces in several files (each rank's partition):
    ``files`` lists them all, and each file counts it."""
    tensors = sorted(index.tensors.values(), key=lambda t: _natural(t.name))
    per_file = Counter(f for t in tensors for f in t.files)
    dtypes: dict[str, dict[str, int]] = {}
    for t in tensors:
        entry = dtypes.setdefault(t.dtype, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += t.nbytes
    files = [{"path": index.path(f), "bytes": index.opened.get(f).identity.size, "tensors": per_file[f]}
             for f in index.files]
    scales, quantization = quantization_summary(index)
    return {
        "source": index.source,
        "valid": True,
        "files": files,
        "tensor_count": len(tensors),
        "tensor_bytes": index.total_bytes,
        "file_bytes": sum(f["bytes"] for f in files),
        "dtypes": dict(sorted(dtypes.items())),
        "quantization": quantization,
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                     "file": index.path(t.file) if t.file else None,
                     "files": [index.path(f) for f in t.files],
                     **({"scale": scales[t.name]} if t.name in scales else {})} for t in tensors],
    }


def quantization_summary(index: CheckpointIndex) -> tuple[dict[str, dict], dict | None]:
    """Each FP8 weight's scale (name and block: ``None`` for one scale per tensor), and the
    checkpoint's quantisation (None for a checkpoint without FP8 weights): method, block sizes,
    counts and the problems ``load_into`` would refuse."""
    from .checkpoint.quantized import FP8, pair_scales, read_quantization

    quantization = read_quantization(index.root)
    _, scales, problems = pair_scales(index, quantization)
    fp8 = [t for t in index.tensors.values() if t.dtype in FP8]
    if not fp8:
        return {}, None
    per_weight = {name: {"name": s.entry.name, "block": None if s.per_tensor else list(s.block)}
                  for name, s in scales.items()}
    blocks = sorted({"per tensor" if w["block"] is None else "x".join(map(str, w["block"]))
                     for w in per_weight.values()})
    return per_weight, {"method": quantization.method, "blocks": blocks, "fp8_weights": len(fp8),
                        "scales": len(scales), "problems": problems}


def plan_summary(index: CheckpointIndex, world_size: int) -> dict:
    """What each of ``world_size`` ranks would read if every tensor were a ZeRO-3 parameter.

    A rank reads only the valid elements of its ``Partition`` of each tensor, as ``load_into``
    does; buffers and plain parameters (read whole by every rank) are not modelled here.
    """
    rank_bytes = [0] * world_size
    padding = 0
    largest = None  # (bytes, name, rank) of the biggest single read
    for t in sorted(index.tensors.values(), key=lambda t: _natural(t.name)):
        for rank in range(world_size):
            part = Partition(t.numel, world_size, rank)
            nbytes = part.valid * t.itemsize
            rank_bytes[rank] += nbytes
            padding += part.size - part.valid
            if largest is None or nbytes > largest[0]:
                largest = (nbytes, t.name, rank)
    most, least = max(rank_bytes), min(rank_bytes)
    return {
        "source": index.source,
        "world_size": world_size,
        "tensor_bytes": index.total_bytes,
        "rank_bytes": rank_bytes,
        "max_rank_bytes": most,
        "min_rank_bytes": least,
        # null when some rank reads nothing (more ranks than elements): the ratio is unbounded
        "max_min_ratio": most / least if least else (1.0 if not most else None),
        "largest_partition": (None if largest is None else
                              {"name": largest[1], "bytes": largest[0], "rank": largest[2]}),
        "padding_elements": padding,
    }


def _exact(nbytes: int) -> str:
    """Human and exact: ``"1.23 MB (1,234,567 bytes)"``, for totals someone may compare."""
    text = human_bytes(nbytes)
    return text if text.endswith(" B") else f"{text} ({nbytes:,} bytes)"


def _table(rows: list[tuple], right: tuple[int, ...] = ()) -> list[str]:
    """Rows of cells as aligned lines; columns in ``right`` are right-aligned (numbers)."""
    rows = [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))] if rows else []
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def _files_cell(files: list[str]) -> str:
    """The first file holding a tensor, and how many more do."""
    more = f" and {len(files) - 1} more" if len(files) > 1 else ""
    return os.path.basename(files[0]) + more if files else ""


def _dtype_cell(tensor: dict) -> str:
    """A tensor's dtype, and for an FP8 weight how it is scaled: ``F8_E4M3 (128x128 blocks)``."""
    scale = tensor.get("scale")
    if scale is None:
        return tensor["dtype"]
    block = "per tensor" if scale["block"] is None else "x".join(map(str, scale["block"])) + " blocks"
    return f"{tensor['dtype']} ({block})"


def render_inspect(summary: dict, limit: int | None) -> list[str]:
    """The text of ``zload inspect``; ``limit`` caps the tensor table (None: every tensor)."""
    lines = [f"source: {summary['source']}", f"files: {len(summary['files'])}"]
    lines += _table([(os.path.basename(f["path"]), human_bytes(f["bytes"]),
                      plural(f["tensors"], "tensor")) for f in summary["files"]], right=(1, 2))
    lines += [f"tensors: {summary['tensor_count']}",
              f"tensor bytes: {_exact(summary['tensor_bytes'])}",
              f"on disk: {_exact(summary['file_bytes'])}",
              "dtypes:"]
    lines += _table([(dtype, plural(d["tensors"], "tensor"), human_bytes(d["bytes"]))
                     for dtype, d in summary["dtypes"].items()], right=(1, 2))
    quantization = summary["quantization"]
    if quantization is not None:
        lines.append(f"quantization: {quantization['method'] or 'none declared'}, "
                     f"{plural(quantization['fp8_weights'], 'FP8 weight')} "
                     f"({', '.join(quantization['blocks']) or 'no scales'}; "
                     f"{plural(quantization['scales'], 'scale')} paired), dequantised on load")
        lines += [f"  problem: {p}" for p in quantization["problems"]]
    tensors = summary["tensors"]
    shown = tensors if limit is None else tensors[:limit]
    if shown:
        lines.append("tensors:" if len(shown) == len(tensors) else
                     f"tensors (first {len(shown)} of {len(tensors)}):")
        lines += _table([("name", "dtype", "shape", "size", "file")] +
                        [(t["name"], _dtype_cell(t), str(t["shape"]), human_bytes(t["bytes"]),
                          _files_cell(t["files"])) for t in shown], right=(3,))
    if shown and len(shown) < len(tensors):  # --no-tensors (or --limit 0) asked for no list at all
        lines.append(f"  ... {len(tensors) - len(shown)} more (--all to list every tensor)")
    lines.append("valid: yes")
    return lines


def render_plan(summary: dict) -> list[str]:
    """The text of ``zload plan``."""
    ratio = summary["max_min_ratio"]
    largest = summary["largest_partition"]
    lines = [f"source: {summary['source']}",
             f"world size: {summary['world_size']} (every tensor as a ZeRO-3 parameter)",
             "bytes read per rank:"]
    lines += _table([(f"rank {rank}", human_bytes(nbytes), f"{nbytes:,}")
                     for rank, nbytes in enumerate(summary["rank_bytes"])], right=(1, 2))
    lines += [f"total: {_exact(summary['tensor_bytes'])}",
              "max/min across ranks: " + (f"{ratio:.3f}" if ratio is not None
                                          else "unbounded (some rank reads nothing)")]
    if largest is not None:
        lines.append(f"largest partition: {largest['name']} {_exact(largest['bytes'])} "
                     f"on rank {largest['rank']}")
    lines.append(f"padding: {plural(summary['padding_elements'], 'element')}")
    return lines


def _at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, with a message that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value
    return parse


PATH_HELP = ("a .safetensors file, an index .json, a folder holding either or a DeepSpeed checkpoint, or a "
             "Hub repo id")
REVISION_HELP = "branch, tag or commit of a Hub repo id (default: main)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zload", description="Inspect, validate and plan loads of safetensors checkpoints; convert "
        "DeepSpeed checkpoints into them.",
        epilog="PATH is a .safetensors file, an index .json, a directory holding either, or a Hub repo id "
               "(inspect, plan and validate read only its headers from the Hub; validate --full downloads "
               "it into the Hugging Face cache, as load_into does).")
    parser.add_argument("--version", action="version", version=f"zload {__version__}",
                        help="print zload's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser("inspect", help="files, dtypes, shapes and sizes of a checkpoint")
    inspect.add_argument("path", metavar="PATH", help=PATH_HELP)
    inspect.add_argument("--revision", metavar="REV", help=REVISION_HELP)
    inspect.add_argument("--json", action="store_true", help="print a JSON object instead "
                         "(it lists every tensor unless --no-tensors)")
    shown = inspect.add_mutually_exclusive_group()
    shown.add_argument("--limit", type=_at_least(0), default=DEFAULT_LIMIT, metavar="N",
                       help=f"list the first N tensors (default {DEFAULT_LIMIT}; text output only)")
    shown.add_argument("--all", dest="limit", action="store_const", const=None,
                       help="list every tensor")
    shown.add_argument("--no-tensors", dest="limit", action="store_const", const=0,
                       help="leave out the tensor list")

    plan = commands.add_parser("plan", help="bytes each rank would read under ZeRO-3")
    plan.add_argument("path", metavar="PATH", help=PATH_HELP)
    plan.add_argument("--revision", metavar="REV", help=REVISION_HELP)
    plan.add_argument("--world-size", "-n", type=_at_least(1), required=True, metavar="N",
                      help="the number of ranks (GPUs) of the job that would load it")
    plan.add_argument("--json", action="store_true", help="print a JSON object instead")

    validate = commands.add_parser("validate", help="check every header; exit 0 if valid, 1 if not")
    validate.add_argument("path", metavar="PATH", help=PATH_HELP)
    validate.add_argument("--revision", metavar="REV", help=REVISION_HELP)
    validate.add_argument("--full", action="store_true", help="also read every byte of the files "
                          "zload.save wrote and check it against the digest recorded in them")

    convert = commands.add_parser("convert", help="a DeepSpeed checkpoint (engine.save_checkpoint) into "
                                  "Hugging Face safetensors, streamed")
    convert.add_argument("checkpoint", metavar="DS_CHECKPOINT", help="the folder save_checkpoint wrote, "
                         "or one of its tag folders (global_stepN)")
    convert.add_argument("out", metavar="OUT", help="the folder to write model.safetensors (or shards and "
                         "their index) into, with the config.json found beside the tag folder")
    convert.add_argument("--module-weights", action="store_true", help="write the module's own weights "
                         "(16-bit when trained so) instead of the fp32 master weights")
    convert.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                         help="largest shard, e.g. 5GB (default) or 500MiB")
    convert.add_argument("--single-process", action="store_true",
                         help=f"convert in this one process even if its environment names a distributed job "
                              f"(WORLD_SIZE > 1), as in a process that a torchrun worker started; also "
                              f"{SINGLE_PROCESS}=1")
    return parser


SINGLE_PROCESS = "ZLOAD_SINGLE_PROCESS"
RENDEZVOUS_TIMEOUT = 60  # seconds for the processes of a launch to meet
INHERITED_TIMEOUT = 5  # seconds, where the parent process holds the same launch variables
_LAUNCH = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _convert(args) -> int:
    """``zload convert``: one process, or each process of a torchrun launch (``WORLD_SIZE``)."""
    import torch.distributed as dist

    from .saving.convert import convert

    single = args.single_process or os.environ.get(SINGLE_PROCESS, "") not in ("", "0")
    joined = not single and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized()
    if joined:
        _join()
    try:
        report = convert(args.checkpoint, args.out, weights="module" if args.module_weights else "master",
                         max_shard_size=args.max_shard_size)
    finally:
        if joined:
            dist.destroy_process_group()
    print(report)
    if joined:
        _exit_skipping_teardown()
    return 0


def _join() -> None:
    """Join the other processes of this launch in one gloo group, or raise within seconds.

    A process's environment does not say whether a launcher started it as one of ``WORLD_SIZE``
    processes, or whether a process of a distributed job started it (``subprocess.run(["zload",
    "convert", ...])`` in a torchrun worker) and it inherited the job's ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``: then no other process will come, and joining the job's
    group would wait for half an hour, or worse, join it. So the processes meet first under their
    own names in the job's store (``zload-convert/...``, apart from the job's own keys) and wait for
    each other ``RENDEZVOUS_TIMEOUT`` seconds at most; only ``INHERITED_TIMEOUT`` where a Python
    process that started this one holds the same launch variables (``_inherited_from``: a launcher
    sets them for the processes it starts, not in its own environment, and a shell it starts is
    looked through). Whoever does not meet them all raises a ``PeerLostError`` saying what to do:
    ``--single-process``, or launching the processes together.
    """
    from datetime import timedelta

    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    parent = _inherited_from()
    timeout = INHERITED_TIMEOUT if parent else RENDEZVOUS_TIMEOUT
    keys = [f"arrived/{r}" for r in range(world)]
    store, missing = None, None
    try:
        rank = int(os.environ.get("RANK", ""))  # a ValueError if unset: the message names it
        store = dist.PrefixStore(f"zload-convert/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                                 f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}/",
                                 next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))[0])
        store.set(keys[rank], str(os.getpid()))
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as e:  # torch's store errors: a timeout, a refused connection, a port in use
        if store is not None:
            try:  # best effort: the store itself may be what failed
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                store.delete_key(keys[rank])
            except Exception:  # the error raised below says what failed
                pass
        raise PeerLostError(_not_joined(world, timeout, parent, missing, e),
                            stage="joining the other processes") from e
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)  # small CPU collectives
    store.delete_key(keys[rank])  # every process has passed its wait: each needs the others to join


def _inherited_from() -> int | None:
    """The id of the nearest Python process among this one's ancestors whose environment (as it
    started: ``/proc``) holds this one's launch variables (``_LAUNCH``), up through wrappers that
    hold them too (a shell, ``timeout``, ``uv run``): a worker of the job, which started this one
    and whose variables it inherited. None when an ancestor without them comes first (a launcher
    sets them for the processes it starts, not in its own environment), or where ``/proc`` cannot
    tell."""
    pid = os.getppid()
    while pid > 1:
        environ = _environ_of(pid)
        if environ is None or any(environ.get(name) != (None if os.environ.get(name) is None else
                                                        os.fsencode(os.environ[name])) for name in _LAUNCH):
            return None
        if _runs_python(pid):
            return pid
        pid = _parent_of(pid)
    return None


def _environ_of(pid: int) -> dict[str, bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0")]
    except OSError:
        return None
    return {key.decode(errors="replace"): value for key, value in (p for p in pairs if len(p) == 2)}


def _runs_python(pid: int) -> bool:
    """Whether the process runs a Python interpreter; True where that cannot be told (the short
    wait stays the answer for an unknown ancestor)."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith(("python", "pypy"))
    except OSError:
        return True


def _parent_of(pid: int) -> int:
    """The process's parent (``/proc/PID/stat``, after the command name in brackets); 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _not_joined(world: int, timeout: int, parent: int | None, missing: list[int] | None, e: Exception) -> str:
    """Why ``zload convert`` did not join the other processes, and what to do."""
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    absent = (f"process{'es' if len(missing) > 1 else ''} of rank {shortened([str(r) for r in missing])} did not come"
              if missing else f"the group's store at {where} could not be used ({detail})")
    cause = (f"process {parent}, which started this one, holds the same variables: a process of a distributed "
             "job, whose variables this one inherited" if parent else "the other processes were not started with it")
    return (f"this zload convert's environment (RANK={os.environ.get('RANK')}, WORLD_SIZE={world}, "
            f"MASTER_ADDR:MASTER_PORT={where}) says it is one of {world} processes, but within {timeout} s the "
            f"{absent}; {cause}. To convert in this one process, pass --single-process (or set "
            f"{SINGLE_PROCESS}=1); to convert with {world} processes, start them together: torchrun "
            f"--nproc_per_node {world} -m zload convert ... Nothing was written.")


def _exit_skipping_teardown() -> None:
    """Leave a torchrun process whose work is done without the interpreter's teardown, where gloo
    sometimes aborts ("terminate called without an active exception", even after
    ``destroy_process_group``; 5 of 24 runs of a script doing a few loads on this project's VM);
    torchrun would then report a finished conversion as failed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_recorded_digests(index: CheckpointIndex) -> tuple[int, int]:
    """Each file with a digest recorded by zload.save, read whole and checked against it: raises
    on a mismatch; returns (files checked, files without a recorded digest)."""
    from .checkpoint.digest import DIGEST_KEY, block_count, block_digests, data_digest, recorded_mismatch
    from .distributed import reader_count

    checked = 0
    for key in index.files:
        opened = index.opened.get(key)
        if DIGEST_KEY not in opened.metadata:
            continue
        count = block_count(opened.data_start, opened.identity.size)
        digest = data_digest(block_digests(opened.fd, opened.data_start, opened.identity.size,
                                           range(count), reader_count()), count)
        wrong = recorded_mismatch(opened.path, opened.metadata, digest)
        if wrong:
            raise InvalidCheckpointError(wrong, path=opened.path)
        checked += 1
    return checked, len(index.files) - checked


def _run(args) -> int:
    if args.command == "convert":
        return _convert(args)
    from .checkpoint.open import open_source

    if args.command == "validate":
        try:
            with open_source(args.path, args.revision, headers_only=not args.full) as index:
                checked, unrecorded = _check_recorded_digests(index) if args.full else (0, 0)
        except ZloadError as e:
            print(f"zload: invalid: {e}", file=sys.stderr)
            return 1
        print(f"valid: {index.source} ({plural(len(index.tensors), 'tensor')}, "
              f"{human_bytes(index.total_bytes)} in {plural(len(index.files), 'file')})")
        if args.full:
            print(f"data: {plural(checked, 'file')} matched the digest zload.save recorded"
                  + (f"; {plural(unrecorded, 'file')} recorded none (not checked)" if unrecorded else ""))
        return 0
    with open_source(args.path, args.revision, headers_only=True) as index:
        if args.command == "inspect":
            summary = inspect_summary(index)
            if args.json and args.limit == 0:
                del summary["tensors"]
            lines = [json.dumps(summary, indent=2)] if args.json else render_inspect(summary, args.limit)
        else:
            summary = plan_summary(index, args.world_size)
            lines = [json.dumps(summary, indent=2)] if args.json else render_plan(summary)
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the ``zload`` command line; returns the exit status (also for argparse errors), but for
    ``convert`` in a torchrun process (``WORLD_SIZE`` > 1, no process group yet), which on success
    ends the process (exit status 0) rather than return."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse has printed the message
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    try:
        return _run(args)
    except (ZloadError, OSError) as e:  # e.g. a shard removed between indexing and getsize
        if isinstance(e, BrokenPipeError):
            return _stdout_closed()
        print(f"zload: error: {e}", file=sys.stderr)
        return 2


def _stdout_closed() -> int:
    """``zload inspect big | head``: the reader left early. Exit quietly, as Unix tools do,
    pointing stdout at /dev/null so that Python's flush at exit does not complain again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
