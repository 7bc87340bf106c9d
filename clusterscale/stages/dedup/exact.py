"""Exact duplicates: the mark step (each row's text key, keep rank, held-out text leak and shuffle keys) and the
reduce over one hash bucket of keys (in each key the first row in keep order stays)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from clusterscale.config import DedupConfig
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.bounded_data import release_freed_memory
from clusterscale.runtime.hashing import splitmix64
from clusterscale.runtime.keep_rules import keep_rule
from clusterscale.runtime.vectors import truncated_columns
from clusterscale.stages.dedup.heldout import heldout_text_leaks
from clusterscale.stages.dedup.partitions import BlockPlan

# bucket and part are int64: the stand-ins of one_key_per_partition land in their partition as int64 values.
MARK_FIELDS = [pa.field("key_hi", pa.int64()), pa.field("key_lo", pa.int64()), pa.field("rank", pa.float64()),
               pa.field("bucket", pa.int64()), pa.field("part", pa.int64()), pa.field("reason", pa.int8()),
               pa.field("duplicate_of", pa.int64()), pa.field("similarity", pa.float32()),
               pa.field("best", pa.float64())]


def mark_rows(batch: pa.Table, dc: DedupConfig, heldout: dict, bucket_keys: np.ndarray,
              cluster_keys: np.ndarray | BlockPlan, dims: int = 0) -> pa.Table:
    """Map step: every row gains key_hi, key_lo (its text key), rank (keep order), bucket (the exact step's
    shuffle key: the stand-in in bucket_keys of a hash bucket of the text key), part (the cluster step's: the
    stand-in in cluster_keys of its cluster, or the BlockPlan's key of its block), reason (KEPT, or HELDOUT_LEAK
    by text), duplicate_of, similarity and best (set by the semantic pass). dims (cluster.dims): the vectors are
    truncated to their first dims dimensions here, so the semantic pass compares (and the shuffles move) those."""
    batch = truncated_columns(batch, dims)
    pair_ids = batch.column("pair_id").to_numpy()
    keys = core.text_keys(core.pair_texts(batch.column("query").to_pylist(), batch.column("passage").to_pylist(),
                                          dc.key))
    leak_of = heldout_text_leaks(batch, heldout)
    leaked = leak_of >= 0
    columns = {
        "key_hi": keys[:, 0], "key_lo": keys[:, 1],
        "rank": np.asarray(keep_rule(dc.keep).rank(batch, dc.seed), np.float64),
        "bucket": bucket_keys[(splitmix64(keys[:, 0]) % np.uint64(len(bucket_keys))).astype(np.int64)],
        "part": (cluster_keys[batch.column("cluster").to_numpy()] if isinstance(cluster_keys, np.ndarray)
                 else cluster_keys.row_keys(batch.column("cluster").to_numpy(), pair_ids)),
        "reason": np.where(leaked, core.HELDOUT_LEAK, core.KEPT).astype(np.int8),
        "duplicate_of": leak_of, "similarity": leaked.astype(np.float32),
        "best": np.full(batch.num_rows, -np.inf)}
    for field in MARK_FIELDS:
        batch = batch.append_column(field, pa.array(columns[field.name], field.type))
    return batch


def resolve_exact(group: pa.Table) -> pa.Table:
    """Group step (one hash bucket of keys): in each key among the rows not already removed, rows after the first
    in keep order are removed (reason exact, similarity 1)."""
    release_freed_memory()  # what the worker's previous group or task freed
    group = group.sort_by("pair_id")
    reason = group.column("reason").to_numpy().copy()
    alive = np.flatnonzero(reason == core.KEPT)
    keys = np.stack([group.column("key_hi").to_numpy(), group.column("key_lo").to_numpy()], axis=1)[alive]
    dup_of = core.exact_duplicates(keys, group.column("pair_id").to_numpy()[alive],
                                   group.column("rank").to_numpy()[alive])
    removed = alive[dup_of >= 0]
    duplicate_of = group.column("duplicate_of").to_numpy().copy()
    similarity = group.column("similarity").to_numpy().copy()
    reason[removed], duplicate_of[removed], similarity[removed] = core.EXACT, dup_of[dup_of >= 0], 1.0
    return replace_columns(group, reason=reason, duplicate_of=duplicate_of, similarity=similarity)


def replace_columns(table: pa.Table, **columns: np.ndarray) -> pa.Table:
    for name, values in columns.items():
        table = table.set_column(table.column_names.index(name), name, pa.array(values))
    return table
