"""A dependency-free progress bar on stderr (terminals only) that appears once work has taken over a second."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, delay_s: float = 1.0, stream=None):
        self.total, self.label, self.delay_s = max(1, total), label, delay_s
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.shown = False
        self.last = 0.0
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay_s or now - self.last < 0.2:
            return
        self.last, self.shown = now, True
        frac = min(1.0, done / self.total)
        bar = "#" * int(30 * frac)
        rate = done / (now - self.t0)
        self.stream.write(f"\r{self.label} [{bar:<30}] {done}/{self.total} ({rate:,.0f}/s)")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.update(self.total)
            self.stream.write("\n")
            self.stream.flush()
