"""Shard: per-cluster files, small-cluster policies, determinism, k-sweep and `inspect` on synthetic runs."""
from __future__ import annotations

import io
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from clusterscale import cli
from clusterscale import config as config_mod
from clusterscale.io.layout import assign_dir, kmeans_dir, shards_dir
from clusterscale.runtime.kmeans_core import fit_spherical_kmeans, nearest_centroid
from clusterscale.io.rundir import RunDir
from clusterscale.pipeline import run_stage
from clusterscale.stages.shards import mean_pairwise_cosine, plan_small_clusters
from clusterscale.stages.synthetic import clustered_unit_vectors, write_embeddings_stage

N, K = 1200, 8


def cfg_with(policy: str = "merge", batch: int = 64, rows_per_file: int = 100, k: int = K):
    return config_mod.load(None, ["data.path=unused.parquet", f"cluster.k={k}", "cluster.niter=6",
                                  f"shard.small_cluster_policy={policy}", f"train.global_batch_size={batch}",
                                  f"shard.target_rows_per_file={rows_per_file}", "train.num_workers=1"])


def assigned_run(path, x: np.ndarray, k: int = K) -> tuple[RunDir, np.ndarray, np.ndarray]:
    """embeddings/, kmeans/k=<k>/ and assign/k=<k>/ written directly (the core fit, no Ray)."""
    run = RunDir(str(path))
    write_embeddings_stage(run, x, rows_per_file=400)
    centroids, _ = fit_spherical_kmeans(x, k, 6, 0)
    sink = io.BytesIO()
    np.save(sink, centroids)
    run.write_bytes(f"{kmeans_dir(k)}/centroids.npy", sink.getvalue())
    run.mark_done(kmeans_dir(k), "test", {})
    sims, labels = nearest_centroid(x, centroids)
    for f in run.files("embeddings"):
        table = pq.read_table(f)
        rows = table.column("pair_id").to_numpy()
        table = table.append_column("cluster", pa.array(labels[rows].astype(np.int32)))
        table = table.append_column("cos", pa.array(sims[rows]))
        out = io.BytesIO()
        pq.write_table(table, out)
        run.write_bytes(f"{assign_dir(k)}/{f.rsplit('/', 1)[1]}", out.getvalue())
    run.mark_done(assign_dir(k), "test", {})
    return run, centroids, labels


@pytest.fixture(scope="module")
def data():
    return clustered_unit_vectors(N, 16, 8, seed=7)[0]


def read_shard(run: RunDir, files: list[str]) -> pa.Table:
    return pads.dataset([run.path(f) for f in files], format="parquet").to_table()


def test_merge_goes_to_nearest_big_cluster():
    counts = np.array([100, 5, 80, 0, 3])
    centroids = np.eye(5, dtype=np.float32)
    centroids[1] = [0.2, 0.1, 0.9, 0.1, 0.0]
    centroids[4] = [0.9, 0.1, 0.3, 0.0, 0.1]
    plan = plan_small_clusters(counts, centroids, 10, "merge")
    assert plan["moved"] == {1: 2, 4: 0} and plan["pool_id"] is None
    pool = plan_small_clusters(counts, centroids, 10, "pool")
    assert pool["moved"] == {1: 5, 4: 5} and pool["pool_id"] == 5


@pytest.fixture(scope="module")
def merged(tmp_path_factory, data, ray_local):
    run, centroids, labels = assigned_run(tmp_path_factory.mktemp("merge") / "run", data)
    counts = np.bincount(labels, minlength=K)
    batch = int(np.sort(counts)[2]) + 1  # at least the two smallest clusters are small
    run_stage("shard", cfg_with("merge", batch), run)
    return run, centroids, labels, batch


def test_merge_policy_manifest_files_and_rows(merged, data):
    run, centroids, labels, batch = merged
    manifest = run.read_json(f"{shards_dir(K)}/manifest.json")
    counts = np.bincount(labels, minlength=K)
    small = np.flatnonzero((counts > 0) & (counts < batch))
    big = np.flatnonzero(counts >= batch)
    assert len(small) >= 2
    expected = {str(c): int(big[np.argmax(centroids[big] @ centroids[c])]) for c in small}
    assert manifest["moved"] == expected
    seen = []
    for c in manifest["clusters"]:
        table = read_shard(run, c["files"])
        ids = table.column("pair_id").to_numpy()
        seen += ids.tolist()
        assert c["rows"] == len(ids) >= batch
        assert set(labels[ids]) == set(c["members"])
        assert c["mean_intra_cosine"] == pytest.approx(mean_pairwise_cosine(data[ids].astype(np.float64).sum(0),
                                                                            len(ids)), rel=1e-5)
        assert all(pads.dataset(run.path(f), format="parquet").count_rows() <= 100 for f in c["files"])
    assert sorted(seen) == list(range(N))  # nothing dropped, nothing duplicated
    assert manifest["stats"]["files"] <= K + math.ceil(N / 100)
    assert run.listdir(shards_dir(K))[-1] == "manifest.json" or run.exists(shards_dir(K), "manifest.json")


def test_pool_policy_and_determinism(tmp_path, merged, data):
    run_a, _, labels, batch = merged
    run_b, _, _ = assigned_run(tmp_path / "b", data)
    run_stage("shard", cfg_with("pool", batch), run_b)
    manifest = run_b.read_json(f"{shards_dir(K)}/manifest.json")
    counts = np.bincount(labels, minlength=K)
    small = sorted(int(c) for c in np.flatnonzero((counts > 0) & (counts < batch)))
    assert manifest["moved"] == {str(c): K for c in small}
    pool = next(c for c in manifest["clusters"] if c["name"] == "pool")
    assert pool["rows"] == counts[small].sum() and sorted(pool["members"]) == small
    assert sum(c["rows"] for c in manifest["clusters"]) == N
    # A fixed seed gives the same rows in the same order: big clusters are equal under both policies.
    manifest_a = run_a.read_json(f"{shards_dir(K)}/manifest.json")
    for c in manifest["clusters"]:
        if c["name"] == "pool":
            continue
        twin = next(t for t in manifest_a["clusters"] if t["name"] == c["name"])
        if twin["members"] == c["members"]:
            assert read_shard(run_b, c["files"]).equals(read_shard(run_a, twin["files"]))
            assert c["samples"] == twin["samples"]


def test_inspect_prints_table_and_writes_json(merged, data, capsys, tmp_path):
    run, _, _, _ = merged
    assert cli.main(["inspect", run.root, "--k", str(K), "--json", str(tmp_path / "t.json")]) == 0
    printed = capsys.readouterr().out
    table = json.loads((tmp_path / "t.json").read_text())
    assert f"k={K}: {N} rows" in printed and "intra cos" in printed
    assert sum(c["rows"] for c in table["clusters"]) == N
    overall = data.astype(np.float64)
    assert table["overall_mean_cosine"] == pytest.approx(mean_pairwise_cosine(overall.sum(0), N), rel=1e-5)
    for c in table["clusters"]:
        assert c["cluster"] in printed and len(c["sample_queries"]) == 3
        assert c["mean_intra_cosine"] > table["overall_mean_cosine"]  # clusters are tighter than the data
    assert cli.main(["inspect", run.root, "--k", str(K)]) == 0  # default JSON path inside the run
    assert json.loads(run.read_bytes(f"{shards_dir(K)}/inspect.json")) == table
    assert cli.main(["inspect", run.root, "--k", "99"]) == 2  # no such k: a clear error, not a traceback
    assert "clusterscale shard" in capsys.readouterr().err


def test_k_sweep_reuses_embeddings_and_writes_beside(merged):

    run, _, _, _ = merged
    before = run.read_bytes("embeddings/_DONE.json")
    cfg = cfg_with("merge", 16, k=3)
    run_stage("fit", cfg, run)
    run_stage("assign", cfg, run)
    run_stage("shard", cfg, run)
    assert run.read_bytes("embeddings/_DONE.json") == before
    assert run.exists(shards_dir(K), "manifest.json") and run.exists(shards_dir(3), "manifest.json")
    assert run.read_json(f"{shards_dir(3)}/manifest.json")["stats"]["rows"] == N
    assert run.listdir("kmeans") == [f"k={K}", "k=3"] or sorted(run.listdir("kmeans")) == ["k=3", f"k={K}"]
