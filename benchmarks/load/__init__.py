"""Load benchmark: transformers ``from_pretrained`` under ZeRO-3 and PyTorch DCP vs ``zload.load_into`` vs
the I/O floor and the device's ceiling.

    python -m benchmarks.load --size 300MB 600MB@2 --world 1 2 --runs 3
    torchrun --nproc_per_node 8 -m benchmarks.load --size 16GB --world 1 2 4 8

For each size it writes (once, into a cache directory) a Llama-shaped bf16 checkpoint with
transformers' ``save_pretrained`` (sharded), reads it once so the page cache is warm, and then, for
each world size, method and run, starts a fresh world of W ranks (so peak RSS is that method's):

- ``floor``: each rank ``os.preadv``s exactly its ZeRO-3 byte ranges (the ones zload reads) into a
  preallocated buffer. Only the reads are timed: the I/O floor for a partitioned load.
- ``ceiling``: each rank reads a contiguous 1/W span of the files (concatenated in sorted order)
  with ``os.preadv`` in 16 MiB blocks from 4 threads: the best time for the storage device to read the
  same files with large blocks and parallel readers. ``ceiling-1``: the same with one thread a rank
  (narrowly faster at 300 MB W=2 here, slower elsewhere); the targets take the faster of the two measured.
- ``alloc-floor``: each rank allocates (``torch.empty``) and touches (``fill_``) exactly its ZeRO-3
  partitions, one tensor each, in the models' dtype and where zload keeps them (the GPU where CUDA
  is): the floor for building a partitioned model.
- ``zload``: build the model under ``deepspeed.zero.Init`` (timed as construct), then
  ``zload.load_into`` (timed as load).
- ``zload+init``: build under ``zload.init`` (no weight init, no broadcast), then ``load_into``.
- ``dcp``: ``torch.distributed.checkpoint.load`` with its ``HuggingFaceStorageReader`` into one DTensor
  per checkpoint tensor, sharded by rows (``Shard(0)``) over a device mesh of the W ranks (their
  GPUs where CUDA is, as zload's partitions, else the CPU); the local shards are allocated and
  touched before the load, which alone is timed.
- ``dcp-after-zero.Init``, ``dcp-after-zload.init``: controls for ``dcp``. The model is first built
  as for ``zload`` or ``zload+init`` (timed as construct) and kept, then DCP loads as above: its read
  after the same construction as zload's. (On this project's VM, after zero.Init built a 2.4 GB
  model, cold loads by both were slower.)
- ``transformers``: ``LlamaForCausalLM.from_pretrained`` with a live ``HfDeepSpeedConfig`` (ZeRO-3):
  construct + load is the whole call, the load step is its ``_load_pretrained_model``.

Run plainly, the script launches each world itself (``python -m torch.distributed.run``). Run under
``torchrun`` (any number of nodes), the torchrun ranks only coordinate: for each measurement every
rank below W starts one fresh worker process, and those workers form the measured world (NCCL and
partitions on the GPUs when CUDA is available, else gloo on CPU).

Each worker reports per rank: seconds (barrier to barrier, so the slowest rank's time), peak RSS
(the kernel's high-water mark, reset at every segment boundary), bytes read and the bytes
received through collectives (counted by wrapping torch.distributed's collectives). The parent
takes the max over ranks of each run and the median over runs, and writes
``OUT/load-<name>.json``, ``.md`` and ``.png``.

Package layout: ``checkpoint`` (sizes, the Llama checkpoint, the page cache), ``methods`` (what
each method does in a worker), ``worker`` (one rank of a measured world: metering and reporting),
``launch`` (starting worlds, plainly or under torchrun), ``report`` (aggregation, table and plot),
``targets`` (the targets' verdicts) and ``__main__`` (the command line and the measuring loop).
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO = os.path.dirname(HERE)
METHODS = ("floor", "ceiling", "ceiling-1", "alloc-floor", "zload", "zload+init", "dcp", "dcp-after-zero.Init",
           "dcp-after-zload.init", "transformers")
DEFAULT_STAGING = 64 << 20  # zload's default staging_bytes (zload.loading.execute.DEFAULT_STAGING_BYTES)
SLACK = 64_000_000  # the memory target: growth <= staging + 64 MB
MB = 1e6


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_order(methods: list[str], run: int) -> list[str]:
    """The methods of one round: interleaved, so drift affects every method alike, in the rows of a
    Williams design (for an odd n each row and then its mirror), so that what runs just before a method
    changes from round to round and over n rounds (2n for an odd n) each method follows every other
    equally often. On this project's VM zload.init's cold load at 300 MB W=2 took 0.19 s right after
    zload's zero.Init world against 0.15 s first in its round, and with a fixed order it always came
    after zload; the resume from DeepSpeed's files, always right after DeepSpeed's universal load in a
    plain rotation, ran slower there. Each run records the step measured before it (``after``)."""
    n = len(methods)
    steps = [0] + [(i + 1) // 2 if i % 2 else n - i // 2 for i in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    row = run // 2 if n % 2 else run
    order = [methods[(step + row) % n] for step in steps]
    return order[::-1] if n % 2 and run % 2 else order


def exit_without_teardown(status: int) -> None:
    """Leave a measured rank now, output flushed, without the interpreter's teardown: gloo sometimes
    aborts there after DeepSpeed (see examples/demo.py), which would fail a finished measurement."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
