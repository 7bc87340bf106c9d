"""Retrieval metrics, tie handling, grouping and the cost arithmetic against hand-computed values."""
from __future__ import annotations

import math

import numpy as np
import pytest

from clusterscale.stages.costs import extrapolate
from clusterscale.stages.evaluate import (mean_by_group, mrr_at_k, ndcg_at_k, recall_at_k, retrieval_metrics, search,
                                         whole_pool_warning)
from clusterscale.experiments import paired_difference, spread
from clusterscale.stages.report_plots import rolling_mean


def test_single_relevant_at_rank_three():
    ranked = [7, 8, 3, 9]
    assert ndcg_at_k(ranked, {3}, 10) == pytest.approx(1 / math.log2(4))  # = 0.5
    assert mrr_at_k(ranked, {3}, 10) == pytest.approx(1 / 3)
    assert recall_at_k(ranked, {3}, 1) == 0.0
    assert recall_at_k(ranked, {3}, 3) == 1.0


def test_several_relevant_passages():
    ranked = [1, 5, 2, 6, 7]
    relevant = {1, 2, 4}  # 4 is never retrieved
    dcg = 1 + 1 / math.log2(4)  # hits at ranks 1 and 3
    ideal = 1 + 1 / math.log2(3) + 1 / math.log2(4)
    assert ndcg_at_k(ranked, relevant, 10) == pytest.approx(dcg / ideal)  # 1.5 / 2.1309 = 0.7039
    assert ndcg_at_k(ranked, relevant, 10) == pytest.approx(0.70391, abs=1e-5)
    assert mrr_at_k(ranked, relevant, 10) == 1.0
    assert recall_at_k(ranked, relevant, 2) == pytest.approx(1 / 3)
    assert recall_at_k(ranked, relevant, 5) == pytest.approx(2 / 3)


def test_ideal_dcg_is_capped_at_k():
    # 12 relevant passages, all of the top 10 relevant: a perfect NDCG@10 even though recall@10 < 1.
    ranked = list(range(12))
    assert ndcg_at_k(ranked, set(range(12)), 10) == pytest.approx(1.0)
    assert recall_at_k(ranked, set(range(12)), 10) == pytest.approx(10 / 12)


def test_none_retrieved_scores_zero_and_counts_in_the_mean():
    assert ndcg_at_k([1, 2, 3], {9}, 10) == 0.0
    assert mrr_at_k([1, 2, 3], {9}, 10) == 0.0
    assert recall_at_k([1, 2, 3], {9}, 100) == 0.0
    assert recall_at_k([], set(), 10) == 0.0
    m = retrieval_metrics([[0, 1], [1, 0]], [{0}, {9}], [1, 10])
    assert m["ndcg_at_10"] == pytest.approx(0.5)  # (1 + 0) / 2: the miss is not dropped
    assert m["mrr_at_10"] == pytest.approx(0.5)
    assert m["recall_at_1"] == pytest.approx(0.5)


def test_relevant_beyond_cutoff_is_not_counted():
    ranked = list(range(20))
    assert ndcg_at_k(ranked, {15}, 10) == 0.0
    assert mrr_at_k(ranked, {15}, 10) == 0.0
    assert recall_at_k(ranked, {15}, 10) == 0.0
    assert recall_at_k(ranked, {15}, 100) == 1.0


def test_search_orders_by_score_and_ties_independently_of_pool_index():
    pool = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.6, 0.8]], dtype=np.float32)
    query = np.array([[1.0, 0.0]], dtype=np.float32)
    ranked = search(query, pool, depth=4)[0]
    assert set(ranked[:2]) == {0, 2} and ranked[2:] == [3, 1]
    # Deterministic (a fixed key per pool index), and whichever tied passage is relevant, NDCG is 1 or
    # 1/log2(3): the tie is resolved one way, never counted twice.
    assert search(query, pool, depth=4)[0] == ranked
    tied_first, tied_second = ranked[0], ranked[1]
    assert ndcg_at_k(ranked, {tied_first}, 10) == 1.0
    assert ndcg_at_k(ranked, {tied_second}, 10) == pytest.approx(1 / math.log2(3))


def test_search_depth_larger_than_pool():
    pool = np.eye(3, dtype=np.float32)
    assert sorted(search(np.eye(3, dtype=np.float32)[:1], pool, depth=100)[0]) == [0, 1, 2]


def test_mean_by_group():
    out = mean_by_group([1.0, 0.0, 0.5, 0.25], [2, 0, 2, 0])
    assert out == {0: {"queries": 2, "mean": 0.125}, 2: {"queries": 2, "mean": 0.75}}


def test_spread_uses_sample_std():
    s = spread([0.5, 0.7, 0.6])
    assert s["mean"] == pytest.approx(0.6)
    assert s["std"] == pytest.approx(0.1)  # ddof=1
    assert (s["min"], s["max"]) == (0.5, 0.7)
    assert spread([0.3])["std"] == 0.0


def test_extrapolation_proportional_and_linear():
    one = extrapolate([(1000, 50.0)], 1_000_000)
    assert one["value"] == pytest.approx(50_000.0) and "proportional" in one["method"]
    line = extrapolate([(1000, 12.0), (3000, 32.0)], 10_000)  # a = 2 s, b = 0.01 s/row
    assert line["value"] == pytest.approx(102.0)
    assert line["points"] == [(1000, 12.0), (3000, 32.0)]


def test_rolling_mean():
    out = rolling_mean(np.array([1.0, 3.0, 5.0, 7.0]), 2)
    assert out.tolist() == [1.0, 2.0, 4.0, 6.0]


def test_ties_are_not_broken_in_favour_of_low_pool_indices():
    # Held-out (relevant) passages come first in the pool: an index-order tie-break would favour them.
    pool = np.tile(np.array([[1.0, 0.0]], dtype=np.float32), (20, 1))
    ranked = search(np.array([[1.0, 0.0]], dtype=np.float32), pool, depth=20)[0]
    assert sorted(ranked) == list(range(20)) and ranked != list(range(20))


def test_eval_set_groups_a_heldout_query_with_all_its_passages(tmp_path):
    """The split keeps a query's pairs together: one scored query, every one of its passages relevant."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from clusterscale.stages.evaluate import build_eval_set
    from clusterscale.io.rundir import RunDir

    (tmp_path / "heldout").mkdir()
    (tmp_path / "pairs").mkdir()
    pq.write_table(pa.table({"pair_id": pa.array([10, 11, 12, 13], pa.int64()),
                             "query": ["What is a star", "what is  a STAR", "bake bread", "what is a star"],
                             "passage": ["a ball of gas", "a luminous body", "flour and water", "a ball of gas"],
                             "source": ["a", "a", "b", "a"]}), tmp_path / "heldout" / "part-0.parquet")
    pq.write_table(pa.table({"pair_id": pa.array([1, 2], pa.int64()), "passage": ["a goal in football", "stocks"]}),
                   tmp_path / "pairs" / "part-0.parquet")
    es = build_eval_set(RunDir(str(tmp_path)), max_queries=10, num_distractors=10)
    assert sorted(es["query_ids"]) == [10, 12]  # three spellings of one query are one query
    star = es["query_ids"].index(10)
    assert {es["pool"][i] for i in es["qrels"][star]} == {"a ball of gas", "a luminous body"}
    assert len(es["pool"]) == 5 and len(set(es["pool"])) == 5  # passages once each, distractors included


def test_paired_difference_interval_by_hand():
    d = paired_difference([0.01, 0.03, -0.01])  # mean 0.01, sample std 0.02, t(0.975, 2) = 4.302653
    half = 4.302653 * 0.02 / math.sqrt(3)
    assert d["mean"] == pytest.approx(0.01) and d["ci95"] == pytest.approx([0.01 - half, 0.01 + half], abs=1e-6)
    assert (d["n"], d["wins"]) == (3, 2)
    assert paired_difference([0.02])["ci95"] is None  # one seed: no interval


def test_a_recall_at_k_over_the_whole_pool_is_said_not_reported_silently():
    """Recall@k with k >= the pool's size is 1.0 by construction: evaluate warns, naming the first such k."""
    assert whole_pool_warning([1, 10, 100], 132) is None
    warning = whole_pool_warning([1, 10, 100, 1000], 100)
    assert warning.startswith("Recall@100 counts every passage of the pool of 100"), warning
    # A pool of one passage (every held-out pair has the same passage text) scores NDCG@10 1.0: said too.
    one = whole_pool_warning([100], 1)
    assert one.startswith("Recall@100 counts every passage of the pool of 1 ") and "NDCG@10 and MRR@10" in one
    assert "same passage text" in one and whole_pool_warning([], 10).startswith("NDCG@10 and MRR@10 rank every")
    assert whole_pool_warning([5], 11) is None
    assert "eval.num_distractors" in warning
