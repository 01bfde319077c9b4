"""What each measured method does on one rank of a worker world, and the check of the partitions
it leaves.
"""

from __future__ import annotations

import contextlib
import os

from benchmarks.load.checkpoint import checkpoint_bytes, checkpoint_files
from benchmarks.load.stages import timed_stages

CEILING_BLOCK = 16 << 20  # bytes per os.preadv of the device ceiling
CEILING_THREADS = 4  # the device ceiling's parallel readers (``ceiling-1``: one)


def ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3}}


@contextlib.contextmanager
def descriptors():
    """A function giving a read-only descriptor of a path, opened once on first use; all are closed
    on leaving."""
    fds = {}

    def fd_of(path: str) -> int:
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
        return fds[path]

    try:
        yield fd_of
    finally:
        for fd in fds.values():
            os.close(fd)


def read_fully(fd: int, view: memoryview, offset: int, name: str) -> int:
    """Fill ``view`` from ``offset`` on with ``os.preadv`` (which may return short); returns its length."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{name}: unexpected end of file at {offset + done}")
        done += got
    return done


def touched_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of memory, every page written once, so that reading into it faults no page in."""
    import torch

    buffer = torch.empty(nbytes, dtype=torch.uint8)
    buffer.fill_(0)
    return memoryview(buffer.numpy()).cast("B")


def check_against_checkpoint(tensors: dict, folder: str, problem_of) -> dict:
    """Each of ``tensors`` (name -> tensor) is in the checkpoint and passes
    ``problem_of(tensor, entry, read)``: None, or what is wrong with it (``read(entry, first, n)``
    gives ``n`` bytes of the entry's data from its byte ``first`` on)."""
    from zload import open_checkpoint

    with open_checkpoint(folder) as index:
        entries, path_of = index.tensors, index.path
    problems, checked = [], 0
    with descriptors() as fd_of:
        def read(e, first: int, n: int) -> bytes:
            return os.pread(fd_of(path_of(e.file)), n, e.start + first)

        for name, tensor in tensors.items():
            e = entries.get(name)
            if e is None:
                problems.append(f"{name}: not in the checkpoint")
                continue
            problem = problem_of(tensor, e, read)
            if problem:
                problems.append(f"{name}: {problem}")
            checked += 1
    return {"checked": checked, "problems": problems[:10], "ok": not problems and checked > 0}


def verify_partitions(model, folder: str) -> dict:
    """Every parameter is a ZeRO-3 parameter whose partition holds the checkpoint's bytes."""
    import torch
    import torch.distributed as dist

    from zload.checkpoint.index import DTYPES

    rank, world = dist.get_rank(), dist.get_world_size()

    def partition_problem(p, e, read) -> str | None:
        if not hasattr(p, "ds_id") or not hasattr(p, "ds_tensor"):
            return "not a ZeRO-3 parameter"
        ps = p.ds_tensor.ds_numel
        lo = rank * ps
        valid = max(0, min(ps, e.numel - lo))
        if e.numel != p.ds_numel or ps != -(-e.numel // world):
            return "unexpected partition geometry"
        want = read(e, lo * e.itemsize, valid * e.itemsize)
        stored = getattr(torch, DTYPES[e.dtype][0])
        if stored != p.ds_tensor.dtype:  # a cast load: compare with Tensor.to of the file bytes
            raw = torch.frombuffer(bytearray(want), dtype=torch.uint8) if want else \
                torch.empty(0, dtype=torch.uint8)
            want = raw.view(stored).to(p.ds_tensor.dtype).view(torch.uint8).numpy().tobytes()
        got = p.ds_tensor.detach().reshape(-1)[:valid].cpu().contiguous().view(torch.uint8)
        return None if bytes(got.numpy().tobytes()) == want else "partition differs from the checkpoint"

    return check_against_checkpoint(dict(model.named_parameters()), folder, partition_problem)


def rank_partitions(folder: str, rank: int | None = None, world: int | None = None) -> list[tuple]:
    """For each checkpoint tensor (in file order): its file's path, its index entry, the ZeRO-3
    partition size ``ceil(numel / W)`` and the first and count of the elements that rank's
    partition holds. ``rank``/``world`` default to this process's in torch.distributed."""
    from zload import open_checkpoint

    if rank is None:
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
    with open_checkpoint(folder) as index:
        entries = sorted(index.tensors.values(), key=lambda e: (e.file, e.start))
    out = []
    for e in entries:
        ps = -(-e.numel // world)
        lo = rank * ps
        out.append((index.path(e.file), e, ps, lo, max(0, min(ps, e.numel - lo))))
    return out


def partition_bytes(folder: str, dtype) -> int:
    """The bytes of this rank's partitions of every checkpoint tensor in ``dtype``."""
    import torch

    return sum(ps for _, _, ps, _, _ in rank_partitions(folder)) * torch.empty(0, dtype=dtype).element_size()


def partition_device() -> str:
    """Where the measured worlds keep partitions: this rank's GPU where CUDA is, else CPU memory."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def alloc_floor(folder: str, meter, args) -> dict:
    import torch

    dtype = getattr(torch, args.model_dtype)
    sizes = [ps for _, _, ps, _, _ in rank_partitions(folder)]
    device = partition_device()
    meter.begin("total")
    meter.begin("construct")
    partitions = [torch.empty(ps, dtype=dtype, device=device).fill_(0) for ps in sizes]
    meter.end("construct")
    meter.end("total")
    return {"bytes_read": 0, "verified": None, "tensors": len(partitions)}


def floor(folder: str, meter, args) -> dict:
    ranges = [(path, e.start + lo * e.itemsize, n * e.itemsize)
              for path, e, _, lo, n in rank_partitions(folder) if n]
    # touched now, like the partitions zload writes into (allocated at construction)
    view = touched_buffer(sum(n for _, _, n in ranges))

    meter.begin("total")
    meter.begin("load")
    position, read = 0, 0
    with descriptors() as fd_of:
        for file, offset, n in ranges:
            read += read_fully(fd_of(file), view[position:position + n], offset, file)
            position += n
    meter.end("load")
    meter.end("total")
    return {"bytes_read": read, "verified": None}


def contiguous_share(folder: str, rank: int, world: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s share of the checkpoint files (concatenated in sorted order, cut into
    ``world`` equal contiguous spans) as (path, offset, length), one per file it touches."""
    files = [(path, os.path.getsize(path)) for path in checkpoint_files(folder)]
    total = sum(size for _, size in files)
    lo, hi = rank * total // world, (rank + 1) * total // world
    spans, file_start = [], 0
    for path, size in files:
        first, last = max(lo, file_start), min(hi, file_start + size)
        if first < last:
            spans.append((path, first - file_start, last - first))
        file_start += size
    return spans


def ceiling_blocks(folder: str, world: int | None = None) -> list[tuple[str, int, int]]:
    """This rank's contiguous share of the files as blocks of at most ``CEILING_BLOCK`` bytes, the
    files cut in ``world`` shares (default: the world size; 1: rank 0 reads them all)."""
    import torch.distributed as dist

    return [(path, at, min(CEILING_BLOCK, offset + length - at))
            for path, offset, length in contiguous_share(folder, dist.get_rank(), world or dist.get_world_size())
            for at in range(offset, offset + length, CEILING_BLOCK)]


def ceiling(folder: str, meter, args, threads: int = CEILING_THREADS, world: int | None = None) -> dict:
    """The storage device's ceiling for these files: the best time to read them with large blocks
    (and, but for ``ceiling-1``, parallel readers). Each rank reads its 1/W span (``world=1``: rank
    0 all of it) with ``threads`` threads taking ``CEILING_BLOCK`` blocks in order (``ceiling-1``:
    one thread a rank, as ``dd``; the faster of the two only at 300 MB W=2 so far, narrowly; the
    targets take the faster of those measured). The bytes are discarded, so each thread reads into
    one reused, touched block buffer rather than a span-sized one: the least memory work a read
    can do, and no span-sized allocation raising the rank's memory."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    blocks = ceiling_blocks(folder, world)
    free = queue.SimpleQueue()  # one buffer per thread: a block takes one and gives it back
    for _ in range(threads):
        free.put(touched_buffer(CEILING_BLOCK))

    def read_block(block) -> int:
        fd, path, offset, n = block
        buffer = free.get()
        try:
            return read_fully(fd, buffer[:n], offset, path)
        finally:
            free.put(buffer)

    meter.begin("total")
    meter.begin("load")
    with descriptors() as fd_of:
        opened = [(fd_of(path), path, offset, n) for path, offset, n in blocks]  # opened before the threads
        with ThreadPoolExecutor(threads) as pool:
            read = sum(pool.map(read_block, opened))
    meter.end("load")
    meter.end("total")
    return {"bytes_read": read, "verified": None}


def dcp_state_dict(folder: str) -> dict:
    """One DTensor per checkpoint tensor, in its dtype, sharded by rows (``Shard(0)``, as
    ``torch.chunk`` splits them) over the world's ranks, on their GPUs where CUDA is (as zload's
    partitions), else on the CPU; the local shards touched."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, empty

    from zload import open_checkpoint
    from zload.checkpoint.index import DTYPES

    mesh = init_device_mesh(partition_device(), (dist.get_world_size(),))
    with open_checkpoint(folder) as index:
        entries = index.tensors
    state_dict = {name: empty(e.shape, dtype=getattr(torch, DTYPES[e.dtype][0]), device_mesh=mesh,
                              placements=[Shard(0)]) for name, e in entries.items()}
    for tensor in state_dict.values():
        tensor.to_local().fill_(0)
    return state_dict


def verify_row_shards(state_dict: dict, folder: str) -> dict:
    """Every local shard holds the checkpoint's bytes of the rows ``Shard(0)`` gives this rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    rank, world = dist.get_rank(), dist.get_world_size()

    def shard_problem(dtensor, e, read) -> str | None:
        local = dtensor.to_local()
        rows, first = Shard.local_shard_size_and_offset(e.shape[0], world, rank)
        if tuple(local.shape) != (rows, *e.shape[1:]):
            return f"local shard {tuple(local.shape)}, expected {rows} rows"
        row_bytes = e.nbytes // e.shape[0]
        want = read(e, first * row_bytes, rows * row_bytes)
        got = local.reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return None if got == want else "local shard differs from the checkpoint"

    return check_against_checkpoint(state_dict, folder, shard_problem)


def dcp_load(folder: str, meter, args, build: str | None = None) -> dict:
    """PyTorch DCP's reader for Hugging Face checkpoints into row-sharded DTensors, at its default
    ``thread_count`` (1: its documented default, and the one a plain ``dcp.load`` user gets).
    With ``build`` ("zero.Init" or "zload.init") the model is built first, as for zload's load, and
    kept through DCP's: a control, DCP reading after the same construction as zload."""
    import torch.distributed.checkpoint as dcp

    model = build_model(folder, meter, args, build) if build else None  # begins "total"
    state_dict = dcp_state_dict(folder)  # the partitions exist before the load, as in every method
    reader = dcp.HuggingFaceStorageReader(folder)
    if model is None:
        meter.begin("total")
    meter.begin("load")
    dcp.load(state_dict, storage_reader=reader)
    meter.end("load")
    meter.end("total")
    verified = verify_row_shards(state_dict, folder) if args.verify else None
    # Each rank memory-maps every file (safetensors' default backend), reads all the headers for the
    # metadata, and copies its rows out of the mapping (then into its shard), one file at a time: it
    # faults in its rows' pages, rounded out to pages and widened by the kernel's read-around. Counted
    # here as its rows' bytes: from a cold cache (20 MB, W=2) the ranks together read the files
    # about once, but a page shared by two ranks counts for whichever faulted first.
    local = sum(t.to_local().nbytes for t in state_dict.values())
    return {"bytes_read": local, "bytes_read_estimated": True, "verified": verified}


def build_model(folder: str, meter, args, how: str):
    """The checkpoint's Llama, built under ``how`` ("zero.Init" or "zload.init"), timed as the
    "construct" segment within a "total" one that this begins."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zload

    config = LlamaConfig.from_pretrained(folder)
    meter.begin("total")
    meter.begin("construct")
    dtype = getattr(torch, args.model_dtype)
    if how == "zload.init":
        context = zload.init(ds_config(), dtype=dtype)
    else:
        context = deepspeed.zero.Init(config_dict_or_path=ds_config(), dtype=dtype)
    with context:
        model = LlamaForCausalLM(config)
    meter.end("construct")
    return model


def zload_load(folder: str, meter, args, build: str) -> dict:
    import zload

    model = build_model(folder, meter, args, build)
    with timed_stages() as stages:
        meter.begin("load")
        report = zload.load_into(model, folder, progress=False, staging_bytes=args.staging_bytes,
                                 verify=args.load_verify)
        meter.end("load")
    meter.end("total")
    verified = verify_partitions(model, folder) if args.verify else None
    # Diagnostic, not a headline number: the same load again in this process, where one-time costs
    # (lazy imports, transformers' conversion mapping, thread start-up) are already paid.
    meter.begin("reload")
    zload.load_into(model, folder, progress=False, staging_bytes=args.staging_bytes,
                    verify=args.load_verify)
    meter.end("reload")
    return {"bytes_read": report.bytes_read, "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received, "report_seconds": report.seconds,
            "loaded": len(report.loaded), "verified": verified, "zload_file": zload.__file__,
            "stages_s": stages}


def transformers_load(folder: str, meter, args) -> dict:
    import torch
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.modeling_utils import PreTrainedModel

    keep_alive = HfDeepSpeedConfig(ds_config())  # from_pretrained takes the ZeRO-3 path while it lives
    load_step = PreTrainedModel._load_pretrained_model  # a staticmethod: the load after construction

    def timed_load_step(*a, **k):
        meter.begin("load")
        try:
            return load_step(*a, **k)
        finally:
            meter.end("load")

    PreTrainedModel._load_pretrained_model = staticmethod(timed_load_step)
    try:
        meter.begin("total")
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        meter.end("total")
    finally:
        PreTrainedModel._load_pretrained_model = staticmethod(load_step)
    if "load" not in meter.done:
        raise RuntimeError("transformers never called _load_pretrained_model; cannot time its load step")
    verified = verify_partitions(model, folder) if args.verify else None
    del keep_alive
    # Rank 0 reads (memory-maps) the whole checkpoint; the other ranks read none of it.
    import torch.distributed as dist

    return {"bytes_read": checkpoint_bytes(folder) if dist.get_rank() == 0 else 0,
            "bytes_read_estimated": True, "verified": verified}


RUNNERS = {  # method -> what a worker runs: (checkpoint folder, Meter, args) -> result
    "floor": floor,
    "alloc-floor": alloc_floor,
    "zload": lambda folder, meter, args: zload_load(folder, meter, args, "zero.Init"),
    "zload+init": lambda folder, meter, args: zload_load(folder, meter, args, "zload.init"),
    "transformers": transformers_load,
    "ceiling": ceiling,
    "ceiling-1": lambda folder, meter, args: ceiling(folder, meter, args, threads=1),
    "dcp": dcp_load,
    "dcp-after-zero.Init": lambda folder, meter, args: dcp_load(folder, meter, args, "zero.Init"),
    "dcp-after-zload.init": lambda folder, meter, args: dcp_load(folder, meter, args, "zload.init"),
}
