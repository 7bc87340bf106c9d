"""Dedup's compute core and group steps, single-process: equal to brute force on planted duplicates."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from clusterscale.config import DedupConfig
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.vectors import emb_array
from clusterscale.stages.dedup import (MARK_FIELDS, dedup_cluster, heldout_keys, mark_rows, resolve_exact,
                                       route_heldout, semantic_pass)

from tests.dedup_reference import (brute_force_exact, brute_force_heldout_vectors, brute_force_semantic,
                                   planted_vectors, unit)

N, D, K, COPIES, THRESHOLD = 300, 16, 4, 40, 0.9


@pytest.fixture(scope="module")
def planted():
    x, cluster, source = planted_vectors(N, D, K, COPIES, seed=3)
    rng = np.random.default_rng(1)
    pair_ids = rng.permutation(len(x)).astype(np.int64) * 5 + 2  # not row numbers, not in row order
    cos = rng.random(len(x)).astype(np.float32)
    return x, cluster, pair_ids, cos


def greedy_by_cluster(x, cluster, pair_ids, cos, rule, block_rows) -> dict[int, tuple[int, float]]:
    removed = {}
    for c in np.unique(cluster):
        rows = np.flatnonzero(cluster == c)
        rows = rows[core.keep_order(pair_ids[rows], core.keep_rank(pair_ids[rows], cos[rows], rule, 7))]
        kept, dup, best = core.semantic_greedy(x[rows], THRESHOLD, block_rows)
        for r in np.flatnonzero(~kept):
            removed[int(pair_ids[rows[r]])] = (int(pair_ids[rows[dup[r]]]), float(best[r]))
    return removed


@pytest.mark.parametrize("rule", ["hard", "easy", "random"])
@pytest.mark.parametrize("block_rows", [7, 64, 10_000])
def test_semantic_greedy_equals_brute_force(planted, rule, block_rows):
    x, cluster, pair_ids, cos = planted
    expected = brute_force_semantic(x, cluster, pair_ids, cos, rule, 7, THRESHOLD)
    got = greedy_by_cluster(x, cluster, pair_ids, cos, rule, block_rows)
    assert len(expected) >= COPIES // 2  # the planted copies (and a few natural neighbours) are found
    assert got.keys() == expected.keys()
    for pid, (dup, sim) in expected.items():
        assert got[pid][0] == dup and got[pid][1] == pytest.approx(sim, abs=1e-12)


def split_by_cluster(x, cluster, pair_ids, cos, rule, max_group_rows) -> dict[int, tuple[int, float]]:
    """greedy_by_cluster decided in chunks of the keep order (core.split_greedy, in this process)."""
    removed = {}
    for c in np.unique(cluster):
        rows = np.flatnonzero(cluster == c)
        rows = rows[core.keep_order(pair_ids[rows], core.keep_rank(pair_ids[rows], cos[rows], rule, 7))]
        kept, dup, best = core.split_greedy(x[rows], THRESHOLD, 5, max_group_rows)
        for r in np.flatnonzero(~kept):
            removed[int(pair_ids[rows[r]])] = (int(pair_ids[rows[dup[r]]]), float(best[r]))
    return removed


@pytest.mark.parametrize("rule", ["hard", "easy", "random"])
@pytest.mark.parametrize("max_group_rows", [13, 64])
def test_clusters_split_into_blocks_equal_brute_force(planted, rule, max_group_rows):
    """Clusters of ~85 rows in chunks of 13 or 64 rows of their keep order: each chunk against the rows kept
    before it, then within itself, removes exactly the rows brute force removes, with the same duplicate_of and
    cosine."""
    x, cluster, pair_ids, cos = planted
    assert np.bincount(cluster).min() > max_group_rows  # every cluster split, into blocks of 5-row chunks
    expected = brute_force_semantic(x, cluster, pair_ids, cos, rule, 7, THRESHOLD)
    got = split_by_cluster(x, cluster, pair_ids, cos, rule, max_group_rows)
    assert len(expected) >= COPIES // 2 and got.keys() == expected.keys()
    for pid, (dup, sim) in expected.items():
        assert got[pid][0] == dup and got[pid][1] == pytest.approx(sim, abs=1e-12)


def boilerplate_cluster(n: int, dense: bool, seed: int = 0) -> np.ndarray:
    """n unit vectors (fp16-representable), random order: spread ones, and with `dense` a third of them within
    cosine ~0.995 of one centre (a boilerplate group: every pair of it over the threshold)."""
    rng = np.random.default_rng(seed)
    x = unit(rng.standard_normal((n, D)))
    if dense:
        third = rng.permutation(n)[:n // 3]
        x[third] = unit(x[0] + 0.1 * rng.standard_normal((len(third), D)) / np.sqrt(D))
    return x.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("rule", ["hard", "easy", "random"])
@pytest.mark.parametrize("chunk_rows, block_rows", [(16, 5), (50, 16), (1000, 7)])
def test_split_greedy_equals_semantic_greedy_on_a_boilerplate_cluster(rule, chunk_rows, block_rows):
    """A cluster a third of whose rows are near-duplicates of one another (and planted copies): chunked in its
    keep order, the kept set, duplicate_of and similarity are the unsplit pass's, for every keep rule."""
    x = boilerplate_cluster(240, dense=True)
    rng = np.random.default_rng(5)
    pair_ids, cos = rng.permutation(len(x)).astype(np.int64) * 3 + 1, rng.random(len(x)).astype(np.float32)
    order = core.keep_order(pair_ids, core.keep_rank(pair_ids, cos, rule, 7))
    kept, dup, best = core.semantic_greedy(x[order], THRESHOLD, 64)
    assert (~kept).sum() >= len(x) // 3 - 1  # the boilerplate group is one kept row
    got_kept, got_dup, got_best = core.split_greedy(x[order], THRESHOLD, block_rows, chunk_rows)
    np.testing.assert_array_equal(got_kept, kept)
    np.testing.assert_array_equal(got_dup, dup)
    np.testing.assert_allclose(got_best[~kept], best[~kept], rtol=0, atol=1e-12)
    np.testing.assert_allclose(got_best[kept], best[kept], rtol=0, atol=1e-5)  # below the threshold: float32's


def test_split_greedy_memory_does_not_grow_with_duplicate_density():
    """The chunked pass materialises nothing per near-duplicate pair: its peak traced memory on a cluster a third
    of whose rows are near-duplicates of one another (~1,800 pairs over the threshold, ~2x the rows) is no larger
    than on a cluster of the same size with none."""
    import tracemalloc

    peaks = {}
    for dense in (False, True):
        x = boilerplate_cluster(240, dense)
        pairs = int(np.triu((x.astype(np.float64) @ x.T.astype(np.float64)) >= THRESHOLD, k=1).sum())
        tracemalloc.start()
        core.split_greedy(x, THRESHOLD, 16, 48)
        peaks[dense] = (tracemalloc.get_traced_memory()[1], pairs)
        tracemalloc.stop()
    assert peaks[False][1] == 0 and peaks[True][1] > 2 * len(x)
    assert peaks[True][0] <= 1.1 * peaks[False][0]


def test_raise_best_decides_near_threshold_pairs_in_float64():
    """Thresholds 1e-12 either side of a pair's cosine (far inside float32's error): the kept row's best is the
    float64 cosine, so it reaches the threshold exactly when float64 says; equal cosines: the earlier kept row."""
    rng = np.random.default_rng(0)
    a = unit(rng.standard_normal((1, D)))
    b = unit(rng.standard_normal((1, D)))
    exact = float((a @ b.T)[0, 0])
    for threshold, removed in ((exact - 1e-12, True), (exact + 1e-12, False)):
        best, best_of = np.full(1, -np.inf), np.full(1, -1, np.int64)
        core.raise_best(a, np.concatenate([b, b]), np.array([7, 8]), threshold, 8, best, best_of)
        assert (best[0] >= threshold) == removed and best_of[0] == 7
        assert best[0] == pytest.approx(exact, abs=1e-14)


def test_keep_rules_keep_the_right_member():
    """Two identical vectors: hard keeps the one farther from its centroid (lower cos), easy the nearer."""
    x = np.tile(np.eye(3)[:1], (2, 1))
    pair_ids, cos = np.array([10, 11]), np.array([0.9, 0.5])
    for rule, kept_id in (("hard", 11), ("easy", 10)):
        removed = brute_force_semantic(x, np.zeros(2), pair_ids, cos, rule, 0, 0.99)
        assert list(removed.values())[0][0] == kept_id
        assert greedy_by_cluster(x, np.zeros(2, int), pair_ids, cos, rule, 1).keys() == removed.keys()


def test_exact_removes_every_planted_copy_and_nothing_else():
    rng = np.random.default_rng(0)
    texts = [f"passage number {i}" for i in range(200)]
    sources = rng.integers(200, size=30)
    texts += [f"  PASSAGE   number {s} " if j % 2 else f"passage number {s}" for j, s in enumerate(sources)]
    pair_ids = np.arange(len(texts), dtype=np.int64)[::-1].copy()
    cos = rng.random(len(texts))
    for rule in ("hard", "easy", "random"):
        rank = core.keep_rank(pair_ids, cos, rule, 3)
        dup_of = core.exact_duplicates(core.text_keys(texts), pair_ids, rank)
        got = {int(pair_ids[i]): int(dup_of[i]) for i in np.flatnonzero(dup_of >= 0)}
        assert got == brute_force_exact(texts, pair_ids, cos, rule, 3)
        assert len(got) == 30  # each planted copy (or its original, by the keep rule): one row per text stays
        kept = {core.normalised(texts[i]) for i in np.flatnonzero(dup_of < 0)}
        assert len(kept) == len(np.flatnonzero(dup_of < 0)) == 200


def _rows(x, cluster, pair_ids, cos, queries=None, passages=None) -> pa.Table:
    return pa.table({"pair_id": pa.array(pair_ids, pa.int64()),
                     "query": queries or [f"q{i}" for i in pair_ids],
                     "passage": passages or [f"p{i}" for i in pair_ids],
                     "emb": emb_array(x), "cluster": pa.array(cluster.astype(np.int32)),
                     "cos": pa.array(np.asarray(cos, np.float32))})


NO_HELDOUT = heldout_keys(pa.table({"pair_id": pa.array([], pa.int64()), "query": pa.array([], pa.string()),
                                    "passage": pa.array([], pa.string())}))


def _mark(rows: pa.Table, dedup: DedupConfig, heldout: dict, buckets: int = 1) -> pa.Table:
    """mark_rows with `buckets` exact buckets and K + 1 cluster keys (any distinct stand-ins do without a shuffle)."""
    return mark_rows(rows, dedup, heldout, np.arange(buckets, dtype=np.int64) * 7, np.arange(K + 1, dtype=np.int64) * 3)


def test_group_steps_do_not_depend_on_row_arrival(planted):
    """The exact and cluster steps give the same marks whatever order (or split) their rows arrive in."""
    x, cluster, pair_ids, cos = planted
    one = cluster == 0
    dedup = DedupConfig(exact=True, key="passage", semantic_threshold=THRESHOLD, block_rows=16)
    passages = [f"p{i % 150}" for i in range(len(x))]  # exact copies too
    table = _rows(x[one], cluster[one], pair_ids[one], cos[one], passages=[p for p, o in zip(passages, one) if o])
    outs = []
    for perm_seed in (0, 1):
        perm = np.random.default_rng(perm_seed).permutation(table.num_rows)
        shuffled = table.take(pa.array(perm))
        marked = pa.concat_tables([_mark(shuffled.slice(s, 37), dedup, NO_HELDOUT, 3)
                                   for s in range(0, table.num_rows, 37)])
        out = semantic_pass(resolve_exact(marked).sort_by("pair_id"), dedup)
        outs.append(out.select(["pair_id", "reason", "duplicate_of", "similarity"]).to_pydict())
        assert {core.EXACT, core.SEMANTIC} <= set(out.column("reason").to_pylist())
    assert outs[0] == outs[1]


def test_heldout_text_leaks_are_marked():
    x, cluster, _ = planted_vectors(50, D, 1, 0, seed=5)
    pair_ids = np.arange(50, dtype=np.int64)
    heldout = heldout_keys(pa.table({"pair_id": [900, 901, 902], "query": ["hq0", "hq1", "HQ2"],
                                     "passage": ["hp0", "hp1", "p7 "]}))
    queries = [f"q{i}" for i in range(50)]
    queries[5] = "hq2"  # leaks by query text (normalised)
    marked = _mark(_rows(x, cluster, pair_ids, np.ones(50), queries=queries), DedupConfig(), heldout)
    leaks = {p: d for p, r, d in zip(pair_ids, marked.column("reason").to_pylist(),
                                     marked.column("duplicate_of").to_pylist()) if r == core.HELDOUT_LEAK}
    assert leaks == {5: 902, 7: 902}


def _cluster_leaks(rows: pa.Table, held: pa.Table, centroids: np.ndarray, nprobe: int, dedup: DedupConfig,
                   tmp_path) -> dict[int, tuple[int, float]]:
    """Held-out leaks of every cluster's step (route_heldout, then dedup_cluster per cluster), one process."""
    marked = _mark(rows, dedup, NO_HELDOUT)
    schema = pa.schema([*rows.schema, *MARK_FIELDS])
    routed = route_heldout(held, centroids, nprobe, schema, np.arange(K + 1, dtype=np.int64) * 3)
    assert routed.column("part").to_pylist() == (routed.column("cluster").to_numpy() * 3).tolist()
    both = pa.concat_tables([marked, routed])
    k = len(centroids)
    for c in range(k):
        group = both.filter(pa.array(both.column("cluster").to_numpy() == c))
        if group.num_rows:
            dedup_cluster(group, str(tmp_path), dedup, rows.column_names)
    from clusterscale.io.rundir import RunDir
    from clusterscale.stages.dedup import removed_table

    removed = removed_table(RunDir(str(tmp_path)))
    return {p: (d, s) for p, r, d, s in zip(*(removed.column(c).to_pylist() for c in ("pair_id", "reason",
                                                                                      "duplicate_of", "similarity")))
            if r == "heldout_leak"}


@pytest.mark.parametrize("nprobe", [1, 2, K])
def test_heldout_vector_leaks_equal_brute_force_over_the_probed_clusters(nprobe, tmp_path):
    """Held-out vectors routed to their nprobe nearest clusters find exactly the leaks of the brute-force
    definition; with nprobe = k, every training row is compared with every held-out vector (all pairs)."""
    rng = np.random.default_rng(2)
    centroids = unit(rng.standard_normal((K, D))).astype(np.float32)
    x, cluster, _ = planted_vectors(200, D, K, 0, seed=7)
    cluster = np.argmax(x @ centroids.T, axis=1)  # the rows' nearest centroid, as assign gives
    # held-out vectors: copies of rows (same cluster), and mixtures of rows of two clusters close to both of them
    a, b = rng.choice(200, 30), rng.choice(200, 30)
    mixed = unit(x[a] + x[b] * 0.9)
    held_x = np.concatenate([x[rng.choice(200, 10)], mixed]).astype(np.float16).astype(np.float32)
    held_ids = rng.permutation(len(held_x)).astype(np.int64) + 1000
    held = pa.table({"pair_id": held_ids, "emb": emb_array(held_x)})
    pair_ids = np.arange(200, dtype=np.int64)
    rows = _rows(x, cluster, pair_ids, np.ones(200))
    dedup = DedupConfig(semantic_threshold=0.8, heldout_nprobe=nprobe, block_rows=16)
    got = _cluster_leaks(rows, held, centroids, nprobe, dedup, tmp_path)
    expected = brute_force_heldout_vectors(x, cluster, held_x, held_ids, centroids, nprobe, 0.8)
    assert {int(pair_ids[i]): dup for i, (dup, _) in expected.items()} == {p: d for p, (d, _) in got.items()}
    for i, (_, sim) in expected.items():
        assert got[int(pair_ids[i])][1] == pytest.approx(sim, abs=1e-5)
    all_pairs = brute_force_heldout_vectors(x, cluster, held_x, held_ids, centroids, K, 0.8)
    if nprobe == K:
        assert expected == all_pairs
    elif nprobe == 1:
        assert expected.keys() < all_pairs.keys()  # some leaks are across clusters: nprobe=1 misses them


@pytest.mark.parametrize("block_rows", [1, 7, 1000])
def test_heldout_matches_in_blocks_equal_all_pairs(block_rows):
    """Blocks of rows and of held-out vectors give each row's best held-out vector of the all-pairs matrix (equal
    cosines: the earlier held-out vector)."""
    rng = np.random.default_rng(4)
    x, held = unit(rng.standard_normal((50, D))), unit(rng.standard_normal((20, D)))
    x[3] = held[4] = held[11] = np.eye(D)[0]  # an exact tie (cosine 1 in any summation order): index 4 wins
    best_of, best = core.heldout_matches(x, held, block_rows)
    sims = (x.astype(np.float32) @ held.astype(np.float32).T).astype(np.float64)
    np.testing.assert_array_equal(best_of, sims.argmax(axis=1))
    np.testing.assert_allclose(best, sims.max(axis=1), rtol=1e-6)
    assert best_of[3] == 4 and best[3] == 1.0


def test_shuffle_keys_put_one_bucket_and_one_cluster_in_each_partition(planted):
    """mark_rows's shuffle keys, made from one_key_per_partition stand-ins, send every exact bucket and every
    cluster to a partition of its own under Ray Data's hash partitioning (what the two shuffles use)."""
    from ray.data._internal.arrow_ops.transform_pyarrow import hash_partition

    from clusterscale.runtime.bounded_data import one_key_per_partition

    x, cluster, pair_ids, cos = planted
    buckets = 6
    marked = mark_rows(_rows(x, cluster, pair_ids, cos), DedupConfig(exact=True), NO_HELDOUT,
                       one_key_per_partition(buckets), one_key_per_partition(K + 1))
    for column, partitions in (("bucket", buckets), ("part", K + 1)):
        parts = hash_partition(marked.select([column]), hash_cols=[column], num_partitions=partitions)
        assert all(len(set(t.column(column).to_pylist())) == 1 for t in parts.values())
    assert len(set(marked.column("bucket").to_pylist())) == buckets


def test_block_plan_splits_only_the_clusters_over_the_limit():
    """BlockPlan: a cluster over max_group_rows gets ceil(rows / max_group_rows) blocks that its rows' pair_ids
    hash to (about equal), plus a partition for its held-out vectors with a semantic threshold; every partition
    key is distinct and maps back to its (cluster, block)."""
    from clusterscale.stages.dedup.partitions import BlockPlan

    plan = BlockPlan.of(np.array([100, 1000, 0, 250]), 100, semantic=True)
    assert plan.blocks.tolist() == [1, 10, 1, 3] and plan.split == [1, 3]
    assert plan.partitions == 1 + 11 + 1 + 4 == len(set(plan.keys.tolist()))
    pair_ids = np.arange(20_000, dtype=np.int64)
    keys = plan.row_keys(np.full(len(pair_ids), 1), pair_ids)
    blocks = [plan.block_of(int(key)) for key in keys]
    assert {c for c, _ in blocks} == {1} and sorted({b for _, b in blocks}) == list(range(10))
    assert max(np.bincount([b for _, b in blocks])) < 1.1 * len(pair_ids) / 10  # hashed evenly
    assert [plan.block_of(int(key)) for key in plan.heldout_keys(np.array([0, 1, 2, 3]))] == \
        [(0, 0), (1, -1), (2, 0), (3, -1)]
    assert plan.block_of(int(plan.row_keys(np.array([0]), np.array([5]))[0])) == (0, 0)
    without = BlockPlan.of(np.array([100, 1000]), 100, semantic=False)  # no held-out partition without semantic
    assert without.partitions == 11 and (without.heldout == -1).all()


@pytest.mark.parametrize("chunk_rows", [16, 50])
def test_split_cluster_write_task_reads_only_its_own_blocks_decisions(tmp_path, monkeypatch, chunk_rows):
    """A boilerplate cluster in 4 blocks, decided in chunks by the block tasks (bounds, split, decide chain, in this
    process): each block's write step (decided_block) reads decisions only for its own rows (a per-(chunk, block)
    file each), so the rows of decisions read in all are the cluster's rows, not blocks x cluster; and the
    decisions are the unsplit greedy's."""
    from clusterscale.config import DedupConfig
    from clusterscale.io.rundir import RunDir
    from clusterscale.stages.dedup import blocks as bl

    x = boilerplate_cluster(240, dense=True)
    rng = np.random.default_rng(5)
    n = len(x)
    pair_ids, cos = rng.permutation(n).astype(np.int64) * 3 + 1, rng.random(n).astype(np.float32)
    rank = core.keep_rank(pair_ids, cos, "hard", 7)
    reason = np.full(n, core.KEPT, np.int8)
    reason[:5] = core.EXACT  # a few rows the exact step removed: no decisions for them
    run, cluster, dc = RunDir(str(tmp_path / "run")), 3, DedupConfig(semantic_threshold=THRESHOLD, block_rows=7,
                                                                     max_group_rows=chunk_rows)
    block_of, blocks = pair_ids % 4, [0, 1, 2, 3]
    for b in blocks:
        rows = block_of == b
        bl.write_block(pa.table({"pair_id": pair_ids[rows], "rank": rank[rows], "reason": reason[rows],
                                 "duplicate_of": np.full(rows.sum(), -1, np.int64),
                                 "similarity": np.zeros(rows.sum(), np.float32),
                                 "best": np.full(rows.sum(), -np.inf), "emb": emb_array(x[rows])}),
                       run, cluster, b)
    bounds = bl.chunk_bounds(run.uri, cluster, blocks, chunk_rows)
    splits = [bl.split_block(run.uri, cluster, b, dc, bounds) for b in blocks]
    state = {"kept": [], "last_rows": 0}
    for chunk in range(len(bounds[1])):
        state = bl.decide_chunk(run.uri, cluster, chunk, blocks, dc, "faiss", state, *splits)
    assert len(bounds[1]) >= 4  # several chunks, each with rows of several blocks

    read_rows, plain_read = {}, bl._read

    def counting_read(run_, rel):
        table = plain_read(run_, rel)
        if rel.endswith("-decisions.parquet"):
            read_rows[rel] = read_rows.get(rel, 0) + table.num_rows
        return table

    monkeypatch.setattr(bl, "_read", counting_read)
    got = {}
    for b, split in zip(blocks, splits):
        before = sum(read_rows.values())
        decided = bl.decided_block(run, cluster, b, split)
        alive = int((reason[block_of == b] == core.KEPT).sum())
        assert sum(read_rows.values()) - before == alive  # its own rows' decisions, each once
        got.update({pid: (r, d, s) for pid, r, d, s in zip(*(decided.column(c).to_pylist() for c in (
            "pair_id", "reason", "duplicate_of", "similarity")))})
    assert len(read_rows) == sum(len(set(s)) for s in splits)  # one file per (chunk, block) of the block's rows
    assert sum(read_rows.values()) == int((reason == core.KEPT).sum())  # the cluster's rows once, not 4x

    alive = np.flatnonzero(reason == core.KEPT)
    order = alive[core.keep_order(pair_ids[alive], rank[alive])]
    kept, dup, best = core.semantic_greedy(x[order], THRESHOLD, 64)
    assert (~kept).sum() >= n // 4
    for i, row in enumerate(order):
        r, d, s = got[int(pair_ids[row])]
        if kept[i]:
            assert r == core.KEPT
        else:
            assert (r, d) == (core.SEMANTIC, int(pair_ids[order[dup[i]]])) and s == pytest.approx(best[i], abs=1e-6)
    assert all(got[int(p)][0] == core.EXACT for p in pair_ids[:5])
