"""The benchmark checkpoint: sizes, a Llama-shaped bf16 model of that size written once with
``save_pretrained``, and the page cache it is read from.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

from benchmarks.load import log


def parse_bytes(text: str) -> int:
    """A size as ``zload.save(max_shard_size=...)`` reads it (``300MB``, ``64MiB``, bytes)."""
    from zload.errors import ZloadError
    from zload.saving.plan import parse_size  # imported here: the launcher itself does not load torch

    try:
        return parse_size(text)
    except ZloadError as e:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 300MB, 1GB, 64MiB)") from e


# Named checkpoint shapes, accepted wherever a size is: (LlamaConfig sizes, save_pretrained's
# max_shard_size, or None for --shard-size). The issue-43 shapes: the one its cold numbers came
# from, and the one of its construction numbers (594 MB: the same Llama as 600MB's).
SHAPES = {
    "issue43-1.1GB": (dict(hidden=2048, inter=5632, layers=8, vocab=32000), "200MB"),
    "issue43-540MB": (dict(hidden=1024, inter=2816, layers=18, vocab=32000), None),
}


def parse_size_spec(text: str) -> tuple[str, int, list[int] | None]:
    """``300MB`` -> every --world; ``600MB@2`` or ``600MB@2,4`` -> only those world sizes; a name
    from ``SHAPES`` in place of the size (``issue43-1.1GB@2``) -> that shape, its bf16 bytes."""
    size, _, worlds = text.partition("@")
    size = size.strip()
    try:
        nbytes = 2 * _llama_params(**SHAPES[size][0]) if size in SHAPES else parse_bytes(size)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}, or a named shape: {', '.join(SHAPES)}") from None
    ws = [int(w) for w in worlds.split(",")] if worlds else None
    if ws is not None and any(w < 1 for w in ws):
        raise argparse.ArgumentTypeError(f"bad world sizes in {text!r}")
    return size, nbytes, ws


def _llama_params(hidden: int, inter: int, layers: int, vocab: int) -> int:
    """Parameters of an untied Llama whose key/value heads are as many as its query heads."""
    return 2 * vocab * hidden + hidden + layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)


def _config(hidden: int, inter: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    heads = max(1, hidden // 128)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def llama_config(nbytes: int):
    """A LlamaConfig whose bf16 parameters take about ``nbytes``."""
    params = nbytes / 2
    if params < 1e8:
        hidden, inter = 512, 1408
    elif params < 1.5e9:
        hidden, inter = 1024, 2816
    elif params < 8e9:
        hidden, inter = 2048, 5632
    elif params < 4e10:
        hidden, inter = 4096, 11008
    else:
        hidden, inter = 8192, 28672
    vocab = 32000
    if 2 * vocab * hidden > params / 2:  # small checkpoints: keep most of the bytes in the layers
        vocab = max(256, int(params / 4 / hidden) // 64 * 64)
    per_layer = _llama_params(hidden, inter, 1, 0) - hidden
    layers = max(1, round((params - 2 * vocab * hidden - hidden) / per_layer))
    return _config(hidden, inter, layers, vocab)


def checkpoint_shape(size: str, nbytes: int, shard: str) -> tuple:
    """``(LlamaConfig, max_shard_size)`` of a ``parse_size_spec`` point: a named shape's own (its
    shard size, if it has one, over ``shard``), else ``llama_config(nbytes)`` in ``shard`` files."""
    if size in SHAPES:
        sizes, own_shard = SHAPES[size]
        return _config(**sizes), own_shard or shard
    return llama_config(nbytes), shard


def checkpoint_dir(cache: str, config, shard: str) -> str:
    c = config
    return os.path.join(cache, f"llama-bf16-h{c.hidden_size}-i{c.intermediate_size}-l{c.num_hidden_layers}"
                               f"-v{c.vocab_size}-shard{shard}")


def bf16_llama(config):
    """A plain ``LlamaForCausalLM`` built directly in bf16 (no fp32 copy on the way)."""
    import torch
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LlamaForCausalLM(config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)


def ensure_checkpoint(folder: str, config, shard: str) -> None:
    """Write the checkpoint unless a complete one is there (safe if several nodes share the cache)."""
    marker = os.path.join(folder, "zload-bench-complete")
    if os.path.exists(marker):
        return
    import torch

    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".tmp-", dir=os.path.dirname(folder))
    started = time.perf_counter()
    torch.manual_seed(0)
    model = bf16_llama(config)
    model.save_pretrained(tmp, max_shard_size=shard)
    del model
    with open(os.path.join(tmp, "zload-bench-complete"), "w") as f:
        f.write("written by benchmarks/load.py\n")
    try:
        os.rename(tmp, folder)
    except OSError:  # another node (shared cache) or a stale partial directory
        if os.path.exists(marker):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(tmp, folder)
    log(f"wrote {folder} in {time.perf_counter() - started:.1f} s")


def checkpoint_files(folder: str, suffix: str = ".safetensors") -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(suffix))


def warm_page_cache(folder: str, suffix: str = ".safetensors") -> dict:
    """Read every file once (like ``cat`` to /dev/null); report how much of it is then cached.
    ``suffix``: ``.pt`` for a DeepSpeed checkpoint's tag folder."""
    started = time.perf_counter()
    total = 0
    buf = bytearray(16 << 20)
    for path in checkpoint_files(folder, suffix):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    info = {"bytes": total, "seconds": round(time.perf_counter() - started, 3)}
    info["resident_fraction"] = page_cache_residency(folder, suffix)
    return info


EVICTIONS = ("fadvise", "drop-caches")  # ways to empty the page cache, as --evict names them
DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_caches_problem() -> str | None:
    """Why ``--evict drop-caches`` cannot work here, or None: the file is opened for writing and
    closed, nothing written (so nothing dropped)."""
    try:
        with open(DROP_CACHES, "w"):
            return None
    except OSError as e:
        return _drop_caches_refused(e)


def _drop_caches_refused(e: OSError) -> str:
    return (f"{DROP_CACHES} is not writable here ({e.strerror}): --evict drop-caches needs root and a writable "
            "/proc/sys (a container's is often read-only); --evict fadvise empties only the checkpoint's pages "
            "and needs neither")


def _drop_caches() -> None:
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def evict_page_cache(folder: str, how: str = "fadvise") -> dict:
    """Empty the page cache of the checkpoint's files, dirty pages written back first; report how,
    and how much stayed resident. ``fadvise``: each file's pages (``posix_fadvise(DONTNEED)``,
    which leaves the rest of the machine's cache alone), then, if pages stay resident and this is
    root, the whole cache. ``drop-caches``: the whole cache, dentries and inodes at once, as
    ``sync; echo 3 > /proc/sys/vm/drop_caches`` does (also the pages of Python's modules and of
    every other file, which the next reads must fetch again); raises where that is not allowed."""
    os.sync()
    if how == "drop-caches":
        try:
            _drop_caches()
        except OSError as e:
            raise RuntimeError(_drop_caches_refused(e)) from e
        return {"how": "drop_caches", "resident_fraction": page_cache_residency(folder)}
    for path in checkpoint_files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how, resident = "posix_fadvise(DONTNEED)", page_cache_residency(folder)
    if resident is None or resident > 0.05:
        try:
            _drop_caches()
            how, resident = "drop_caches", page_cache_residency(folder)
        except OSError:  # not root, or a container without a writable /proc/sys
            pass
    return {"how": how, "resident_fraction": resident}


def page_cache_residency(folder: str, suffix: str = ".safetensors") -> float | None:
    """Fraction of the checkpoint's bytes in the page cache (util-linux ``fincore``), if available."""
    return files_residency(checkpoint_files(folder, suffix))


def files_residency(paths: list[str]) -> float | None:
    """Fraction of the bytes of ``paths`` in the page cache (util-linux ``fincore``), if available."""
    if not shutil.which("fincore"):
        return None
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *paths],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    res = size = 0
    for line in out.split("\n"):
        parts = line.split()
        if len(parts) == 2:
            res, size = res + int(parts[0]), size + int(parts[1])
    return round(res / size, 4) if size else None


def checkpoint_bytes(folder: str) -> int:
    from zload import open_checkpoint

    with open_checkpoint(folder) as index:
        return index.total_bytes
