"""Dedup's compute core and group steps, single-process: equal to brute force on planted duplicates."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from clusterscale.config import DedupConfig
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.vectors import emb_array
from clusterscale.stages.dedup import heldout_keys, mark_rows, resolve_exact, semantic_pass

from tests.dedup_reference import brute_force_exact, brute_force_semantic, planted_vectors

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
                                    "passage": pa.array([], pa.string())})) | {"vectors": {}}


def test_group_steps_do_not_depend_on_row_arrival(planted):
    """The exact and cluster steps give the same marks whatever order (or split) their rows arrive in."""
    x, cluster, pair_ids, cos = planted
    one = cluster == 0
    dedup = vars(DedupConfig(exact=True, key="passage", semantic_threshold=THRESHOLD, block_rows=16))
    passages = [f"p{i % 150}" for i in range(len(x))]  # exact copies too
    table = _rows(x[one], cluster[one], pair_ids[one], cos[one], passages=[p for p, o in zip(passages, one) if o])
    outs = []
    for perm_seed in (0, 1):
        perm = np.random.default_rng(perm_seed).permutation(table.num_rows)
        shuffled = table.take(pa.array(perm))
        marked = pa.concat_tables([mark_rows(shuffled.slice(s, 37), dedup, NO_HELDOUT, 3)
                                   for s in range(0, table.num_rows, 37)])
        out = semantic_pass(resolve_exact(marked).sort_by("pair_id"), DedupConfig(**dedup))
        outs.append(out.select(["pair_id", "reason", "duplicate_of", "similarity"]).to_pydict())
        assert {core.EXACT, core.SEMANTIC} <= set(out.column("reason").to_pylist())
    assert outs[0] == outs[1]


def test_heldout_leaks_are_marked():
    x, cluster, _ = planted_vectors(50, D, 1, 0, seed=5)
    pair_ids = np.arange(50, dtype=np.int64)
    held_x = np.concatenate([x[:2], np.eye(D, dtype=np.float32)[:1]])  # rows 0 and 1 leak by vector
    heldout = heldout_keys(pa.table({"pair_id": [900, 901, 902], "query": ["hq0", "hq1", "HQ2"],
                                     "passage": ["hp0", "hp1", "p7 "]})) | {"vectors": {"emb": held_x}}
    queries = [f"q{i}" for i in range(50)]
    queries[5] = "hq2"  # leaks by query text (normalised)
    dedup = vars(DedupConfig(semantic_threshold=0.999))
    marked = mark_rows(_rows(x, cluster, pair_ids, np.ones(50), queries=queries), dedup, heldout, 1)
    leaks = {p: d for p, r, d in zip(pair_ids, marked.column("reason").to_pylist(),
                                     marked.column("duplicate_of").to_pylist()) if r == core.HELDOUT_LEAK}
    assert leaks == {0: 900, 1: 901, 5: 902, 7: 902}
