"""zload.progress: who draws, when, and what; a fake clock and stream, so no test sleeps."""

from __future__ import annotations

import io

import pytest

from zload.progress import DELAY_S, PLAIN_INTERVAL_S, Progress, human_bytes, progress_for

GB = 10**9


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def make(total=4 * GB, *, rank=0, enabled=None, stream=None):
    clock = Clock()
    stream = io.StringIO() if stream is None else stream
    return progress_for(total, rank=rank, enabled=enabled, stream=stream, clock=clock), stream, clock


def feed(progress, clock, steps: int, nbytes: int, dt: float) -> None:
    for _ in range(steps):
        clock.now += dt
        progress.update(nbytes)


@pytest.mark.parametrize("case", [
    dict(enabled=None),  # auto without a terminal
    dict(enabled=False, stream=Terminal()),
    dict(enabled=None, rank=1, stream=Terminal()),
    dict(enabled=True, rank=3),
])
def test_silent_cases(case):
    progress, stream, clock = make(**case)
    feed(progress, clock, steps=100, nbytes=GB // 100, dt=0.5)
    progress.close()
    assert stream.getvalue() == ""
    assert type(progress) is Progress  # the no-op: nothing to pay per update


def test_auto_on_a_terminal_waits_then_redraws_in_place():
    progress, stream, clock = make(stream=Terminal())
    feed(progress, clock, steps=9, nbytes=GB // 10, dt=DELAY_S / 10)  # under the delay
    assert stream.getvalue() == ""
    feed(progress, clock, steps=30, nbytes=GB // 10, dt=0.05)  # 1.5 s at 20 updates a second
    out = stream.getvalue()
    draws = out.count("\r")
    assert 1 <= draws <= 16 and "\n" not in out  # ~10 redraws a second at most
    progress.close()
    out = stream.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1
    last = out.rstrip("\n").split("\r")[-1]
    assert last.startswith("zload: 3.90/4.00 GB   97%") and "GB/s" in last and "eta" in last


def test_enabled_without_a_terminal_prints_plain_lines_every_few_seconds():
    progress, stream, clock = make(enabled=True)
    feed(progress, clock, steps=40, nbytes=GB // 10, dt=0.5)  # 20 s, 4 GB
    progress.close()
    out = stream.getvalue()
    lines = out.splitlines()
    assert "\r" not in out
    assert 2 <= len(lines) <= 20 / PLAIN_INTERVAL_S + 2
    assert lines[0].startswith("zload: 0.") and "/4.00 GB" in lines[0]
    assert lines[-1].startswith("zload: 4.00/4.00 GB  100%")  # close shows where the load ended


def test_close_adds_a_newline_only_after_drawing():
    progress, stream, clock = make(stream=Terminal())
    feed(progress, clock, steps=3, nbytes=GB, dt=0.1)  # a quick load
    progress.close()
    assert stream.getvalue() == ""

    progress, stream, clock = make(enabled=True, stream=Terminal())
    feed(progress, clock, steps=2, nbytes=GB, dt=DELAY_S)
    progress.close()
    progress.close()  # idempotent
    assert stream.getvalue().endswith("\n") and stream.getvalue().count("\n") == 1


def test_context_manager_closes():
    progress, stream, clock = make(enabled=True, stream=Terminal())
    with progress:
        feed(progress, clock, steps=1, nbytes=GB, dt=2 * DELAY_S)
    assert stream.getvalue().endswith("\n")


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(999) == "999 B"
    assert human_bytes(1234) == "1.23 KB"
    assert human_bytes(4_560_000_000) == "4.56 GB"
    assert human_bytes(2 * 10**12) == "2.00 TB"


def test_reader_threads_reporting_at_once_draw_one_line():
    # The executor's reader threads report concurrently. A write that yields mid-draw lets a second
    # thread pass the "time to draw?" check before the first has recorded its draw, unless the
    # check and the draw happen under one lock.
    import threading
    import time

    class SlowStream(io.StringIO):
        def write(self, text):
            time.sleep(0.01)
            return super().write(text)

    bar, stream, clock = make(enabled=True, stream=SlowStream())
    clock.now += DELAY_S + 1
    threads = [threading.Thread(target=bar.update, args=(GB,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bar.done == 4 * GB
    assert len(stream.getvalue().splitlines()) == 1
