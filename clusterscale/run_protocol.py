"""The executor's protocol on a run directory: the lock a stage holds while it writes its folder, replacing an output
and everything made from it, and the cost record. The run directory's contract (its files, the `_DONE.json` markers
written and checked, RunDir.clear) stays in io/rundir.py; when a stage is locked, cleared, marked done or replaced is
the executor's decision alone (executor.py, with this module)."""
from __future__ import annotations

import contextlib
import json
import os
import posixpath
import socket
import threading
import time
import uuid
from typing import Iterator

from clusterscale.errors import UserError
from clusterscale.io.rundir import COSTS, DONE, RunDir
from clusterscale.runtime import interrupt


class StageLockedError(UserError, RuntimeError):
    """Another process is writing the same stage output of the same run."""


LOCK_TTL_S = 300.0  # a lease its holder stopped renewing for this long is stale (the holder is gone)
LOCK_RENEW_S = 30.0
LOCK_SETTLE_S = 2.0  # object stores: how long a new lease must stay ours before we trust it
LOCK_SETTLE_ENV = "CLUSTERSCALE_LOCK_SETTLE_S"  # overrides it (docs/cli.md, "Locks")


def lock_settle_s() -> float:
    """Seconds a new lease on an object store must stay ours: LOCK_SETTLE_S, or CLUSTERSCALE_LOCK_SETTLE_S."""
    text = os.environ.get(LOCK_SETTLE_ENV, "").strip()
    if not text:
        return LOCK_SETTLE_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.0 <= seconds <= 60.0:
        raise UserError(f"{LOCK_SETTLE_ENV}={text!r} is not a number of seconds from 0 to 60: set it to how long "
                        f"a new stage lock on an object store must stay yours (default {LOCK_SETTLE_S}), or unset it.")
    return seconds


@contextlib.contextmanager
def lock(run: RunDir, stage_dir: str) -> Iterator[None]:
    """Hold RUN/locks/<stage_dir>.json while writing `stage_dir`; a second holder is refused by name.

    The lock is a lease (holder, host, pid, start, expiry) that a thread renews; a lease of a dead pid on
    this host, or one not renewed for LOCK_TTL_S, is stale and taken over. Local folders create it
    exclusively (atomic); object stores have no create-if-absent, so a new lease is re-read after
    LOCK_SETTLE_S and given up when another writer's lease replaced it."""
    rel = f"locks/{stage_dir}.json"
    me = _acquire(run, rel, stage_dir)
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(run, rel, me, stop), daemon=True)
    renewer.start()
    _HELD_LOCKS[me["id"]] = (run, rel)
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        _release_lock(run, rel, me["id"])
        _HELD_LOCKS.pop(me["id"], None)


def _release_lock(run: RunDir, rel: str, lock_id: str) -> None:
    if (_read_lock(run, rel) or {}).get("id") == lock_id:
        run.remove(rel)


def _acquire(run: RunDir, rel: str, stage_dir: str) -> dict:
    me = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
          "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "expires": time.time() + LOCK_TTL_S}
    for _ in range(2):
        if _create_lock(run, rel, me):
            return me
        held = _read_lock(run, rel)
        if held and not _lock_is_stale(held):
            raise StageLockedError(
                f"{run.path(stage_dir)} is being written by another clusterscale process: pid {held['pid']} "
                f"on host {held['host']}, since {held['since']} (lock {run.path(rel)}). Wait for it to "
                f"finish. If that process is gone, its lock is taken over by the next attempt (at once on "
                f"{held['host']}, elsewhere after {time.strftime('%H:%M:%SZ', time.gmtime(held['expires']))}), "
                f"or delete the lock file yourrun.")
        _drop_stale_lock(run, rel)
    raise StageLockedError(f"{run.path(stage_dir)}: another process took the lock {run.path(rel)} at the "
                           f"same moment; run the command again once it has finished.")


def _create_lock(run: RunDir, rel: str, me: dict) -> bool:
    """Write `me` at `rel` unless a lock is there; True when `me` holds it."""
    run.makedirs(posixpath.dirname(rel))
    if run.is_local:
        # Written whole under a temporary name, then linked: the link is atomic and fails when a lock exists,
        # so no reader ever sees a lock without its holder.
        staged = f"{run.path(rel)}.{me['id']}"
        with open(staged, "w") as f:
            json.dump(me, f)
        try:
            os.link(staged, run.path(rel))
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(staged)
    if run.exists(rel):
        return False
    run.write_json(rel, me)
    time.sleep(lock_settle_s())
    return (_read_lock(run, rel) or {}).get("id") == me["id"]


def _read_lock(run: RunDir, rel: str) -> dict | None:
    try:
        return run.read_json(rel)
    except (OSError, ValueError):  # gone (released or taken over), or torn
        return None


def _drop_stale_lock(run: RunDir, rel: str) -> None:
    if not run.is_local:
        run.remove(rel)
        return
    aside = f"{run.path(rel)}.stale-{uuid.uuid4().hex}"
    try:  # a rename, so that of two processes taking over the same stale lock only one succeeds
        os.rename(run.path(rel), aside)
    except FileNotFoundError:
        return
    os.remove(aside)


def _renew(run: RunDir, rel: str, me: dict, stop: threading.Event) -> None:
    while not stop.wait(LOCK_RENEW_S):
        if (_read_lock(run, rel) or {}).get("id") != me["id"]:
            print(f"warning: lost the lock {run.path(rel)} (taken over as stale?)", flush=True)
            return
        run.write_json(rel, me | {"expires": time.time() + LOCK_TTL_S})


def _lock_is_stale(held: dict) -> bool:
    if held.get("host") == socket.gethostname():
        try:
            os.kill(int(held["pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, owned by another user
            return False
        return False
    return time.time() > float(held.get("expires", 0))


# The locks this process holds now ({lock id: (run, lock file)}), for a process that ends without unwinding.
_HELD_LOCKS: dict[str, tuple[RunDir, str]] = {}


def release_held_locks() -> None:
    """Give back every lock this process holds (Ctrl-C ends the process with os._exit, which runs no `finally`):
    a rerun on another host would otherwise wait LOCK_TTL_S for the lease to expire. Best effort."""
    for lock_id, (run, rel) in list(_HELD_LOCKS.items()):
        try:
            _release_lock(run, rel, lock_id)
        except Exception:  # noqa: BLE001 - the process is ending; an unreleased lease still expires
            pass


interrupt.on_stop(release_held_locks)  # Ctrl-C ends the process without unwinding: give the locks back first


# --- done markers and replacing ----------------------------------------------------------------------------
def replace(run: RunDir, stage_dir: str) -> list[str]:
    """Remove `stage_dir` and every output made from it; the removed folders, dependents first.

    An output was made from `stage_dir` when its marker covers the same values for every config
    section `stage_dir`'s marker covers (shards/k=4 was made from kmeans/k=4, not from kmeans/k=8) and was
    finished no earlier than it: kmeans/k=4 covers what assign/k=4 covers, but is assign's input, not made from
    it (`assign --replace` removed the fit it reads)."""
    removed = []
    covers = run.covers(stage_dir) if run.exists(stage_dir, DONE) else None
    if covers:
        since = run.done_marker(stage_dir).finished_at or ""
        for other in run.files(suffix=DONE, include_private=True):
            rel = posixpath.relpath(other, run.root)
            other_dir = posixpath.dirname(rel)
            if other_dir == stage_dir or other_dir.startswith(stage_dir + "/") or not run.exists(rel):
                continue  # inside the folder removed below, or inside a dependent removed already
            if _made_from(run.covers(other_dir), covers) and \
                    (run.done_marker(other_dir).finished_at or since) >= since:
                run.remove(other_dir)
                removed.append(other_dir)
    run.remove(stage_dir)
    return removed + [stage_dir]


def _made_from(covers: dict | None, base: dict) -> bool:
    """True when an output covering `covers` used the same values as `base` for all of base's sections."""
    sections = [s for s in base if s != "extra"]
    return bool(covers) and all(covers.get(s) == base[s] for s in sections)


# --- costs ---------------------------------------------------------------------------------------------
def record_cost(run: RunDir, key: str, record: dict) -> None:
    """Merge one stage's cost record into RUN/report/costs.json (driver-only, so no races)."""
    costs = run.read_json(COSTS) if run.exists(COSTS) else {}
    costs[key] = record
    run.write_json(COSTS, costs)
