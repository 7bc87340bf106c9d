"""Semantic duplicates within one cluster (SemDeDup on runtime/dedup_core.py, in blocks), after the held-out
vector leaks routed there, and the cluster's output files: its kept rows and its removed rows.

A cluster with more rows than dedup.max_group_rows never comes here whole: stages/dedup/blocks.py decides it in
chunks of its keep order, each against the rows kept before it, in a chain of Ray tasks (the same removals as
comparing it whole, no task holding more than a few blocks); write_outputs writes its blocks."""
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
HISTOGRAM_BINS = len(core.histogram_near(np.zeros(0), 0.0)[1])
REMOVED_SCHEMA = pa.schema([("pair_id", pa.int64()), ("duplicate_of", pa.int64()), ("similarity", pa.float32()),
                            ("reason", pa.string()), ("cluster", pa.int32())])


def mark_vector_leaks(group: pa.Table, held: pa.Table, dc: DedupConfig, products: core.Products | None = None
                      ) -> pa.Table:
    """The cluster's training rows with held-out vector leaks marked among the rows not already removed (`held`:
    the held-out vectors routed to this cluster; products: core.Products)."""
    if dc.semantic_threshold <= 0 or not held.num_rows:
        return group
    alive = np.flatnonzero(group.column("reason").to_numpy() == core.KEPT)
    leak_of, leak_sim = heldout_vector_leaks(group.take(pa.array(alive)), held, dc, products)
    leaked = alive[leak_of >= 0]
    reason = group.column("reason").to_numpy().copy()
    duplicate_of = group.column("duplicate_of").to_numpy().copy()
    similarity = group.column("similarity").to_numpy().copy()
    reason[leaked], duplicate_of[leaked], similarity[leaked] = core.HELDOUT_LEAK, leak_of[leak_of >= 0], \
        leak_sim[leak_of >= 0]
    return replace_columns(group, reason=reason, duplicate_of=duplicate_of, similarity=similarity)


def task_has_gpu() -> bool:
    """Whether Ray gave this task a GPU."""
    import ray

    return ray.is_initialized() and bool(ray.get_gpu_ids())


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


def semantic_pass(group: pa.Table, dc: DedupConfig, products: core.Products | None = None) -> pa.Table:
    """The cluster's rows (sorted by pair_id) with semantic removals marked among the rows not already removed,
    compared whole (a cluster larger than dedup.max_group_rows comes here in blocks: stages/dedup/blocks.py);
    products: core.Products (default float64 numpy)."""
    reason = group.column("reason").to_numpy().copy()
    duplicate_of = group.column("duplicate_of").to_numpy().copy()
    similarity = group.column("similarity").to_numpy().copy()
    best = group.column("best").to_numpy().copy()
    if dc.semantic_threshold > 0:
        alive = np.flatnonzero(reason == core.KEPT)
        pair_ids = group.column("pair_id").to_numpy()
        rows = alive[core.keep_order(pair_ids[alive], group.column("rank").to_numpy()[alive])]
        x = emb_matrix(group.column("emb").take(pa.array(rows)))
        kept, dup_index, row_best = core.semantic_greedy(x, dc.semantic_threshold, dc.block_rows, products=products)
        removed = rows[~kept]
        reason[removed] = core.SEMANTIC
        duplicate_of[removed] = pair_ids[rows[dup_index[~kept]]]
        similarity[removed] = row_best[~kept]
        best[rows] = row_best
    return replace_columns(group, reason=reason, duplicate_of=duplicate_of, similarity=similarity, best=best)


def example_group(group: pa.Table) -> dict | None:
    """The cluster's largest semantic group: its kept pair and up to 3 removed ones (for the report). Of a block
    of a split cluster: the largest group whose kept pair is in the block (its members in other blocks not
    counted)."""
    reason = group.column("reason").to_numpy()
    pair_ids = group.column("pair_id").to_numpy()
    semantic = np.flatnonzero(reason == core.SEMANTIC)
    semantic = semantic[np.isin(group.column("duplicate_of").to_numpy()[semantic], pair_ids)]
    if not len(semantic):
        return None
    dup_of = group.column("duplicate_of").to_numpy()[semantic]
    heads, counts = np.unique(dup_of, return_counts=True)
    head = heads[np.argmax(counts)]  # equal sizes: the lowest pair_id
    members = semantic[dup_of == head][:3]
    kept_row = int(np.flatnonzero(pair_ids == head)[0])
    texts = {side: group.column(side) for side in ("query", "passage")}
    return {"cluster": int(group.column("cluster")[0].as_py()), "size": int(counts.max()) + 1,
            "kept": {"pair_id": int(head), "query": texts["query"][kept_row].as_py(),
                     "passage": texts["passage"][kept_row].as_py()[:200]},
            "removed": [{"pair_id": int(pair_ids[r]), "similarity": round(float(
                group.column("similarity")[int(r)].as_py()), 4), "query": texts["query"][int(r)].as_py(),
                "passage": texts["passage"][int(r)].as_py()[:200]} for r in members]}


def dedup_cluster(group: pa.Table, run_uri: str, dc: DedupConfig, columns: list[str], block: int = -1,
                  backend: str = "faiss") -> pa.Table:
    """Group step: the semantic pass of one cluster (or, block >= 0, of one block of a cluster split without a
    semantic threshold), then its kept rows (all `columns` of assign/) and its removed rows are written; returns
    the counts row of write_outputs. dc: the dedup section; backend: ray.vector_backend (core.products_for)."""
    release_freed_memory()  # what the worker's previous group or task freed
    unit_delay_for_tests("dedup")
    cluster = int(group.column("cluster")[0].as_py())
    probe = pa.array(group.column("reason").to_numpy() == core.HELDOUT_PROBE)
    held, group = group.filter(probe).sort_by("pair_id"), group.filter(pc.invert(probe)).sort_by("pair_id")
    gpu = task_has_gpu()
    group = semantic_pass(mark_vector_leaks(group, held, dc, core.products_for(backend, gpu, dc.semantic_threshold,
                                                                               "numpy32")),
                          dc, core.products_for(backend, gpu, dc.semantic_threshold))
    return write_outputs(group, RunDir(run_uri), cluster, block, columns, dc)


def counts_row(cluster: int, block: int, rows: int = 0, kept: int = 0, reason: np.ndarray | None = None,
               histogram: list | None = None, example: dict | None = None, pending: bool = False) -> pa.Table:
    """The one-row result of a group or block task: its rows, kept rows and removals per reason, the histogram of
    best cosines near the threshold, an example group; pending: a split cluster's block whose removals are
    decided later (stages/dedup/blocks.py), counted by its write task."""
    reason = np.zeros(0, np.int8) if reason is None else reason
    return pa.table({"cluster": [cluster], "block": [block], "pending": [pending], "rows": [rows], "kept": [kept],
                     **{name: [int((reason == code).sum())] for code, name in core.REASONS.items()},
                     "histogram": [histogram if histogram is not None else [0] * HISTOGRAM_BINS],
                     "example": [json.dumps(example) if example else ""], "node": [this_node()]})


def write_outputs(group: pa.Table, run: RunDir, cluster: int, block: int, columns: list[str], dc: DedupConfig
                  ) -> pa.Table:
    """Write the kept rows (all `columns` of assign/) and removed rows of a cluster, or of a block of one (block
    >= 0: in the file names); the counts row."""
    reason = group.column("reason").to_numpy()
    name = f"c{cluster:06d}" if block < 0 else f"c{cluster:06d}-b{block:05d}"
    kept = group.filter(pa.array(reason == core.KEPT)).select(columns)
    for part, start in enumerate(range(0, kept.num_rows, KEPT_ROWS_PER_FILE)):
        run.write_parquet(f"{DEDUP_KEPT}/part-{name}-{part:05d}.parquet",
                          kept.slice(start, KEPT_ROWS_PER_FILE), row_group_size=EMBEDDINGS_ROW_GROUP_ROWS)
    removed = group.filter(pa.array(reason != core.KEPT))
    if removed.num_rows:
        names = np.array([core.REASONS.get(int(r), "") for r in range(max(core.REASONS) + 1)], dtype=object)
        run.write_parquet(f"{DEDUP_REMOVED}/part-{name}.parquet", pa.table({
            "pair_id": removed.column("pair_id"), "duplicate_of": removed.column("duplicate_of"),
            "similarity": removed.column("similarity"),
            "reason": pa.array(names[removed.column("reason").to_numpy()].tolist(), pa.string()),
            "cluster": pa.array(np.full(removed.num_rows, cluster, np.int32))}, schema=REMOVED_SCHEMA))
    _, histogram = core.histogram_near(group.column("best").to_numpy(), dc.semantic_threshold)
    return counts_row(cluster, block, group.num_rows, kept.num_rows, reason, histogram, example_group(group))
