"""The trainer's job: what the driver's dict becomes on a worker, and the starts a segment refuses."""
from __future__ import annotations

import pytest

from clusterscale import config as config_mod
from clusterscale.train.trainer import SegmentJob


def _job(tmp_path, *extra: str, segment=(1, 4, 8), resume=True) -> SegmentJob:
    cfg = config_mod.load(None, ["train.recluster_every=4", *extra])
    return SegmentJob.from_loop_config({"cfg": cfg, "run_uri": str(tmp_path), "name": "t", "num_steps": 8,
                                        "segment": segment, "resume": resume, "shards_uri": str(tmp_path / "c")})


def test_job_from_the_driver_dict(tmp_path):
    job = _job(tmp_path, "train.stop_after_steps=6")
    assert (job.segment, job.seg_start, job.seg_stop, job.stop_step) == (1, 4, 8, 6)
    assert job.shards_run.uri.endswith("/c") and job.fail_at_step is None
    assert job.cursor()["recluster_every"] == 4 and job.cursor()["num_steps"] == 8


@pytest.mark.parametrize("start, restored, segment, resume, message", [
    (0, False, (1, 4, 8), True, "segment 1 \\(re-clustering\\) found no checkpoint of the previous segment"),
    (0, False, (0, 0, 8), True, "--resume: Ray Train found no checkpoint of train/t"),
    (7, True, (1, 4, 8), True, "at step 7, past this run's stop at step 6"),
    (2, True, (1, 4, 8), True, "at step 2, before segment 1 \\(steps 4..8\\)"),
])
def test_refused_starts_say_what_to_do(tmp_path, start, restored, segment, resume, message):
    job = _job(tmp_path, "train.stop_after_steps=6", segment=segment, resume=resume)
    with pytest.raises(RuntimeError, match=message):
        job.check_start(start, restored)
    _job(tmp_path, segment=(0, 0, 8), resume=False).check_start(0, restored=False)  # a fresh start is fine


def test_a_workers_console_drops_user_faults_only(monkeypatch):
    """keep_user_faults_off_console: a record logged while a user fault is handled (as Ray Train logs a rank's error)
    is not shown; a bug's traceback is, and other records are."""
    import errno
    import logging

    from clusterscale.train.trainer import keep_user_faults_off_console

    class Collect(logging.Handler):
        def __init__(self, name: str):
            super().__init__()
            self.set_name(name)  # Ray Train's dictConfig names its handlers
            self.shown: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.shown.append(record.getMessage())

    console, log_file = Collect("console"), Collect("file_train_sys_worker")
    monkeypatch.setattr(logging.getLogger("ray.train"), "handlers", [console, log_file])
    keep_user_faults_off_console()
    keep_user_faults_off_console()  # once per segment in the same worker: one filter
    assert len(console.filters) == 1 and not log_file.filters
    log = logging.getLogger("ray.train.v2._internal.util")
    for fault in (OSError(errno.ENOSPC, "No space left on device"), RuntimeError("a bug")):
        try:
            raise fault
        except Exception:
            log.error("Error in training function: %s", fault)
    log.warning("a warning")
    assert console.shown == ["Error in training function: a bug", "a warning"]
    assert log_file.shown == ["Error in training function: [Errno 28] No space left on device",
                              "Error in training function: a bug", "a warning"]


def test_the_controllers_poll_interval_reaches_ray_train_unless_the_user_set_it(monkeypatch):
    """Ray Train's controller sees a fit's end (and a rank's failure) one poll late: clusterscale polls at 32 ranks
    a second within [0.25 s, Ray's 2 s], through the variable Ray passes from the driver to its controller, and
    leaves the driver's environment as it was; a value the user set is kept."""
    import os

    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    from clusterscale.stages.train import HEALTH_CHECK_ENV, controller_poll

    monkeypatch.delenv(HEALTH_CHECK_ENV, raising=False)
    for ranks, interval in ((1, "0.25"), (8, "0.25"), (16, "0.5"), (64, "2.0"), (512, "2.0")):
        with controller_poll(ranks):
            assert get_env_vars_to_propagate()[HEALTH_CHECK_ENV] == interval
        assert HEALTH_CHECK_ENV not in os.environ
    monkeypatch.setenv(HEALTH_CHECK_ENV, "5")
    with controller_poll(1):
        assert get_env_vars_to_propagate()[HEALTH_CHECK_ENV] == "5"
    assert os.environ[HEALTH_CHECK_ENV] == "5"
