"""Semantic duplicates within one cluster (SemDeDup on runtime/dedup_core.py, in blocks), after the held-out
vector leaks routed there, and the cluster's output files: its kept rows and its removed rows.

A cluster with more rows to compare than dedup.max_group_rows is compared block x block in parallel Ray tasks
(one per block pair, each returning only the pairs at or above the threshold), and the keep rule walks that edge
list: the same removals as comparing it whole, with its work spread over every CPU of the Ray cluster."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from clusterscale.config import DedupConfig
from clusterscale.io.layout import DEDUP_KEPT, DEDUP_REMOVED
from clusterscale.io.rundir import RunDir
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.bounded_data import release_freed_memory
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS, emb_matrix
from clusterscale.stages.dedup.exact import replace_columns
from clusterscale.stages.dedup.heldout import heldout_vector_leaks
from clusterscale.runtime.nodes import this_node, unit_delay_for_tests

TASK_MEMORY_FRACTION = 0.25  # of one task's memory, what dedup.max_group_rows=auto lets a cluster's rows take

KEPT_ROWS_PER_FILE = 200_000
REMOVED_SCHEMA = pa.schema([("pair_id", pa.int64()), ("duplicate_of", pa.int64()), ("similarity", pa.float32()),
                            ("reason", pa.string()), ("cluster", pa.int32())])


def mark_vector_leaks(group: pa.Table, held: pa.Table, dc: DedupConfig) -> pa.Table:
    """The cluster's training rows with held-out vector leaks marked among the rows not already removed (`held`:
    the held-out vectors routed to this cluster)."""
    if dc.semantic_threshold <= 0 or not held.num_rows:
        return group
    alive = np.flatnonzero(group.column("reason").to_numpy() == core.KEPT)
    leak_of, leak_sim = heldout_vector_leaks(group.take(pa.array(alive)), held, dc)
    leaked = alive[leak_of >= 0]
    reason = group.column("reason").to_numpy().copy()
    duplicate_of = group.column("duplicate_of").to_numpy().copy()
    similarity = group.column("similarity").to_numpy().copy()
    reason[leaked], duplicate_of[leaked], similarity[leaked] = core.HELDOUT_LEAK, leak_of[leak_of >= 0], \
        leak_sim[leak_of >= 0]
    return replace_columns(group, reason=reason, duplicate_of=duplicate_of, similarity=similarity)


def task_memory_bytes() -> float:
    """The memory of one task: the largest Ray node's `memory` resource per CPU (this machine's without Ray)."""
    import ray

    from clusterscale.runtime.resources import ClusterResources

    if ray.is_initialized():
        cluster = ClusterResources.current()
        if cluster.node_memory_bytes:
            return cluster.task_memory_bytes
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (os.cpu_count() or 1)


def group_rows_limit(dc: DedupConfig, row_bytes: float) -> int:
    """dedup.max_group_rows as a number of rows: 'auto' = the rows of `row_bytes` bytes each (a row's columns in
    memory plus its float32 vector) that TASK_MEMORY_FRACTION of one task's memory holds (at least block_rows)."""
    if dc.max_group_rows != "auto":
        return int(dc.max_group_rows)
    return max(dc.block_rows, int(task_memory_bytes() * TASK_MEMORY_FRACTION // max(row_bytes, 1.0)))


def block_pair_edges_task(*args):
    """core.block_pair_edges as a Ray task (one CPU; numpy's BLAS gets Ray's one thread)."""
    return core.block_pair_edges(*args)


def split_greedy(x: np.ndarray, threshold: float, block_rows: int, max_group_rows: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """core.semantic_greedy's result for a cluster larger than max_group_rows (x in keep order): the edges of
    every block pair (blocks of max_group_rows rows), each pair a Ray task (in this process without Ray), then
    the keep rule over the edge list."""
    import ray

    starts = range(0, len(x), max_group_rows)
    pairs = core.block_pairs(len(x), max_group_rows)
    if ray.is_initialized():
        blocks = {s: ray.put(x[s:s + max_group_rows]) for s in starts}  # each block stored once, read by its pairs
        task = ray.remote(num_cpus=1)(block_pair_edges_task)
        edges = ray.get([task.remote(blocks[a], blocks[b], a, b, threshold, block_rows) for a, b in pairs])
    else:
        edges = [core.block_pair_edges(x[a:a + max_group_rows], x[b:b + max_group_rows], a, b, threshold, block_rows)
                 for a, b in pairs]
    i, j, sim = (np.concatenate(column) for column in zip(*edges))
    return core.greedy_from_edges(len(x), i, j, sim)


def semantic_pass(group: pa.Table, dc: DedupConfig) -> pa.Table:
    """The cluster's rows (sorted by pair_id) with semantic removals marked among the rows not already removed:
    compared whole, or block x block in Ray tasks when more than dedup.max_group_rows rows are left."""
    reason = group.column("reason").to_numpy().copy()
    duplicate_of = group.column("duplicate_of").to_numpy().copy()
    similarity = group.column("similarity").to_numpy().copy()
    best = group.column("best").to_numpy().copy()
    if dc.semantic_threshold > 0:
        alive = np.flatnonzero(reason == core.KEPT)
        pair_ids = group.column("pair_id").to_numpy()
        rows = alive[core.keep_order(pair_ids[alive], group.column("rank").to_numpy()[alive])]
        x = emb_matrix(group.column("emb").take(pa.array(rows)))
        limit = group_rows_limit(dc, group.nbytes / max(group.num_rows, 1) + x.shape[1] * 4)
        if len(rows) > limit:
            kept, dup_index, row_best = split_greedy(x, dc.semantic_threshold, dc.block_rows, limit)
        else:
            kept, dup_index, row_best = core.semantic_greedy(x, dc.semantic_threshold, dc.block_rows)
        removed = rows[~kept]
        reason[removed] = core.SEMANTIC
        duplicate_of[removed] = pair_ids[rows[dup_index[~kept]]]
        similarity[removed] = row_best[~kept]
        best[rows] = row_best
    return replace_columns(group, reason=reason, duplicate_of=duplicate_of, similarity=similarity, best=best)


def example_group(group: pa.Table) -> dict | None:
    """The cluster's largest semantic group: its kept pair and up to 3 removed ones (for the report)."""
    reason = group.column("reason").to_numpy()
    semantic = np.flatnonzero(reason == core.SEMANTIC)
    if not len(semantic):
        return None
    dup_of = group.column("duplicate_of").to_numpy()[semantic]
    heads, counts = np.unique(dup_of, return_counts=True)
    head = heads[np.argmax(counts)]  # equal sizes: the lowest pair_id
    members = semantic[dup_of == head][:3]
    pair_ids = group.column("pair_id").to_numpy()
    kept_row = int(np.flatnonzero(pair_ids == head)[0])
    texts = {side: group.column(side) for side in ("query", "passage")}
    return {"cluster": int(group.column("cluster")[0].as_py()), "size": int(counts.max()) + 1,
            "kept": {"pair_id": int(head), "query": texts["query"][kept_row].as_py(),
                     "passage": texts["passage"][kept_row].as_py()[:200]},
            "removed": [{"pair_id": int(pair_ids[r]), "similarity": round(float(
                group.column("similarity")[int(r)].as_py()), 4), "query": texts["query"][int(r)].as_py(),
                "passage": texts["passage"][int(r)].as_py()[:200]} for r in members]}


def dedup_cluster(group: pa.Table, run_uri: str, dc: DedupConfig, columns: list[str]) -> pa.Table:
    """Group step: the semantic pass of one cluster, then its kept rows (all `columns` of assign/) and its removed
    rows are written; returns the cluster's counts and histogram of best cosines (one row). dc: the dedup
    section."""
    release_freed_memory()  # what the worker's previous group or task freed
    unit_delay_for_tests("dedup")
    cluster = int(group.column("cluster")[0].as_py())
    probe = pa.array(group.column("reason").to_numpy() == core.HELDOUT_PROBE)
    held, group = group.filter(probe).sort_by("pair_id"), group.filter(pc.invert(probe)).sort_by("pair_id")
    group = semantic_pass(mark_vector_leaks(group, held, dc), dc)
    reason = group.column("reason").to_numpy()
    run = RunDir(run_uri)
    kept = group.filter(pa.array(reason == core.KEPT)).select(columns)
    for part, start in enumerate(range(0, kept.num_rows, KEPT_ROWS_PER_FILE)):
        run.write_parquet(f"{DEDUP_KEPT}/part-c{cluster:06d}-{part:05d}.parquet",
                          kept.slice(start, KEPT_ROWS_PER_FILE), row_group_size=EMBEDDINGS_ROW_GROUP_ROWS)
    removed = group.filter(pa.array(reason != core.KEPT))
    if removed.num_rows:
        names = np.array([core.REASONS.get(int(r), "") for r in range(max(core.REASONS) + 1)], dtype=object)
        run.write_parquet(f"{DEDUP_REMOVED}/part-c{cluster:06d}.parquet", pa.table({
            "pair_id": removed.column("pair_id"), "duplicate_of": removed.column("duplicate_of"),
            "similarity": removed.column("similarity"),
            "reason": pa.array(names[removed.column("reason").to_numpy()].tolist(), pa.string()),
            "cluster": pa.array(np.full(removed.num_rows, cluster, np.int32))}, schema=REMOVED_SCHEMA))
    _, histogram = core.histogram_near(group.column("best").to_numpy(), dc.semantic_threshold)
    example = example_group(group)
    return pa.table({"cluster": [cluster], "rows": [group.num_rows], "kept": [kept.num_rows],
                     **{name: [int((reason == code).sum())] for code, name in core.REASONS.items()},
                     "histogram": [histogram], "example": [json.dumps(example) if example else ""],
                     "node": [this_node()]})
