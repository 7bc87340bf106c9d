"""Dedup: remove exact and semantic duplicates, and training pairs that duplicate held-out ones, before sharding.

Run with `clusterscale dedup [CONFIG] --run-dir R` (after `assign`; `run` runs it when dedup.exact or
dedup.semantic_threshold is set). Three Ray Data steps over assign/k=<k>/ (read one row group per task, hash
shuffles in ~64 MiB map tasks, through local files with ray.disk_shuffle: runtime/bounded_data.py), none of
which holds all rows nor all held-out vectors:
  1. a map: each row's 128-bit key of its normalised dedup.key text, its keep rank (dedup.keep), whether its
     query or passage text equals a held-out pair's (every task holds the held-out text keys: O(held-out x
     32 B), not their texts nor vectors), and the shuffle keys of steps 2 and 3;
  2. group by a hash bucket of the key (dedup.exact), one bucket of ~ROWS_PER_BUCKET rows per reduce task: in
     each key, the first row in keep order stays;
  3. group by cluster, one cluster per reduce task, with the held-out vectors routed there: a map over heldout/
     sends each held-out vector to its dedup.heldout_nprobe nearest clusters (rows marked HELDOUT_PROBE, never
     written). Per cluster: the training rows still kept whose vector has cosine >= the threshold to a held-out
     vector routed there are held-out leaks (so a semantic leak is found when the held-out vector's
     heldout_nprobe nearest clusters include the training row's cluster: near-duplicates at cosine >= 0.9 almost
     always share the nearest centroid; heldout_nprobe = cluster.k is the all-pairs check); then semantic groups
     within the cluster (runtime/dedup_core.py, in blocks); the cluster's kept rows go to dedup/kept/ and its
     removed rows to dedup/removed/ (pair_id, duplicate_of, similarity, reason, cluster); the task returns its
     counts.
Both shuffles group by stand-ins of the bucket / cluster ids that land one per partition
(bounded_data.one_key_per_partition), as mine does: a reduce task then holds one bucket or one cluster, not the
several that hashing the ids puts in the fullest partition, so its memory does not grow with N (an exact bucket
holds ~ROWS_PER_BUCKET rows whatever N; a cluster is the unit of the semantic pass).
Order of the rules: held-out text leaks, exact duplicates, held-out vector leaks, semantic duplicates; each
among the rows the earlier ones kept.
The output describes one clustering (the semantic pass is per cluster; dedup/_DONE.json's stats carry k): dedup
at another cluster.k replaces it (a sweep deduplicates every k in turn, and a rerun of a finished sweep does it
again). The shard stage reads dedup/kept/ instead of assign/k=<k>/ when dedup is on and dedup.apply_to_shards
(shard_input), and is refused when dedup/kept/ holds another clustering's rows; a training run with
train.dedup=true trains the clustered sampler on a shard set written from it (shards/k=<k>/dedup/: compare's
clustered_dedup arm).
"""
from __future__ import annotations

import functools
import json
import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config, DedupConfig, EmbedConfig, variant
from clusterscale.errors import UserError
from clusterscale.io.layout import DEDUP, DEDUP_KEPT, DEDUP_REMOVED, assign_dir
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.bounded_data import (bounded_shuffle_maps, one_key_per_partition, read_row_groups,
                                               release_freed_memory)
from clusterscale.runtime.hashing import splitmix64
from clusterscale.runtime.progress import ProgressLine
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS, emb_array, emb_matrix
from clusterscale.stages.kmeans import load_centroids
from clusterscale.stages.synthetic import synthetic_embeddings

ROWS_PER_BUCKET = 25_000  # rows of one exact-dedup reduce task (all columns of its rows are in memory)
KEPT_ROWS_PER_FILE = 200_000
MARK_BATCH_ROWS = 4096  # rows per map batch (mark, and routing held-out vectors)
REMOVED_SCHEMA = pa.schema([("pair_id", pa.int64()), ("duplicate_of", pa.int64()), ("similarity", pa.float32()),
                            ("reason", pa.string()), ("cluster", pa.int32())])
NUM_EXAMPLES = 3  # example groups in the stats (the report shows them)
# What train.dedup=true deduplicates with when the run's dedup is off (compare's clustered_dedup arm): exact
# duplicates of the pair text, and pairs whose vectors have cosine >= 0.95 within a cluster.
TRAIN_DEDUP_DEFAULTS = {"exact": True, "key": "pair", "semantic_threshold": 0.95}


def shard_input(cfg: Config) -> str:
    """The folder the shard stage reads (its done marker counts its rows): dedup/kept/ when dedup is on and
    applied to the shards, else assign/k=<k>/."""
    return DEDUP_KEPT if dedup_applied(cfg) else assign_dir(cfg.cluster.k)


def dedup_applied(cfg: Config) -> bool:
    """Whether the run's shards are built from the kept rows (dedup on and dedup.apply_to_shards)."""
    return cfg.dedup.enabled and cfg.dedup.apply_to_shards


def train_dedup_config(cfg: Config) -> Config:
    """The config whose dedup stage a train.dedup=true run trains after: the run's own dedup.* when on, else
    TRAIN_DEDUP_DEFAULTS. Refused when the run's shards are deduplicated already (the set would equal them)."""
    if dedup_applied(cfg):
        raise UserError("train.dedup=true trains on a deduplicated shard set beside the run's shards, but dedup is on "
                        "and applied to the run's shards (dedup.apply_to_shards=true), so they hold only the kept "
                        "pairs already. To compare with and without dedup in one run (compare's clustered_dedup "
                        "arm), set dedup.apply_to_shards=false: the run's shards then hold every assigned pair; or "
                        "set train.dedup=false.")
    return cfg if cfg.dedup.enabled else variant(cfg, dedup=TRAIN_DEDUP_DEFAULTS)


def removed_table(run: RunDir) -> pa.Table:
    """Every removed row (pair_id, duplicate_of, similarity, reason, cluster) of the finished dedup stage (of the
    clustering dedup/_DONE.json names)."""
    files = run.files(DEDUP_REMOVED)
    if not files:
        return REMOVED_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(run.fs.open_input_file(f)) for f in files])


# --- held-out pairs: their text keys (every mark task holds them) and vectors (routed to their clusters) -----
def heldout_keys(held: pa.Table) -> dict:
    """Per side ('query', 'passage') the sorted text keys of held-out pairs with the pair_id of each (equal keys:
    in table order); 'pairs' = how many. O(held-out x 32 B): every mark task holds them."""
    pair_ids = held.column("pair_id").to_numpy()
    out = {"pairs": len(pair_ids)}
    for side in ("query", "passage"):
        keys = core.text_keys(held.column(side).to_pylist())
        order = np.lexsort((keys[:, 1], keys[:, 0]))
        out[side], out[f"{side}_pair_id"] = keys[order], pair_ids[order]
    return out


def load_heldout_keys(run: RunDir) -> dict:
    """heldout_keys of heldout/, read one file's text columns at a time (the driver holds the keys, not texts)."""
    parts = []
    for f in run.files("heldout"):
        held = pq.read_table(run.fs.open_input_file(f), columns=["pair_id", "query", "passage"])
        parts.append(heldout_keys(held))
    if not parts:
        return heldout_keys(pa.table({"pair_id": pa.array([], pa.int64()), "query": pa.array([], pa.string()),
                                      "passage": pa.array([], pa.string())}))
    out = {"pairs": sum(p["pairs"] for p in parts)}
    for side in ("query", "passage"):
        keys, pair_ids = np.concatenate([p[side] for p in parts]), np.concatenate([p[f"{side}_pair_id"] for p in parts])
        order = np.lexsort((keys[:, 1], keys[:, 0]))  # stable: equal keys stay in file order
        out[side], out[f"{side}_pair_id"] = keys[order], pair_ids[order]
    return out


def heldout_text_leaks(batch: pa.Table, heldout: dict) -> np.ndarray:
    """duplicate_of: the held-out pair_id whose query (then passage) has a row's normalised query (passage) text,
    or -1."""
    dup_of = np.full(batch.num_rows, -1, np.int64)
    for side in ("query", "passage"):
        held_keys = heldout[side]
        if not len(held_keys):
            continue
        keys = core.text_keys(batch.column(side).to_pylist())
        at = np.minimum(np.searchsorted(held_keys[:, 0], keys[:, 0]), len(held_keys) - 1)
        hit = (held_keys[at] == keys).all(axis=1) & (dup_of < 0)
        dup_of[hit] = heldout[f"{side}_pair_id"][at[hit]]
    return dup_of


def vector_columns(columns: list[str]) -> list[str]:
    """The vector columns of assign/ a held-out leak is checked on: 'emb', and 'emb_query' when embedded."""
    return [c for c in ("emb", "emb_query") if c in columns]


def heldout_vector_source(cfg: Config, run: RunDir, vectors: list[str]) -> dict | None:
    """None when heldout/ stores the vectors (synthetic runs), else {vector column: the held-out text side the
    frozen encoder embeds for it} (embed.side). Refuses a synthetic run whose heldout/ has no vectors."""
    files = run.files("heldout")
    with run.fs.open_input_file(files[0]) as f:
        stored = pq.read_schema(f).names
    if all(c in stored for c in vectors):
        return None
    if synthetic_embeddings(run):
        raise UserError("This synthetic run's heldout/ holds no vectors (written before `clusterscale synth` "
                        "stored them), so dedup.semantic_threshold cannot check held-out leaks: write the synthetic "
                        "run again into a new --run-dir.")
    sides = {"emb": "query" if cfg.embed.side == "query" else "passage", "emb_query": "query"}
    return {c: sides[c] for c in vectors}


@functools.lru_cache(maxsize=1)
def _encoder(model: str, pooling: str, max_length: int, trust_remote_code: bool, max_tokens_per_batch: int):
    """The frozen encoder, loaded once per worker process."""
    from clusterscale.modeling.encoder import Encoder

    return Encoder(model, pooling=pooling, max_length=max_length, trust_remote_code=trust_remote_code,
                   max_tokens_per_batch=max_tokens_per_batch)


def heldout_vectors(batch: pa.Table, source: dict | None, embed: EmbedConfig | None) -> dict[str, np.ndarray]:
    """{vector column: (n, d) vectors} of a batch of held-out pairs: stored in it (source None), else embedded
    with the frozen encoder embed.model from the text side source[column]."""
    if source is None:
        return {c: emb_matrix(batch.column(c)) for c in batch.column_names if c in ("emb", "emb_query")}
    encoder = _encoder(embed.model, embed.pooling, embed.max_length, embed.trust_remote_code,
                       embed.max_tokens_per_batch)
    return {c: encoder.encode(batch.column(side).to_pylist(), embed.batch_size) for c, side in source.items()}


def route_heldout(batch: pa.Table, centroids: np.ndarray, nprobe: int, source: dict | None,
                  embed: EmbedConfig | None, schema: pa.Schema, cluster_keys: np.ndarray) -> pa.Table:
    """Map step over heldout/: each held-out pair once per cluster among its `nprobe` nearest centroids (by its
    'emb'), as a row of the marked training rows' `schema` with reason HELDOUT_PROBE, its pair_id, vectors and the
    cluster's shuffle key `part` (cluster_keys: see mark_rows; other columns null), so it travels through the
    cluster shuffle to exactly those clusters."""
    vectors = heldout_vectors(batch, source, embed)
    n, nprobe = batch.num_rows, min(nprobe, len(centroids))
    sims = vectors["emb"] @ np.asarray(centroids, np.float32).T
    probes = np.argpartition(-sims, nprobe - 1, axis=1)[:, :nprobe] if n else np.zeros((0, nprobe), np.int64)
    rows = np.repeat(np.arange(n), nprobe)
    values = {"pair_id": pa.array(batch.column("pair_id").to_numpy()[rows], pa.int64()),
              "cluster": pa.array(probes.reshape(-1).astype(np.int32)),
              "part": pa.array(cluster_keys[probes.reshape(-1)], pa.int64()),
              "reason": pa.array(np.full(len(rows), core.HELDOUT_PROBE, np.int8)),
              **{c: emb_array(x[rows]) for c, x in vectors.items()}}
    return pa.table([values[f.name].cast(f.type) if f.name in values else pa.nulls(len(rows), f.type)
                     for f in schema], schema=schema)


def heldout_vector_leaks(rows: pa.Table, held: pa.Table, dc: DedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """(duplicate_of: the held-out pair_id a training row's vector has cosine >= the threshold to, or -1;
    similarity) for one cluster's training `rows` and the held-out vectors routed to it (`held`): each vector
    column in turn ('emb', then 'emb_query'); the first match counts. Blocked matmul (dedup.block_rows)."""
    dup_of, similarity = np.full(rows.num_rows, -1, np.int64), np.zeros(rows.num_rows, np.float32)
    if not held.num_rows or not rows.num_rows:
        return dup_of, similarity
    held_ids = held.column("pair_id").to_numpy()
    for column in vector_columns(held.column_names):
        best_of, best = core.heldout_matches(emb_matrix(rows.column(column)), emb_matrix(held.column(column)),
                                             dc.block_rows)
        hit = (best >= dc.semantic_threshold) & (dup_of < 0)
        dup_of[hit], similarity[hit] = held_ids[best_of[hit]], best[hit]
    return dup_of, similarity


# --- step 1: keys, keep rank and held-out text leaks per row -------------------------------------------------
# bucket and part are int64: the stand-ins of one_key_per_partition land in their partition as int64 values.
MARK_FIELDS = [pa.field("key_hi", pa.int64()), pa.field("key_lo", pa.int64()), pa.field("rank", pa.float64()),
               pa.field("bucket", pa.int64()), pa.field("part", pa.int64()), pa.field("reason", pa.int8()),
               pa.field("duplicate_of", pa.int64()), pa.field("similarity", pa.float32()),
               pa.field("best", pa.float64())]


def mark_rows(batch: pa.Table, dc: DedupConfig, heldout: dict, bucket_keys: np.ndarray, cluster_keys: np.ndarray
              ) -> pa.Table:
    """Map step: every row gains key_hi, key_lo (its text key), rank (keep order), bucket (the exact step's
    shuffle key: the stand-in in bucket_keys of a hash bucket of the text key), part (the cluster step's: the
    stand-in in cluster_keys of its cluster), reason (KEPT, or HELDOUT_LEAK by text), duplicate_of, similarity
    and best (set by the semantic pass)."""
    pair_ids = batch.column("pair_id").to_numpy()
    keys = core.text_keys(core.pair_texts(batch.column("query").to_pylist(), batch.column("passage").to_pylist(),
                                          dc.key))
    leak_of = heldout_text_leaks(batch, heldout)
    leaked = leak_of >= 0
    columns = {
        "key_hi": keys[:, 0], "key_lo": keys[:, 1],
        "rank": core.keep_rank(pair_ids, batch.column("cos").to_numpy(), dc.keep, dc.seed),
        "bucket": bucket_keys[(splitmix64(keys[:, 0]) % np.uint64(len(bucket_keys))).astype(np.int64)],
        "part": cluster_keys[batch.column("cluster").to_numpy()],
        "reason": np.where(leaked, core.HELDOUT_LEAK, core.KEPT).astype(np.int8),
        "duplicate_of": leak_of, "similarity": leaked.astype(np.float32),
        "best": np.full(batch.num_rows, -np.inf)}
    for field in MARK_FIELDS:
        batch = batch.append_column(field, pa.array(columns[field.name], field.type))
    return batch


# --- step 2: exact duplicates, one hash bucket of keys at a time --------------------------------------------
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
    return _replace_columns(group, reason=reason, duplicate_of=duplicate_of, similarity=similarity)


def _replace_columns(table: pa.Table, **columns: np.ndarray) -> pa.Table:
    for name, values in columns.items():
        table = table.set_column(table.column_names.index(name), name, pa.array(values))
    return table


# --- step 3: held-out vector leaks and semantic duplicates within one cluster, and its output files ----------
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
    return _replace_columns(group, reason=reason, duplicate_of=duplicate_of, similarity=similarity)


def semantic_pass(group: pa.Table, dc: DedupConfig) -> pa.Table:
    """The cluster's rows (sorted by pair_id) with semantic removals marked among the rows not already removed."""
    reason = group.column("reason").to_numpy().copy()
    duplicate_of = group.column("duplicate_of").to_numpy().copy()
    similarity = group.column("similarity").to_numpy().copy()
    best = group.column("best").to_numpy().copy()
    if dc.semantic_threshold > 0:
        alive = np.flatnonzero(reason == core.KEPT)
        pair_ids = group.column("pair_id").to_numpy()
        rows = alive[core.keep_order(pair_ids[alive], group.column("rank").to_numpy()[alive])]
        x = emb_matrix(group.column("emb").take(pa.array(rows)))
        kept, dup_index, row_best = core.semantic_greedy(x, dc.semantic_threshold, dc.block_rows)
        removed = rows[~kept]
        reason[removed] = core.SEMANTIC
        duplicate_of[removed] = pair_ids[rows[dup_index[~kept]]]
        similarity[removed] = row_best[~kept]
        best[rows] = row_best
    return _replace_columns(group, reason=reason, duplicate_of=duplicate_of, similarity=similarity, best=best)


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
                     "histogram": [histogram], "example": [json.dumps(example) if example else ""]})


# --- the stage ---------------------------------------------------------------------------------------------
def routed_heldout(cfg: Config, run: RunDir, schema: pa.Schema, cluster_keys: np.ndarray) -> ray.data.Dataset | None:
    """The held-out vectors as rows of `schema`, one per (held-out pair, probed cluster) (route_heldout); None
    without a semantic threshold or held-out pairs."""
    files, vectors = run.files("heldout"), vector_columns(schema.names)
    if cfg.dedup.semantic_threshold <= 0 or not files:
        return None
    source = heldout_vector_source(cfg, run, vectors)
    columns = ["pair_id", *(vectors if source is None else sorted(set(source.values())))]
    return read_row_groups(run, files, columns).map_batches(
        route_heldout, fn_kwargs={"centroids": load_centroids(run, cfg.cluster.k), "nprobe": cfg.dedup.heldout_nprobe,
                                  "source": source, "embed": cfg.embed, "schema": schema,
                                  "cluster_keys": cluster_keys},
        batch_size=MARK_BATCH_ROWS, batch_format="pyarrow")


def dedup_all(cfg: Config, run: RunDir, heldout: dict, n_rows: int) -> list[dict]:
    """Run mark -> exact by key bucket -> (with the routed held-out vectors) semantic and write by cluster; the
    per-cluster results."""
    files = run.files(assign_dir(cfg.cluster.k))
    with run.fs.open_input_file(files[0]) as f:
        schema = pq.read_schema(f).remove_metadata()
    columns = schema.names
    # One partition per bucket and per cluster (+ 1: a pooled small-cluster id may be k), each bucket / cluster
    # grouped by the stand-in that lands in its own partition: a reduce holds one of them, whatever N.
    buckets, clusters = max(1, math.ceil(n_rows / ROWS_PER_BUCKET)), cfg.cluster.k + 1
    bucket_keys, cluster_keys = one_key_per_partition(buckets), one_key_per_partition(clusters)
    progress, results = ProgressLine("dedup", n_rows), []
    with bounded_shuffle_maps(cfg.ray.disk_shuffle):  # 64 MiB shuffle maps, through files (runtime/bounded_data)
        ds = read_row_groups(run, files, columns)
        ds = ds.map_batches(mark_rows, fn_kwargs={"dc": cfg.dedup, "heldout": heldout, "bucket_keys": bucket_keys,
                                                  "cluster_keys": cluster_keys},
                            batch_size=MARK_BATCH_ROWS, batch_format="pyarrow")
        if cfg.dedup.exact:
            ds = ds.groupby("bucket", num_partitions=buckets).map_groups(resolve_exact, batch_format="pyarrow")
        held = routed_heldout(cfg, run, pa.schema([*schema, *MARK_FIELDS]), cluster_keys)
        if held is not None:
            ds = ds.union(held)
        ds = ds.groupby("part", num_partitions=clusters).map_groups(
            dedup_cluster, fn_kwargs={"run_uri": run.uri, "dc": cfg.dedup, "columns": columns},
            batch_format="pyarrow")
        for result in ds.iter_rows():
            results.append(result)
            progress.advance(result["rows"])
    return results


def check_config(cfg: Config) -> None:
    """Refuse to run with dedup off (nothing to do)."""
    if not cfg.dedup.enabled:
        raise UserError("Dedup is off: set dedup.exact=true and/or dedup.semantic_threshold (a cosine in (0, 1]), "
                        "e.g. `clusterscale dedup --run-dir R --set dedup.exact=true`.")


def run_dedup(cfg: Config, run: RunDir) -> StageResult:
    """Write dedup/kept/ and dedup/removed/ from assign/k=<k>/ and heldout/; kept + removed = assigned. The done
    markers (dedup/_DONE.json with the counts, dedup/kept/'s with the kept rows) carry k."""
    check_config(cfg)
    started = time.time()
    n_rows = int(run.done_stats(assign_dir(cfg.cluster.k))["rows"])
    heldout = load_heldout_keys(run)
    results = dedup_all(cfg, run, heldout, n_rows)
    stats = stage_stats(cfg, results, n_rows, heldout["pairs"], time.time() - started)
    print(f"[dedup] {n_rows} pairs: kept {stats['rows']}, removed {stats['removed']} (exact {stats['exact']}, "
          f"semantic {stats['semantic']}, held-out leaks {stats['heldout_leak']}) in {stats['wall_s']:.1f}s",
          flush=True)
    config = {"dedup": cfg.dedup.to_dict(), "cluster": cfg.cluster.to_dict()}
    kept = StageResult({"rows": stats["rows"], "k": cfg.cluster.k}, config=config)
    return StageResult(stats, outputs={DEDUP_KEPT: kept}, config=config)


def stage_stats(cfg: Config, results: list[dict], n_rows: int, n_heldout: int, wall: float) -> dict:
    """The done marker's figures: rows = kept (what shard reads), removed per reason and per cluster, the histogram
    of best cosines near the threshold, example groups; raises when kept + removed != assigned."""
    totals = {name: sum(r[name] for r in results) for name in ("rows", "kept", *core.REASONS.values())}
    removed = sum(totals[name] for name in core.REASONS.values())
    if totals["rows"] != n_rows or totals["kept"] + removed != n_rows:
        raise RuntimeError(f"dedup saw {totals['rows']} rows (kept {totals['kept']}, removed {removed}) but "
                           f"assign/k={cfg.cluster.k}/ holds {n_rows}: rerun `clusterscale dedup`.")
    edges, _ = core.histogram_near(np.zeros(0), cfg.dedup.semantic_threshold)
    histogram = np.sum([r["histogram"] for r in results], axis=0).astype(int).tolist() if results else []
    examples = sorted((json.loads(r["example"]) for r in results if r["example"]),
                      key=lambda e: (-e["size"], e["cluster"]))
    return {"rows": totals["kept"], "assigned": n_rows, "removed": removed,
            **{name: totals[name] for name in core.REASONS.values()}, "heldout_pairs": n_heldout,
            "removed_per_cluster": {str(r["cluster"]): r["rows"] - r["kept"] for r in sorted(
                results, key=lambda r: r["cluster"])},
            "similarity_histogram": {"edges": edges, "counts": histogram} if cfg.dedup.semantic_threshold else None,
            "examples": examples[:NUM_EXAMPLES], "k": cfg.cluster.k, "wall_s": round(wall, 3),
            "worker_s": round(wall, 3)}


# --- the report's section ----------------------------------------------------------------------------------
def report_lines(run: RunDir, k: int, max_clusters: int = 20) -> list[str]:
    """Markdown of the dedup/ results (of the clustering they were made at; `k`: the report's, named when they
    differ): counts per reason, removed per cluster (the most first), the histogram of each pair's highest cosine
    to an earlier kept pair around the threshold, and example groups."""
    done = run.read_json(f"{DEDUP}/_DONE.json")
    s, dc = done["stats"], done["config"]["dedup"]
    lines = [f"## Dedup (k={s['k']}, key={dc['key']}, keep={dc['keep']}, exact={dc['exact']}, "
             f"semantic_threshold={dc['semantic_threshold']})"]
    if s["k"] != k:
        lines.append(f"(dedup/ holds one clustering at a time: the last dedup ran at k={s['k']}, not at this "
                     f"report's k={k}.)  ")
    lines += [f"Assigned {s['assigned']} pairs: kept {s['rows']}, removed {s['removed']} (exact {s['exact']}, "
              f"semantic {s['semantic']}, held-out leaks {s['heldout_leak']} against {s['heldout_pairs']} held-out "
              f"pairs). Removed rows: `{DEDUP_REMOVED}/`.", ""]
    per_cluster = sorted(s["removed_per_cluster"].items(), key=lambda kv: (-kv[1], int(kv[0])))
    lines += ["| cluster | removed |", "|---|---|"] + [f"| {c} | {n} |" for c, n in per_cluster[:max_clusters]]
    if len(per_cluster) > max_clusters:
        lines.append(f"| ({len(per_cluster) - max_clusters} more) | {sum(n for _, n in per_cluster[max_clusters:])} |")
    histogram = s.get("similarity_histogram")
    if histogram:
        edges, counts = histogram["edges"], histogram["counts"]
        lines += ["", "Highest cosine of each pair to a pair kept before it in its cluster (>= threshold: removed):",
                  "", "| cosine | pairs |", "|---|---|"]
        lines += [f"| [{a:.3f}, {b:.3f}){' removed' if a >= dc['semantic_threshold'] else ''} | {n} |"
                  for a, b, n in zip(edges, edges[1:], counts)]
    for example in s.get("examples", []):
        kept = example["kept"]
        lines += ["", f"Group of {example['size']} in cluster {example['cluster']}: kept pair {kept['pair_id']} "
                      f"({kept['query']!r} -> {kept['passage'][:80]!r})"]
        lines += [f"- removed {r['pair_id']} (cosine {r['similarity']}): {r['query']!r} -> {r['passage'][:80]!r}"
                  for r in example["removed"]]
    return lines + [""]
