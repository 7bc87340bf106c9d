"""One progress line at a time for a long stage, printed by the driver when stdout is not a terminal.

In logs and `ray job submit` output Ray Data's bars would become an 8-line status block every 10 s (its
non-TTY mode), and they count Ray Data rows (work units, groups), not pairs; init_ray turns them off there
and each long stage reports `[stage] done/total rows (pct), rows/s, ETA` instead. On a terminal Ray
Data's own bars show progress and these lines stay silent.

A line is printed when work finishes; while none does (a shuffle's barrier, one long unit: at 100M pairs mine
routes and shuffles for tens of minutes before its first search group ends), a heartbeat thread repeats the line
with the time that step has run every HEARTBEAT_S.
"""
from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Callable, TextIO

HEARTBEAT_S = 60.0  # the longest a stage's log stays silent off a terminal while no unit finishes


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
    """Counts finished rows of a step of a stage; prints format_progress at most every interval_s (not on a TTY),
    and while no row finishes, every heartbeat_s (HEARTBEAT_S; None: never) with the time since the line was made
    and, before the first, `before_first` (what runs until then).

    Nothing is printed at completion: the stage's own summary line follows. The heartbeat thread ends with the
    work (done >= total), with close(), or once the line is no longer referenced (the stage returned or failed)."""

    def __init__(self, stage: str, total: int, unit: str = "rows", interval_s: float = 10.0,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic, on_tty: bool = False,
                 heartbeat_s: float | None = HEARTBEAT_S, before_first: str | None = None):
        self.stage, self.total, self.unit, self.interval_s = stage, total, unit, interval_s
        self.stream = stream or sys.stdout
        self.enabled = on_tty or not self.stream.isatty()  # on_tty: work without Ray Data's bars (plain tasks)
        self.clock = clock
        self.started = self.last_printed = clock()
        self.done = 0
        self.closed = False
        self.heartbeat_s, self.before_first = heartbeat_s, before_first
        self._lock, self._over = threading.Lock(), threading.Event()
        self.heartbeat = None  # the thread, when there is one
        if self.enabled and heartbeat_s and total > 0:
            self.heartbeat = threading.Thread(target=_heartbeat, args=(weakref.ref(self), heartbeat_s, self._over),
                                              daemon=True, name=f"progress-{stage}")
            self.heartbeat.start()

    def advance(self, rows: int) -> None:
        with self._lock:
            self.done += rows
            if self.done >= self.total:
                self._over.set()
        now = self.clock()
        if self.enabled and self.done < self.total and now - self.last_printed >= self.interval_s:
            self._print(now, format_progress(self.stage, self.done, self.total, now - self.started, self.unit))

    def close(self) -> None:
        """End the heartbeat (the stage's work is over, whatever its count)."""
        with self._lock:
            self.closed = True
            self._over.set()

    @property
    def finished(self) -> bool:
        return self.closed or self.done >= self.total

    def beat(self) -> bool:
        """Print the heartbeat line if nothing was printed for heartbeat_s; False once the work is over."""
        with self._lock:  # not after the work ended (the stage's summary line may follow at once)
            if self.finished:
                return False
            now = self.clock()
            if now - self.last_printed >= self.heartbeat_s:
                line = format_progress(self.stage, self.done, self.total, now - self.started, self.unit)
                note = f"; {self.before_first}" if self.before_first and not self.done else ""
                self._write(now, f"{line} (running for {format_duration(now - self.started)}{note})")
            return True

    def _print(self, now: float, line: str) -> None:
        with self._lock:  # the heartbeat thread and the stage's own calls
            self._write(now, line)

    def _write(self, now: float, line: str) -> None:
        """One write per line (print's two could interleave with another thread's output); under _lock."""
        self.last_printed = now
        self.stream.write(line + "\n")
        self.stream.flush()


def _heartbeat(ref: "weakref.ref[ProgressLine]", period: float, over: threading.Event) -> None:
    """The heartbeat thread: checks every few seconds (at most period / 4) while the line lives and is not over
    (`over` wakes it at once when the work ends)."""
    while not over.wait(min(5.0, period / 4)):
        line = ref()
        try:
            if line is None or not line.beat():
                return
        except (ValueError, OSError):  # the stream was closed under it (a captured test output, a closed pipe)
            return
        finally:
            del line
