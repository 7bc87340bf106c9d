"""A watcher beside a local Ray: when its driver dies (kill -9, the OOM killer), end the raylet's agents at once.

Ray ties a local Ray's gcs_server and raylet to the driver (the kernel kills them with it), not the raylet's agents
(ray::DashboardAgent, ray::RuntimeEnvAgent): they see the raylet gone within a second, find no SIGTERM in its log and
report its end to the gcs_server, which died with it, and that call waits a fixed 60 s (publish_error_to_driver in
ray._private.utils; no Ray setting shortens it), with SIGTERM deferred. `start` runs this file as a small process that
reads a pipe from the driver; at the pipe's end it waits for the raylet to be gone and SIGKILLs the processes left
of it (those whose environment names it in RAY_RAYLET_PID: the agents, a worker not yet gone), then, when no Ray runs on
this machine any more, removes the files a killed driver's Ray Data disk shuffles left in the temporary folder
(remove_orphaned_shuffle_files; session.init_ray does too before it starts a local Ray). Linux only: elsewhere Ray ends
the process group with a reaper of its own. Standard library only: the watcher's start and end take ~40 ms.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RAYLET_GONE_WAIT_S = 10.0  # the kernel kills the raylet as the driver exits; a raylet still alive then is not ours
SHUFFLE_FILES = "ray_shuffle_disk_*"  # Ray Data's disk shuffle: <temp>/ray_shuffle_disk_<id>_map and _reduce per node


def start(raylet_pid: int) -> subprocess.Popen | None:
    """Start the watcher of this driver's local Ray (raylet_pid); its pipe closes when this process ends."""
    if not sys.platform.startswith("linux"):
        return None
    return subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(raylet_pid)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # no Ctrl-C from the terminal: it outlives the driver by design


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def left_of(raylet_pid: int) -> list[int]:
    """The processes started by the raylet raylet_pid that still run (Ray sets RAY_RAYLET_PID in their environment)."""
    marker = f"RAY_RAYLET_PID={raylet_pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def raylets_alive() -> bool:
    """Whether a Ray node (a raylet process, any user's) runs on this machine."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == "raylet":
                        return True
            except OSError:
                continue
    return False


def remove_orphaned_shuffle_files(temp_dir: str | None = None) -> list[str]:
    """Ray Data stages a disk shuffle's files in the temporary folder of each node (ray_shuffle_disk_<id>_map and
    _reduce) and removes them when the shuffle ends: a killed driver's stay, up to the shuffled bytes per node. With no
    Ray running on this machine, none is in use: remove them; the folders removed. Linux only (/proc)."""
    if not sys.platform.startswith("linux") or raylets_alive():
        return []
    removed = []
    for path in glob.glob(os.path.join(temp_dir or tempfile.gettempdir(), SHUFFLE_FILES)):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def watch(raylet_pid: int, pipe=None) -> list[int]:
    """Block until the driver's pipe ends; then, once the raylet is gone, SIGKILL what is left of it (returned)."""
    pipe = pipe if pipe is not None else sys.stdin.buffer
    while pipe.read(4096):
        pass
    deadline = time.monotonic() + RAYLET_GONE_WAIT_S
    while _alive(raylet_pid):
        if time.monotonic() > deadline:
            return []
        time.sleep(0.05)
    killed = []
    for pid in left_of(raylet_pid):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    remove_orphaned_shuffle_files()  # a killed driver's shuffles' files (a finished run's are gone already)
    return killed


if __name__ == "__main__":
    watch(int(sys.argv[1]))
