"""A tiny progress reporter for long loads, drawn on stderr by rank 0 only.

Dependency-free on purpose: zload is vendored into other trees, and a progress bar is not worth a
requirement. Quick loads print nothing (drawing starts only after ``DELAY_S``), other ranks print
nothing (one bar per job, not one per rank), and a disabled reporter is a shared no-op object, so
the executor's reader threads can call ``update`` per read without a cost worth measuring.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, TextIO

DELAY_S = 1.0  # nothing is drawn before this: a load that quick needs no bar
TTY_INTERVAL_S = 0.1  # at most ~10 redraws a second on a terminal
PLAIN_INTERVAL_S = 5.0  # log files get a plain line every few seconds, not a stream of \r

_UNITS = ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"))


def _unit(nbytes: float) -> tuple[float, str]:
    """The decimal unit ``nbytes`` reads best in (as disk and download tools count)."""
    for scale, label in _UNITS:
        if abs(nbytes) >= scale:
            return scale, label
    return 1, "B"


def human_bytes(nbytes: float) -> str:
    """``1234567`` -> ``"1.23 MB"``; whole bytes below 1 KB."""
    scale, label = _unit(nbytes)
    return f"{int(nbytes)} B" if scale == 1 else f"{nbytes / scale:.2f} {label}"


def _human_seconds(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Reports bytes as they are read. This base class draws nothing: it is what a disabled
    reporter, a rank other than 0, or an auto reporter without a terminal gets."""

    def update(self, nbytes: int) -> None:
        """``nbytes`` more bytes have been read."""

    def close(self) -> None:
        """The load is over (or failed): finish the line if one was drawn."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DISABLED = Progress()


class _Bar(Progress):
    """Draws ``zload: 1.23/4.56 GB  27%  2.10 GB/s  eta 3s``: redrawn in place with ``\\r`` on a
    terminal, as separate lines every ``PLAIN_INTERVAL_S`` otherwise."""

    def __init__(self, total: int, stream: TextIO, clock: Callable[[], float], tty: bool):
        self.total, self.stream, self.clock, self.tty = total, stream, clock, tty
        self.interval = TTY_INTERVAL_S if tty else PLAIN_INTERVAL_S
        self.started = clock()
        self.done = 0
        self.shown: int | None = None  # ``done`` when last drawn; None until the first draw
        self.last_draw = float("-inf")
        self.width = 0  # longest line drawn, so a shorter redraw blanks the rest
        self.closed = False
        self.lock = threading.Lock()  # the executor's reader threads report concurrently

    def update(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            now = self.clock()
            if (not self.closed and now - self.started >= DELAY_S
                    and now - self.last_draw >= self.interval):
                self._draw(now)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.shown is None:
                return  # never drawn: a quick load stays silent
            if self.tty or self.shown != self.done:
                self._draw(self.clock())  # show where the load really ended
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()

    def line(self, now: float) -> str:
        scale, label = _unit(self.total)
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        percent = 100 * self.done // self.total if self.total else 100
        text = f"zload: {self.done / scale:.2f}/{self.total / scale:.2f} {label}  {percent:3d}%"
        if rate > 0:
            text += f"  {human_bytes(rate)}/s"
            if self.done < self.total:
                text += f"  eta {_human_seconds((self.total - self.done) / rate)}"
        return text

    def _draw(self, now: float) -> None:
        text = self.line(now)
        if self.tty:
            self.width = max(self.width, len(text))
            self.stream.write("\r" + text.ljust(self.width))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.shown, self.last_draw = self.done, now


def progress_for(total_bytes: int, *, rank: int, enabled: bool | None,
                 stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> Progress:
    """The reporter for a load of ``total_bytes`` on ``rank``.

    ``enabled=None`` (auto): a bar on rank 0 when ``stream`` is a terminal; ``True``: on rank 0
    even without one (plain lines then, for log files); ``False``: never. In every case nothing is
    drawn during the first ``DELAY_S`` seconds. ``stream`` defaults to ``sys.stderr`` (looked up
    at call time); ``stream`` and ``clock`` are there for tests.
    """
    if enabled is False or rank != 0:
        return _DISABLED
    stream = sys.stderr if stream is None else stream
    tty = _isatty(stream)
    if enabled is None and not tty:
        return _DISABLED
    return _Bar(total_bytes, stream, clock, tty)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
