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
from clusterscale.io.records import ShardManifest
from clusterscale.runtime.kmeans_core import fit_spherical_kmeans, nearest_centroid
from clusterscale.io.rundir import RunDir
from clusterscale.pipeline import run_stage
from clusterscale.runtime.vectors import emb_array, emb_matrix
from clusterscale.stages import shards
from clusterscale.stages.shards import (block_cluster_stats, cluster_stats, groups_per_shard, mean_pairwise_cosine,
                                        plan_small_clusters, sub_groups)
from clusterscale.stages.synthetic import clustered_unit_vectors, write_embeddings_stage
from clusterscale.train.data import ShardReader

N, K = 1200, 8


def cfg_with(policy: str = "merge", batch: int = 64, rows_per_file: int = 100, k: int = K, extra: tuple = ()):
    return config_mod.load(None, ["data.path=unused.parquet", f"cluster.k={k}", "cluster.niter=6",
                                  f"shard.small_cluster_policy={policy}", f"train.global_batch_size={batch}",
                                  f"shard.target_rows_per_file={rows_per_file}", "train.num_workers=1", *extra])


def assigned_run(path, x: np.ndarray, k: int = K, rows_per_file: int = 400) -> tuple[RunDir, np.ndarray, np.ndarray]:
    """embeddings/, kmeans/k=<k>/ and assign/k=<k>/ written directly (the core fit, no Ray)."""
    run = RunDir(str(path))
    write_embeddings_stage(run, x, rows_per_file=rows_per_file)
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
    g = manifest["row_group_rows"]
    rows_per_file = manifest["rows_per_file"]  # shard.batches_per_file=1 global batch, under target_rows_per_file
    assert rows_per_file == max(1, min(batch, 100) // g) * g
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
        assert all(pads.dataset(run.path(f), format="parquet").count_rows() <= rows_per_file for f in c["files"])
    assert sorted(seen) == list(range(N))  # nothing dropped, nothing duplicated
    assert manifest["stats"]["files"] <= K + math.ceil(N / rows_per_file)
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


def test_block_stats_add_up_to_the_whole(data):
    labels = np.random.default_rng(0).integers(0, 5, len(data))
    vectors = data.astype(np.float16)
    table = pa.table({"cluster": labels, "cos": np.linspace(0, 1, len(data)), "emb": emb_array(vectors)})
    parts = [block_cluster_stats(table.slice(a, 500)) for a in range(0, len(data), 500)]
    sums = np.zeros((5, data.shape[1]))
    rows, cos = np.zeros(5, np.int64), np.zeros(5)
    for p in parts:
        np.add.at(sums, p.column("cluster").to_numpy(), emb_matrix(p.column("vector_sum"), np.float64))
        np.add.at(rows, p.column("cluster").to_numpy(), p.column("rows").to_numpy())
        np.add.at(cos, p.column("cluster").to_numpy(), p.column("cos_sum").to_numpy())
    for c in range(5):
        mine = labels == c
        assert rows[c] == mine.sum() and cos[c] == pytest.approx(np.linspace(0, 1, len(data))[mine].sum())
        np.testing.assert_allclose(sums[c], vectors[mine].astype(np.float64).sum(0), rtol=1e-9, atol=1e-9)
    assert block_cluster_stats(table.slice(0, 0)).num_rows == 0


def test_cluster_stats_added_in_a_tree_of_tasks_equal_the_whole(tmp_path, data, ray_local, monkeypatch):
    """12 row groups added 2 at a time in Ray tasks, then partial sums 2 at a time: the per-cluster rows, cos sums
    and vector sums of every row (the fp16 vectors' float64 sums are exact in any order, so equal to the bit)."""
    run, _, labels = assigned_run(tmp_path / "run", data, rows_per_file=100)
    monkeypatch.setattr(shards, "STATS_FAN_IN", 2)
    stats = cluster_stats(run, K, N, assign_dir(K))
    table = pads.dataset(run.files(assign_dir(K)), filesystem=run.fs).to_table()
    assert len(run.files(assign_dir(K))) == 12
    cluster, cos = table.column("cluster").to_numpy(), table.column("cos").to_numpy().astype(np.float64)
    vectors = emb_matrix(table.column("emb"), np.float64)
    np.testing.assert_array_equal(stats.rows, np.bincount(cluster, minlength=K))
    np.testing.assert_allclose(stats.cos_sum, np.bincount(cluster, cos, K), rtol=1e-12)
    np.testing.assert_array_equal(stats.vector_sum, np.stack([vectors[cluster == c].sum(0) for c in range(K)]))


def test_sub_groups_are_a_balanced_seeded_hash():
    assert groups_per_shard(np.array([0, 1, 100, 101, 250]), 100).tolist() == [0, 1, 1, 2, 3]
    ids = np.arange(30_000)
    subs = sub_groups(ids, np.full(len(ids), 3), seed=5)
    assert np.bincount(subs).tolist() == pytest.approx([10_000] * 3, rel=0.05)
    assert (sub_groups(ids[::-1], np.full(len(ids), 3), seed=5) == subs[::-1]).all()  # per row, any batching
    assert (sub_groups(ids, np.full(len(ids), 3), seed=6) != subs).mean() > 0.5
    assert (sub_groups(ids, np.ones(len(ids), np.int64), seed=5) == 0).all()


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory, data, merged):
    """Two reruns with clusters split into groups of ~60 rows: one keeps `emb`, one does not."""
    batch = merged[3]
    runs = []
    for keep in (True, False):
        run, _, _ = assigned_run(tmp_path_factory.mktemp(f"split{keep}") / "run", data)
        cfg = cfg_with("merge", batch, rows_per_file=40,
                       extra=("shard.max_group_rows=60", f"shard.keep_emb={str(keep).lower()}"))
        run_stage("shard", cfg, run)
        runs.append(run)
    return runs


def test_split_groups_hold_the_same_rows_and_stats(split_runs, merged, data):
    run_whole = merged[0]
    whole = {c["name"]: c for c in run_whole.read_json(f"{shards_dir(K)}/manifest.json")["clusters"]}
    manifest = split_runs[0].read_json(f"{shards_dir(K)}/manifest.json")
    assert any(c["groups"] > 1 for c in manifest["clusters"])
    assert manifest["stats"]["rows"] == N and manifest["keep_emb"] and manifest["max_group_rows"] == 60
    for c in manifest["clusters"]:
        twin = whole[c["name"]]
        table = read_shard(split_runs[0], c["files"])
        ids = table.column("pair_id").to_numpy()
        assert sorted(ids) == sorted(read_shard(run_whole, twin["files"]).column("pair_id").to_numpy())
        assert c["groups"] == math.ceil(c["rows"] / 60) and c["files"] == sorted(c["files"])
        assert all(pads.dataset(split_runs[0].path(f), format="parquet").count_rows() <= 40 for f in c["files"])
        for key in ("rows", "members"):
            assert c[key] == twin[key]
        for key in ("mean_intra_cosine", "mean_cos_to_centroid"):
            assert c[key] == pytest.approx(twin[key], rel=1e-7)
        assert c["samples"] == table.column("query").slice(0, len(c["samples"])).to_pylist()
        np.testing.assert_array_equal(emb_matrix(table.column("emb")), data[ids].astype(np.float16))
        assert c["file_rows"] == [pq.ParquetFile(split_runs[0].path(f)).metadata.num_rows for f in c["files"]]
        rows = np.random.default_rng(0).permutation(c["rows"])[:50]  # training reads through the file_rows
        got = ShardReader(split_runs[0], ShardManifest.from_json(manifest)).read(manifest["clusters"].index(c), rows)[0]
        assert got.column("pair_id").to_numpy().tolist() == ids[rows].tolist()


def test_split_rerun_is_identical_and_drops_emb_by_default(split_runs):
    run_emb, run_text = split_runs
    with_emb, without = (r.read_json(f"{shards_dir(K)}/manifest.json") for r in split_runs)
    assert [c["files"] for c in with_emb["clusters"]] == [c["files"] for c in without["clusters"]]
    for a, b in zip(with_emb["clusters"], without["clusters"]):
        table = read_shard(run_text, b["files"])
        assert table.column_names == ["pair_id", "query", "passage", "source"]  # cluster, cos: in assign/
        assert read_shard(run_emb, a["files"]).drop_columns(["emb"]).equals(table)


def test_files_of_a_few_global_batches_bound_the_footer(tmp_path, data, ray_local):
    # A rank reads the footer of each file it takes a row group from: files of shard.batches_per_file global
    # batches hold batches_per_file x batch / row_group_rows row groups, however big the cluster, and their
    # column chunks carry no dictionary pages or statistics.
    run, _, _ = assigned_run(tmp_path / "run", data)
    run_stage("shard", cfg_with("merge", 64, rows_per_file=10_000, extra=("shard.batches_per_file=2",)), run)
    manifest = run.read_json(f"{shards_dir(K)}/manifest.json")
    assert manifest["row_group_rows"] == 32 and manifest["rows_per_file"] == 128
    for c in manifest["clusters"]:
        assert c["file_rows"][:-1] == [128] * (len(c["files"]) - 1)
        for f in c["files"]:
            md = pq.read_metadata(run.path(f))
            assert md.num_row_groups <= 4 and md.num_columns == 4
            chunks = [md.row_group(0).column(i) for i in range(md.num_columns)]
            assert not any(ch.has_dictionary_page or ch.is_stats_set for ch in chunks)
