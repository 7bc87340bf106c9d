"""The job entry points run in-process on local Ray: exit codes, the printed run directory, the k sweep."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

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


# The sweep job (its output, and that it reuses every size's embeddings and every finished k of a sweep):
# test_experiments_sweep.test_preprocess_only_over_k_and_sizes runs it on the run directory of a CLI sweep.
