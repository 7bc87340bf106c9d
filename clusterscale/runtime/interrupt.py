"""Ctrl-C (SIGINT) for the command line and the jobs: stop within seconds with exit 130, keep every finished unit.

A stage's finished work is already safe against a kill (units, checkpoints and done markers are written under a
temporary name and renamed; a rerun skips what is complete and clears temporary leftovers), so the first SIGINT
says so in one line, gives back this process's stage locks, disconnects from Ray (bounded) and ends the process
with os._exit(130); a second SIGINT ends it at once. Nothing unwinds: a KeyboardInterrupt raised somewhere in Ray
Data's iterator or a Ray Train fit would print a traceback, or be caught and turned into an exit 0.

Why a watcher thread reading a wakeup fd rather than the Python handler itself: Ray Train's fit() replaces the
SIGINT handler with its own (abort the run, exit 0 at the third signal), and a Python handler runs only when the
main thread gets back to the interpreter. The C-level handler writes every signal to the wakeup fd whatever
Python handler is installed, so the watcher sees each SIGINT in time. The Python handler installed here does
nothing; it also replaces SIG_IGN, which a process started in the background by a non-interactive shell
(`clusterscale run ... &` in a script) inherits for SIGINT and under which Ctrl-C was silently ignored.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator

from clusterscale.io.rundir import release_held_locks

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
MESSAGE = "interrupted: finished units are kept; rerun the same command to resume"
SHUTDOWN_TIMEOUT_S = 5.0  # the most the first SIGINT waits for Ray to disconnect before the process ends
FLUSH_TIMEOUT_S = 1.0  # the most it waits for buffered output (a full pipe must not hold the exit)

_messages = [MESSAGE]  # the line the first SIGINT prints: the innermost `saying` in force
_wakeup: tuple[socket.socket, socket.socket] | None = None  # kept referenced: the C handler writes to it


def install() -> bool:
    """Take over SIGINT for this process (idempotent). Only from the main thread of a program's entry point: a
    library caller (a test calling cli.main) keeps its own Ctrl-C. False when not installed (not the main thread)."""
    global _wakeup
    if _wakeup is not None:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    reader, writer = socket.socketpair()
    reader.setblocking(True)
    writer.setblocking(False)  # the C handler must never block on a full buffer
    signal.signal(signal.SIGINT, _ignore)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _wakeup = (reader, writer)
    threading.Thread(target=_watch, args=(reader,), name="clusterscale-sigint", daemon=True).start()
    return True


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
    """The Python-level SIGINT handler: no KeyboardInterrupt; the watcher thread acts."""


def _watch(reader: socket.socket) -> None:
    """Read the signal numbers the C handler writes; the first SIGINT starts the stop, the second exits now."""
    seen = 0
    while True:
        data = reader.recv(64)
        for number in data:
            if number != signal.SIGINT:
                continue  # another signal with a Python handler (Ray's SIGTERM): not ours
            seen += 1
            if seen == 1:
                threading.Thread(target=_stop, name="clusterscale-stop", daemon=True).start()
            else:
                os._exit(EXIT_INTERRUPTED)


def _stop() -> None:
    """Say it, silence what Ray prints while it disconnects, give back the stage locks, exit 130 (bounded)."""
    _bounded(_flush, FLUSH_TIMEOUT_S)  # lines already printed come out before ours
    os.write(2, f"\n{_messages[-1]}\n".encode())  # unbuffered: the main thread may hold sys.stderr's lock
    # Ray Data's executor thread and Ray Train print tracebacks when Ray goes away under them: not the user's news.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _bounded(_release, SHUTDOWN_TIMEOUT_S)
    os._exit(EXIT_INTERRUPTED)


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


def _release() -> None:
    """Ray first (a local instance's workers stop writing), then this process's stage locks."""
    try:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the process ends anyway
        pass
    release_held_locks()
