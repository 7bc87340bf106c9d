"""`clusterscale sweep` on tiny data: one embedding pass per size, every k clustered, a too-large k reported."""
from __future__ import annotations

import pytest

from clusterscale import cli
from tests.conftest import make_pairs, tiny_overrides


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    import pyarrow.parquet as pq

    base = tmp_path_factory.mktemp("sweep")
    pq.write_table(make_pairs(320), base / "pairs.parquet")
    return str(base / "pairs.parquet")


def test_preprocess_only_over_k_and_sizes(monkeypatch, tmp_path, data_path, tiny_model, ray_local, capsys):
    """`clusterscale sweep --preprocess-only` over two sizes (the larger one more than the data) and two ks; then the
    same sweep as a Ray job (jobs/sweep.py, the older space-separated --k) on its run directory reuses every size's
    embeddings and every finished k, and prints one line per point and the run directory."""
    from clusterscale.io.rundir import RunDir
    from tests.test_jobs_local import run_job

    overrides = tiny_overrides(tiny_model, data_path) + ["eval.extrapolate_to_rows=100000"]
    rc = cli.main(["sweep", "--run-dir", str(tmp_path / "run"), "--k", "2,64", "--limit", "160,400",
                   "--preprocess-only", "--set", *overrides])
    assert rc == 0
    # 400 is more than the data's 320 pairs: that size is the whole data, and the sweep says so.
    assert "--limit 400: the data holds 320 pairs, fewer than the limit: this size is the whole data" in \
        capsys.readouterr().out
    top = RunDir(str(tmp_path / "run"))
    sweep = top.read_json("report/sweep.json")
    ok = [p for p in sweep["points"] if "error" not in p]
    assert sorted((p["rows"] < 200, p["k"]) for p in ok) == [(False, 2), (True, 2)]
    # k=64 on ~150-290 rows leaves every cluster below one global batch (16): reported, not a crash.
    skipped = [p for p in sweep["points"] if "error" in p]
    assert [p["k"] for p in skipped] == [64, 64] and "global batch" in skipped[0]["error"]
    embedded_at, manifest_written = {}, {}
    for limit in (160, 400):
        run = RunDir(str(tmp_path / "run" / f"limit={limit}"))
        assert run.read_json("pairs/_DONE.json")["config"]["data"]["limit"] == limit
        # One embedding pass per size: both ks read the same embeddings (k=64 is fitted and assigned, then refused).
        costs = run.read_json("report/costs.json")
        assert {"embed", "fit:k=2", "fit:k=64", "assign:k=2", "assign:k=64", "shard:k=2"} <= set(costs)
        for k in (2,):
            manifest = run.read_json(f"shards/k={k}/manifest.json")
            assert manifest["k"] == k and manifest["stats"]["rows"] == run.done_stats("pairs")["pairs"]
            point = next(p for p in ok if p["k"] == k and p["rows"] == manifest["stats"]["rows"])
            assert point["shards"] == len(manifest["clusters"])
            assert point["min_rows"] == min(c["rows"] for c in manifest["clusters"])
        assert not run.exists("train")
        report = run.read_bytes("report/report.md").decode()
        assert "## Sweep over k and N" in report and run.exists("report/sweep.png")
        # Extrapolation of each size uses both sizes' measured points (a line, not a proportion).
        assert "least-squares line" in report
        embedded_at[limit] = run.read_json("embeddings/_DONE.json")["finished_at"]
        manifest_written[limit] = (tmp_path / "run" / f"limit={limit}" / "shards" / "k=2" / "manifest.json").stat().st_mtime_ns
    assert len(sweep["cost_points"]) == 2
    assert top.exists("report/report.md") and top.exists("report/sweep.png")

    # The job (preprocess-only unless --train) on the finished sweep: nothing is redone, the table is the same.
    capsys.readouterr()
    assert run_job(monkeypatch, "sweep", "--run-dir", str(tmp_path / "run"), "--k", "2", "64", "--limit", "160,400",
                   "--set", *overrides) == 0
    out = capsys.readouterr().out
    assert out.count("== sweep: N=") == 4 and f"done; run directory: {tmp_path / 'run'}" in out
    for limit in (160, 400):
        run = RunDir(str(tmp_path / "run" / f"limit={limit}"))
        assert run.read_json("embeddings/_DONE.json")["finished_at"] == embedded_at[limit]
        assert (tmp_path / "run" / f"limit={limit}" / "shards" / "k=2" / "manifest.json").stat().st_mtime_ns \
            == manifest_written[limit]
    assert top.read_json("report/sweep.json")["points"] == sweep["points"]  # as `clusterscale sweep` wrote it


def test_sweep_with_training(tmp_path, shared_run):
    """On a copy of conftest's finished shared run: sweep reuses its embeddings; k=3 is new to it (fitted, assigned,
    sharded, trained and evaluated), k=4 is the run's own clustering and, with the run's train config, its own
    training: reused with its evaluation, not trained again under the sweep's name."""
    import shutil

    from clusterscale.io.rundir import RunDir

    shutil.copytree(shared_run.run.path(), tmp_path / "run")
    overrides = ["train.log_batches=false"]  # over the run's config.yaml, as on any finished run (not an output key)
    assert cli.main(["sweep", "--run-dir", str(tmp_path / "run"), "--k", "3,4", "--set", *overrides]) == 0
    run = RunDir(str(tmp_path / "run"))
    assert run.read_json("embeddings/_DONE.json")["finished_at"] == shared_run.embedded_at  # reused
    sweep = run.read_json("report/sweep.json")
    assert [point["k"] for point in sweep["points"]] == [3, 4]
    assert [point["run"] for point in sweep["points"]] == ["sweep-clustered-k3-seed0", "clustered-seed0"]
    for point in sweep["points"]:
        name = point["run"]
        assert point["ndcg_at_10"] == run.read_json(f"eval/{name}.json")["metrics"]["ndcg_at_10"]
        assert run.read_json(f"train/{name}/_DONE.json")["stats"]["steps"] == 6  # the run's train.steps
    assert run.read_json("train/clustered-seed0/_DONE.json") == shared_run.trained  # reused, untouched
    assert not run.exists("train/sweep-clustered-k4-seed0") and not run.exists("eval/sweep-clustered-k4-seed0.json")
    report = run.read_bytes("report/report.md").decode()
    assert "## Sweep over k and N" in report and "ratio" in report
    assert run.exists("report/sweep.png") and run.exists("report/loss.png")
    # Each k's training run is costed under its own name, next to the per-k preprocessing stages; the run's own k
    # shows the seconds `run` spent on it (a reused stage's record repeats the work's), not the reuse's.
    costs = run.read_json("report/costs.json")
    assert {"train:sweep-clustered-k3-seed0", "train:clustered-seed0", "fit:k=3", "shard:k=3"} <= set(costs)
    assert "train:sweep-clustered-k4-seed0" not in costs
    own = sweep["points"][1]
    assert [own[f"{s}_s"] for s in ("fit", "assign", "shard")] == [costs[s]["wall_s"] for s in ("fit", "assign", "shard")]
    assert own["train_worker_s"] == costs["train:clustered-seed0"]["worker_s"] > 0


def test_bad_k_list_is_a_clear_error(tmp_path, data_path, tiny_model, capsys):
    rc = cli.main(["sweep", "--run-dir", str(tmp_path / "run"), "--k", "4,x", "--set",
                   *tiny_overrides(tiny_model, data_path)])
    assert rc == 2 and "--k" in capsys.readouterr().err
