"""Ctrl-C of a clusterscale process (runtime.interrupt), without Ray: a second SIGINT ends it at once, even when
the first one's stop hangs and when the process inherited SIGINT ignored (a background job of a script); SIGTERM
stops it the same way, after ray.init's own SIGTERM handler too. The first SIGINT during a real stage is tested in
test_embed_restart (embed killed mid-run, then resumed)."""
from __future__ import annotations

import pytest

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from clusterscale.pipeline import STAGES
from clusterscale.runtime import interrupt

REPO = Path(__file__).resolve().parents[1]

# A process whose first-SIGINT stop never finishes (a lock release that hangs), so only the second can end it;
# it runs "train", whose line differs from the default (its rerun needs --resume).
HANGING_STOP = """
import threading, time
from clusterscale.pipeline import STAGES
from clusterscale.pipeline import STAGES
from clusterscale.runtime import interrupt
interrupt.RELEASE_TIMEOUT_S = 3600.0
interrupt.on_stop(lambda: threading.Event().wait())
assert interrupt.install()
with interrupt.saying(STAGES["train"].interrupted), interrupt.saying(""):
    print("ready", flush=True)
    time.sleep(3600)
"""


@pytest.mark.integration
def test_second_sigint_ends_the_process_at_once(tmp_path):
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        # SIGINT ignored at the start, as a shell leaves it for `clusterscale run ... &` in a script.
        proc = subprocess.Popen([sys.executable, "-c", HANGING_STOP], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=stderr, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            assert proc.stdout.readline() == b"ready\n"
            proc.send_signal(signal.SIGINT)
            deadline = time.time() + 60
            while "interrupted" not in err.read_text() and time.time() < deadline:
                time.sleep(0.02)
            assert "interrupted" in err.read_text() and proc.poll() is None  # stopping, and it cannot finish
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == interrupt.EXIT_INTERRUPTED
        finally:
            proc.kill()
            proc.wait()
    assert err.read_text().strip() == STAGES["train"].interrupted and "train --resume" in err.read_text()


# A driver holding a stage lock when SIGTERM comes (`ray job stop`, `kill`). It joins the suite's Ray (RAY_ADDRESS)
# through runtime/session.init_ray, whose ray.init gives a driver a SIGTERM handler of its own (sys.exit on the main
# thread: the stage would unwind from wherever it is) that init_ray takes back.
TERMINATED = """
import sys, time
from clusterscale.config import RayConfig
from clusterscale.io.rundir import RunDir
from clusterscale.run_protocol import lock
from clusterscale.runtime import interrupt, session
assert interrupt.install()
session.init_ray(RayConfig())
with lock(RunDir(sys.argv[1]), "embeddings"):
    print("ready", flush=True)
    try:
        time.sleep(3600)
    finally:  # never reached: the process ends without unwinding, as after Ctrl-C
        print("unwound", flush=True)
"""


def test_sigterm_stops_like_ctrl_c_with_exit_143_and_gives_the_lock_back(tmp_path, ray_local):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    proc = subprocess.Popen([sys.executable, "-c", TERMINATED, str(run)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n", proc.stderr.read().decode()[-3000:]
        assert list((run / "locks").glob("*.json"))  # held
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == interrupt.EXIT_TERMINATED == 143
    finally:
        proc.kill()
        proc.wait()
    err = proc.stderr.read().decode()
    assert err.rstrip().endswith(interrupt.MESSAGE) and err.count(interrupt.MESSAGE) == 1 and "Traceback" not in err
    assert proc.stdout.read() == b""  # nothing unwound
    assert not list((run / "locks").glob("*.json"))


def test_a_library_caller_keeps_its_own_ctrl_c():
    """cli.main(argv) from a caller (tests, notebooks) does not take SIGINT over; the program (argv None) does."""
    from clusterscale import cli

    before, wakeup = signal.getsignal(signal.SIGINT), interrupt._wakeup  # (a job test may have installed it)
    assert cli.main(["config"]) == 0
    assert signal.getsignal(signal.SIGINT) is before and interrupt._wakeup is wakeup
