"""The compute core of `mine`, without Ray: route pairs to clusters, search one cluster, merge one query group.

stages/mine.py distributes these three steps over Ray Data (a map, a grouping by cluster, a grouping by
a hash bucket of the query's pair_id); each is a plain function of an Arrow table, so tests can run them
against a brute-force reference on a single process.
"""
from __future__ import annotations

import math

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from clusterscale.config import MineConfig
from clusterscale.runtime.faiss_index import build_ip_index
from clusterscale.runtime.hashing import splitmix64, text_hashes
from clusterscale.runtime.vectors import emb_matrix

PASSAGE, QUERY = 0, 1  # the `kind` of a routed row
DROP_REASONS = ("positive", "duplicate", "margin")


# --- the per-query rule -------------------------------------------------------------------------------------
def filter_candidates(scores: np.ndarray, rows: np.ndarray, own_rows: np.ndarray, pos_scores: np.ndarray,
                      passage_key: np.ndarray, query_key: np.ndarray, mc: MineConfig
                      ) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """Kept candidate rows and scores per query (best first), and drop counts per reason.

    scores, rows: (b, K) search results (row -1 = no hit); own_rows: (b,) each query's own pair row."""
    b, depth = rows.shape
    valid = (rows >= 0) & (np.arange(depth)[None, :] >= mc.range_min)
    safe = np.where(rows >= 0, rows, 0)
    positive = valid & (query_key[safe] == query_key[own_rows][:, None])          # incl. the pair itself
    duplicate = valid & ~positive & (passage_key[safe] == passage_key[own_rows][:, None])
    margin = np.zeros_like(valid)
    if mc.margin is not None:
        margin = valid & ~positive & ~duplicate & (scores > mc.margin * pos_scores[:, None])
    keep = valid & ~positive & ~duplicate & ~margin
    drops = {"positive": int(positive.sum()), "duplicate": int(duplicate.sum()), "margin": int(margin.sum())}
    return [rows[i][keep[i]] for i in range(b)], [scores[i][keep[i]] for i in range(b)], drops


# --- step 1: route every pair (a map over pairs with their vectors and cluster) ----------------------------
def bucket_of(pair_ids: np.ndarray, buckets: int) -> np.ndarray:
    """The output file (hash bucket) of each query: a fixed function of its pair_id."""
    return (splitmix64(np.asarray(pair_ids, dtype=np.int64)) % np.uint64(buckets)).astype(np.int32)


def probed_clusters(query_vectors: np.ndarray, own_cluster: np.ndarray, centroids: np.ndarray, nprobe: int,
                    by_query: bool) -> np.ndarray:
    """(n, min(nprobe, k)) clusters each query searches: the centroids nearest to the query vector (by_query),
    or, when the query vectors live in another space than the centroids (a re-embedding), the centroids
    nearest to the centroid of the pair's own cluster."""
    nprobe = min(nprobe, len(centroids))
    index = build_ip_index(centroids)
    if by_query:
        return index.search(np.ascontiguousarray(query_vectors, dtype=np.float32), nprobe)[1]
    neighbours = index.search(np.ascontiguousarray(centroids, dtype=np.float32), nprobe)[1]
    neighbours[:, 0] = np.arange(len(centroids))  # a centroid is its own nearest, whatever float ties say
    return neighbours[own_cluster]


def route_rows(batch: pa.Table, centroids: np.ndarray, nprobe: int, by_query: bool) -> pa.Table:
    """One passage row per pair (in its own cluster) and one query row per probed cluster.

    batch: pair_id, query, passage, emb (the passage vector), emb_query, cluster. Every row carries the text
    keys of its pair; a query row also carries the score of its own positive."""
    pair_ids = batch.column("pair_id").to_numpy()
    own = batch.column("cluster").to_numpy().astype(np.int64)
    p, q = emb_matrix(batch.column("emb")), emb_matrix(batch.column("emb_query"))
    qk, pk = text_hashes(batch.column("query").to_pylist()), text_hashes(batch.column("passage").to_pylist())
    probes = probed_clusters(q, own, centroids, nprobe, by_query)
    reps = probes.shape[1]
    n, d = p.shape
    pos = np.einsum("ij,ij->i", q, p).astype(np.float32)
    vectors = np.concatenate([p, np.repeat(q, reps, axis=0)]).astype(np.float32)
    return pa.table({
        "kind": pa.array(np.r_[np.full(n, PASSAGE), np.full(n * reps, QUERY)].astype(np.int8)),
        "cluster": pa.array(np.r_[own, probes.reshape(-1)].astype(np.int32)),
        "pair_id": pa.array(np.r_[pair_ids, np.repeat(pair_ids, reps)].astype(np.int64)),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), d),
        "query_key": pa.array(np.r_[qk, np.repeat(qk, reps)]),
        "passage_key": pa.array(np.r_[pk, np.repeat(pk, reps)]),
        "pos_score": pa.array(np.r_[np.zeros(n, np.float32), np.repeat(pos, reps)]),
    })


# --- step 2: one cluster's passages against the queries routed to it ---------------------------------------
def build_index(emb: np.ndarray, mc: MineConfig) -> faiss.Index:
    """One cluster's passage index: exact, or IVF with mine.ivf_nlist lists (default about 4 sqrt(n), >= 39
    rows each)."""
    n = emb.shape[0]
    nlist = mc.ivf_nlist or max(1, min(n // 39, int(4 * math.sqrt(n))))
    return build_ip_index(emb, mc.index, nlist=nlist, nprobe=mc.ivf_nprobe)


def search_cluster(group: pa.Table, mc: MineConfig, buckets: int) -> pa.Table:
    """The top mine.range_max passages of this cluster for each query routed here, best first (equal scores:
    lower pair_id first), with their pairs' text keys; one output row per routed query, lists maybe empty."""
    kind = group.column("kind").to_numpy()
    passages = group.filter(pa.array(kind == PASSAGE))
    passages = passages.take(pc.sort_indices(passages.column("pair_id")))  # index order independent of arrival
    queries = group.filter(pa.array(kind == QUERY))
    # BLAS may round a row's scores differently by its position in the batch: fix the order for reruns.
    queries = queries.take(pc.sort_indices(queries.column("pair_id")))
    b, n = queries.num_rows, passages.num_rows
    depth = min(mc.range_max, n)
    scores, rows = np.zeros((b, depth), np.float32), np.zeros((b, depth), np.int64)
    if b and depth:
        index = build_index(emb_matrix(passages.column("vec")), mc)
        q = emb_matrix(queries.column("vec"))
        for start in range(0, b, mc.query_batch_size):
            sl = slice(start, start + mc.query_batch_size)
            scores[sl], rows[sl] = index.search(q[sl], depth)
    ids = passages.column("pair_id").to_numpy()
    # An approximate (IVF) index may return fewer than `depth` hits (-1): they sort last and are cut below.
    hit_ids = np.where(rows >= 0, ids[np.maximum(rows, 0)], np.iinfo(np.int64).max)
    order = np.lexsort((hit_ids, -np.where(rows >= 0, scores, -np.inf)), axis=-1)
    rows, scores = np.take_along_axis(rows, order, 1), np.take_along_axis(scores, order, 1)
    found = (rows >= 0).sum(1)
    keep = np.arange(depth)[None, :] < found[:, None]
    safe = np.maximum(rows, 0)
    qk, pk = passages.column("query_key").to_numpy(), passages.column("passage_key").to_numpy()
    offsets = pa.array(np.r_[0, np.cumsum(found)].astype(np.int32))
    lists = {name: pa.ListArray.from_arrays(offsets, pa.array(values[safe][keep], type_))
             for name, values, type_ in (("cand_ids", ids, pa.int64()), ("cand_query_keys", qk, pa.int64()),
                                         ("cand_passage_keys", pk, pa.int64()))}
    return pa.table({"bucket": pa.array(bucket_of(queries.column("pair_id").to_numpy(), buckets)),
                     "pair_id": queries.column("pair_id"), "query_key": queries.column("query_key"),
                     "passage_key": queries.column("passage_key"), "pos_score": queries.column("pos_score"),
                     "cand_scores": pa.ListArray.from_arrays(offsets, pa.array(scores[keep], pa.float32())),
                     **lists})


# --- step 3: merge each query's candidates over its probed clusters and apply the rule ----------------------
def merge_candidates(group: pa.Table, mc: MineConfig) -> tuple[pa.Table, dict]:
    """negatives rows (pair_id, neg_pair_ids, neg_scores, pos_score), sorted by pair_id, and drop counts.

    group: search_cluster rows of some queries (one per probed cluster). A query's candidates from all its
    clusters are ranked together (score, then pair_id), cut at mine.range_max and filtered by
    filter_candidates, so with every cluster probed the result is exact search."""
    pair_ids = group.column("pair_id").to_numpy()
    queries, first_row = np.unique(pair_ids, return_index=True)
    of_query = np.searchsorted(queries, pair_ids)
    lists = group.column("cand_ids").combine_chunks()
    parent = of_query[np.asarray(pc.list_parent_indices(lists))]
    flat = {name: np.asarray(pc.list_flatten(group.column(name).combine_chunks()))
            for name in ("cand_ids", "cand_scores", "cand_query_keys", "cand_passage_keys")}
    order = np.lexsort((flat["cand_ids"], -flat["cand_scores"], parent))
    parent, flat = parent[order], {name: v[order] for name, v in flat.items()}
    rank = np.arange(len(parent)) - np.searchsorted(parent, parent)  # position within the query's run
    cut = rank < mc.range_max
    b, m = len(queries), len(parent)
    # filter_candidates indexes key arrays by row: candidates first, then each query's own pair.
    table_rows = np.full((b, mc.range_max), -1, np.int64)
    table_scores = np.zeros((b, mc.range_max), np.float32)
    table_rows[parent[cut], rank[cut]] = np.arange(m)[cut]
    table_scores[parent[cut], rank[cut]] = flat["cand_scores"][cut]
    own_qk = group.column("query_key").to_numpy()[first_row]
    own_pk = group.column("passage_key").to_numpy()[first_row]
    pos = group.column("pos_score").to_numpy()[first_row]
    kept_rows, kept_scores, drops = filter_candidates(
        table_scores, table_rows, m + np.arange(b), pos, np.r_[flat["cand_passage_keys"], own_pk],
        np.r_[flat["cand_query_keys"], own_qk], mc)
    out = pa.table({"pair_id": pa.array(queries, pa.int64()),
                    "neg_pair_ids": pa.array([flat["cand_ids"][r].tolist() for r in kept_rows], pa.list_(pa.int64())),
                    "neg_scores": pa.array([s.tolist() for s in kept_scores], pa.list_(pa.float32())),
                    "pos_score": pa.array(pos.astype(np.float32))})
    return out, drops
