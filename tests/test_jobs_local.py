"""The job entry points run in-process on local Ray: exit codes, the printed run directory, the k sweep."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from clusterscale.io.rundir import RunDir
from tests.conftest import make_pairs, tiny_overrides

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def run_job(monkeypatch, name: str, *args: str) -> int:
    """Run jobs/<name>.py as `python jobs/<name>.py ARGS` would; returns its exit status."""
    monkeypatch.setattr(sys, "argv", [str(JOBS / f"{name}.py"), *args])
    monkeypatch.syspath_prepend(str(JOBS))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(JOBS / f"{name}.py"), run_name="__main__")
    return exit_info.value.code


def test_every_job_shows_its_usage():
    for job in ("run_pipeline", "preprocess", "train", "evaluate", "sweep"):
        text = (JOBS / f"{job}.py").read_text()
        assert f"python jobs/{job}.py" in text and 'if __name__ == "__main__":' in text


def test_bad_config_exits_2_and_names_the_key(monkeypatch, tmp_path, capsys):
    assert run_job(monkeypatch, "preprocess", "--run-dir", str(tmp_path / "r"), "--set", "train.lr=-1") == 2
    assert "train.lr must be greater than 0" in capsys.readouterr().err


def test_missing_stage_exits_2_and_names_the_verb(monkeypatch, tmp_path, ray_local, tiny_model, capsys):
    code = run_job(monkeypatch, "train", "--run-dir", str(tmp_path / "empty"), "--set", f"train.init={tiny_model}")
    assert code == 2
    err = capsys.readouterr().err
    assert "clusterscale shard" in err and f"run directory: {tmp_path / 'empty'}" in err


def test_sweep_embeds_once_and_shards_every_k(monkeypatch, tmp_path, ray_local, tiny_model, capsys):
    pq.write_table(make_pairs(160), tmp_path / "pairs.parquet")
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_model, str(tmp_path / "pairs.parquet"))
    assert run_job(monkeypatch, "sweep", "--run-dir", str(run_dir), "--k", "2,3", "--set", *overrides) == 0
    out = capsys.readouterr().out
    assert out.count("== sweep: N=") == 2 and f"done; run directory: {run_dir}" in out
    run = RunDir(str(run_dir))
    assert [p["k"] for p in run.read_json("report/sweep.json")["points"]] == [2, 3]  # as `clusterscale sweep` writes
    embedded_at = run.read_json("embeddings/_DONE.json")["finished_at"]
    for k in (2, 3):
        manifest = run.read_json(f"shards/k={k}/manifest.json")
        assert manifest["k"] == k and manifest["stats"]["rows"] == run.done_stats("pairs")["pairs"]
    # A second sweep (the older space-separated --k) reuses the embeddings and every finished k (a new k on reused
    # embeddings: test_experiments_sweep.test_sweep_with_training).
    manifest_written = (run_dir / "shards" / "k=3" / "manifest.json").stat().st_mtime_ns
    assert run_job(monkeypatch, "sweep", "--run-dir", str(run_dir), "--k", "2", "3", "--set", *overrides) == 0
    assert run.read_json("embeddings/_DONE.json")["finished_at"] == embedded_at
    assert (run_dir / "shards" / "k=3" / "manifest.json").stat().st_mtime_ns == manifest_written
    assert [p["k"] for p in run.read_json("report/sweep.json")["points"]] == [2, 3]
