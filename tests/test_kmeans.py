"""Spherical k-means: the compute core against naive numpy and faiss.Kmeans, the Ray fit against the core."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import config as config_mod
from clusterscale.pipeline import run_stage
from clusterscale.runtime.faiss_index import faiss
from clusterscale.stages.kmeans import load_centroids
from clusterscale.io.layout import assign_dir, kmeans_dir
from clusterscale.runtime.kmeans_core import (LloydWorker, Partials, fit_spherical_kmeans, lloyd_partials,
                                      nearest_centroid, update_centroids)
from clusterscale.io.rundir import RunDir
from clusterscale.stages.synthetic import clustered_unit_vectors, write_embeddings_stage


def cfg_with(**cluster):
    return config_mod.load(None, ["data.path=unused.parquet"] + [f"cluster.{k}={v}" for k, v in cluster.items()])


def test_lloyd_partials_match_naive_numpy():
    x, _ = clustered_unit_vectors(500, 16, 5, seed=3)
    centroids = x[:7] / np.linalg.norm(x[:7], axis=1, keepdims=True)
    p = lloyd_partials(x, centroids)
    sims = x.astype(np.float64) @ centroids.T.astype(np.float64)
    labels = sims.argmax(axis=1)
    expected = np.stack([x[labels == c].astype(np.float64).sum(axis=0) for c in range(7)])
    np.testing.assert_allclose(p.sums, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(p.counts, np.bincount(labels, minlength=7))
    assert p.objective == pytest.approx(sims.max(axis=1).sum(), rel=1e-5)


def test_incremental_sums_equal_a_full_recount_on_fp16_rows():
    x, _ = clustered_unit_vectors(3000, 16, 8, seed=2)  # fp16-valued, like the fit's input
    worker = LloydWorker(x)
    assert worker.incremental
    centroids, moved = x[:10] / np.linalg.norm(x[:10], axis=1, keepdims=True), []
    for _ in range(5):
        previous = worker.labels
        p = worker.step(centroids)
        full = lloyd_partials(x, centroids)  # a fresh worker sums every row
        np.testing.assert_array_equal(p.sums, full.sums)
        np.testing.assert_array_equal(p.counts, full.counts)
        if previous is not None:
            moved.append(int((worker.labels != previous).sum()))
        centroids, _ = update_centroids(p)
    assert any(0 < m <= len(x) // 2 for m in moved)  # the incremental path ran and moved rows
    rng = np.random.default_rng(0)
    assert not LloydWorker(rng.standard_normal((50, 16)).astype(np.float32)).incremental  # not fp16: full sums


def test_empty_cluster_takes_half_of_the_largest():
    sums = np.array([[10.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    centroids, splits = update_centroids(Partials(sums, np.array([10, 2, 0]), 0.0))
    assert splits == 1
    np.testing.assert_allclose(np.linalg.norm(centroids, axis=1), 1.0, rtol=1e-6)
    assert centroids[2] @ centroids[0] > 0.99 and not np.array_equal(centroids[2], centroids[0])
    np.testing.assert_allclose(centroids[1], [0.0, 1.0])


def test_objective_within_one_percent_of_faiss():
    x, _ = clustered_unit_vectors(6000, 32, 40, seed=1)
    k, niter, seed = 24, 20, 0
    ours, stats = fit_spherical_kmeans(x, k, niter, seed)
    km = faiss.Kmeans(32, k, niter=niter, seed=seed, spherical=True, max_points_per_centroid=10**9)
    km.train(x)
    # Spherical k-means maximises the summed cosine to the nearest centroid.
    ratio = nearest_centroid(x, km.centroids)[0].sum() / nearest_centroid(x, ours)[0].sum()
    assert ratio <= 1.01
    assert len(stats["objective_per_iteration"]) == niter
    assert stats["objective_per_iteration"][-1] >= stats["objective_per_iteration"][0]


def test_too_few_vectors_is_a_clear_error():
    from clusterscale.runtime.kmeans_core import ClusteringError

    x, _ = clustered_unit_vectors(5, 8, 2)
    with pytest.raises(ClusteringError, match="cluster.k=6 is larger"):
        fit_spherical_kmeans(x, 6, 3, 0)


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """An embeddings/ stage of 3,000 clustered vectors in 3 files of 2 row groups each."""
    run = RunDir(str(tmp_path_factory.mktemp("kmeans") / "run"))
    x, _ = clustered_unit_vectors(3000, 24, 12, seed=5)
    write_embeddings_stage(run, x, rows_per_file=1000)
    return run, x


def fit_in(run: RunDir, cfg) -> tuple[np.ndarray, dict]:
    if run.exists(kmeans_dir(cfg.cluster.k)):
        run.remove(kmeans_dir(cfg.cluster.k))
    stats = run_stage("fit", cfg, run).stats
    return load_centroids(run, cfg.cluster.k), stats


@pytest.fixture(scope="module")
def fits(synthetic_run, ray_local):
    """The same fit (k=10, all 3,000 rows) on 1 and on 2 Ray actors; the second one stays on disk."""
    run, _ = synthetic_run
    return [fit_in(run, cfg_with(k=10, niter=8, seed=3, num_workers=w, fit_sample="all")) for w in (1, 2)]


def test_ray_fit_same_centroids_for_one_and_two_workers_and_the_core(synthetic_run, fits):
    run, x = synthetic_run
    (c1, s1), (c2, s2) = fits
    assert (s1["num_workers"], s2["num_workers"]) == (1, 2)
    np.testing.assert_array_equal(c1, c2)
    reference, _ = fit_spherical_kmeans(x, 10, 8, 3, ids=np.arange(len(x)))
    np.testing.assert_array_equal(c1, reference)
    other_seed, _ = fit_spherical_kmeans(x, 10, 8, 4, ids=np.arange(len(x)))
    assert not np.array_equal(reference, other_seed)  # the seed matters
    stats = run.read_json(f"{kmeans_dir(10)}/fit_stats.json")
    assert len(stats["objective_per_iteration"]) == len(stats["seconds_per_iteration"]) == 8
    assert stats["imbalance_factor"] >= 1.0 and stats["n_sample"] == 3000 and stats["seed"] == 3


def test_ray_fit_sample_is_seeded_and_capped(tmp_path, synthetic_run, ray_local):
    _, x = synthetic_run
    run = RunDir(str(tmp_path / "run"))
    write_embeddings_stage(run, x, rows_per_file=1000)
    cfg = cfg_with(k=10, niter=2, max_points_per_centroid=50, num_workers=2)
    _, stats = fit_in(run, cfg)
    assert 400 <= stats["n_sample"] <= 600  # about 50 x 10 of 3,000 rows, by a seeded hash of pair_id
    from clusterscale.runtime.hashing import hash_unit

    assert stats["n_sample"] == int((hash_unit(np.arange(3000), salt=0) < 500 / 3000).sum())


@pytest.fixture(scope="module")
def many_groups_run(tmp_path_factory, synthetic_run):
    """The same 3,000 vectors in 75 files of 2 row groups of 20 rows."""
    run = RunDir(str(tmp_path_factory.mktemp("kmeans_groups") / "run"))
    write_embeddings_stage(run, synthetic_run[1], rows_per_file=40, texts=False)
    return run


def test_fit_sample_reads_whole_seeded_row_groups_only(many_groups_run):
    from clusterscale.runtime.fit_sample import choose_sample_units, read_sample_rows, row_group_units

    units = row_group_units(many_groups_run)
    assert len(units) == 150 and sum(u.rows for u in units) == 3000
    chosen, fraction = choose_sample_units(units, 500, seed=0, min_groups=64, spread=1)
    assert len(chosen) == 64 and sum(u.rows for u in chosen) == 1280 and fraction == 500 / 1280
    assert chosen == sorted(chosen, key=lambda u: (u.name, u.group))  # read in file order
    assert {(u.name, u.group) for u in choose_sample_units(units, 500, seed=1, min_groups=64, spread=1)[0]} != \
        {(u.name, u.group) for u in chosen}  # the seed picks the groups
    few, _ = choose_sample_units(units, 500, seed=0, min_groups=4, spread=1)  # groups until >= 500 rows
    assert len(few) == 25 and set(few) <= set(units)
    spread, _ = choose_sample_units(units, 500, seed=0, min_groups=4, spread=2)  # until >= 2 x 500 rows
    assert len(spread) == 50 and set(few) < set(spread)
    assert choose_sample_units(units, 3000, seed=0) == (units, 1.0)  # everything wanted: everything read
    ids, chunks = read_sample_rows(many_groups_run, chosen, fraction, seed=0)
    in_chosen = np.concatenate([np.arange(20) + 40 * int(u.name[5:10]) + 20 * u.group for u in chosen])
    from clusterscale.runtime.hashing import hash_unit

    np.testing.assert_array_equal(np.sort(ids), np.sort(in_chosen[hash_unit(in_chosen, salt=0) < fraction]))
    assert sum(len(c) for c in chunks) == len(ids) and chunks[0].dtype == np.float32


def test_ray_fit_on_row_group_sample_same_for_one_and_two_workers(many_groups_run, synthetic_run, ray_local):
    from clusterscale.runtime.fit_sample import choose_sample_units, read_sample_rows, row_group_units

    cfgs = [cfg_with(k=10, niter=4, seed=2, max_points_per_centroid=50, num_workers=w) for w in (1, 2)]
    (c1, s1), (c2, s2) = [fit_in(many_groups_run, cfg) for cfg in cfgs]
    assert (s1["num_workers"], s2["num_workers"]) == (1, 2)
    np.testing.assert_array_equal(c1, c2)
    # 50 x 10 rows wanted: groups of 20 rows until they hold 4 x 500 (SPREAD_FACTOR), 100 of the 150
    assert s1["n_sample"] == s2["n_sample"] and s1["sample_row_groups"] == 100 and s1["row_groups"] == 150
    assert s1["sample_rows_read"] == 2000 and s1["sample_bytes_read"] < 0.7 * s1["embeddings_bytes"]
    chosen, fraction = choose_sample_units(row_group_units(many_groups_run), 500, seed=2)
    ids, chunks = read_sample_rows(many_groups_run, chosen, fraction, seed=2)
    assert len(ids) == s1["n_sample"]
    np.testing.assert_array_equal(c1, fit_spherical_kmeans(np.concatenate(chunks), 10, 4, 2, ids=ids)[0])


@pytest.mark.parametrize("index", ["flat", "ivf"])
def test_assign_index_matches_brute_force(synthetic_run, index):
    import pyarrow.parquet as pq

    from clusterscale.stages.kmeans import AssignBatches, build_assign_index

    run, x = synthetic_run
    centroids = fit_spherical_kmeans(x, 10, 5, 0)[0]
    batch = pq.read_table(run.files("embeddings")[0])
    out = AssignBatches(build_assign_index(centroids, index, nprobe=4))(batch)  # nprobe 4 >= sqrt(10) lists
    sims, labels = nearest_centroid(x[:1000], centroids)
    np.testing.assert_array_equal(out.column("cluster").to_numpy(), labels)
    np.testing.assert_allclose(out.column("cos").to_numpy(), sims, rtol=1e-5)


def test_ray_assign_streams_every_row(synthetic_run, fits):
    import pyarrow.dataset as pads

    run, x = synthetic_run
    cfg = cfg_with(k=10, niter=8, seed=3, fit_sample="all", assign_index="ivf", ivf_nprobe=4)
    if run.exists(assign_dir(10)):
        run.remove(assign_dir(10))
    run_stage("assign", cfg, run)
    table = pads.dataset(run.files(assign_dir(10)), format="parquet").to_table().sort_by("pair_id")
    sims, labels = nearest_centroid(x, load_centroids(run, 10))
    assert table.num_rows == 3000
    np.testing.assert_array_equal(table.column("cluster").to_numpy(), labels)
    np.testing.assert_allclose(table.column("cos").to_numpy(), sims, rtol=1e-5)
    # An attempt that stopped midway (files of some units written, no done marker): the rerun writes the rest only,
    # into the same names, and the output is byte for byte the uninterrupted one.
    files = sorted(run.files(assign_dir(10)))
    whole = {f: open(f, "rb").read() for f in files}
    kept = {f: os.stat(f).st_mtime_ns for f in files[::2]}
    for f in files[1::2]:
        os.remove(f)
    run.remove(assign_dir(10), "_DONE.json")
    assert len(files) > 1 and run_stage("assign", cfg, run).stats["rows"] == 3000
    assert sorted(run.files(assign_dir(10))) == files and {f: os.stat(f).st_mtime_ns for f in kept} == kept
    assert {f: open(f, "rb").read() for f in files} == whole


@pytest.mark.parametrize("side, dims", [("query", 0), ("mean", 16)])
def test_cluster_side_fits_and_assigns_the_chosen_vectors(tmp_path, synthetic_run, ray_local, side, dims):
    """cluster.side=query fits and assigns `emb_query`, mean their normalised sum with `emb`: the centroids are the
    core's fit on those vectors (as read back, fp16), every row goes to the nearest of them by that vector, and the
    passage side gives other centroids. With cluster.dims=16 (of 24) all of it on each vector's first 16 dimensions,
    re-normalised; a cluster.dims wider than the embeddings is refused by name."""
    from clusterscale.runtime.vectors import clustered_matrix

    _, x = synthetic_run
    q, _ = clustered_unit_vectors(3000, 24, 12, seed=6)  # another clustering than the passages'
    run = RunDir(str(tmp_path / "run"))
    write_embeddings_stage(run, x, rows_per_file=1000, queries=q)
    keys = ["data.path=unused.parquet", "embed.side=both", f"cluster.side={side}", "cluster.k=10", "cluster.niter=8",
            "cluster.seed=3", "cluster.num_workers=1", "cluster.fit_sample=all", f"cluster.dims={dims}"]
    cfg = config_mod.load(None, keys)
    centroids, _ = fit_in(run, cfg)
    assert centroids.shape == (10, dims or 24)
    table = pa.concat_tables([pq.read_table(f) for f in run.files("embeddings")])
    chosen = clustered_matrix(table, side, dims)
    reference, _ = fit_spherical_kmeans(chosen, 10, 8, 3, ids=table.column("pair_id").to_numpy())
    np.testing.assert_array_equal(centroids, reference)
    passage, _ = fit_spherical_kmeans(clustered_matrix(table, "passage", dims), 10, 8, 3,
                                      ids=table.column("pair_id").to_numpy())
    assert not np.allclose(centroids, passage)
    run_stage("assign", cfg, run)
    assigned = pa.concat_tables([pq.read_table(f) for f in run.files(assign_dir(10))])
    expected = np.argmax(clustered_matrix(assigned, side, dims) @ centroids.T, axis=1)
    np.testing.assert_array_equal(assigned.column("cluster").to_numpy(), expected)
    if dims:
        from clusterscale.runtime.kmeans_core import ClusteringError

        with pytest.raises(ClusteringError, match="cluster.dims=32 is more than the embeddings. 24 dimensions"):
            fit_in(run, config_mod.load(None, keys[:-1] + ["cluster.dims=32"]))
    with pytest.raises(config_mod.ConfigError, match="cluster.side=query .* embed.side=passage"):
        config_mod.load(None, ["cluster.side=query"])
