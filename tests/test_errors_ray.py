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
