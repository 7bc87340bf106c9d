"""The held-out check: held-out pairs' text keys (every mark task holds them), their vectors routed to their
nearest clusters, and the training rows of a cluster whose vector duplicates one of them."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.config import Config, DedupConfig
from clusterscale.errors import UserError
from clusterscale.io.rundir import RunDir
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.vectors import emb_array, emb_matrix, truncated
from clusterscale.stages.synthetic import synthetic_embeddings


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
    frozen encoder embeds for it} (embed.side; the embed_heldout stage writes them). Refuses a synthetic run whose
    heldout/ has no vectors."""
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


def route_heldout(batch: pa.Table, centroids: np.ndarray, nprobe: int, schema: pa.Schema, cluster_keys) -> pa.Table:
    """Map step over heldout/: each held-out pair once per cluster among its `nprobe` nearest centroids (by its
    'emb'), as a row of the marked training rows' `schema` with reason HELDOUT_PROBE, its pair_id, vectors and the
    cluster's shuffle key `part` (cluster_keys: see mark_rows; a split cluster's held-out partition with a
    BlockPlan; other columns null), so it travels through the cluster shuffle to exactly those clusters. With
    cluster.dims the vectors are truncated to the centroids' width, as mark_rows truncates the training rows'."""
    width = np.asarray(centroids).shape[1]
    vectors = {c: truncated(emb_matrix(batch.column(c)), width)
               for c in batch.column_names if c in ("emb", "emb_query")}
    n, nprobe = batch.num_rows, min(nprobe, len(centroids))
    sims = vectors["emb"] @ np.asarray(centroids, np.float32).T
    probes = np.argpartition(-sims, nprobe - 1, axis=1)[:, :nprobe] if n else np.zeros((0, nprobe), np.int64)
    rows = np.repeat(np.arange(n), nprobe)
    values = {"pair_id": pa.array(batch.column("pair_id").to_numpy()[rows], pa.int64()),
              "cluster": pa.array(probes.reshape(-1).astype(np.int32)),
              "part": pa.array(cluster_keys[probes.reshape(-1)] if isinstance(cluster_keys, np.ndarray)
                               else cluster_keys.heldout_keys(probes.reshape(-1)), pa.int64()),
              "reason": pa.array(np.full(len(rows), core.HELDOUT_PROBE, np.int8)),
              **{c: emb_array(x[rows]) for c, x in vectors.items()}}
    return pa.table([values[f.name].cast(f.type) if f.name in values else pa.nulls(len(rows), f.type)
                     for f in schema], schema=schema)


def heldout_vector_leaks(rows: pa.Table, held: pa.Table, dc: DedupConfig, products: core.Products | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(duplicate_of: the held-out pair_id a training row's vector has cosine >= the threshold to, or -1;
    similarity) for one cluster's training `rows` and the held-out vectors routed to it (`held`): each vector
    column in turn ('emb', then 'emb_query'); the first match counts. Blocked matmul (dedup.block_rows) in float32,
    the products near the threshold in float64 (products: core.Products; default numpy)."""
    products = products or core.Products(dc.semantic_threshold, "numpy32")
    dup_of, similarity = np.full(rows.num_rows, -1, np.int64), np.zeros(rows.num_rows, np.float32)
    if not held.num_rows or not rows.num_rows:
        return dup_of, similarity
    held_ids = held.column("pair_id").to_numpy()
    for column in vector_columns(held.column_names):
        best_of, best = core.heldout_matches(emb_matrix(rows.column(column)), emb_matrix(held.column(column)),
                                             dc.block_rows, products)
        hit = (best >= dc.semantic_threshold) & (dup_of < 0)
        dup_of[hit], similarity[hit] = held_ids[best_of[hit]], best[hit]
    return dup_of, similarity
