"""The progress bar of long loads and saves: huggingface_hub's tqdm on rank 0, a shared no-op
elsewhere.

huggingface_hub's tqdm honours ``HF_HUB_DISABLE_PROGRESS_BARS`` and ``disable_progress_bars()``,
as the bars of its downloads do. It is imported only when a bar may be drawn: zload imports
without it. Other ranks, disabled bars and auto bars without a terminal get the no-op, so
the executor's reader threads can call ``update`` per read without a cost worth measuring.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

DELAY_S = 1.0  # nothing is drawn before this: a load that quick needs no bar
TTY_INTERVAL_S = 0.1  # at most ~10 redraws a second on a terminal
LOG_INTERVAL_S = 5.0  # a log file gets a redraw every few seconds, not ten a second


class Progress:
    """Reports bytes as they are read (or written). This base class draws nothing: it is what a
    disabled reporter, a rank other than 0, or an auto reporter without a terminal gets."""

    def update(self, nbytes: int) -> None:
        """``nbytes`` more bytes have been read (or written)."""

    def close(self) -> None:
        """The load or save is over (or failed): finish the line if one was drawn."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DISABLED = Progress()


class _Bar(Progress):
    """A tqdm ``bar`` behind a lock: tqdm's ``update`` adds to its count unguarded, and the
    executor's reader threads report concurrently."""

    def __init__(self, bar):
        self.bar = bar
        self.lock = threading.Lock()

    def update(self, nbytes: int) -> None:
        with self.lock:
            self.bar.update(nbytes)

    def close(self) -> None:
        with self.lock:
            self.bar.close()


def progress_for(total_bytes: int, *, rank: int, enabled: bool | None,
                 stream: TextIO | None = None) -> Progress:
    """The reporter for a load (or save) of ``total_bytes`` on ``rank``.

    ``enabled=None`` (auto): a bar on rank 0 when ``stream`` is a terminal; ``True``: on rank 0
    even without one (for log files); ``False``: never. In every case nothing is drawn during the
    first ``DELAY_S`` seconds, nor while huggingface_hub's progress bars are disabled. ``stream``
    defaults to ``sys.stderr`` (looked up at call time).
    """
    if enabled is False or rank != 0:
        return _DISABLED
    stream = sys.stderr if stream is None else stream
    tty = _isatty(stream)
    if enabled is None and not tty:
        return _DISABLED
    tqdm = _tqdm_class()
    if tqdm is None:
        return _DISABLED
    bar = tqdm(total=total_bytes, desc="zload", unit="B", unit_scale=True, file=stream,
               delay=DELAY_S, mininterval=TTY_INTERVAL_S if tty else LOG_INTERVAL_S)
    return _DISABLED if bar.disable else _Bar(bar)


def _tqdm_class():
    """huggingface_hub's tqdm; plain tqdm where zload is vendored without huggingface_hub; None
    (no bar) without either, since a progress bar is not worth a requirement."""
    try:
        from huggingface_hub.utils import tqdm
    except ImportError:
        try:
            from tqdm import tqdm
        except ImportError:
            return None
    return tqdm


def _isatty(stream) -> bool:
    """Asked here rather than through tqdm's ``disable=None``: it also picks the redraw interval,
    and an auto bar without a terminal then imports nothing."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
