"""What each measured method does on one rank of a worker world, and the check of the partitions
it leaves.
"""

from __future__ import annotations

import os

from .checkpoint import checkpoint_bytes


def ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3}}


def verify_partitions(model, folder: str) -> dict:
    """Every parameter is a ZeRO-3 parameter whose partition holds the checkpoint's bytes."""
    import torch
    import torch.distributed as dist

    from zload import open_checkpoint
    from zload.index import DTYPES

    rank, world = dist.get_rank(), dist.get_world_size()
    with open_checkpoint(folder) as index:
        entries, path_of = index.tensors, index.path
    problems, checked, fds = [], 0, {}
    try:
        for name, p in model.named_parameters():
            if not hasattr(p, "ds_id") or not hasattr(p, "ds_tensor"):
                problems.append(f"{name}: not a ZeRO-3 parameter")
                continue
            e = entries.get(name)
            if e is None:
                problems.append(f"{name}: not in the checkpoint")
                continue
            ps = p.ds_tensor.ds_numel
            lo = rank * ps
            valid = max(0, min(ps, e.numel - lo))
            if e.numel != p.ds_numel or ps != -(-e.numel // world):
                problems.append(f"{name}: unexpected partition geometry")
                continue
            if e.file not in fds:
                fds[e.file] = os.open(path_of(e.file), os.O_RDONLY)
            want = os.pread(fds[e.file], valid * e.itemsize, e.start + lo * e.itemsize)
            stored = getattr(torch, DTYPES[e.dtype][0])
            if stored != p.ds_tensor.dtype:  # a cast load: compare with Tensor.to of the file bytes
                raw = torch.frombuffer(bytearray(want), dtype=torch.uint8) if want else \
                    torch.empty(0, dtype=torch.uint8)
                want = raw.view(stored).to(p.ds_tensor.dtype).view(torch.uint8).numpy().tobytes()
            got = p.ds_tensor.detach().reshape(-1)[:valid].cpu().contiguous().view(torch.uint8)
            if bytes(got.numpy().tobytes()) != want:
                problems.append(f"{name}: partition differs from the checkpoint")
            checked += 1
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"checked": checked, "problems": problems[:10], "ok": not problems and checked > 0}


def rank_partitions(folder: str) -> list[tuple]:
    """For each checkpoint tensor (in file order): its file's path, its index entry, this rank's
    ZeRO-3 partition size ``ceil(numel / W)`` and the first and count of the elements that
    partition holds."""
    import torch.distributed as dist

    from zload import open_checkpoint

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


def alloc_floor(folder: str, meter, args) -> dict:
    import torch

    dtype = getattr(torch, args.model_dtype)
    sizes = [ps for _, _, ps, _, _ in rank_partitions(folder)]
    meter.begin("total")
    meter.begin("construct")
    partitions = [torch.empty(ps, dtype=dtype).fill_(0) for ps in sizes]
    meter.end("construct")
    meter.end("total")
    return {"bytes_read": 0, "verified": None, "tensors": len(partitions)}


def floor(folder: str, meter, args) -> dict:
    import torch

    ranges = [(path, e.start + lo * e.itemsize, n * e.itemsize)
              for path, e, _, lo, n in rank_partitions(folder) if n]
    total = sum(n for _, _, n in ranges)
    buffer = torch.empty(total, dtype=torch.uint8)
    buffer.fill_(0)  # touched now, like the partitions zload writes into (allocated at construction)
    view = memoryview(buffer.numpy()).cast("B")

    meter.begin("total")
    meter.begin("load")
    fds, position, read = {}, 0, 0
    try:
        for file, offset, n in ranges:
            fd = fds.get(file)
            if fd is None:
                fd = fds[file] = os.open(file, os.O_RDONLY)
            part = view[position:position + n]
            while len(part):
                got = os.preadv(fd, [part], offset)
                if got <= 0:
                    raise OSError(f"{file}: unexpected end of file at {offset}")
                part, offset, read = part[got:], offset + got, read + got
            position += n
    finally:
        for fd in fds.values():
            os.close(fd)
    meter.end("load")
    meter.end("total")
    return {"bytes_read": read, "verified": None}


def zload_load(folder: str, meter, args, use_init: bool) -> dict:
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zload

    config = LlamaConfig.from_pretrained(folder)
    meter.begin("total")
    meter.begin("construct")
    dtype = getattr(torch, args.model_dtype)
    if use_init:
        context = zload.init(ds_config(), dtype=dtype)
    else:
        context = deepspeed.zero.Init(config_dict_or_path=ds_config(), dtype=dtype)
    with context:
        model = LlamaForCausalLM(config)
    meter.end("construct")
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
            "loaded": len(report.loaded), "verified": verified, "zload_file": zload.__file__}


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
    "zload": lambda folder, meter, args: zload_load(folder, meter, args, use_init=False),
    "zload+init": lambda folder, meter, args: zload_load(folder, meter, args, use_init=True),
    "transformers": transformers_load,
}
