"""The compute core of `dedup`, numpy only: the keep order, exact groups by text key, semantic groups inside one
cluster, and matches against held-out pairs. stages/dedup/ distributes them over Ray Data.

Semantic groups, precisely: sort a cluster's rows into keep order; walk it; a row is removed when its cosine to
a row kept before it is >= the threshold, else it is kept. A removed row's duplicate_of is the kept row before it
with the highest cosine (equal cosines: the earliest in keep order). `semantic_greedy` computes exactly that in
blocks of rows, so its memory does not grow with the square of the cluster. A cluster too large for one task
is decided in chunks of its keep order instead (`split_greedy` in one process; stages/dedup/blocks.py runs it as a
chain of Ray tasks): each chunk against the rows kept before it (`raise_best`), then within itself
(`semantic_greedy` with that prior), so the kept rows, each removed row's duplicate_of and similarity are
`semantic_greedy`'s, and a removed row is never compared again: no list of near-duplicate pairs is ever made.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from clusterscale.runtime.keep_rules import keep_rule

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
    """The primary keep key of rows given by their pair_ids and cos (lower = kept first; ties by pair_id) under the
    dedup.keep rule `rule` (runtime/keep_rules: 'hard' keeps the row farthest from its centroid, 'easy' the nearest,
    'random' a seeded hash of pair_id). The dedup stage passes the rule its rows' every column (keep_rules)."""
    return keep_rule(rule).rank(pa.table({"pair_id": np.asarray(pair_ids, np.int64), "cos": np.asarray(cos)}), seed)


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


class Products:
    """a @ b.T of unit vectors for the semantic steps, as float64: on numpy in float64 (device None: the CPU path),
    or in float32 (device 'numpy32', or a torch device: a task's GPU, a CPU when ray.vector_backend=torch) with every
    entry within near_threshold_margin of the threshold or above recomputed in float64. Either way a decision
    (>= threshold), a removed row's similarity and the earliest column among equal bests at or above the threshold
    are float64's (to an ulp: the recomputed entries are summed in another order than BLAS's); an entry below the
    threshold (a kept row's best: only the histogram reads it) may be float32's."""

    def __init__(self, threshold: float, device: str | None = None):
        self.threshold, self.device = threshold, device

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.device is None:
            return np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
        if self.device == "numpy32":
            sims = (np.asarray(a, np.float32) @ np.asarray(b, np.float32).T).astype(np.float64)
        else:
            import torch

            with torch.no_grad():
                left = torch.from_numpy(np.array(a, np.float32)).to(self.device)  # copies: Arrow's are read-only
                right = torch.from_numpy(np.array(b, np.float32)).to(self.device)
                sims = (left @ right.T).cpu().numpy().astype(np.float64)
        near_r, near_c = np.nonzero(sims >= self.threshold - near_threshold_margin(a.shape[1]))
        if len(near_r):
            sims[near_r, near_c] = np.einsum("nd,nd->n", np.asarray(a[near_r], np.float64),
                                             np.asarray(b[near_c], np.float64))
        return sims


def products_for(backend: str, gpu: bool, threshold: float, fallback: str | None = None) -> Products:
    """dedup's products on ray.vector_backend in a task with or without a GPU: torch when forced (on the GPU if the
    task has one), or with 'auto' on a task's GPU; else numpy (`fallback`: None = float64, 'numpy32')."""
    from clusterscale.runtime.vector_search import torch_cuda

    if backend == "torch":
        return Products(threshold, "cuda" if gpu and torch_cuda() else "cpu")
    if backend == "auto" and gpu and torch_cuda():
        return Products(threshold, "cuda")
    return Products(threshold, fallback)


def semantic_greedy(x: np.ndarray, threshold: float, block_rows: int, keys: np.ndarray | None = None,
                    prior: tuple[np.ndarray, np.ndarray] | None = None, products: Products | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Semantic groups (module docstring) of unit vectors x already in keep order, block_rows rows at a time.

    Returns (kept: bool (n,), duplicate_of: the key of a removed row's kept duplicate, -1 when kept, best: each
    row's highest cosine to a row kept before it, -inf when none). keys: what duplicate_of names a row of x by
    (default: its index). prior: (best, best_of) of each row over kept rows that precede all of x (best_of in the
    caller's keys; raise_best leaves them so), when x is one chunk of a longer keep order (split_greedy).
    Cosines in float64 (products: Products, default float64 numpy), so the result does not depend on the blocking
    (nor on the BLAS, nor on the backend). x stays in its own dtype; only blocks are widened."""
    products = products or Products(threshold)
    n = len(x)
    keys = np.arange(n) if keys is None else np.asarray(keys, np.int64)
    kept = np.zeros(n, bool)
    best, best_of = (np.full(n, -np.inf), np.full(n, -1, np.int64)) if prior is None else \
        (np.array(prior[0], np.float64), np.array(prior[1], np.int64))
    for start in range(0, n, block_rows):
        stop = min(n, start + block_rows)
        block, rows = x[start:stop], np.arange(start, stop)
        earlier = np.flatnonzero(kept[:start])
        for c in range(0, len(earlier), block_rows):
            columns = earlier[c:c + block_rows]
            _take_better(best[start:stop], best_of[start:stop], products(block, x[columns]), keys[columns])
        within = products(block, block)
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
        _take_better(best[start:stop], best_of[start:stop], within.T, keys[rows])
    return kept, np.where(kept, -1, best_of), best


def near_threshold_margin(d: int) -> float:
    """How far below the threshold a float32 cosine of d-dim unit vectors may fall and still be >= it in float64:
    float32 accumulates at most ~d x 2^-24 relative error per product sum of unit vectors (|a.b| <= 1), so pairs
    within this margin are decided in float64 (at least 1e-5)."""
    return max(1e-5, d * 2.0 ** -23)


def raise_best(x: np.ndarray, kept_x: np.ndarray, kept_keys: np.ndarray, threshold: float, block_rows: int,
               best: np.ndarray, best_of: np.ndarray, products: Products | None = None) -> None:
    """Raise each row of x's best (its highest cosine to a kept row before it) and best_of (that row's key) in place
    over kept rows `kept_x` (keys `kept_keys`) that are in keep order and all precede x's rows; called on earlier
    kept rows in keep order, it leaves what semantic_greedy's `prior` wants. Products in float32, block_rows x
    block_rows at a time; a row with a product within near_threshold_margin of the threshold or above gets its
    best over those few columns in float64, so a best at or above the threshold and the earliest kept row among
    equal ones are semantic_greedy's (exact float64); a best below it (a kept row's: only the histogram reads
    it) may be float32's. Memory: the two blocks and one block_rows^2 product, whatever the duplicates. products:
    where the float32 products are made (Products; default numpy)."""
    margin = near_threshold_margin(x.shape[1])
    products = products or Products(threshold, "numpy32")
    kept_keys = np.asarray(kept_keys, np.int64)
    for r in range(0, len(x), block_rows):
        rows = np.asarray(x[r:r + block_rows], np.float32)
        for c in range(0, len(kept_x), block_rows):
            sims = products(rows, np.asarray(kept_x[c:c + block_rows], np.float32))
            j = np.argmax(sims, axis=1)  # the first maximum: the earliest column among equals
            top = sims[np.arange(len(j)), j].astype(np.float64)
            near_r, near_c = np.nonzero(sims >= threshold - margin)
            del sims
            if len(near_r):
                exact = np.einsum("nd,nd->n", np.asarray(x[r + near_r], np.float64),
                                  np.asarray(kept_x[c + near_c], np.float64))
                order = np.lexsort((near_c, -exact, near_r))  # per row: the highest cosine, then the earliest column
                first = order[np.r_[True, near_r[order][1:] != near_r[order][:-1]]]
                j[near_r[first]], top[near_r[first]] = near_c[first], exact[first]
            better = top > best[r:r + len(rows)]  # equal: the earlier block's column stays
            best[r:r + len(rows)][better] = top[better]
            best_of[r:r + len(rows)][better] = kept_keys[c + j[better]]


def split_greedy(x: np.ndarray, threshold: float, block_rows: int, chunk_rows: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """semantic_greedy's (kept, duplicate_of, best) for x in keep order, decided chunk_rows rows at a time in keep
    order: each chunk against the kept rows of the chunks before it (raise_best, one earlier chunk's kept rows at a
    time), then within itself (semantic_greedy with that prior). A removed row is never compared again, so nothing
    grows with the number of near-duplicate pairs: in one process, what stages/dedup/blocks.py runs as a chain of
    Ray tasks. best below the threshold (kept rows) from earlier chunks may be float32's (raise_best)."""
    n = len(x)
    kept, duplicate_of, best = np.zeros(n, bool), np.full(n, -1, np.int64), np.full(n, -np.inf)
    kept_before: list[np.ndarray] = []  # the kept rows of each chunk so far
    for start in range(0, n, chunk_rows):
        rows = np.arange(start, min(n, start + chunk_rows))
        prior = np.full(len(rows), -np.inf), np.full(len(rows), -1, np.int64)
        for earlier in kept_before:
            raise_best(x[rows], x[earlier], earlier, threshold, block_rows, *prior)
        kept[rows], duplicate_of[rows], best[rows] = semantic_greedy(x[rows], threshold, block_rows, keys=rows,
                                                                     prior=prior)
        kept_before.append(rows[kept[rows]])
    return kept, duplicate_of, best


def heldout_matches(x: np.ndarray, heldout: np.ndarray, block_rows: int, products: Products | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(index of the most similar held-out vector, its cosine) for each row of x; (-1, -inf) with no held-out.
    block_rows rows of x against block_rows held-out vectors at a time, so memory does not grow with the cluster.
    products: Products (its threshold's near entries in float64; default float32 numpy, no threshold)."""
    products = products or Products(np.inf, "numpy32")
    best, best_of = np.full(len(x), -np.inf), np.full(len(x), -1, np.int64)
    for row in range(0, len(x), block_rows):
        block = np.asarray(x[row:row + block_rows], np.float32)
        for start in range(0, len(heldout), block_rows):
            columns = np.arange(start, min(len(heldout), start + block_rows))
            sims = products(block, np.asarray(heldout[columns], np.float32))
            _take_better(best[row:row + block_rows], best_of[row:row + block_rows], sims, columns)
    return best_of, best


def histogram_near(best: np.ndarray, threshold: float, bins: int = 20, width: float = 0.1) -> tuple[list, list]:
    """Counts of `best` in `bins` equal bins over [threshold - width, 1] (edges, counts): how many rows sit just
    below the threshold (kept) and just above it (removed)."""
    edges = np.linspace(max(-1.0, threshold - width), 1.0, bins + 1)
    counts, _ = np.histogram(best[np.isfinite(best)], bins=edges)
    return edges.round(6).tolist(), counts.tolist()
