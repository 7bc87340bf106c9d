"""Clusters with more rows than dedup.max_group_rows, in blocks: no task holds a whole cluster.

The cluster shuffle sends each row of such a cluster to one of its blocks (by a hash of its pair_id, about
max_group_rows rows each: partitions.BlockPlan) and the held-out vectors routed to it to a partition of their own; the
group task of each writes its rows under dedup/_blocks/. Then Ray tasks, each holding at most two blocks' rows:
  edges    one per block a: the held-out vector leaks among its rows (against the cluster's routed held-out
           vectors), and every pair at or above the threshold between a and each block b >= a (b read one at a
           time; core.block_pair_edges: float32 products, float64 near the threshold);
  decide   one per cluster: the keep rule (core.greedy_from_edges) over the edge list of the rows still kept, in
           keep order; it reads only the cluster's pair_id, rank and reason columns, and writes its decisions
           (the removed rows) under dedup/_blocks/;
  write    one per block: its kept and removed rows to dedup/kept/ and dedup/removed/, and its counts.
The removals are those of comparing the cluster whole (semantic.semantic_pass), whatever the blocking. Without a
semantic threshold the blocks are independent: each block's group task writes its rows itself."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from clusterscale.config import DedupConfig
from clusterscale.io.layout import DEDUP
from clusterscale.io.rundir import RunDir
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.bounded_data import read_row_groups, release_freed_memory
from clusterscale.runtime.nodes import unit_delay_for_tests
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS, emb_matrix
from clusterscale.stages.dedup.exact import replace_columns
from clusterscale.stages.dedup.heldout import heldout_vector_leaks, vector_columns
from clusterscale.stages.dedup.partitions import BlockPlan
from clusterscale.stages.dedup.semantic import counts_row, dedup_cluster, write_outputs

BLOCKS = f"{DEDUP}/_blocks"  # the split clusters' rows and decisions while the stage runs (removed at its end)
DECISION_SCHEMA = pa.schema([("pair_id", pa.int64()), ("reason", pa.int8()), ("duplicate_of", pa.int64()),
                             ("similarity", pa.float32()), ("best", pa.float64())])


def block_file(cluster: int, block: int) -> str:
    return f"{BLOCKS}/_c{cluster:06d}-b{block:05d}.parquet"  # "_": never one of the stage's data files


def heldout_file(cluster: int) -> str:
    return f"{BLOCKS}/_c{cluster:06d}-heldout.parquet"


def decisions_file(cluster: int) -> str:
    return f"{BLOCKS}/_c{cluster:06d}-decisions.parquet"


def _count_clusters(batch: pa.Table, clusters: int) -> pa.Table:
    return pa.table({"counts": [np.bincount(batch.column("cluster").to_numpy(), minlength=clusters).tolist()]})


def cluster_sizes(run: RunDir, files: list[str], clusters: int) -> np.ndarray:
    """Rows per cluster id of assign/'s `files` (a pass over their cluster column; the driver adds one vector
    of `clusters` counts per row group)."""
    sizes = np.zeros(clusters, np.int64)
    ds = read_row_groups(run, files, ["cluster"]).map_batches(_count_clusters, fn_kwargs={"clusters": clusters},
                                                              batch_size=None, batch_format="pyarrow")
    for row in ds.iter_rows():
        sizes += np.asarray(row["counts"], np.int64)
    return sizes


def write_block(group: pa.Table, run: RunDir, cluster: int, block: int) -> None:
    """A split cluster's block (training rows, or block -1: its held-out vectors) to dedup/_blocks/."""
    if block < 0:
        run.write_parquet(heldout_file(cluster), group.select(["pair_id", *vector_columns(group.column_names)]))
    else:
        run.write_parquet(block_file(cluster, block), group.sort_by("pair_id"),
                          row_group_size=EMBEDDINGS_ROW_GROUP_ROWS)


def cluster_group(group: pa.Table, run_uri: str, dc: DedupConfig, columns: list[str], plan: BlockPlan
                  ) -> pa.Table:
    """Group step of the cluster shuffle: a whole cluster (semantic.dedup_cluster), or a block of a split one:
    finished here without a semantic threshold, else written for the block tasks (a pending counts row)."""
    cluster, block = plan.block_of(int(group.column("part")[0].as_py()))
    if plan.blocks[cluster] == 1 or dc.semantic_threshold <= 0:
        return dedup_cluster(group, run_uri, dc, columns, block=-1 if plan.blocks[cluster] == 1 else block)
    release_freed_memory()  # what the worker's previous group or task freed
    write_block(group, RunDir(run_uri), cluster, block)
    return counts_row(cluster, block, pending=True)


def _alive_rows(run: RunDir, cluster: int, block: int, columns: list[str]) -> pa.Table:
    """`columns` of a block's rows still kept after the exact step."""
    table = pq.read_table(run.fs.open_input_file(run.path(block_file(cluster, block))), columns=columns)
    return table.filter(pc.equal(table.column("reason"), core.KEPT))


def block_edges(run_uri: str, cluster: int, block: int, later: list[int], dc: DedupConfig) -> dict:
    """Ray task (edges): block `block`'s held-out vector leaks, and the edges (pair_id u, pair_id v, cosine) at or
    above the threshold between its rows and those of itself and each block of `later` (read one at a time),
    among the rows the exact step kept."""
    release_freed_memory()
    run = RunDir(run_uri)
    names = pq.read_schema(run.fs.open_input_file(run.path(block_file(cluster, block)))).names
    rows = _alive_rows(run, cluster, block, ["pair_id", "reason", *vector_columns(names)])
    ids_a, xa = rows.column("pair_id").to_numpy(), emb_matrix(rows.column("emb"))
    leak_of, similarity = np.full(rows.num_rows, -1, np.int64), np.zeros(rows.num_rows, np.float32)
    if run.exists(heldout_file(cluster)):
        held = pq.read_table(run.fs.open_input_file(run.path(heldout_file(cluster))))
        leak_of, similarity = heldout_vector_leaks(rows, held, dc)
        del held
    del rows
    hit = leak_of >= 0
    leaks = {"pair_id": ids_a[hit], "duplicate_of": leak_of[hit], "similarity": similarity[hit]}
    found = []
    for other in [block, *later]:
        if other == block:
            ids_b, xb = ids_a, xa
        else:
            rows = _alive_rows(run, cluster, other, ["pair_id", "reason", "emb"])
            ids_b, xb = rows.column("pair_id").to_numpy(), emb_matrix(rows.column("emb"))
        i, j, sim = core.block_pair_edges(xa, xb, 0, 0, dc.semantic_threshold, dc.block_rows, same=other == block)
        found.append((ids_a[i], ids_b[j], sim))
    u, v, sim = (np.concatenate(column) for column in zip(*found))
    return {"leaks": leaks, "u": u, "v": v, "sim": sim}


def decide_cluster(run_uri: str, cluster: int, blocks: list[int], *edges: dict) -> int:
    """Ray task (decide): the keep rule over one split cluster's edge lists (one per block, from block_edges)
    among its rows not removed by the exact step nor as held-out leaks; writes the cluster's decisions (every
    removed row: held-out leak or semantic, with duplicate_of, similarity, best); returns their number."""
    run = RunDir(run_uri)
    parts = [pq.read_table(run.fs.open_input_file(run.path(block_file(cluster, b))),
                           columns=["pair_id", "rank", "reason"]) for b in blocks]
    table = pa.concat_tables(parts).sort_by("pair_id")
    del parts
    pair_ids, rank = table.column("pair_id").to_numpy(), table.column("rank").to_numpy()
    reason = table.column("reason").to_numpy().copy()
    leaked = {name: np.concatenate([e["leaks"][name] for e in edges]) for name in ("pair_id", "duplicate_of",
                                                                                   "similarity")}
    reason[np.searchsorted(pair_ids, leaked["pair_id"])] = core.HELDOUT_LEAK
    alive = np.flatnonzero(reason == core.KEPT)
    order = core.keep_order(pair_ids[alive], rank[alive])  # order[p]: the alive row at keep position p
    position = np.empty(len(alive), np.int64)
    position[order] = np.arange(len(alive))
    alive_ids = pair_ids[alive]  # sorted (pair_ids is)
    u, v, sim = (np.concatenate([e[name] for e in edges]) for name in ("u", "v", "sim"))
    at_u, at_v = np.searchsorted(alive_ids, u), np.searchsorted(alive_ids, v)
    both = (at_u < len(alive_ids)) & (at_v < len(alive_ids))
    both[both] = (alive_ids[at_u[both]] == u[both]) & (alive_ids[at_v[both]] == v[both])  # a leak is no source
    pu, pv = position[at_u[both]], position[at_v[both]]
    kept, dup_index, best = core.greedy_from_edges(len(alive), np.minimum(pu, pv), np.maximum(pu, pv), sim[both])
    removed = np.flatnonzero(~kept)  # keep positions
    semantic_ids = alive_ids[order[removed]]
    decisions = pa.table({
        "pair_id": np.r_[leaked["pair_id"], semantic_ids],
        "reason": np.r_[np.full(len(leaked["pair_id"]), core.HELDOUT_LEAK), np.full(len(removed), core.SEMANTIC)
                        ].astype(np.int8),
        "duplicate_of": np.r_[leaked["duplicate_of"], alive_ids[order[dup_index[removed]]]].astype(np.int64),
        "similarity": np.r_[leaked["similarity"], best[removed]].astype(np.float32),
        "best": np.r_[np.full(len(leaked["pair_id"]), -np.inf), best[removed]]}, schema=DECISION_SCHEMA)
    run.write_parquet(decisions_file(cluster), decisions)
    return decisions.num_rows


def decided_block(run: RunDir, cluster: int, block: int) -> pa.Table:
    """A split cluster's block (sorted by pair_id) with its cluster's decisions applied."""
    group = pq.read_table(run.fs.open_input_file(run.path(block_file(cluster, block))))
    decisions = pq.read_table(run.fs.open_input_file(run.path(decisions_file(cluster))))
    mine = pc.is_in(decisions.column("pair_id"), value_set=group.column("pair_id").combine_chunks())
    decisions = decisions.filter(mine).sort_by("pair_id")
    at = np.searchsorted(group.column("pair_id").to_numpy(), decisions.column("pair_id").to_numpy())
    columns = {name: group.column(name).to_numpy().copy() for name in ("reason", "duplicate_of", "similarity",
                                                                       "best")}
    for name, values in columns.items():
        values[at] = decisions.column(name).to_numpy()
    return replace_columns(group, **columns)


def write_block_outputs(run_uri: str, cluster: int, block: int, columns: list[str], dc: DedupConfig,
                        _decided: int) -> dict:
    """Ray task (write): a split cluster's block, its cluster's decisions applied, to dedup/kept/ and
    dedup/removed/; its counts row (semantic.write_outputs) as a dict. _decided: decide_cluster's result, so that
    this task runs after it."""
    release_freed_memory()
    unit_delay_for_tests("dedup")
    run = RunDir(run_uri)
    return write_outputs(decided_block(run, cluster, block), run, cluster, block, columns, dc).to_pylist()[0]


def run_split_clusters(run: RunDir, pending: list[tuple[int, int]], columns: list[str], dc: DedupConfig
                       ) -> tuple[list[ray.ObjectRef], list[ray.ObjectRef]]:
    """Start the edges, decide and write tasks of the split clusters whose blocks (cluster, block) the cluster
    shuffle wrote (a block the hash left empty has no file and no task); the edges and the write tasks' refs, one
    of each per block."""
    edges_task = ray.remote(num_cpus=1)(block_edges)
    decide_task = ray.remote(num_cpus=1)(decide_cluster)
    write_task = ray.remote(num_cpus=1)(write_block_outputs)
    by_cluster: dict[int, list[int]] = {}
    for cluster, block in pending:
        by_cluster.setdefault(cluster, []).append(block)
    compared, writes = [], []
    for cluster, blocks in sorted(by_cluster.items()):
        blocks = sorted(blocks)
        edges = [edges_task.remote(run.uri, cluster, b, blocks[n + 1:], dc) for n, b in enumerate(blocks)]
        decided = decide_task.remote(run.uri, cluster, blocks, *edges)
        writes += [write_task.remote(run.uri, cluster, b, columns, dc, decided) for b in blocks]
        compared += edges
    return compared, writes
