"""The compute core of `dedup`, numpy only: the keep order, exact groups by text key, semantic groups inside one
cluster, and matches against held-out pairs. stages/dedup/ distributes them over Ray Data.

Semantic groups, precisely: sort a cluster's rows into keep order; walk it; a row is removed when its cosine to
a row kept before it is >= the threshold, else it is kept. A removed row's duplicate_of is the kept row before it
with the highest cosine (equal cosines: the earliest in keep order). `semantic_greedy` computes exactly that in
blocks of rows, so its memory does not grow with the square of the cluster. A cluster too large for one task
is compared block x block instead (`block_pair_edges`; stages/dedup/blocks.py runs them in Ray tasks): only the
pairs at or above the threshold come back (an edge list), and `greedy_from_edges` walks the same keep order over
them, so the kept rows, each removed row's duplicate_of and similarity are exactly `semantic_greedy`'s
(`split_greedy`: the same in one process).
"""
from __future__ import annotations

import hashlib

import numpy as np

from clusterscale.runtime.hashing import hash_unit

KEPT, HELDOUT_LEAK, EXACT, SEMANTIC = 0, 1, 2, 3  # the `reason` code of a row
HELDOUT_PROBE = -1  # the `reason` of a held-out vector routed to a cluster (compared there, never written)
REASONS = {HELDOUT_LEAK: "heldout_leak", EXACT: "exact", SEMANTIC: "semantic"}
KEY_SEPARATOR = "\x1f"  # between query and passage in a pair key (ingest turns control characters into spaces)


def normalised(text: str) -> str:
    """The text dedup compares: case-folded, runs of whitespace as one space (ingest already applied NFC)."""
    return " ".join(text.casefold().split())


def text_keys(texts: list[str]) -> np.ndarray:
    """(n, 2) int64: a 128-bit hash of each normalised text (64 bits collide about once in 4e9 texts)."""
    digests = b"".join(hashlib.blake2b(normalised(t).encode(), digest_size=16, person=b"dedup").digest()
                       for t in texts)
    return np.frombuffer(digests, dtype="<i8").reshape(-1, 2).copy()


def pair_texts(queries: list[str], passages: list[str], key: str) -> list[str]:
    """The texts dedup.key compares: 'pair' (both), 'passage' or 'query'."""
    if key == "query":
        return queries
    if key == "passage":
        return passages
    return [f"{normalised(q)}{KEY_SEPARATOR}{normalised(p)}" for q, p in zip(queries, passages)]


def keep_rank(pair_ids: np.ndarray, cos: np.ndarray, rule: str, seed: int) -> np.ndarray:
    """The primary keep key of each row (lower = kept first; ties by pair_id): 'hard' keeps the row farthest from
    its centroid (lowest cos), 'easy' the nearest, 'random' a seeded hash of pair_id."""
    if rule == "hard":
        return np.asarray(cos, np.float64)
    if rule == "easy":
        return -np.asarray(cos, np.float64)
    return hash_unit(pair_ids, salt=seed)


def keep_order(pair_ids: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Indices of the rows in keep order: by rank, then pair_id (a total order, whatever the rows' arrival)."""
    return np.lexsort((pair_ids, rank))


def exact_duplicates(keys: np.ndarray, pair_ids: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """duplicate_of per row: -1 for the first row of its key in keep order (kept), else that row's pair_id."""
    n = len(pair_ids)
    position = np.empty(n, np.int64)
    position[keep_order(pair_ids, rank)] = np.arange(n)
    order = np.lexsort((position, keys[:, 1], keys[:, 0]))
    sorted_keys = keys[order]
    first = np.r_[True, (sorted_keys[1:] != sorted_keys[:-1]).any(axis=1)] if n else np.zeros(0, bool)
    head = order[np.maximum.accumulate(np.where(first, np.arange(n), 0))] if n else order
    dup_of = np.full(n, -1, np.int64)
    dup_of[order[~first]] = pair_ids[head[~first]]
    return dup_of


def _take_better(best: np.ndarray, best_of: np.ndarray, sims: np.ndarray, columns: np.ndarray) -> None:
    """Raise best (and best_of) where a column of sims beats it; equal values keep the earlier column."""
    if sims.shape[1] == 0:
        return
    j = np.argmax(sims, axis=1)  # the first maximum: the earliest column among equals
    top = sims[np.arange(len(j)), j]
    better = top > best
    best[better] = top[better]
    best_of[better] = columns[j[better]]


def semantic_greedy(x: np.ndarray, threshold: float, block_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Semantic groups (module docstring) of unit vectors x already in keep order, block_rows rows at a time.

    Returns (kept: bool (n,), duplicate_of: the index of a removed row's kept duplicate, -1 when kept,
    best: each row's highest cosine to a row kept before it, -inf when none). Cosines in float64, so the
    result does not depend on the blocking (nor on the BLAS). x stays in its own dtype; only blocks are widened."""
    n = len(x)
    kept = np.zeros(n, bool)
    best, best_of = np.full(n, -np.inf), np.full(n, -1, np.int64)
    for start in range(0, n, block_rows):
        stop = min(n, start + block_rows)
        block, rows = np.asarray(x[start:stop], np.float64), np.arange(start, stop)
        earlier = np.flatnonzero(kept[:start])
        for c in range(0, len(earlier), block_rows):
            columns = earlier[c:c + block_rows]
            _take_better(best[start:stop], best_of[start:stop], block @ np.asarray(x[columns], np.float64).T, columns)
        within = block @ block.T
        before = np.tri(len(rows), k=-1, dtype=bool).T  # before[i, j]: row i precedes row j
        alive = best[start:stop] < threshold
        hits = before & (within >= threshold) & alive[:, None] & alive[None, :]
        for i in np.flatnonzero(hits.any(axis=1)):  # in keep order: a row still alive here is kept
            if alive[i]:
                alive[hits[i]] = False
        kept[start:stop] = alive
        # best over the block's own kept rows before each row (columns = the kept rows, rows of `within`); in
        # place, so the block holds one block_rows^2 float64 matrix, not two
        within[~(before & alive[:, None])] = -np.inf
        _take_better(best[start:stop], best_of[start:stop], within.T, rows)
    return kept, np.where(kept, -1, best_of), best


def near_threshold_margin(d: int) -> float:
    """How far below the threshold a float32 cosine of d-dim unit vectors may fall and still be >= it in float64:
    float32 accumulates at most ~d x 2^-24 relative error per product sum of unit vectors (|a.b| <= 1), so pairs
    within this margin are decided in float64 (at least 1e-5)."""
    return max(1e-5, d * 2.0 ** -23)


def block_pair_edges(xa: np.ndarray, xb: np.ndarray, start_a: int, start_b: int, threshold: float,
                     block_rows: int, same: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The edges (i, j, cosine) between two blocks of unit vectors of one cluster in keep order, rows start_a..
    and start_b.. (start_a <= start_b; the same block: only i < j): every pair with i < j and float64 cosine >=
    threshold. Products in float32, block_rows x block_rows at a time; the few pairs within
    near_threshold_margin of the threshold or above are recomputed in float64 (their cosine is exact, so ties
    and duplicate_of do not depend on the blocking nor on the BLAS). `same` (default: start_a == start_b) says
    whether xa and xb are one block (only its pairs i < j) or two (every pair)."""
    same = start_a == start_b if same is None else same
    margin = near_threshold_margin(xa.shape[1])
    a32, b32 = np.asarray(xa, np.float32), np.asarray(xb, np.float32)
    found_i, found_j = [], []
    for r in range(0, len(xa), block_rows):
        rows = a32[r:r + block_rows]
        for c in range(r if same else 0, len(xb), block_rows):
            hit_r, hit_c = np.nonzero(rows @ b32[c:c + block_rows].T >= threshold - margin)
            hit_r, hit_c = hit_r + r, hit_c + c
            if same:
                keep = hit_r < hit_c
                hit_r, hit_c = hit_r[keep], hit_c[keep]
            found_i.append(hit_r)
            found_j.append(hit_c)
    i = np.concatenate(found_i) if found_i else np.zeros(0, np.int64)
    j = np.concatenate(found_j) if found_j else np.zeros(0, np.int64)
    sim = np.einsum("nd,nd->n", np.asarray(xa[i], np.float64), np.asarray(xb[j], np.float64))
    keep = sim >= threshold
    return (i[keep] + start_a).astype(np.int64), (j[keep] + start_b).astype(np.int64), sim[keep]


def block_pairs(n: int, max_group_rows: int) -> list[tuple[int, int]]:
    """The (start_a, start_b) of every block pair of a cluster of n rows in blocks of max_group_rows,
    start_a <= start_b: each pair of rows is in exactly one of them."""
    starts = range(0, n, max_group_rows)
    return [(a, b) for a in starts for b in starts if a <= b]


def split_greedy(x: np.ndarray, threshold: float, block_rows: int, max_group_rows: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """semantic_greedy's (kept, duplicate_of) for x in keep order, through the edges of every block pair (blocks
    of max_group_rows rows) walked by greedy_from_edges: in one process, what stages/dedup/blocks.py spreads over
    Ray tasks."""
    edges = [block_pair_edges(x[a:a + max_group_rows], x[b:b + max_group_rows], a, b, threshold, block_rows)
             for a, b in block_pairs(len(x), max_group_rows)]
    i, j, sim = (np.concatenate(column) for column in zip(*edges))
    return greedy_from_edges(len(x), i, j, sim)


def greedy_from_edges(n: int, i: np.ndarray, j: np.ndarray, sim: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """semantic_greedy's (kept, duplicate_of, best) for n rows in keep order from the edge list of every pair
    i < j with cosine >= the threshold: walking j in keep order, a row is removed when an edge reaches it from a
    kept row; its duplicate is that kept row with the highest cosine (the earliest among equals). best holds a
    removed row's cosine to it; a kept row's best to the rows kept before it is below the threshold, so not in
    the edge list: -inf."""
    kept = np.ones(n, bool)
    best, best_of = np.full(n, -np.inf), np.full(n, -1, np.int64)
    order = np.lexsort((i, j))  # by target row, then source row: the earliest source first among equal cosines
    i, j, sim = i[order], j[order], sim[order]
    starts = np.flatnonzero(np.r_[True, j[1:] != j[:-1]]) if len(j) else np.zeros(0, np.int64)
    for lo, hi in zip(starts, np.r_[starts[1:], len(j)].astype(np.int64)):
        sources = i[lo:hi]
        from_kept = kept[sources]  # final: every source precedes this target
        if from_kept.any():
            s = np.where(from_kept, sim[lo:hi], -np.inf)
            at = int(np.argmax(s))
            target = j[lo]
            kept[target], best[target], best_of[target] = False, s[at], sources[at]
    return kept, np.where(kept, -1, best_of), best


def heldout_matches(x: np.ndarray, heldout: np.ndarray, block_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(index of the most similar held-out vector, its cosine) for each row of x; (-1, -inf) with no held-out.
    block_rows rows of x against block_rows held-out vectors at a time, so memory does not grow with the cluster."""
    best, best_of = np.full(len(x), -np.inf), np.full(len(x), -1, np.int64)
    for row in range(0, len(x), block_rows):
        block = np.asarray(x[row:row + block_rows], np.float32)
        for start in range(0, len(heldout), block_rows):
            columns = np.arange(start, min(len(heldout), start + block_rows))
            sims = (block @ np.asarray(heldout[columns], np.float32).T).astype(np.float64)
            _take_better(best[row:row + block_rows], best_of[row:row + block_rows], sims, columns)
    return best_of, best


def histogram_near(best: np.ndarray, threshold: float, bins: int = 20, width: float = 0.1) -> tuple[list, list]:
    """Counts of `best` in `bins` equal bins over [threshold - width, 1] (edges, counts): how many rows sit just
    below the threshold (kept) and just above it (removed)."""
    edges = np.linspace(max(-1.0, threshold - width), 1.0, bins + 1)
    counts, _ = np.histogram(best[np.isfinite(best)], bins=edges)
    return edges.round(6).tolist(), counts.tolist()
