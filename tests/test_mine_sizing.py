"""How mine sizes its work (no Ray): mine.max_group_rows=auto (auto_group_bounds) from a search task's memory, whole clusters when
they fit (each passage routed once, each query once per probed cluster), split groups equal to brute force, the
sidecar grouping's partitions sized by the data, and the resume path counting from the bucket files' footers."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import config as config_mod
from clusterscale.config import ConfigError, MineConfig
from clusterscale.io.rundir import RunDir
from clusterscale.stages import mine
from clusterscale.stages.mine_rows import candidate_partitions
from clusterscale.stages.mine_search import SearchGroups, auto_group_bounds, cluster_counts, route_rows
from tests.test_mine_clusters import K, N, brute_force, mine_in_one_process, pairs  # noqa: F401 - a fixture


def test_auto_group_bounds_on_known_numbers():
    # 4 GB per task, 768-d fp16 vectors, nprobe 4, query blocks of 4,096, top 30. A routed row is 2 x 768 + 40
    # = 1,576 B. Passages: a quarter (1e9 B) less the block (4,096 x (1,576 + 4 x 768 + 30 x 12)), over a
    # passage (two routed rows + 4 x 768 in the index): 157,372. Queries: 4 x that, under what half the memory
    # holds at 1,576 + 30 x 13 B each (1,017,293).
    assert auto_group_bounds(4e9, 768, 2, 4, 4096, 30) == (157_372, 629_488)
    assert auto_group_bounds(4e9, 768, 2, 8, 4096, 30) == (157_372, 1_017_293)  # nprobe 8: half the memory binds
    assert auto_group_bounds(8e9, 768, 2, 4, 4096, 30)[0] == 318_041          # twice the memory: > twice the rows
    assert auto_group_bounds(4e9, 384, 2, 4, 4096, 30)[0] > 157_372            # smaller vectors: more rows
    assert auto_group_bounds(1e6, 768, 2, 4, 4096, 30)[0] == 1                 # no room: 1 passage, never 0


def test_max_group_rows_is_auto_by_default_and_an_integer_overrides():
    assert config_mod.load(None, []).mine.max_group_rows == "auto"
    assert config_mod.load(None, ["mine.max_group_rows=16384"]).mine.max_group_rows == 16_384  # the old key
    for bad in ("0", "big", "1.5"):
        with pytest.raises(ConfigError, match="mine.max_group_rows"):
            config_mod.load(None, [f"mine.max_group_rows={bad}"])


def test_auto_searches_whole_clusters_moving_each_row_once_per_probe(pairs):
    """Groups sized by auto_group_bounds on an ordinary task's memory hold whole clusters: the routed rows are
    N passages + N x nprobe queries, whatever the cluster sizes."""
    table, centroids = pairs
    nprobe = 2
    bounds = auto_group_bounds(2 * 1024**3, table.column("emb").type.list_size, 2, nprobe, 4096, 30)
    passages, queries = cluster_counts(table, centroids, nprobe)
    assert bounds[0] > passages.max() and bounds[1] > queries.max()
    groups = SearchGroups.plan(passages, queries, *bounds)
    assert groups.num_groups == K
    kind = route_rows(table, centroids, nprobe, True, groups).column("kind").to_numpy()
    assert (kind == 0).sum() == N and (kind == 1).sum() == N * nprobe


@pytest.mark.parametrize("max_queries", [N, 60])
def test_clusters_split_into_several_groups_equal_brute_force(pairs, max_queries):
    """Passage parts of <= 20 rows: every cluster is several groups. With room for every query (N) a query is
    copied to each passage part it probes and each passage is routed once; with 60 the queries are split too
    (a passage copied per query part). Either way the negatives equal brute force over the probed clusters."""
    table, centroids = pairs
    mc = MineConfig(nprobe=K, range_max=12, margin=0.95)
    passages, queries = cluster_counts(table, centroids, mc.nprobe)
    groups = SearchGroups.plan(passages, queries, 20, max_queries)
    assert (groups.passage_parts > 1).all() and (groups.query_parts > 1).any() == (max_queries < N)
    kind = route_rows(table, centroids, mc.nprobe, True, groups).column("kind").to_numpy()
    assert (kind == 0).sum() == int((passages * groups.query_parts).sum())  # once per query part
    assert (kind == 1).sum() == int((queries * groups.passage_parts).sum())  # once per passage part
    mined, expected = mine_in_one_process(table, centroids, mc, groups=groups), brute_force(table, centroids, mc, K)
    assert sorted(mined) == sorted(expected)
    assert all(mined[i]["neg_pair_ids"] == expected[i]["neg_pair_ids"] for i in expected)
    assert sum(len(e["neg_pair_ids"]) for e in expected.values()) > N


def test_sidecar_grouping_partitions_follow_the_rows():
    assert candidate_partitions(150, 12, pieces=3) == 1
    # 100M pairs x 30 candidates: far more than Ray's default 200 partitions, about 250k rows each.
    parts = candidate_partitions(100_000_000, 30, pieces=1_000_000)
    assert parts > 200 and 100_000_000 * 30 / parts <= 250_000
    assert candidate_partitions(100_000_000, 30, pieces=500) == 500  # never more partitions than pieces


def test_resume_counts_from_the_footers_without_reading_rows(tmp_path, monkeypatch):
    run = RunDir(str(tmp_path))
    plan = {"units": [{"output": mine.bucket_file(b)} for b in range(3)]}
    negatives = pa.table({"pair_id": pa.array([1, 2, 3], pa.int64()),
                          "neg_pair_ids": pa.array([[2, 3], [], [1]], pa.list_(pa.int64())),
                          "neg_scores": pa.array([[0.5, 0.4], [], [0.3]], pa.list_(pa.float32())),
                          "pos_score": pa.array([0.9, 0.8, 0.7], pa.float32())})
    counts = {"rows": 3, "negatives": 3, "without_negatives": 1, "dropped_positive": 2, "dropped_duplicate": 1,
              "dropped_margin": 0}
    run.write_parquet(mine.bucket_file(1), mine.with_counts(negatives, counts))
    mine.write_empty_buckets(run, plan)  # buckets 0 and 2: empty files, zero counts

    def no_rows(*args, **kwargs):
        raise AssertionError("the resume path read rows on the driver")
    for name in ("read_table", "read_pandas"):
        monkeypatch.setattr(pq, name, no_rows)
    for name in ("read", "read_row_group", "read_row_groups", "iter_batches"):
        monkeypatch.setattr(pq.ParquetFile, name, no_rows)
    stats = mine._stage_stats(run, plan, [], 3, 1.0, 1.0, {}, None, 0)
    assert {k: stats[k] for k in counts} == counts
