"""Dependency-free progress display on stderr, for terminals only, that appears once work has taken over a
second (``delay_s``): ``Progress`` counts done items against a total; ``Heartbeat`` shows the time spent
against an estimate for work that reports no progress of its own (it redraws from a daemon thread).

Both are context managers: on a clean exit the bar is completed, on an exception it is only ended with a
newline, so an error message printed next starts on its own line. Off a terminal both do nothing.
"""

from __future__ import annotations

import sys
import threading
import time


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


class Progress:
    def __init__(self, total: int, label: str, delay_s: float = 1.0, stream=None):
        self.total, self.label, self.delay_s = max(1, int(total)), label, delay_s
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.shown = False
        self.last = 0.0
        self.done = 0
        self.enabled = _is_tty(self.stream)

    def update(self, done: int) -> None:
        self.done = done
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay_s or now - self.last < 0.2:
            return
        self._draw(done, now)

    def _draw(self, done: int, now: float) -> None:
        self.last, self.shown = now, True
        frac = min(1.0, done / self.total)
        bar = "#" * int(30 * frac)
        el = now - self.t0
        rate = done / el if el > 0 else 0.0
        eta = f", {_duration((self.total - done) / rate)} left" if 0 < rate and done < self.total else ""
        self.stream.write(f"\r{self.label} [{bar:<30}] {done}/{self.total} ({rate:,.0f}/s{eta})  ")
        self.stream.flush()

    def close(self, completed: bool = True) -> None:
        if self.shown:
            if completed:
                self._draw(self.total, time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(completed=exc_type is None)


class Heartbeat:
    """``with Heartbeat("verify", estimate_s=30): verify(...)``: after ``delay_s`` a line with the elapsed
    time (and a bar against the estimate, held below 100% while the work goes on) is redrawn every 0.25 s."""

    def __init__(self, label: str, estimate_s: float | None = None, delay_s: float = 1.0, stream=None):
        self.label, self.estimate_s, self.delay_s = label, estimate_s, delay_s
        self.stream = stream or sys.stderr
        self.enabled = _is_tty(self.stream)
        self.shown = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _line(self, el: float) -> str:
        if not self.estimate_s:
            return f"\r{self.label}: {_duration(el)} so far  "
        frac = min(0.99, el / self.estimate_s)
        bar = "#" * int(30 * frac)
        return f"\r{self.label} [{bar:<30}] {_duration(el)} of about {_duration(self.estimate_s)} (estimated)  "

    def _run(self) -> None:
        t0 = time.perf_counter()
        if self._stop.wait(self.delay_s):
            return
        while not self._stop.is_set():
            self.stream.write(self._line(time.perf_counter() - t0))
            self.stream.flush()
            self.shown = True
            self._stop.wait(0.25)

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="turnip-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self.shown:
                self.stream.write("\n")
                self.stream.flush()
