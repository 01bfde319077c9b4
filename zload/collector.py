"""Python's cyclic garbage collector, paused while zload builds, plans and copies."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def collector_paused():
    """Pause the cyclic garbage collector for the block (usable as a decorator).

    Building a model and planning a load allocate many small objects. In a process that holds a
    large model (or has imported transformers and DeepSpeed), each full collection they trigger
    walks every live object, which can take longer than the reads of such a load (benchmarks/README.md,
    the zload.init targets). Reference counting still frees memory;
    cycles created in the block are collected after it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
