"""Node-local checkpoints: ranks that cannot see a file get its bytes from ranks that can.

``checkpoint.open_agreed`` has settled which ranks can read which files (``SharedIndex``). Each
rank that lacks a file asks one of its readers for exactly the byte ranges it would have read
itself; readers send them point to point in bounded batches (``fetch_remote``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ..checkpoint.views import SharedIndex
from ..distributed import (
    BATCH_FAILED,
    BATCH_OK,
    Problem,
    collective,
    comm_device,
    exchange,
    problems_of,
    rank_and_world,
)
from ..errors import CheckpointError
from ..kernels import Segment, scatter_cast
from .execute import DEFAULT_STAGING_BYTES, RangeReader, byte_view
from .plan import ALIGN, ReadItem, staging_batches


def _server(readers: list[int], requester: int, world: int) -> int:
    """The reader that serves ``requester``: the ranks lacking a file are spread over its readers."""
    lacking = [r for r in range(world) if r not in readers]
    return readers[lacking.index(requester) % len(readers)]


def fetch_remote(shared: SharedIndex, items: list[ReadItem], dests: list[torch.Tensor],
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> tuple[int, int, int, list]:
    """Exchange the byte ranges ``items`` (this rank's reads of files it lacks) with their readers.

    Every rank must call this when ``shared.sharing``. Returns (bytes read for others, bytes
    sent, bytes received, problems). Pairs (reader -> requester) are served in one global order, so
    the sends and receives cannot deadlock. Within a pair, batches of half of
    ``staging_bytes`` alternate between two buffers: the reader reads the next batch while the
    last is being sent, the requester receives the next while writing the last.
    Each batch ends in a status byte: a reader whose read fails still sends every batch it owes
    (marked failed, unread), and a rank that fails to write what it received keeps receiving, so
    no rank waits forever; the caller agrees on the problems.
    """
    rank, world = rank_and_world()
    requests = [(_server(shared.readers[i.file], rank, world), i) for i in items]
    wire = [(server, i.file, i.offset, i.nbytes, i.numel, i.src_dtype) for server, i in requests]
    everyone = exchange(wire)
    read = sent = received = 0
    problems: list[Problem] = []
    capacity = max(ALIGN * 2, staging_bytes // 2)
    outboxes = inboxes = None  # allocated once, when first needed; fresh ones would page-fault
    with RangeReader(shared.index.opened) as reader:  # its threads serve every batch read here
        for requester in range(world):
            for server in sorted({w[0] for w in everyone[requester]}):
                if rank == server:
                    mine = [ReadItem(k, offset, nbytes, dtype, 0, 0, numel)
                            for s, k, offset, nbytes, numel, dtype in everyone[requester] if s == server]
                    outboxes = outboxes or [torch.empty(capacity + 1, dtype=torch.uint8) for _ in range(2)]
                    got, out, problems = _serve(staging_batches(mine, capacity), requester, outboxes, reader,
                                                problems)
                    read, sent = read + got, sent + out
                elif rank == requester:
                    mine = [i for s, i in requests if s == server]
                    inboxes = inboxes or [torch.empty(capacity + 1, dtype=torch.uint8, device=comm_device())
                                          for _ in range(2)]
                    got, problems = _receive(staging_batches(mine, capacity), server, inboxes, dests, problems)
                    received += got
    return read, sent, received, problems


def _used(batch: list[tuple[int, ReadItem]]) -> int:
    return batch[-1][0] + batch[-1][1].nbytes


def _serve(batches, requester: int, outboxes: list[torch.Tensor], reader: RangeReader,
           problems: list) -> tuple[int, int, list]:
    """Read and send each batch to ``requester``; returns (bytes read, bytes sent, problems).

    Batch k goes through ``outboxes[k % 2]``, whose send from batch k - 2 was waited for before
    batch k - 1 was sent.
    """
    read = sent = 0
    in_flight = None  # (work, the tensor being sent)
    for k, batch in enumerate(batches):
        used = _used(batch)
        message = outboxes[k % 2][:used + 1]  # the batch, then its status
        if not problems:
            view = byte_view(message)
            ranges = [(part.file, part.offset, view[start:start + part.nbytes]) for start, part in batch]
            got, problems = problems_of(f"reading for rank {requester}", partial(reader.read, ranges))
            read += got or 0
        message[used] = BATCH_FAILED if problems else BATCH_OK
        with collective():
            if in_flight is not None:
                in_flight[0].wait()
            outgoing = message.to(comm_device())
            in_flight = (dist.isend(outgoing, dst=requester), outgoing)
        sent += used
    if in_flight is not None:
        with collective():
            in_flight[0].wait()
    return read, sent, problems


def _receive(batches, server: int, inboxes: list[torch.Tensor], dests: list[torch.Tensor],
             problems: list) -> tuple[int, list]:
    """Receive each batch from ``server`` and write it; returns (bytes received, problems).

    Batch k lands in ``inboxes[k % 2]``, posted once batch k - 2 has been written from it.
    """
    received = 0
    pending = None  # (work, buffer, batch) received into but not yet written
    for k, batch in enumerate(batches):
        used = _used(batch)
        incoming = inboxes[k % 2][:used + 1]
        with collective():
            work = dist.irecv(incoming, src=server)
        if pending is not None:
            problems = _write_received(*pending, server, dests, problems)
        pending = (work, incoming, batch)
        received += used
    if pending is not None:
        problems = _write_received(*pending, server, dests, problems)
    return received, problems


def _write_received(work, incoming: torch.Tensor, batch, server: int, dests: list[torch.Tensor],
                    problems: list) -> list:
    """Wait for one received batch and write it into ``dests``, unless the load already failed."""
    with collective():
        work.wait()
    if int(incoming[-1]) != BATCH_OK and not problems:
        problems = [*problems, Problem(CheckpointError, f"rank {server} could not read the bytes this rank "
                                                        f"lacks (see rank {server}'s problem)")]
    if problems:
        return problems  # the load has failed: keep receiving, write no more
    segments = [Segment(start, part.src_dtype, part.numel, part.target, part.dst_offset)
                for start, part in batch]
    _, problems = problems_of(f"writing the bytes rank {server} sent",
                              partial(scatter_cast, incoming, segments, dests))
    return problems
