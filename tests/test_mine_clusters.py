"""Mining sharded by cluster (stages/mine_search.py), single-process: equal to brute force when every cluster
is probed, and to brute force over the probed clusters otherwise."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from clusterscale import config as config_mod
from clusterscale.config import MineConfig
from clusterscale.runtime.hashing import text_hashes
from clusterscale.runtime.vectors import emb_array
from clusterscale.stages.mine_search import (SearchGroups, cluster_counts, merge_candidates, route_rows,
                                             search_cluster)

N, D, K = 240, 16, 6


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def pairs():
    """Clustered pairs with duplicate passages and repeated queries; vectors rounded to fp16 as stored."""
    rng = np.random.default_rng(7)
    centroids = _unit(rng.normal(size=(K, D)))
    topic = rng.integers(K, size=N)
    p = _unit(centroids[topic] + 0.5 * rng.normal(size=(N, D))).astype(np.float16)
    q = _unit(p.astype(np.float32) + 0.4 * rng.normal(size=(N, D))).astype(np.float16)
    queries, passages = [f"q{i}" for i in range(N)], [f"p{i}" for i in range(N)]
    for i in range(0, 30, 3):
        passages[i + 1] = passages[i]   # a duplicate of i's passage text
        queries[i + 2] = queries[i]     # a query with two positives
    pf = p.astype(np.float32)
    cluster = np.argmax(pf @ centroids.T, axis=1).astype(np.int32)
    pair_ids = np.arange(N, dtype=np.int64) * 7 + 3  # not row numbers
    table = pa.table({"pair_id": pair_ids, "query": queries, "passage": passages, "emb": emb_array(p),
                      "emb_query": emb_array(q), "cluster": cluster})
    return table, centroids


def mine_in_one_process(table: pa.Table, centroids: np.ndarray, mc: MineConfig, buckets: int = 3,
                        groups: SearchGroups | None = None) -> dict:
    """The stage's three steps without Ray: route per batch, group by search group, group by bucket."""
    routed = pa.concat_tables([route_rows(table.slice(s, 50), centroids, mc.nprobe, True, groups)
                               for s in range(0, table.num_rows, 50)])
    keys = routed.column("group").to_numpy()
    found = pa.concat_tables([search_cluster(routed.filter(pa.array(keys == g)), mc, buckets)
                              for g in np.unique(keys)])
    out = {}
    for b in np.unique(found.column("bucket").to_numpy()):
        negatives, _ = merge_candidates(found.filter(pa.array(found.column("bucket").to_numpy() == b)), mc)
        assert negatives.column("pair_id").to_numpy().tolist() == sorted(negatives.column("pair_id").to_pylist())
        out |= {row["pair_id"]: row for row in negatives.to_pylist()}
    return out


def brute_force(table: pa.Table, centroids: np.ndarray, mc: MineConfig, nprobe: int) -> dict:
    """The rule with a full sort per query over the passages of its nprobe nearest clusters (numpy only)."""
    p = table.column("emb").combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    q = table.column("emb_query").combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    p, q = p.reshape(N, D), q.reshape(N, D)
    ids, cluster = table.column("pair_id").to_numpy(), table.column("cluster").to_numpy()
    qk, pk = text_hashes(table.column("query").to_pylist()), text_hashes(table.column("passage").to_pylist())
    out = {}
    for i in range(N):
        probed = np.argsort(-(centroids @ q[i]), kind="stable")[:nprobe]
        pool = np.flatnonzero(np.isin(cluster, probed))
        scores = p[pool] @ q[i]
        ranked = pool[np.lexsort((ids[pool], -scores))][:mc.range_max]
        pos = float(p[i] @ q[i])
        kept = [j for rank, j in enumerate(ranked) if rank >= mc.range_min and qk[j] != qk[i] and pk[j] != pk[i]
                and (mc.margin is None or p[j] @ q[i] <= mc.margin * pos)]
        out[int(ids[i])] = {"neg_pair_ids": ids[kept].tolist(), "probed_own": cluster[i] in probed}
    return out


@pytest.mark.parametrize("mc", [MineConfig(nprobe=K, range_max=12, margin=None),
                                MineConfig(nprobe=K + 4, range_min=2, range_max=20, margin=0.95)])
def test_every_cluster_probed_equals_brute_force(pairs, mc):
    table, centroids = pairs
    mined, expected = mine_in_one_process(table, centroids, mc), brute_force(table, centroids, mc, K)
    assert sorted(mined) == sorted(expected)  # every training query exactly once
    assert all(mined[i]["neg_pair_ids"] == expected[i]["neg_pair_ids"] for i in expected)
    assert sum(len(e["neg_pair_ids"]) for e in expected.values()) > N  # the comparison is not vacuous
    for row in mined.values():
        assert all(np.diff(row["neg_scores"]) <= 0)  # best first


@pytest.mark.parametrize("nprobe", [1, 2])
def test_fewer_clusters_equal_brute_force_over_the_probed_ones(pairs, nprobe):
    table, centroids = pairs
    mc = MineConfig(nprobe=nprobe, range_max=12, margin=None)
    mined, expected = mine_in_one_process(table, centroids, mc), brute_force(table, centroids, mc, nprobe)
    exact = brute_force(table, centroids, mc, K)
    assert sorted(mined) == sorted(expected)
    assert sum(e["probed_own"] for e in expected.values()) > N // 3
    # Every query (its positive's cluster probed or not) gets exactly the search over its probed clusters.
    assert all(mined[i]["neg_pair_ids"] == expected[i]["neg_pair_ids"] for i in expected)
    assert any(mined[i]["neg_pair_ids"] != exact[i]["neg_pair_ids"] for i in expected)  # restricted indeed


def test_same_output_whatever_the_batches_and_buckets(pairs):
    table, centroids = pairs
    mc = MineConfig(nprobe=3, range_max=10, margin=0.95)
    shuffled = table.take(pa.array(np.random.default_rng(1).permutation(N)))
    assert mine_in_one_process(table, centroids, mc, buckets=1) == mine_in_one_process(shuffled, centroids, mc,
                                                                                       buckets=4)


def test_split_search_groups_give_the_same_negatives(pairs):
    """Clusters split into passage x query parts (a small mine.max_group_rows): every group is bounded and
    the merged negatives equal the unsplit search."""
    table, centroids = pairs
    mc = MineConfig(nprobe=K, range_max=12, margin=0.95)
    passages, queries = cluster_counts(table, centroids, mc.nprobe)
    assert passages.sum() == N and queries.sum() == N * K
    groups = SearchGroups.plan(passages, queries, max_group_rows=25)
    assert groups.num_groups > 4 * K and (groups.passage_parts > 1).any()
    routed = route_rows(table, centroids, mc.nprobe, True, groups)
    kind, keys = routed.column("kind").to_numpy(), routed.column("group").to_numpy()
    assert (kind == 0).sum() == int((passages * groups.query_parts).sum())  # a copy per query part
    largest = max(np.bincount(keys[kind == k]).max() for k in (0, 1))
    assert largest <= 3 * 25  # hash parts: balanced in expectation
    assert mine_in_one_process(table, centroids, mc, groups=groups) == mine_in_one_process(table, centroids, mc)


def _kill_midway(argv: list[str], address: str, delays: dict, folder: str, prefix: str, files: int) -> None:
    """`clusterscale <argv>` on the session's Ray with its units slowed by `delays` (tests/conftest.py's hook), killed
    (SIGKILL) once `folder` holds `files` files named `prefix`*. Returns once no more such files come: Ray ends a
    killed driver's tasks only when it has seen the driver gone, and a task that ends first still writes its file
    (still slowed meanwhile: the files counted after this are the ones a rerun finds)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from clusterscale.runtime.nodes import TEST_UNIT_DELAY_ENV

    def count() -> int:
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return len([f for f in names if f.startswith(prefix) and not f.startswith(".")])

    delay = Path(os.environ[TEST_UNIT_DELAY_ENV])  # the session's Ray workers read it
    delay.parent.mkdir(parents=True, exist_ok=True)
    delay.write_text(json.dumps(delays))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "clusterscale.cli", *argv], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env={**os.environ, "RAY_ADDRESS": address})
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and count() < files:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        quiet = max(2.0, 5 * max(delays.values()))  # seconds without a new file
        seen, settled = count(), time.time() + quiet
        while time.time() < min(settled, deadline):
            time.sleep(0.05)
            if count() != seen:
                seen, settled = count(), time.time() + quiet
    finally:
        delay.unlink()


def test_stage_on_a_synth_run_with_split_groups_equals_one_process(tmp_path, ray_local, monkeypatch, capsys):
    """The Ray stage (row-group reads, counting pass, split groups, shuffles) writes what the single-process
    steps give on the same assign/ rows: exact search (nprobe = k, flat index) over groups of <= 150 passages.
    The sidecar writer groups its drawn rows by piece into partitions sized by the rows (here ~1,000 each). Killed
    (SIGKILL of the driver) in the midst of its search, `mine` keeps the groups it searched: the rerun searches the
    rest and writes the same negatives."""
    import errno
    import json
    import os

    from clusterscale.stages import mine as mine_stage
    from clusterscale.stages import shards as shard_stage

    import pyarrow.parquet as pq
    import ray

    from clusterscale import cli
    from clusterscale.io.layout import assign_dir
    from clusterscale.io.rundir import RunDir
    from clusterscale.stages import mine_rows
    from clusterscale.stages.kmeans import load_centroids
    from clusterscale.io.negatives import shard_files, training_manifest

    groupings, groupby = [], ray.data.Dataset.groupby

    def spy(self, key, num_partitions=None, **kwargs):
        groupings.append((key, num_partitions))
        return groupby(self, key, num_partitions=num_partitions, **kwargs)
    monkeypatch.setattr(ray.data.Dataset, "groupby", spy)
    monkeypatch.setattr(mine_rows, "JOIN_ROWS_PER_PARTITION", 1000)

    run_dir, k = str(tmp_path / "run"), 5
    keys = [f"cluster.k={k}", "embed.side=both", "data.rows_per_part=600", f"mine.nprobe={k}", "mine.range_max=8",
            "mine.max_group_rows=150", "ray.disk_shuffle_min_mib=0",  # the shuffles through local files
            "train.negatives_per_query=1"]
    assert cli.main(["synth", "--run-dir", run_dir, "--rows", "1500", "--dim", "16", "--topics", "4",
                     "--set", *keys]) == 0
    for verb in ("fit", "assign", "shard", "mine"):
        assert cli.main([verb, "--run-dir", run_dir, "--set", *keys]) == 0
    run = RunDir(run_dir)
    assigned = pa.concat_tables([pq.read_table(f) for f in run.files(assign_dir(k))])
    mc = MineConfig(nprobe=k, range_max=8)
    expected = mine_in_one_process(assigned, load_centroids(run, k), mc)

    def check_negatives() -> None:
        parts = [pq.read_table(f) for f in run.files("negatives") if os.path.basename(f).startswith("part-")]
        got = {row["pair_id"]: row for row in pa.concat_tables(parts).to_pylist()}
        assert sorted(got) == sorted(expected) and len(got) == assigned.num_rows
        assert all(got[i]["neg_pair_ids"] == expected[i]["neg_pair_ids"] for i in expected)
        assert np.allclose([s for i in expected for s in got[i]["neg_scores"]],
                           [s for i in expected for s in expected[i]["neg_scores"]], atol=1e-6)
    check_negatives()
    assert not run.exists(mine_stage.SEARCH_DIR)  # the search groups' results go once the buckets are written
    # Every negatives file there, the marker lost: the rerun counts them from their footers, or, for a file
    # written before the footers held counts, in Ray tasks.
    stats = run.done_stats("negatives")
    first = sorted(f for f in run.files("negatives") if os.path.basename(f).startswith("part-"))[0]
    pq.write_table(pq.read_table(first).replace_schema_metadata(None), first)
    run.remove("negatives", "_DONE.json")
    assert cli.main(["mine", "--run-dir", run_dir, "--set", *keys]) == 0
    again = run.done_stats("negatives")
    assert {k: again[k] for k in ("rows", "negatives", "without_negatives")} == \
        {k: stats[k] for k in ("rows", "negatives", "without_negatives")}
    manifest = training_manifest(config_mod.load(None, keys), run)[1]
    pieces, shard_rows = len(mine_rows.piece_units(manifest)), sum(n for _, n in shard_files(manifest))
    assert ("unit", min(pieces, -(-shard_rows * 1 // 1000))) in groupings and pieces > 1  # 1 negative, 1 draw

    searched = run.path(mine_stage.SEARCH_DIR)
    address = ray_local.get_runtime_context().gcs_address
    _kill_midway(["mine", "--run-dir", run_dir, "--replace", "--set", *keys], address, {"mine": 0.3}, searched,
                 "searched-", 3)  # per search chunk (and bucket): the kill lands mid-search
    before = [f for f in os.listdir(searched) if f.startswith("searched-")]
    plan = run.read_json("negatives/_plan.json")["groups"]
    groups = mine_stage.SearchGroups(np.asarray(plan["passage_parts"]), np.asarray(plan["query_parts"])).num_groups
    assert 3 <= len(before) < groups and not run.exists("negatives/_DONE.json")
    capsys.readouterr()
    assert cli.main(["mine", "--run-dir", run_dir, "--set", *keys]) == 0
    said = capsys.readouterr().out
    assert f"resuming: {len(before)} of {groups} search groups" in said, said
    check_negatives()

    # shard: an attempt that stopped before its manifest (here a failure writing it, in this process) keeps the
    # (shard, sub) groups it recorded; with two of them lost as a kill mid-write would, the rerun writes those only.
    clusters = run.read_json("shards/k=5/manifest.json")["clusters"]
    files = {f: open(run.path(f), "rb").read() for c in clusters for f in c["files"]}
    records = run.path("shards/k=5", shard_stage.GROUPS_DIR)
    write_json = RunDir.write_json

    def no_manifest(self, rel, obj):
        if rel.endswith("k=5/manifest.json"):
            raise OSError(errno.EIO, "stopped before the manifest", rel)
        return write_json(self, rel, obj)
    monkeypatch.setattr(RunDir, "write_json", no_manifest)
    with pytest.raises(OSError, match="stopped before the manifest"):
        cli.main(["shard", "--run-dir", run_dir, "--replace", "--set", *keys])
    monkeypatch.setattr(RunDir, "write_json", write_json)
    lost = sorted(os.listdir(records))[:2]
    for name in lost:
        for f in json.loads(open(os.path.join(records, name)).read())["files"]:
            os.remove(run.path(f))
        os.remove(os.path.join(records, name))
    kept = {f: os.stat(run.path(f)).st_mtime_ns for f in files if os.path.exists(run.path(f))}
    assert len(lost) == 2 and kept and len(kept) < len(files) and not run.exists("shards/k=5/_DONE.json")
    capsys.readouterr()
    assert cli.main(["shard", "--run-dir", run_dir, "--set", *keys]) == 0
    said = capsys.readouterr().out
    assert f"resuming: {len(clusters) - 2} of {len(clusters)} groups" in said, said
    assert run.read_json("shards/k=5/manifest.json")["clusters"] == clusters and not os.path.exists(records)
    assert {f: os.stat(run.path(f)).st_mtime_ns for f in kept} == kept  # the kept groups' files untouched
    assert {f: open(run.path(f), "rb").read() for f in files} == files


@pytest.mark.unit
def test_merge_ranks_each_query_on_its_own_in_blocks(monkeypatch):
    """merge_candidates against a per-query reference: a query's candidates from all its rows (arriving in any order,
    some rows short, some queries with many rows) ranked by score then pair_id, cut at range_max, the rule applied;
    the same whatever the block of queries ranked at once, and on a sliced table (list offsets not from 0)."""
    from clusterscale.stages import mine_search

    rng = np.random.default_rng(11)
    mc = MineConfig(range_min=2, range_max=8, margin=0.9)
    rows = []
    for q in range(60):
        for r in range(1 + q % 5):
            n = int(rng.integers(0, 9))
            scores = np.round(rng.random(n), 1).astype(np.float32)  # ties within and across rows
            ids = rng.choice(10_000, n, replace=False) + 10_000 * r  # disjoint across a query's rows
            order = np.lexsort((ids, -scores))
            rows.append({"bucket": 0, "pair_id": 5 * q + 1, "pos_score": float(rng.random()),
                         "cand_scores": scores[order].tolist(), "cand_ids": ids[order].tolist(),
                         "cand_flags": rng.choice([0, 0, 0, 1, 2], n).tolist()})
    rows = [rows[i] for i in rng.permutation(len(rows))]
    pos = {}
    for row in rows:
        pos.setdefault(row["pair_id"], row["pos_score"])
    for row in rows:
        row["pos_score"] = pos[row["pair_id"]]
    table = pa.Table.from_pylist(rows, pa.schema([("bucket", pa.int32()), ("pair_id", pa.int64()),
                                                  ("pos_score", pa.float32()),
                                                  ("cand_scores", pa.list_(pa.float32())),
                                                  ("cand_ids", pa.list_(pa.int64())),
                                                  ("cand_flags", pa.list_(pa.int8()))]))
    expected = {}
    for q in sorted(pos):
        cands = sorted(((s, i, f) for row in rows if row["pair_id"] == q
                        for s, i, f in zip(row["cand_scores"], row["cand_ids"], row["cand_flags"])),
                       key=lambda c: (-np.float32(c[0]), c[1]))[:mc.range_max]
        limit = mc.margin * np.float32(pos[q])
        expected[q] = [i for rank, (s, i, f) in enumerate(cands)
                       if rank >= mc.range_min and f == 0 and np.float32(s) <= limit]
    for block in (4096, 7):
        monkeypatch.setattr(mine_search, "MERGE_QUERY_BLOCK", block)
        out, _ = merge_candidates(table, mc)
        assert dict(zip(out.column("pair_id").to_pylist(), out.column("neg_pair_ids").to_pylist())) == expected
        sliced, _ = merge_candidates(table.slice(40), mc)
        kept = set(table.slice(40).column("pair_id").to_pylist())
        assert sliced.column("pair_id").to_pylist() == sorted(kept)


@pytest.mark.unit
def test_a_search_task_keeps_the_chunks_an_earlier_attempt_wrote(pairs, tmp_path, monkeypatch):
    """mine's search task writes a group's results a chunk of queries per file, then the group's marker; run again on
    the same rows (a retry, or a rerun after a kill) it searches only the chunks not written, and the chunks together
    are search_cluster's rows for the whole group."""
    import os

    import ray

    from clusterscale.io.rundir import RunDir
    from clusterscale.stages import mine as mine_stage

    table, centroids = pairs
    mc = MineConfig(nprobe=K, range_max=10, query_batch_size=16)
    routed = route_rows(table, centroids, mc.nprobe, True)
    group = routed.filter(pa.array(routed.column("group").to_numpy() == 2))
    monkeypatch.setattr(mine_stage, "SEARCH_CHUNK_QUERIES", (40, 40))  # whole blocks: 48 queries a chunk
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    run, keys = RunDir(str(tmp_path / "run")), np.array([-1, -1, 2])  # shuffle keys: group 2 keeps its id

    def search() -> dict[str, int]:
        mine_stage._search(group, run.uri, mc, 3, keys)
        folder = run.path(mine_stage.search_folder(2))
        return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in sorted(os.listdir(folder))}

    first = search()
    queries = int((group.column("kind").to_numpy() == 1).sum())
    assert len(first) == -(-queries // 48) >= 3 and run.exists(mine_stage.searched_marker(2))
    got = pa.concat_tables([pq_read(run, mine_stage.search_folder(2), name) for name in first])
    assert got.equals(search_cluster(group, mc, 3))
    lost = list(first)[1]
    run.remove(mine_stage.search_folder(2), lost)
    run.remove(mine_stage.searched_marker(2))
    second = search()
    assert second.keys() == first.keys()
    assert [name for name in first if second[name] != first[name]] == [lost]  # only the lost chunk again
    assert pa.concat_tables([pq_read(run, mine_stage.search_folder(2), name) for name in second]).equals(got)


@pytest.mark.unit
def test_search_chunks_are_cut_by_work_within_their_bounds():
    """A chunk is about SEARCH_CHUNK_MACS multiply-adds of search (what a lost search task costs), never fewer than
    16,384 queries (files) nor more than 32,768; a plan written before the rule was recorded keeps its 32,768."""
    from clusterscale.stages import mine as mine_stage

    rule = mine_stage.chunk_rule()
    assert mine_stage.chunk_queries(rule, 24_000, 384) == 16_384  # a group of a 200k-pair run, k = 8: ~15k by work
    assert mine_stage.chunk_queries(rule, 1_000_000, 768) == 16_384
    assert mine_stage.chunk_queries(rule, 5_000, 384) == 32_768  # small groups: few files
    between = mine_stage.chunk_queries(rule, 8_000, 768)
    assert 16_384 < between < 32_768 and between * 8_000 * 768 <= rule["macs"] < (between + 1) * 8_000 * 768
    assert mine_stage.chunk_queries(mine_stage.UNRECORDED_CHUNKS, 24_000, 384) == 32_768
    plan = mine_stage.plan_units(100, config_mod.load(None, []), SearchGroups.one_per_cluster(2), (10, 40))
    assert plan["search_chunks"] == rule  # recorded: a rerun by a later version cuts the chunks this one cut


def pq_read(run, folder: str, name: str) -> pa.Table:
    import pyarrow.parquet as pq

    return pq.read_table(run.path(folder, name))
