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


def test_preprocess_only_over_k_and_sizes(tmp_path, data_path, tiny_model, ray_local):
    from clusterscale.io.rundir import RunDir

    overrides = tiny_overrides(tiny_model, data_path) + ["eval.extrapolate_to_rows=100000"]
    rc = cli.main(["sweep", "--run-dir", str(tmp_path / "run"), "--k", "2,64", "--limit", "160,320",
                   "--preprocess-only", "--set", *overrides])
    assert rc == 0
    top = RunDir(str(tmp_path / "run"))
    sweep = top.read_json("report/sweep.json")
    ok = [p for p in sweep["points"] if "error" not in p]
    assert sorted((p["rows"] < 200, p["k"]) for p in ok) == [(False, 2), (True, 2)]
    # k=64 on ~150-290 rows leaves every cluster below one global batch (16): reported, not a crash.
    skipped = [p for p in sweep["points"] if "error" in p]
    assert [p["k"] for p in skipped] == [64, 64] and "global batch" in skipped[0]["error"]
    for limit in (160, 320):
        run = RunDir(str(tmp_path / "run" / f"limit={limit}"))
        assert run.read_json("pairs/_DONE.json")["config"]["data"]["limit"] == limit
        # One embedding pass per size: both ks read the same embeddings (k=64 is fitted and assigned, then refused).
        costs = run.read_json("report/costs.json")
        assert {"embed", "fit:k=2", "fit:k=64", "assign:k=2", "assign:k=64", "shard:k=2"} <= set(costs)
        for k in (2,):
            manifest = run.read_json(f"shards/k={k}/manifest.json")
            point = next(p for p in ok if p["k"] == k and p["rows"] == manifest["stats"]["rows"])
            assert point["shards"] == len(manifest["clusters"])
            assert point["min_rows"] == min(c["rows"] for c in manifest["clusters"])
        assert not run.exists("train")
        report = run.read_bytes("report/report.md").decode()
        assert "## Sweep over k and N" in report and run.exists("report/sweep.png")
        # Extrapolation of each size uses both sizes' measured points (a line, not a proportion).
        assert "least-squares line" in report
    assert len(sweep["cost_points"]) == 2
    assert top.exists("report/report.md") and top.exists("report/sweep.png")


def test_sweep_with_training(tmp_path, shared_run):
    """On a copy of conftest's finished shared run (sweep reuses its embeddings; k=2 and k=3 are new to it)."""
    import shutil

    from clusterscale.io.rundir import RunDir

    shutil.copytree(shared_run.run.path(), tmp_path / "run")
    overrides = ["train.steps=2", "train.log_batches=false"]  # over the run's config.yaml, as on any finished run
    assert cli.main(["sweep", "--run-dir", str(tmp_path / "run"), "--k", "2,3", "--set", *overrides]) == 0
    run = RunDir(str(tmp_path / "run"))
    assert run.read_json("embeddings/_DONE.json")["finished_at"] == shared_run.embedded_at  # reused
    sweep = run.read_json("report/sweep.json")
    assert [point["k"] for point in sweep["points"]] == [2, 3]
    for point in sweep["points"]:
        name = f"sweep-clustered-k{point['k']}-seed0"
        assert point["ndcg_at_10"] == run.read_json(f"eval/{name}.json")["metrics"]["ndcg_at_10"]
        assert run.read_json(f"train/{name}/_DONE.json")["stats"]["steps"] == 2
    report = run.read_bytes("report/report.md").decode()
    assert "## Sweep over k and N" in report and "ratio" in report
    assert run.exists("report/sweep.png") and run.exists("report/loss.png")
    # Each k's training run is costed under its own name, next to the per-k preprocessing stages.
    costs = run.read_json("report/costs.json")
    assert {"train:sweep-clustered-k2-seed0", "train:sweep-clustered-k3-seed0", "fit:k=2", "shard:k=3"} <= set(costs)


def test_bad_k_list_is_a_clear_error(tmp_path, data_path, tiny_model, capsys):
    rc = cli.main(["sweep", "--run-dir", str(tmp_path / "run"), "--k", "4,x", "--set",
                   *tiny_overrides(tiny_model, data_path)])
    assert rc == 2 and "--k" in capsys.readouterr().err
