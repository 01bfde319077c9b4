"""Digests of checkpoint data: what tells two copies of a file apart, and a file from its record.

- ``sample_digests``: a cheap fingerprint of each file's data, ``SAMPLE_WINDOWS`` windows of
  ``SAMPLE_BYTES`` spread evenly over it (small windows: hashing, not reading, dominates when the
  data are cached). Every rank of a multi-rank load takes it of every file
  it can see, so that copies on different nodes whose headers match but whose data differ (a
  stale copy of an earlier fine-tune) are refused before anything is written.
- ``data_digest``: the SHA-256 of the SHA-256s of the data area's ``BLOCK_BYTES`` blocks. Any rank
  can hash any block, so the work splits over ranks. ``zload.save`` records it in each file's
  metadata (``DIGEST_KEY``), which makes two saves with different weights differ in their
  headers; ``load_into(..., verify="full")`` recomputes it.

Pure Python: reads through a file descriptor, no torch.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

from .pagecache import prefetch_if_uncached

SAMPLE_WINDOWS = 64
SAMPLE_BYTES = 512
BLOCK_BYTES = 16 << 20
DIGEST_KEY = "zload_data_digest"  # in a safetensors header's __metadata__
DIGEST_SCHEME = "sha256/16MiB:"  # the value's prefix: what was hashed, and how
DIGEST_PLACEHOLDER = DIGEST_SCHEME + "0" * 64  # written first, replaced in place once known


def sample_windows(data_start: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of the windows ``sample_digests`` reads: evenly spread from the first data
    byte to the last; the whole data area when it is no larger than the windows together."""
    length = size - data_start
    if length <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        return [(data_start, length)] if length else []
    last = length - SAMPLE_BYTES
    return [(data_start + last * k // (SAMPLE_WINDOWS - 1), SAMPLE_BYTES) for k in range(SAMPLE_WINDOWS)]


def _pread(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise OSError(f"file ends at byte {offset + len(data)}, before {offset + length}")
    return data


def sample_digests(files: list[tuple[int, int, int]]) -> tuple[list[str], list[tuple[int, int, int]]]:
    """For each ``(fd, data start, size)``: the SHA-256 of the sampled windows of its data; and
    the windows, as ``(fd, offset, length)``, of the files that looked uncached, which this call
    brought into the page cache (for ``pagecache.forget`` once no rank samples any more).

    One thread: from the page cache, threads cost more than the few hundred small reads they
    would share (benchmarks/README.md, verify.py). From a cold cache
    the windows are all hinted to the kernel first, so the device fetches them together rather
    than one wait each."""
    digests, brought = [], []
    for fd, data_start, size in files:
        windows = sample_windows(data_start, size)
        brought += [(fd, offset, length) for offset, length in prefetch_if_uncached(fd, windows)]
        digest = hashlib.sha256()
        for offset, length in windows:
            digest.update(_pread(fd, length, offset))
        digests.append(digest.hexdigest())
    return digests, brought


def block_count(data_start: int, size: int) -> int:
    return -(-(size - data_start) // BLOCK_BYTES)


def block_digests(fd: int, data_start: int, size: int, blocks, threads: int = 1) -> dict[int, bytes]:
    """The SHA-256 of each of ``blocks`` (block numbers) of a file's data area."""
    def one(k: int) -> tuple[int, bytes]:
        offset = data_start + k * BLOCK_BYTES
        return k, hashlib.sha256(_pread(fd, min(BLOCK_BYTES, size - offset), offset)).digest()

    blocks = list(blocks)
    if threads <= 1 or len(blocks) <= 1:
        return dict(map(one, blocks))
    with ThreadPoolExecutor(min(threads, len(blocks)), thread_name_prefix="zload-digest") as pool:
        return dict(pool.map(one, blocks))


def data_digest(digests: dict[int, bytes], count: int) -> str:
    """The recorded form (``DIGEST_SCHEME`` + hex) of a file whose ``count`` block digests these are."""
    return DIGEST_SCHEME + hashlib.sha256(b"".join(digests[k] for k in range(count))).hexdigest()


def recorded_mismatch(path: str, metadata: dict[str, str], digest: str) -> str | None:
    """What is wrong when a file's data digest is not the one recorded in its header, if any."""
    recorded = metadata.get(DIGEST_KEY)
    if recorded is None or recorded == digest:
        return None
    return (f"{path}: its data do not match the digest recorded when it was saved ({recorded}, "
            f"read {digest}): the file is corrupt")
