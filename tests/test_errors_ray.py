"""On a local Ray: a user error raised inside a Ray task, and a full disk, end as one paragraph with exit 2."""
from __future__ import annotations

import errno

import pyarrow.dataset as pads

from clusterscale import cli
from clusterscale.io.rundir import RunDir


def error_paragraph(err: str) -> str:
    """What the CLI printed from its `error: ` line on (Ray's own worker logs may come before it)."""
    starts = [i for i, line in enumerate(err.splitlines(keepends=True)) if line.startswith("error: ")]
    assert len(starts) == 1, err
    return "".join(err.splitlines(keepends=True)[starts[0]:])


def test_task_user_error_and_full_disk_are_one_paragraph_and_lose_no_rows(tmp_path, ray_local, pairs_parquet,
                                                                          monkeypatch, capsys):
    run_dir = tmp_path / "run"
    ingest = ["ingest", "--run-dir", str(run_dir), "--set", f"data.path={pairs_parquet}", "data.passage_column=p",
              "data.heldout_fraction=0.1"]
    assert cli.main(ingest + ["data.query_column=question"]) == 2  # checked inside the Ray task reading the file
    paragraph = error_paragraph(capsys.readouterr().err)
    assert "data.query_column='question' not found. Columns found: 'q', 'p', 'src'" in paragraph
    assert paragraph.count("\n") == 1 and "Traceback" not in paragraph and "ray::" not in paragraph

    mark_done = RunDir.mark_done

    def disk_full_at_the_end(self, stage_dir, *args, **kwargs):
        if stage_dir == "pairs":
            raise OSError(errno.ENOSPC, f"Failed to open local file '{self.path(stage_dir, '_DONE.json')}'. "
                                        f"Detail: [errno 28] No space left on device")
        return mark_done(self, stage_dir, *args, **kwargs)

    monkeypatch.setattr(RunDir, "mark_done", disk_full_at_the_end)
    assert cli.main(ingest + ["data.query_column=q"]) == 2
    paragraph = error_paragraph(capsys.readouterr().err)
    assert paragraph.startswith("error: No space left on device") and f"{run_dir}/pairs/_DONE.json" in paragraph
    assert "free space on that disk" in paragraph and paragraph.count("\n") == 1

    monkeypatch.setattr(RunDir, "mark_done", mark_done)  # space freed: the rerun redoes the unfinished stage
    assert cli.main(ingest + ["data.query_column=q"]) == 0
    run = RunDir(str(run_dir))
    ids = [i for folder in ("pairs", "heldout", "quarantine") if run.files(folder)
           for i in pads.dataset(run.files(folder), format="parquet").to_table().column("pair_id").to_pylist()]
    assert sorted(ids) == list(range(320))


def test_full_disk_in_training_is_one_paragraph_without_worker_tracebacks(tmp_path, ray_local, tiny_model,
                                                                          monkeypatch, capsys):
    """Ray Train logs a worker's error with its traceback before the driver hears of it: for a user fault (here a full
    disk as the rank writes its logs) the worker's console says nothing (its Ray Train log file keeps the record) and
    the driver prints the one paragraph."""
    import glob
    import os
    import time

    from clusterscale.train import trainer
    from tests.train_data import make_sharded_run, train_overrides

    def disk_full_loop(config: dict) -> None:  # runs in the Ray Train worker: the disk fills up there
        from clusterscale.train import metrics
        from clusterscale.train import trainer as worker_trainer

        def full(self) -> None:
            raise OSError(errno.ENOSPC, "No space left on device", self.run.path(self.rel))

        metrics.JsonlLog.flush = full
        worker_trainer.train_loop_per_worker(config)

    monkeypatch.setattr(trainer, "train_loop_per_worker", disk_full_loop)  # what stages/train.py hands Ray Train
    run = make_sharded_run(tmp_path / "run")
    started = time.time()
    overrides = train_overrides(tiny_model, steps=2) + ["train.num_workers=1"]
    assert cli.main(["train", "--run-dir", run.uri, "--set", *overrides]) == 2
    out, err = capsys.readouterr()
    paragraph = error_paragraph(err)
    assert paragraph.startswith("error: No space left on device") and "metrics.jsonl" in paragraph
    assert "free space on that disk" in paragraph and paragraph.count("\n") == 1
    assert "Traceback" not in out + err and "Error in training function" not in out + err
    # What the driver prints of a worker is what the worker wrote to its console files: nothing of the fault; Ray
    # Train's own log file of the worker keeps it.
    logs = os.path.join(ray_local._private.worker._global_node.get_session_dir_path(), "logs")

    def written_since_start(pattern: str) -> str:
        return "".join(open(path, errors="replace").read() for path in glob.glob(os.path.join(logs, pattern))
                       if os.path.getmtime(path) >= started)

    assert "No space left on device" not in written_since_start("worker-*")
    assert "Error in training function" in written_since_start("train/ray-train-sys-worker-*.log")
