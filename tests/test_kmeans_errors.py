"""Bad input to fit/assign: each a clear error naming the cause and the fix."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from clusterscale import cli
from clusterscale import config as config_mod
from clusterscale.pipeline import run_stage
from clusterscale.stages.kmeans import AssignBatches, build_assign_index
from clusterscale.runtime.kmeans_core import ClusteringError
from clusterscale.io.rundir import RunDir, StageMissingError
from clusterscale.stages.synthetic import clustered_unit_vectors, write_embeddings_stage


def cfg_with(*overrides: str):
    return config_mod.load(None, ["data.path=unused.parquet", "cluster.niter=2", "cluster.fit_sample=all",
                                  *overrides])


def test_k_below_one_is_rejected_by_the_config():
    for k in (0, -3):
        with pytest.raises(config_mod.ConfigError, match="cluster.k must be greater than 0"):
            cfg_with(f"cluster.k={k}")


def test_k_larger_than_rows(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    write_embeddings_stage(run, clustered_unit_vectors(20, 8, 2)[0])
    with pytest.raises(ClusteringError, match=r"cluster.k=50 is larger than the number of embedded pairs \(20\)"):
        run_stage("fit", cfg_with("cluster.k=50"), run)


def test_k_larger_than_rows_through_the_cli(tmp_path, capsys, ray_local):
    run = RunDir(str(tmp_path / "run"))
    write_embeddings_stage(run, clustered_unit_vectors(20, 8, 2)[0])
    assert cli.main(["fit", "--run-dir", run.root, "--set", "data.path=x.parquet", "cluster.k=50"]) == 2
    assert "lower cluster.k" in capsys.readouterr().err


def test_missing_embeddings(tmp_path):
    with pytest.raises(StageMissingError, match="run `clusterscale embed`"):
        run_stage("fit", cfg_with("cluster.k=2"), RunDir(str(tmp_path / "run")))


def test_empty_embeddings(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    run.clear("embeddings")
    run.mark_done("embeddings", "x", {"rows": 0})
    with pytest.raises(ClusteringError, match="holds no rows"):
        run_stage("fit", cfg_with("cluster.k=2"), run)


def test_nan_vectors(tmp_path, ray_local):
    run = RunDir(str(tmp_path / "run"))
    x = clustered_unit_vectors(200, 8, 2)[0]
    x[[3, 150]] = np.nan
    x[7, 2] = np.inf
    write_embeddings_stage(run, x, rows_per_file=100)
    with pytest.raises(ClusteringError, match="3 sampled embedding rows hold NaN/inf.*Re-run `clusterscale embed`"):
        run_stage("fit", cfg_with("cluster.k=2", "cluster.num_workers=2"), run)


def test_mixed_dimensions(tmp_path, ray_local):
    run = RunDir(str(tmp_path / "run"))
    write_embeddings_stage(run, clustered_unit_vectors(100, 8, 2)[0])
    other = RunDir(str(tmp_path / "other"))
    write_embeddings_stage(other, clustered_unit_vectors(100, 16, 2)[0], first_id=100)
    run.write_bytes("embeddings/part-00001.parquet", other.read_bytes("embeddings/part-00000.parquet"))
    run.mark_done("embeddings", "synthetic", {"rows": 200})  # written so, not changed since (a stray file is refused)
    with pytest.raises(ClusteringError, match=r"mixes vectors of dimensions \[8, 16\]"):
        run_stage("fit", cfg_with("cluster.k=2", "cluster.num_workers=1"), run)


def test_assign_with_centroids_of_another_dimension(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    write_embeddings_stage(run, clustered_unit_vectors(50, 8, 2)[0])
    assign = AssignBatches(build_assign_index(clustered_unit_vectors(4, 16, 2)[0], "flat", 1))
    with pytest.raises(ClusteringError, match="dimension 8, the centroids 16.*re-run `clusterscale fit`"):
        assign(pq.read_table(run.files("embeddings")[0]))
    nan = clustered_unit_vectors(50, 16, 2)[0]
    nan[0, 0] = np.nan
    write_embeddings_stage(run, nan)
    with pytest.raises(ClusteringError, match="1 embedding rows in embeddings/ hold NaN/inf"):
        assign(pq.read_table(run.files("embeddings")[0]))
