"""Ctrl-C (SIGINT) and SIGTERM (`ray job stop`, `kill`, a scheduler's preemption) for the command line and the jobs:
stop within seconds with exit 130 (143 for SIGTERM), keep every finished unit.

A stage's finished work is already safe against a kill (units, checkpoints and done markers are written under a
temporary name and renamed; a rerun skips what is complete and clears temporary leftovers), so the first SIGINT
says so in one line, gives back this process's stage locks and ends the process with os._exit(130), as a kill
would; a second SIGINT ends it at once (a lock on an object store that does not answer). Nothing unwinds: a
KeyboardInterrupt raised in Ray Data's iterator or in a Ray Train fit printed a traceback or was turned into an exit
0. Ray is left to notice the driver is gone, as after a kill: a joined cluster ends the driver's tasks and actors,
a local instance dies with the process that started it. No ray.shutdown() first: the main thread still runs
meanwhile, and Ray calls failing or a Ray Data stream ending under it could let a stage take a partial output for
a whole one.

Why a watcher thread reading a wakeup fd rather than the Python handler itself: a Python handler runs only when
the main thread gets back to the interpreter, and a library may replace it (Ray Train's fit() does: abort the
run, exit 0 at the third signal; `keep_sigint` stops that). The C-level handler writes every signal to the wakeup
fd whatever Python handler is installed, so the watcher sees each SIGINT in time. The Python handler installed
here does nothing; it also replaces SIG_IGN, which a process started in the background by a non-interactive shell
(`clusterscale run ... &` in a script) inherits for SIGINT and under which Ctrl-C was silently ignored.

SIGTERM takes the same path. ray.init() gives a driver a SIGTERM handler of its own (sys.exit on the main thread:
the stage unwinds from wherever it is, and a library on the way may catch the exit, as Ray Train's fit() turned a
KeyboardInterrupt into a normal return), so runtime/session.init_ray takes SIGTERM back after it (reclaim_sigterm).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_CODES = {signal.SIGINT: EXIT_INTERRUPTED, signal.SIGTERM: EXIT_TERMINATED}
MESSAGE = "interrupted: finished units are kept; rerun the same command to resume"
RELEASE_TIMEOUT_S = 5.0  # the most the first SIGINT waits for the locks to be given back (an object store)
FLUSH_TIMEOUT_S = 1.0  # the most it waits for buffered output (a full pipe must not hold the exit)

_messages = [MESSAGE]  # the line the first SIGINT prints: the innermost `saying` in force
_wakeup: tuple[socket.socket, socket.socket] | None = None  # kept referenced: the C handler writes to it
_stopping = threading.Event()  # set by the first SIGINT; the main thread must not end the process meanwhile
_on_stop: list[Callable[[], None]] = []  # what the stop does before it exits (run_protocol: give the stage locks back)


def on_stop(work: Callable[[], None]) -> None:
    """Have the first SIGINT / SIGTERM run `work` (bounded by RELEASE_TIMEOUT_S, with the others) before it exits."""
    if work not in _on_stop:
        _on_stop.append(work)


def _run_on_stop() -> None:
    for work in list(_on_stop):
        work()


def install() -> bool:
    """Take over SIGINT and SIGTERM for this process (idempotent). Only from the main thread of a program's entry
    point: a library caller (a test calling cli.main) keeps its own. False when not installed (not the main
    thread)."""
    global _wakeup
    if _wakeup is not None:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    reader, writer = socket.socketpair()
    reader.setblocking(True)
    writer.setblocking(False)  # the C handler must never block on a full buffer
    for number in EXIT_CODES:
        signal.signal(number, _ignore)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _wakeup = (reader, writer)
    threading.Thread(target=_watch, args=(reader,), name="clusterscale-sigint", daemon=True).start()
    atexit.register(_wait_for_stop)
    return True


def installed() -> bool:
    return _wakeup is not None


def reclaim_sigterm() -> None:
    """Take SIGTERM back from a handler set after install() (ray.init's sys.exit): on the main thread, when
    installed."""
    if installed() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _ignore)


def keep_sigint(obj, method: str) -> None:
    """Make obj.<method> (a library's own SIGINT registration, e.g. Ray Train's trainer._register_sigint_handler)
    a no-op while this module owns SIGINT: its handler would act on the main thread (abort the run and let the
    stage go on) in the moment before the process ends."""
    if installed() and hasattr(obj, method):
        setattr(obj, method, lambda *args, **kwargs: None)


@contextlib.contextmanager
def saying(message: str) -> Iterator[None]:
    """While the block runs, a Ctrl-C prints `message` instead of MESSAGE ('' keeps the one in force): a stage
    whose rerun does not resume by itself (train needs --resume) says so."""
    _messages.append(message or _messages[-1])
    try:
        yield
    finally:
        _messages.pop()


def _ignore(signum, frame) -> None:
    """The Python-level SIGINT and SIGTERM handler: no KeyboardInterrupt, no SystemExit; the watcher thread acts."""


def _watch(reader: socket.socket) -> None:
    """Read the signal numbers the C handler writes; the first SIGINT or SIGTERM starts the stop (which exits with
    that signal's code), the second exits now."""
    code = None
    while True:
        data = reader.recv(64)
        for number in data:
            if number not in EXIT_CODES:
                continue  # another signal with a Python handler: not ours
            if code is None:
                code = EXIT_CODES[number]
                threading.Thread(target=_stop, args=(code,), name="clusterscale-stop", daemon=True).start()
            else:
                os._exit(code)


def _stop(code: int = EXIT_INTERRUPTED) -> None:
    """Say it, give back the stage locks (bounded), exit with `code` (130 after SIGINT, 143 after SIGTERM)."""
    _stopping.set()
    _bounded(_flush, FLUSH_TIMEOUT_S)  # lines already printed come out before ours
    os.write(2, f"\n{_messages[-1]}\n".encode())  # unbuffered: the main thread may hold sys.stderr's lock
    devnull = os.open(os.devnull, os.O_WRONLY)  # the one line is the last: nothing the main thread prints after it
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _bounded(_run_on_stop, RELEASE_TIMEOUT_S)
    os._exit(code)


def _wait_for_stop() -> None:
    """atexit: a main thread that ends while the stop runs (the command finished, or failed) waits for its exit 130."""
    if _stopping.is_set():
        threading.Event().wait(FLUSH_TIMEOUT_S + RELEASE_TIMEOUT_S + 1.0)


def _bounded(work, timeout_s: float) -> None:
    """Run `work` in a daemon thread and wait at most timeout_s for it (it may hang on a broken connection)."""
    worker = threading.Thread(target=work, name=f"clusterscale-{work.__name__.strip('_')}", daemon=True)
    worker.start()
    worker.join(timeout_s)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - best effort: the process ends anyway
            pass
