"""One progress line at a time for a long stage, printed by the driver when stdout is not a terminal.

In logs and `ray job submit` output Ray Data's bars would become an 8-line status block every 10 s (its
non-TTY mode), and they count Ray Data rows (work units, groups), not pairs; init_ray turns them off there
and each long stage reports `[stage] done/total rows (pct), rows/s, ETA` instead. On a terminal Ray
Data's own bars show progress and these lines stay silent.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def format_duration(seconds: float) -> str:
    """42s, 3m05s, 1h02m."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_rate(rate: float, unit: str) -> str:
    """39.5 rows/s; below one a second, per minute or per hour (a mine search group takes minutes: not 0.0/s)."""
    if rate >= 1 or rate <= 0:
        return f"{rate:,.1f} {unit}/s"
    if rate * 60 >= 1:
        return f"{rate * 60:,.1f} {unit}/min"
    return f"{rate * 3600:,.1f} {unit}/h"


def format_progress(stage: str, done: int, total: int, elapsed_s: float, unit: str = "rows") -> str:
    """`[embed] 1,200/3,781 rows (32%), 39.5 rows/s, ETA 1m05s`; ETA ? until a rate is known."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    eta = format_duration((total - done) / rate) if rate > 0 else "?"
    share = f"{done / total:.0%}" if total else "-"
    return f"[{stage}] {done:,}/{total:,} {unit} ({share}), {format_rate(rate, unit)}, ETA {eta}"


class ProgressLine:
    """Counts finished rows of a stage; prints format_progress at most every interval_s (not on a TTY).

    Nothing is printed at completion: the stage's own summary line follows."""

    def __init__(self, stage: str, total: int, unit: str = "rows", interval_s: float = 10.0,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic, on_tty: bool = False):
        self.stage, self.total, self.unit, self.interval_s = stage, total, unit, interval_s
        self.stream = stream or sys.stdout
        self.enabled = on_tty or not self.stream.isatty()  # on_tty: work without Ray Data's bars (plain tasks)
        self.clock = clock
        self.started = self.last_printed = clock()
        self.done = 0

    def advance(self, rows: int) -> None:
        self.done += rows
        now = self.clock()
        if self.enabled and self.done < self.total and now - self.last_printed >= self.interval_s:
            self.last_printed = now
            print(format_progress(self.stage, self.done, self.total, now - self.started, self.unit),
                  file=self.stream, flush=True)
