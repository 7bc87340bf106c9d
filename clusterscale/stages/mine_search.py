"""The compute core of `mine`, without Ray: route pairs to search groups, search one group, merge one query group.

stages/mine.py distributes these three steps over Ray Data (a map, a grouping by search group, a grouping by
a hash bucket of the query's pair_id); each is a plain function of an Arrow table, so tests can run them
against a brute-force reference on a single process. A search group is one cluster's passages and the
queries that probe it; a cluster is split (SearchGroups) only when its passages exceed mine.max_group_rows
(by default auto_group_bounds: what a quarter of a search task's memory holds), or its probing queries exceed
the queries such a group is sized for.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from clusterscale.config import MineConfig
from clusterscale.runtime.vector_search import build_index as build_vector_index, top_k
from clusterscale.runtime.hashing import splitmix64, text_hashes
from clusterscale.io.sizing import ROUTED_ROW_BYTES
from clusterscale.runtime.vectors import emb_matrix, truncated

PASSAGE, QUERY = 0, 1  # the `kind` of a routed row
DROP_REASONS = ("positive", "duplicate", "margin")
POSITIVE, DUPLICATE = 1, 2  # a candidate's flag (candidate_flags): why the rule drops it whatever its rank
PASSAGE_PART_SALT, QUERY_PART_SALT = 0x7061727470, 0x7175657279  # which part of a cluster a pair falls in


# --- the per-query rule -------------------------------------------------------------------------------------
def filter_candidates(scores: np.ndarray, rows: np.ndarray, own_rows: np.ndarray, pos_scores: np.ndarray,
                      passage_key: np.ndarray, query_key: np.ndarray, mc: MineConfig) -> tuple[np.ndarray, dict]:
    """(b, K) mask of the candidates kept, and drop counts per reason.

    scores, rows: (b, K) search results, best first (row -1 = no hit); own_rows: (b,) each query's own pair
    row; the key arrays are indexed by row."""
    safe = np.where(rows >= 0, rows, 0)
    flags = candidate_flags(query_key[safe], passage_key[safe], query_key[own_rows][:, None],
                            passage_key[own_rows][:, None])
    return apply_rule(scores, rows, flags, pos_scores, mc)


def candidate_flags(cand_query_key: np.ndarray, cand_passage_key: np.ndarray, own_query_key: np.ndarray,
                    own_passage_key: np.ndarray) -> np.ndarray:
    """POSITIVE where a candidate's pair has the query's text (incl. the pair itself), else DUPLICATE where its
    passage has the text of the query's positive, else 0 (arrays broadcast)."""
    positive = cand_query_key == own_query_key
    return np.where(positive, POSITIVE, np.where(cand_passage_key == own_passage_key, DUPLICATE, 0)).astype(np.int8)


def apply_rule(scores: np.ndarray, rows: np.ndarray, flags: np.ndarray, pos_scores: np.ndarray,
               mc: MineConfig) -> tuple[np.ndarray, dict]:
    """(b, K) mask of the candidates kept (ranks [range_min, range_max) that are no positive, no duplicate of the
    positive and, with mine.margin, score <= margin x the positive's), and drop counts per reason. flags: (b, K)
    candidate_flags of each hit."""
    depth = rows.shape[1]
    valid = (rows >= 0) & (np.arange(depth)[None, :] >= mc.range_min)
    positive = valid & (flags == POSITIVE)
    duplicate = valid & (flags == DUPLICATE)
    margin = np.zeros_like(valid)
    if mc.margin is not None:
        margin = valid & ~positive & ~duplicate & (scores > mc.margin * pos_scores[:, None])
    keep = valid & ~positive & ~duplicate & ~margin
    drops = {"positive": int(positive.sum()), "duplicate": int(duplicate.sum()), "margin": int(margin.sum())}
    return keep, drops


# --- search groups: a cluster's passages x the queries probing it, in bounded parts -------------------------
CANDIDATE_BYTES = 13   # one candidate of a result row: score (4), pair_id (8) and its flag (1)
TOPK_BYTES = 12        # one faiss hit of a query block: score (float32) and row (int64)
MERGE_QUERY_BLOCK = 4096  # queries merge_candidates ranks at once: their candidates padded to the widest one's


def auto_group_bounds(memory_bytes: float, dim: int, stored_bytes: int, nprobe: int, query_block: int,
                      depth: int) -> tuple[int, int]:
    """mine.max_group_rows=auto: (passages, queries) of one search group, from one search task's memory.

    memory_bytes: the task's memory (one task per CPU: the node's Ray `memory` / its CPUs, as
    ClusterResources.task_memory_bytes gives; a GPU's memory where the search runs on one). A routed row is
    stored_bytes x dim + ROUTED_ROW_BYTES (search_cluster's group as Ray Data hands it over).
    - Passages: a quarter of the memory holds the passages held (each a routed row, its copy sorted by pair_id
      and its float32 row of the flat index, 4 dim), one block of query_block queries streaming through (their
      routed rows taken from the group, their float32 vectors, faiss's top-depth scores and rows, TOPK_BYTES
      each) and nothing else: passages = (memory / 4 - block) / passage, at least 1.
    - Queries: a group of `passages` is probed by about nprobe x as many queries (each query probes nprobe
      clusters), so they are allowed that many, at most what half of the memory holds (a routed row and a
      result row of depth x CANDIDATE_BYTES each): a cluster within the passage bound is then one group."""
    routed = stored_bytes * dim + ROUTED_ROW_BYTES
    per_passage = 2 * routed + 4 * dim
    block = query_block * (routed + 4 * dim + depth * TOPK_BYTES)
    passages = max(1, int((memory_bytes / 4 - block) // per_passage))
    per_query = routed + depth * CANDIDATE_BYTES
    return passages, max(1, min(nprobe * passages, int(memory_bytes / 2 // per_query)))


@dataclass(frozen=True)
class SearchGroups:
    """How each cluster's search is split. Cluster c's passages fall in passage_parts[c] parts and the queries
    that probe c in query_parts[c] parts (a hash of the pair_id); group (c, i, j) searches passage part i with
    query part j, so every (query, passage) pair of a cluster meets in exactly one group, and the merge's top
    K over a query's groups is the top K over its probed clusters. A cluster within the bounds is one group:
    its passages and its queries each travel once."""
    passage_parts: np.ndarray  # (k,) int64, >= 1
    query_parts: np.ndarray    # (k,) int64, >= 1

    @classmethod
    def plan(cls, passages: np.ndarray, queries: np.ndarray, max_group_rows: int,
             max_group_queries: int | None = None) -> "SearchGroups":
        """Parts such that no group holds more than about max_group_rows passages or max_group_queries
        (default max_group_rows) queries (hash parts are balanced only in expectation); passages, queries:
        (k,) rows per cluster."""
        def parts(counts, bound):
            return np.maximum(1, -(-np.asarray(counts, np.int64) // max(1, int(bound))))
        return cls(parts(passages, max_group_rows), parts(queries, max_group_queries or max_group_rows))

    @classmethod
    def one_per_cluster(cls, k: int) -> "SearchGroups":
        return cls(np.ones(k, np.int64), np.ones(k, np.int64))

    @property
    def first_group(self) -> np.ndarray:
        """(k,) the id of each cluster's group (c, 0, 0); groups of a cluster are numbered i x query_parts + j."""
        sizes = self.passage_parts * self.query_parts
        return np.cumsum(sizes) - sizes

    @property
    def num_groups(self) -> int:
        return int((self.passage_parts * self.query_parts).sum())

    def passage_copies(self, clusters: np.ndarray, pair_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source row, group) per routed copy: a passage goes to every query part of its passage part."""
        part = _part(pair_ids, self.passage_parts[clusters], PASSAGE_PART_SALT)
        rows, j = _expand(self.query_parts[clusters])
        return rows, self.first_group[clusters[rows]] + part[rows] * self.query_parts[clusters[rows]] + j

    def query_copies(self, clusters: np.ndarray, pair_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source row, group) per routed copy: a query goes to every passage part of the cluster it probes."""
        part = _part(pair_ids, self.query_parts[clusters], QUERY_PART_SALT)
        rows, i = _expand(self.passage_parts[clusters])
        return rows, self.first_group[clusters[rows]] + i * self.query_parts[clusters[rows]] + part[rows]


def _part(pair_ids: np.ndarray, parts: np.ndarray, salt: int) -> np.ndarray:
    """A fixed part in [0, parts) per pair_id (parts: per row)."""
    mixed = splitmix64(np.asarray(pair_ids, dtype=np.int64) ^ np.int64(salt))
    return (mixed % parts.astype(np.uint64)).astype(np.int64)


def _expand(repeats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, copy index) for `repeats[row]` copies of each row, in row order."""
    rows = np.repeat(np.arange(len(repeats)), repeats)
    starts = np.cumsum(repeats) - repeats
    return rows, np.arange(len(rows)) - starts[rows]


def cluster_counts(batch: pa.Table, centroids: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(passages, queries) per cluster in a batch of assign/ rows: passages by `cluster`; queries by the
    clusters each `emb_query` probes (None when the batch has no query vectors); with cluster.dims, on the
    centroids' first dimensions."""
    own = batch.column("cluster").to_numpy().astype(np.int64)
    passages = np.bincount(own, minlength=len(centroids))
    if "emb_query" not in batch.column_names:
        return passages, None
    queries = truncated(emb_matrix(batch.column("emb_query")), np.asarray(centroids).shape[1])
    probes = probed_clusters(queries, own, centroids, nprobe, True)
    return passages, np.bincount(probes.reshape(-1), minlength=len(centroids))


def queries_from_neighbours(passages: np.ndarray, centroids: np.ndarray, nprobe: int) -> np.ndarray:
    """Queries per cluster when each pair probes the clusters nearest to its own cluster's centroid (exact for
    a re-embedding, an estimate for queries embedded during the stage)."""
    neighbours = probed_clusters(centroids, np.arange(len(centroids)), centroids, nprobe, False)
    queries = np.zeros(len(centroids), np.int64)
    np.add.at(queries, neighbours, np.repeat(passages, neighbours.shape[1]).reshape(neighbours.shape))
    return queries


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
    centroids = np.ascontiguousarray(centroids, dtype=np.float32)
    index = build_vector_index(centroids, "auto")  # k centroids on this CPU, rescored (top_k) like any search
    if by_query:
        return top_k(index, centroids, query_vectors, nprobe)[1]
    neighbours = top_k(index, centroids, centroids, nprobe)[1]
    neighbours[:, 0] = np.arange(len(centroids))  # a centroid is its own nearest, whatever float ties say
    return neighbours[own_cluster]


def _vector_dtype(*columns: pa.ChunkedArray) -> type:
    """float16 when every vector column is stored as float16 (routing them so loses nothing), else float32."""
    return np.float16 if all(c.type.value_type == pa.float16() for c in columns) else np.float32


def route_rows(batch: pa.Table, centroids: np.ndarray, nprobe: int, by_query: bool,
               groups: SearchGroups | None = None, todo: np.ndarray | None = None) -> pa.Table:
    """Rows keyed by search `group`: each passage in the groups of its own cluster's passage part, each query
    in the groups of its part of every probed cluster (groups: SearchGroups; None = one group per cluster);
    todo: (groups,) bool, only the copies bound for those groups (a resumed mine: the groups not yet searched).

    batch: pair_id, query, passage, emb (the passage vector), emb_query, cluster. Every row carries the text
    keys of its pair; a query row also carries the score of its own positive."""
    groups = groups or SearchGroups.one_per_cluster(len(centroids))
    pair_ids = batch.column("pair_id").to_numpy()
    own = batch.column("cluster").to_numpy().astype(np.int64)
    dtype = _vector_dtype(batch.column("emb"), batch.column("emb_query"))
    p, q = emb_matrix(batch.column("emb"), dtype), emb_matrix(batch.column("emb_query"), dtype)
    if by_query:  # the frozen vectors: with cluster.dims, probed and searched on the centroids' dimensions
        width = np.asarray(centroids).shape[1]
        p, q = truncated(p, width), truncated(q, width)
    probes = probed_clusters(q, own, centroids, nprobe, by_query)
    pos = np.einsum("ij,ij->i", q.astype(np.float32), p.astype(np.float32)).astype(np.float32)
    p_rows, p_groups = groups.passage_copies(own, pair_ids)
    probe_rows = np.repeat(np.arange(len(own)), probes.shape[1])  # one (query, probed cluster) per entry
    q_entries, q_groups = groups.query_copies(probes.reshape(-1), pair_ids[probe_rows])
    q_rows = probe_rows[q_entries]
    if todo is not None:
        p_rows, p_groups = p_rows[todo[p_groups]], p_groups[todo[p_groups]]
        q_rows, q_groups = q_rows[todo[q_groups]], q_groups[todo[q_groups]]
    rows = np.r_[p_rows, q_rows]
    qk, pk = np.zeros(len(own), np.int64), np.zeros(len(own), np.int64)
    needed = np.unique(rows)  # the text keys of the rows routed anywhere
    qk[needed] = text_hashes(batch.column("query").take(pa.array(needed)).to_pylist())
    pk[needed] = text_hashes(batch.column("passage").take(pa.array(needed)).to_pylist())
    vectors = np.concatenate([p[p_rows], q[q_rows]])
    return pa.table({
        "kind": pa.array(np.r_[np.full(len(p_rows), PASSAGE), np.full(len(q_rows), QUERY)].astype(np.int8)),
        "group": pa.array(np.r_[p_groups, q_groups].astype(np.int64)),
        "pair_id": pa.array(pair_ids[rows].astype(np.int64)),
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), p.shape[1]),
        "query_key": pa.array(qk[rows]),
        "passage_key": pa.array(pk[rows]),
        "pos_score": pa.array(np.r_[np.zeros(len(p_rows), np.float32), pos[q_rows]]),
    })


# --- step 2: one group's passages against the queries routed to it -----------------------------------------
def build_index(emb: np.ndarray, mc: MineConfig, backend: str = "faiss", gpu: bool = False):
    """One search group's passage index on ray.vector_backend (gpu: the task has one): exact, or IVF with
    mine.ivf_nlist lists (default about 4 sqrt(n), >= 39 rows each; faiss only)."""
    n = emb.shape[0]
    nlist = mc.ivf_nlist or max(1, min(n // 39, int(4 * math.sqrt(n))))
    return build_vector_index(emb, backend, gpu, mc.index, nlist=nlist, nprobe=mc.ivf_nprobe)


def search_cluster(group: pa.Table, mc: MineConfig, buckets: int, backend: str = "faiss", gpu: bool = False
                   ) -> pa.Table:
    """The top mine.range_max passages of this search group for each query routed here, best first (equal scores:
    lower pair_id first; vector_search.top_k, the same on every backend), each with its candidate_flags against the
    query's pair; one output row per routed query, lists maybe empty."""
    return next(search_chunks(group, mc, buckets, backend, gpu))[1]


def search_chunks(group: pa.Table, mc: MineConfig, buckets: int, backend: str = "faiss", gpu: bool = False,
                  chunk_queries: int | None = None, skip: frozenset[int] = frozenset()
                  ) -> Iterator[tuple[int, pa.Table]]:
    """search_cluster's rows a chunk at a time: (chunk, its rows) for each run of chunk_queries of the group's queries
    in pair_id order (all of them in chunk 0 when None; rounded up to whole blocks of mine.query_batch_size, so every
    query block is the one an unchunked search forms), but the chunks in `skip`. The index over the group's passages
    is built once. A chunk is a fixed set of queries given the group's rows: mine writes each as a file of its own, and
    a rerun searches only those not written."""
    kind, pair_ids = group.column("kind").to_numpy(), group.column("pair_id").to_numpy()
    # Passages by pair_id: the index order is independent of arrival. Queries too: BLAS may round a row's
    # scores differently by its position in the batch, so a fixed order makes reruns equal. The queries stay in
    # `group` and are taken one block at a time (a group holds far more queries than passages).
    p_rows, q_rows = (np.flatnonzero(kind == side) for side in (PASSAGE, QUERY))
    p_rows, q_rows = (r[np.argsort(pair_ids[r], kind="stable")] for r in (p_rows, q_rows))
    passages = group.take(pa.array(p_rows))
    depth = min(mc.range_max, passages.num_rows)
    size = max(1, len(q_rows)) if not chunk_queries else -(-chunk_queries // mc.query_batch_size) * mc.query_batch_size
    ids = passages.column("pair_id").to_numpy()
    qk, pk = passages.column("query_key").to_numpy(), passages.column("passage_key").to_numpy()
    index = base = None
    for chunk, first in enumerate(range(0, max(1, len(q_rows)), size)):
        if chunk in skip:
            continue
        rows = q_rows[first:first + size]
        scores, found_rows = np.zeros((len(rows), depth), np.float32), np.zeros((len(rows), depth), np.int64)
        if len(rows) and depth:
            if index is None:
                base = emb_matrix(passages.column("vec"))
                index = build_index(base, mc, backend, gpu)
            for start in range(0, len(rows), mc.query_batch_size):  # one block of float32 query vectors at a time
                sl = slice(start, start + mc.query_batch_size)
                scores[sl], found_rows[sl] = top_k(index, base, emb_matrix(group.column("vec").take(
                    pa.array(rows[sl]))), depth)
        yield chunk, _result_rows(group, rows, pair_ids, ids, qk, pk, scores, found_rows, depth, buckets)


def _result_rows(group: pa.Table, q_rows: np.ndarray, pair_ids: np.ndarray, ids: np.ndarray, qk: np.ndarray,
                 pk: np.ndarray, scores: np.ndarray, rows: np.ndarray, depth: int, buckets: int) -> pa.Table:
    """One result row per query of q_rows: its hits sorted (score, then pair_id), cut where an approximate index ran
    out, flagged against the query's pair."""
    # An approximate (IVF) index may return fewer than `depth` hits (-1): they sort last and are cut below.
    hit_ids = np.where(rows >= 0, ids[np.maximum(rows, 0)], np.iinfo(np.int64).max)
    order = np.lexsort((hit_ids, -np.where(rows >= 0, scores, -np.inf)), axis=-1)
    rows, scores = np.take_along_axis(rows, order, 1), np.take_along_axis(scores, order, 1)
    found = (rows >= 0).sum(1)
    keep = np.arange(depth)[None, :] < found[:, None]
    safe = np.maximum(rows, 0)
    own = {name: group.column(name).to_numpy()[q_rows] for name in ("query_key", "passage_key", "pos_score")}
    flags = candidate_flags(qk[safe], pk[safe], own["query_key"][:, None], own["passage_key"][:, None])
    offsets = pa.array(np.r_[0, np.cumsum(found)].astype(np.int32))
    return pa.table({"bucket": pa.array(bucket_of(pair_ids[q_rows], buckets)),
                     "pair_id": pa.array(pair_ids[q_rows], pa.int64()), "pos_score": own["pos_score"],
                     "cand_scores": pa.ListArray.from_arrays(offsets, pa.array(scores[keep], pa.float32())),
                     "cand_ids": pa.ListArray.from_arrays(offsets, pa.array(ids[safe][keep], pa.int64())),
                     "cand_flags": pa.ListArray.from_arrays(offsets, pa.array(flags[keep], pa.int8()))})


# --- step 3: merge each query's candidates over its probed clusters and apply the rule ----------------------
def merge_candidates(group: pa.Table, mc: MineConfig) -> tuple[pa.Table, dict]:
    """negatives rows (pair_id, neg_pair_ids, neg_scores, pos_score), sorted by pair_id, and drop counts.

    group: search_cluster rows of some queries (one per search group they were routed to). A query's candidates
    from all its groups are ranked together (score, then pair_id), cut at mine.range_max and filtered by
    apply_rule (with the flags search_cluster set), so with every cluster probed the result is exact search. The
    ranking runs per query, MERGE_QUERY_BLOCK queries at a time (each row of a (queries, widest) matrix sorted on
    its own), never over all of the group's candidates at once."""
    pair_ids = group.column("pair_id").to_numpy()
    queries, first_row, of_query = np.unique(pair_ids, return_index=True, return_inverse=True)
    columns = {name: group.column(name).combine_chunks() for name in ("cand_ids", "cand_scores", "cand_flags")}
    offsets = np.asarray(columns["cand_ids"].offsets)
    flat = {name: np.asarray(pc.list_flatten(col)) for name, col in columns.items()}
    starts = offsets[:-1] - offsets[0]  # (a sliced list array's flat values begin at offsets[0])
    lengths = np.diff(offsets)
    rows = np.argsort(of_query, kind="stable")  # each query's rows together, queries in pair_id order
    per_query = np.bincount(of_query, weights=lengths, minlength=len(queries)).astype(np.int64)
    query_end = np.cumsum(per_query)
    b = len(queries)
    table_rows = np.full((b, mc.range_max), -1, np.int64)
    table_scores = np.zeros((b, mc.range_max), np.float32)
    table_flags = np.zeros((b, mc.range_max), np.int8)
    # The candidates in query order: positions into the flat arrays (a ragged gather of each row's slice).
    row_lengths = lengths[rows]
    take = np.repeat(starts[rows] - np.cumsum(row_lengths) + row_lengths, row_lengths) + np.arange(row_lengths.sum())
    for q0 in range(0, b, MERGE_QUERY_BLOCK):
        q1 = min(b, q0 + MERGE_QUERY_BLOCK)
        lo, hi = (query_end[q0 - 1] if q0 else 0), query_end[q1 - 1]
        counts = per_query[q0:q1]
        width = int(counts.max()) if len(counts) else 0
        if width == 0:
            continue
        owner = np.repeat(np.arange(q1 - q0), counts)
        slot = np.arange(hi - lo) - np.repeat(np.cumsum(counts) - counts, counts)
        where = take[lo:hi]
        scores = np.full((q1 - q0, width), -np.inf, np.float32)
        ids = np.full((q1 - q0, width), np.iinfo(np.int64).max, np.int64)
        source = np.full((q1 - q0, width), -1, np.int64)
        scores[owner, slot], ids[owner, slot], source[owner, slot] = \
            flat["cand_scores"][where], flat["cand_ids"][where], where
        depth = min(mc.range_max, width)
        order = np.lexsort((ids, -scores), axis=-1)[:, :depth]  # best first; equal scores: lower pair_id first
        best = np.take_along_axis(source, order, 1)
        table_rows[q0:q1, :depth] = best
        hit = best >= 0
        table_scores[q0:q1, :depth] = np.where(hit, np.take_along_axis(scores, order, 1), 0.0)
        table_flags[q0:q1, :depth] = np.where(hit, flat["cand_flags"][np.maximum(best, 0)], 0)
    pos = group.column("pos_score").to_numpy()[first_row]
    keep, drops = apply_rule(table_scores, table_rows, table_flags, pos, mc)
    offsets_out = pa.array(np.r_[0, np.cumsum(keep.sum(1))].astype(np.int32))  # row-major: each query's best first
    out = pa.table({"pair_id": pa.array(queries, pa.int64()),
                    "neg_pair_ids": pa.ListArray.from_arrays(offsets_out, pa.array(flat["cand_ids"][table_rows[keep]],
                                                                                   pa.int64())),
                    "neg_scores": pa.ListArray.from_arrays(offsets_out, pa.array(table_scores[keep], pa.float32())),
                    "pos_score": pa.array(pos.astype(np.float32))})
    return out, drops

