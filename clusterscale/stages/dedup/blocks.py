"""Clusters with more rows than dedup.max_group_rows, in blocks: no task holds a whole cluster.

The cluster shuffle sends each row of such a cluster to one of its blocks (by a hash of its pair_id, about
max_group_rows rows each: partitions.BlockPlan) and the held-out vectors routed to it to a partition of their own; the
group task of each writes its rows under dedup/_blocks/. The semantic pass then decides the cluster in chunks of its
keep order (core.split_greedy, as Ray tasks):
  bounds   one per cluster: the keep-order key (rank, pair_id) of every max_group_rows-th row the exact step kept
           (it reads only the pair_id, rank and reason columns: 17 bytes a row);
  split    one per block: its held-out vector leaks (against the cluster's routed held-out vectors; its leaks file),
           and its other rows in keep order, one Parquet row group per chunk they fall in (its chunks file);
  decide   one per chunk, in keep order (each waits for the one before): the chunk's rows (a row group of each
           block) against the rows kept by the chunks before it, one kept file at a time (core.raise_best), then
           within itself (core.semantic_greedy); writes its decisions, one file per block it holds rows of, and
           adds its kept rows to the kept files (each up to max_group_rows rows);
  write    one per block: its kept and removed rows to dedup/kept/ and dedup/removed/, and its counts; it reads
           only its own block's decisions files (those of the chunks its split task put rows in), so the stage
           reads each decision once, whatever the number of blocks.
The removals are those of comparing the cluster whole (semantic.semantic_pass), whatever the blocking. Only kept
rows are compared with later rows, so no structure grows with the number of near-duplicate pairs: a task holds at
most a chunk, one kept file (or the last one topped up: two) and one dedup.block_rows^2 product, whatever the
duplicate density (a boilerplate cluster's removed rows are never compared again). The chain is the cluster's
critical path (as comparing it whole would be); clusters run side by side. Without a semantic threshold the blocks
are independent: each block's group task writes its rows itself."""
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
from clusterscale.stages.dedup.semantic import counts_row, dedup_cluster, task_has_gpu, write_outputs

BLOCKS = f"{DEDUP}/_blocks"  # the split clusters' rows and decisions while the stage runs (removed at its end)
DECISION_SCHEMA = pa.schema([("pair_id", pa.int64()), ("reason", pa.int8()), ("duplicate_of", pa.int64()),
                             ("similarity", pa.float32()), ("best", pa.float64())])
ROW_GROUP_MAX_ROWS = 1 << 20  # of a chunks file (pyarrow's default cap), so that a row group is one chunk's


def block_file(cluster: int, block: int) -> str:
    return f"{BLOCKS}/_c{cluster:06d}-b{block:05d}.parquet"  # "_": never one of the stage's data files


def heldout_file(cluster: int) -> str:
    return f"{BLOCKS}/_c{cluster:06d}-heldout.parquet"


def chunks_file(cluster: int, block: int) -> str:
    return f"{BLOCKS}/_c{cluster:06d}-b{block:05d}-chunks.parquet"


def leaks_file(cluster: int, block: int) -> str:
    return f"{BLOCKS}/_c{cluster:06d}-b{block:05d}-leaks.parquet"


def decisions_file(cluster: int, chunk: int, block: int) -> str:
    """Chunk `chunk`'s decisions on the rows of block `block` (written by the chunk's decide task)."""
    return f"{BLOCKS}/_c{cluster:06d}-k{chunk:05d}-b{block:05d}-decisions.parquet"


def kept_file(cluster: int, chunk: int, part: int) -> str:
    """The kept rows' vectors (part `part` written by chunk `chunk`'s decide task)."""
    return f"{BLOCKS}/_c{cluster:06d}-k{chunk:05d}-kept{part:03d}.parquet"


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


def cluster_group(group: pa.Table, run_uri: str, dc: DedupConfig, columns: list[str], plan: BlockPlan,
                  backend: str = "faiss") -> pa.Table:
    """Group step of the cluster shuffle: a whole cluster (semantic.dedup_cluster), or a block of a split one:
    finished here without a semantic threshold, else written for the block tasks (a pending counts row)."""
    cluster, block = plan.block_of(int(group.column("part")[0].as_py()))
    if plan.blocks[cluster] == 1 or dc.semantic_threshold <= 0:
        return dedup_cluster(group, run_uri, dc, columns, block=-1 if plan.blocks[cluster] == 1 else block,
                             backend=backend)
    release_freed_memory()  # what the worker's previous group or task freed
    write_block(group, RunDir(run_uri), cluster, block)
    return counts_row(cluster, block, pending=True)


def _alive_rows(run: RunDir, cluster: int, block: int, columns: list[str]) -> pa.Table:
    """`columns` of a block's rows still kept after the exact step."""
    table = pq.read_table(run.fs.open_input_file(run.path(block_file(cluster, block))), columns=columns)
    return table.filter(pc.equal(table.column("reason"), core.KEPT))


def _read(run: RunDir, rel: str) -> pa.Table:
    return pq.read_table(run.fs.open_input_file(run.path(rel)))


def chunk_bounds(run_uri: str, cluster: int, blocks: list[int], chunk_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Ray task (bounds): (rank, pair_id) of the first row of each chunk: the rows the exact step kept, in keep
    order, every chunk_rows rows (a chunk loses its held-out leaks later, so it may hold fewer)."""
    run = RunDir(run_uri)
    table = pa.concat_tables([_alive_rows(run, cluster, b, ["pair_id", "rank", "reason"]) for b in blocks])
    pair_ids, rank = table.column("pair_id").to_numpy(), table.column("rank").to_numpy()
    first = core.keep_order(pair_ids, rank)[::chunk_rows]
    return rank[first].astype(np.float64), pair_ids[first].astype(np.int64)


def chunk_of(pair_ids: np.ndarray, rank: np.ndarray, bounds: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The chunk of each row: the last bound at or before its keep-order key (rank, pair_id)."""
    bound_rank, bound_ids = bounds
    n_bounds = len(bound_ids)
    is_row = np.r_[np.zeros(n_bounds, np.int8), np.ones(len(pair_ids), np.int8)]
    order = np.lexsort((is_row, np.r_[bound_ids, pair_ids], np.r_[bound_rank, rank]))  # a bound before its row
    bounds_so_far = np.cumsum(is_row[order] == 0) - 1
    chunk = np.empty(len(pair_ids), np.int64)
    rows = order >= n_bounds
    chunk[order[rows] - n_bounds] = np.maximum(bounds_so_far[rows], 0)
    return chunk


def split_block(run_uri: str, cluster: int, block: int, dc: DedupConfig, bounds: tuple[np.ndarray, np.ndarray],
                backend: str = "faiss") -> list[int]:
    """Ray task (split): block `block`'s held-out vector leaks among the rows the exact step kept (its leaks file),
    and its other such rows (pair_id, rank, emb) in keep order, one row group per chunk (its chunks file); returns
    the chunk of each of its row groups, in order."""
    release_freed_memory()
    run = RunDir(run_uri)
    names = pq.read_schema(run.fs.open_input_file(run.path(block_file(cluster, block)))).names
    rows = _alive_rows(run, cluster, block, ["pair_id", "rank", "reason", *vector_columns(names)])
    leak_of, similarity = np.full(rows.num_rows, -1, np.int64), np.zeros(rows.num_rows, np.float32)
    if run.exists(heldout_file(cluster)):
        leak_of, similarity = heldout_vector_leaks(rows, _read(run, heldout_file(cluster)), dc, core.products_for(
            backend, task_has_gpu(), dc.semantic_threshold, "numpy32"))
    hit = leak_of >= 0
    run.write_parquet(leaks_file(cluster, block), pa.table({
        "pair_id": rows.column("pair_id").to_numpy()[hit], "reason": np.full(hit.sum(), core.HELDOUT_LEAK, np.int8),
        "duplicate_of": leak_of[hit], "similarity": similarity[hit], "best": np.full(hit.sum(), -np.inf)},
        schema=DECISION_SCHEMA))
    rows = rows.filter(pa.array(~hit)).select(["pair_id", "rank", "emb"])
    if not rows.num_rows:
        return []
    rows = rows.take(pa.array(core.keep_order(rows.column("pair_id").to_numpy(), rows.column("rank").to_numpy())))
    chunk = chunk_of(rows.column("pair_id").to_numpy(), rows.column("rank").to_numpy(), bounds)
    starts = np.flatnonzero(np.r_[True, chunk[1:] != chunk[:-1]])  # chunk never decreases in keep order
    sink, group_chunks = pa.BufferOutputStream(), []
    with pq.ParquetWriter(sink, rows.schema) as writer:
        for start, stop in zip(starts.tolist(), np.r_[starts[1:], len(chunk)].tolist()):
            for first in range(start, stop, ROW_GROUP_MAX_ROWS):
                writer.write_table(rows.slice(first, min(stop, first + ROW_GROUP_MAX_ROWS) - first),
                                   row_group_size=ROW_GROUP_MAX_ROWS)
                group_chunks.append(int(chunk[start]))
    run.write_bytes(chunks_file(cluster, block), sink.getvalue())
    return group_chunks


def _append_kept(run: RunDir, cluster: int, chunk: int, kept: pa.Table, state: dict, chunk_rows: int) -> dict:
    """The kept files after adding `kept` (pair_id, emb): the last one topped up to chunk_rows rows (as a new file:
    a retried task reads the files of `state` as they were), then new ones."""
    files = list(state["kept"])
    if not kept.num_rows:
        return state
    if files and state["last_rows"] < chunk_rows:
        kept = pa.concat_tables([_read(run, files.pop()), kept])
    for part, start in enumerate(range(0, kept.num_rows, chunk_rows)):
        files.append(kept_file(cluster, chunk, part))
        run.write_parquet(files[-1], kept.slice(start, chunk_rows))
    return {"kept": files, "last_rows": kept.num_rows - chunk_rows * ((kept.num_rows - 1) // chunk_rows)}


def decide_chunk(run_uri: str, cluster: int, chunk: int, blocks: list[int], dc: DedupConfig, backend: str,
                 state: dict, *splits: list[int]) -> dict:
    """Ray task (decide): chunk `chunk` of a split cluster's keep order (a row group of each block's chunks file:
    `splits`, split_block's results) against the rows kept before it (the kept files of `state`, one at a time),
    then within itself; writes its decisions (every row: best; a removed one: reason, duplicate_of, similarity), one
    file per block it holds rows of (the block's write task reads only its own), and returns the kept files' state
    with its kept rows added."""
    release_freed_memory()
    run = RunDir(run_uri)
    parts, part_blocks = [], []
    for block, chunks in zip(blocks, splits):
        groups = [g for g, c in enumerate(chunks) if c == chunk]
        if groups:
            parts.append(pq.ParquetFile(run.fs.open_input_file(run.path(chunks_file(cluster, block))))
                         .read_row_groups(groups))
            part_blocks.append(block)
    if not parts:  # every row of the chunk a held-out leak: no block reads this chunk's decisions
        return state
    block_of = np.repeat(np.asarray(part_blocks, np.int64), [part.num_rows for part in parts])
    rows = pa.concat_tables(parts)
    del parts
    order = core.keep_order(rows.column("pair_id").to_numpy(), rows.column("rank").to_numpy())
    rows, block_of = rows.take(pa.array(order)), block_of[order]
    pair_ids, x = rows.column("pair_id").to_numpy(), emb_matrix(rows.column("emb"))
    best, best_of = np.full(len(x), -np.inf), np.full(len(x), -1, np.int64)
    gpu = task_has_gpu()
    for rel in state["kept"]:
        earlier = _read(run, rel)
        core.raise_best(x, emb_matrix(earlier.column("emb")), earlier.column("pair_id").to_numpy(),
                        dc.semantic_threshold, dc.block_rows, best, best_of,
                        core.products_for(backend, gpu, dc.semantic_threshold, "numpy32"))
        del earlier
    kept, duplicate_of, best = core.semantic_greedy(x, dc.semantic_threshold, dc.block_rows, keys=pair_ids,
                                                    prior=(best, best_of),
                                                    products=core.products_for(backend, gpu, dc.semantic_threshold))
    decisions = pa.table({
        "pair_id": pair_ids, "reason": np.where(kept, core.KEPT, core.SEMANTIC).astype(np.int8),
        "duplicate_of": duplicate_of, "similarity": np.where(kept, 0.0, best).astype(np.float32), "best": best},
        schema=DECISION_SCHEMA)
    for block in part_blocks:  # deterministic names: a retried task rewrites the same files
        run.write_parquet(decisions_file(cluster, chunk, block), decisions.filter(pa.array(block_of == block)))
    del decisions
    return _append_kept(run, cluster, chunk, rows.filter(pa.array(kept)).select(["pair_id", "emb"]), state,
                        dc.max_group_rows)


def decided_block(run: RunDir, cluster: int, block: int, chunks: list[int]) -> pa.Table:
    """A split cluster's block (sorted by pair_id) with its leaks and its decisions applied: those of `chunks` (the
    chunks its split task put rows in), read one chunk at a time, each file holding only this block's rows."""
    group = _read(run, block_file(cluster, block))
    pair_ids = group.column("pair_id").to_numpy()
    columns = {name: group.column(name).to_numpy().copy() for name in ("reason", "duplicate_of", "similarity",
                                                                       "best")}
    for rel in [leaks_file(cluster, block), *(decisions_file(cluster, c, block) for c in sorted(set(chunks)))]:
        decisions = _read(run, rel)
        at = np.searchsorted(pair_ids, decisions.column("pair_id").to_numpy())
        removed = decisions.column("reason").to_numpy() != core.KEPT
        columns["best"][at] = decisions.column("best").to_numpy()
        for name in ("reason", "duplicate_of", "similarity"):
            columns[name][at[removed]] = decisions.column(name).to_numpy()[removed]
    return replace_columns(group, **columns)


def write_block_outputs(run_uri: str, cluster: int, block: int, columns: list[str], dc: DedupConfig,
                        _decided: dict, split: list[int]) -> dict:
    """Ray task (write): a split cluster's block, its decisions applied, to dedup/kept/ and dedup/removed/; its
    counts row (semantic.write_outputs) as a dict. _decided: the last decide task's result, so that this task runs
    after every decide task; split: the block's split task's result (the chunk of each of its row groups: the
    decisions files it reads)."""
    release_freed_memory()
    unit_delay_for_tests("dedup")
    run = RunDir(run_uri)
    return write_outputs(decided_block(run, cluster, block, split), run, cluster, block, columns, dc
                         ).to_pylist()[0]


def run_split_clusters(run: RunDir, pending: list[tuple[int, int]], columns: list[str], dc: DedupConfig,
                       backend: str = "faiss", gpus: float = 0) -> tuple[list[ray.ObjectRef], list[ray.ObjectRef]]:
    """Start the bounds, split, decide and write tasks of the split clusters whose blocks (cluster, block) the
    cluster shuffle wrote (a block the hash left empty has no file and no task); waits for the bounds (a few keys
    per cluster); returns the decide tasks' refs (one per chunk) and the write tasks' (one per block)."""
    bounds_task = ray.remote(num_cpus=1)(chunk_bounds)
    split_task = ray.remote(num_cpus=1, num_gpus=gpus)(split_block)  # gpus: vector_search.wants_gpus
    decide_task = ray.remote(num_cpus=1, num_gpus=gpus)(decide_chunk)
    write_task = ray.remote(num_cpus=1)(write_block_outputs)
    by_cluster: dict[int, list[int]] = {}
    for cluster, block in pending:
        by_cluster.setdefault(cluster, []).append(block)
    clusters = [(cluster, sorted(blocks)) for cluster, blocks in sorted(by_cluster.items())]
    bounds = ray.get([bounds_task.remote(run.uri, cluster, blocks, dc.max_group_rows) for cluster, blocks in clusters])
    decided, writes = [], []
    for (cluster, blocks), cluster_bounds in zip(clusters, bounds):
        splits = [split_task.remote(run.uri, cluster, b, dc, cluster_bounds, backend) for b in blocks]
        state = {"kept": [], "last_rows": 0}
        chunks = len(cluster_bounds[1])
        for chunk in range(chunks):
            state = decide_task.remote(run.uri, cluster, chunk, blocks, dc, backend, state, *splits)
            decided.append(state)
        writes += [write_task.remote(run.uri, cluster, b, columns, dc, state, split)
                   for b, split in zip(blocks, splits)]
    return decided, writes
