"""zload.progress: who draws (rank 0, unless disabled by argument or by huggingface_hub), when
(after the delay, every so often) and what (bytes, decimal units); tqdm's clock is faked, so no
test sleeps."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time

import huggingface_hub.utils
import pytest
import tqdm

from zload.progress import DELAY_S, LOG_INTERVAL_S, TTY_INTERVAL_S, Progress, progress_for

from tests.support import REPO

GB = 10**9


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    """tqdm's clock (read through ``tqdm.std.time``), without its monitor thread, which would
    compare the real time with the fake one."""
    fake = Clock()
    monkeypatch.setattr("tqdm.std.time", fake)
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    return fake


def feed(progress, clock, steps: int, nbytes: int, dt: float) -> None:
    for _ in range(steps):
        clock.now += dt
        progress.update(nbytes)


@pytest.mark.parametrize("case", [
    dict(enabled=None, stream=io.StringIO()),  # auto without a terminal
    dict(enabled=False, stream=Terminal()),
    dict(enabled=None, rank=1, stream=Terminal()),
    dict(enabled=True, rank=3, stream=Terminal()),
])
def test_only_rank_0_draws_and_only_when_enabled(clock, case):
    progress = progress_for(4 * GB, **{"rank": 0, **case})
    feed(progress, clock, steps=20, nbytes=GB // 5, dt=0.5)
    progress.close()
    assert case["stream"].getvalue() == ""
    assert type(progress) is Progress  # the shared no-op: nothing to pay per update


@pytest.mark.parametrize("enabled", [None, True])
def test_the_bar_is_huggingface_hubs_tqdm_counting_bytes(clock, enabled):
    progress = progress_for(4 * GB, rank=0, enabled=enabled, stream=Terminal())
    assert isinstance(progress.bar, huggingface_hub.utils.tqdm)
    assert (progress.bar.total, progress.bar.unit, progress.bar.unit_scale) == (4 * GB, "B", True)
    progress.close()


def test_huggingface_hubs_disable_progress_bars_silences_it(clock):
    stream = Terminal()
    huggingface_hub.utils.disable_progress_bars()
    try:
        progress = progress_for(4 * GB, rank=0, enabled=True, stream=stream)
    finally:
        huggingface_hub.utils.enable_progress_bars()
    feed(progress, clock, steps=20, nbytes=GB // 5, dt=0.5)
    progress.close()
    assert type(progress) is Progress and stream.getvalue() == ""


def test_HF_HUB_DISABLE_PROGRESS_BARS_silences_it():
    # huggingface_hub reads the variable once, at import: hence a fresh process
    code = ("import sys; from zload.progress import progress_for; "
            "bar = progress_for(4 * 10**9, rank=0, enabled=True, stream=sys.stderr); "
            "print(type(bar).__name__)")
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Progress"


def test_quick_work_draws_nothing_then_the_bar_shows_bytes_and_ends_at_the_total(clock):
    stream = Terminal()
    with progress_for(4 * GB, rank=0, enabled=None, stream=stream) as progress:
        feed(progress, clock, steps=9, nbytes=GB // 10, dt=DELAY_S / 10)  # under the delay
        assert stream.getvalue() == ""
        feed(progress, clock, steps=31, nbytes=GB // 10, dt=0.5)
        assert "zload:" in stream.getvalue() and "\n" not in stream.getvalue()
    out = stream.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1  # closed by the with block
    last = out.rstrip("\n").split("\r")[-1]
    assert last.startswith("zload: 100%") and "4.00G/4.00G" in last and "MB/s" in last

    stream = Terminal()
    with progress_for(4 * GB, rank=0, enabled=True, stream=stream) as progress:
        feed(progress, clock, steps=4, nbytes=GB, dt=DELAY_S / 5)  # all of it, quickly
    assert stream.getvalue() == ""


@pytest.mark.parametrize("enabled, stream, interval", [
    (None, Terminal(), TTY_INTERVAL_S),
    (True, io.StringIO(), LOG_INTERVAL_S),  # a log file: a line every few seconds
])
def test_redraws_at_most_once_an_interval(clock, enabled, stream, interval):
    progress = progress_for(4 * GB, rank=0, enabled=enabled, stream=stream)
    feed(progress, clock, steps=400, nbytes=GB // 100, dt=0.05)  # 20 s at 20 updates a second
    progress.close()
    draws = stream.getvalue().count("\r")
    assert 20 / interval / 2 <= draws <= 20 / interval + 2


def test_reader_threads_reporting_at_once_draw_once_and_count_every_byte(clock):
    # A write that yields mid-draw lets other threads pass tqdm's "time to draw?" check before the
    # first has recorded its draw, unless the update, check and draw happen under one lock.
    class SlowTerminal(Terminal):
        def write(self, text):
            time.sleep(0.01)
            return super().write(text)

    stream = SlowTerminal()
    progress = progress_for(4 * GB, rank=0, enabled=True, stream=stream)
    clock.now += 2 * DELAY_S
    threads = [threading.Thread(target=progress.update, args=(GB,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stream.getvalue().count("\r") == 1
    progress.close()
    assert progress.bar.n == 4 * GB and "4.00G/4.00G" in stream.getvalue().split("\r")[-1]


def test_without_huggingface_hub_plain_tqdm_draws_and_without_tqdm_nothing(clock, monkeypatch):
    for name in ("huggingface_hub", "huggingface_hub.utils"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    progress = progress_for(4 * GB, rank=0, enabled=True, stream=Terminal())
    assert type(progress.bar) is tqdm.tqdm
    progress.close()
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert type(progress_for(4 * GB, rank=0, enabled=True, stream=Terminal())) is Progress
