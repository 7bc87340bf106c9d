"""Spherical k-means compute core: one Lloyd step on an array, the reduction, the update. No Ray here.

The Ray layer (clusterscale/stages/kmeans.py) runs a `LloydWorker` in each of W actors and `lloyd` on the driver;
`fit_spherical_kmeans` runs the same loop in one process (tests, benchmarks, a bare GPU box).

Determinism: per-centroid sums are float64. The fit reads fp16 embeddings, and every fp16 value is an
integer multiple of 2**-24 below 1 in magnitude, so float64 sums of up to ~5e8 such values are exact
and therefore independent of how rows are split over workers: W=1 and W=2 give identical centroids.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from clusterscale.errors import UserError
from clusterscale.runtime.vector_search import build_index, top_k
from clusterscale.runtime.hashing import hash_unit

# Perturbation (relative to the mean's norm) when an empty cluster takes half of the largest one (as FAISS).
SPLIT_EPS = 1.0 / 1024.0
INIT_SALT = 0x1417  # the init keys must not correlate with the fit-sample keys (salt = seed)
SUM_BLOCK_VALUES = 1 << 19  # values per block of the float64 sums: 4 MiB of float64, cache-sized


class ClusteringError(UserError, ValueError):
    """k-means cannot run on this input; the message names the cause and the fix."""


@dataclass
class Partials:
    """What one worker returns per iteration: enough for the driver to compute the new centroids."""

    sums: np.ndarray  # (k, d) float64, sum of the vectors assigned to each centroid
    counts: np.ndarray  # (k,) int64
    objective: float  # sum over rows of the cosine to the nearest centroid


def check_vectors(x: np.ndarray, where: str, dim: int | None = None) -> None:
    """Raise ClusteringError naming the cause and the fix for empty, wrong-dimension or NaN/inf input."""
    if x.ndim != 2 or x.shape[0] == 0:
        raise ClusteringError(f"No embeddings in {where}: run `clusterscale embed` first (and check that "
                              f"ingest kept some pairs).")
    if dim is not None and x.shape[1] != dim:
        raise ClusteringError(f"Embeddings in {where} have dimension {x.shape[1]}, the centroids {dim}: they "
                              f"come from different encoders; re-run `clusterscale fit` for this embed.model.")
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        raise ClusteringError(f"{int(bad.sum())} embedding rows in {where} hold NaN/inf: re-run "
                              f"`clusterscale embed` with a working encoder (delete embeddings/ first).")


def nearest_centroid(x: np.ndarray, centroids: np.ndarray, use_gpu: bool = False, backend: str = "faiss"
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(cosine, label) of every row's nearest centroid by inner product, on `backend` (ray.vector_backend; use_gpu:
    the task has a GPU): the same labels and cosines on every backend (vector_search.top_k)."""
    sims, labels = top_k(build_index(centroids, backend, use_gpu), centroids, x, 1)
    return sims[:, 0], labels[:, 0]


FP16_CHECK_BLOCK_VALUES = 1 << 21  # 8 MiB of float32: the check's three temporaries stay ~20 MiB at any d


def fp16_exact(x: np.ndarray, block_values: int = FP16_CHECK_BLOCK_VALUES) -> bool:
    """True when every value is an fp16 value in [-1, 1]: then float64 sums of up to 2**29 rows are exact."""
    block_rows = max(1, block_values // max(1, x.shape[1] if x.ndim == 2 else 1))
    for start in range(0, len(x), block_rows):  # in blocks: abs() and the fp16 round trip copy their input
        block = x[start:start + block_rows]
        if not (np.abs(block).max() <= 1.0 and np.array_equal(block.astype(np.float16).astype(block.dtype), block)):
            return False
    return True


def _signed_onehot(k: int, plus: np.ndarray, minus: np.ndarray | None = None):
    """(k x m) scipy CSR matrix with +1 at (plus[j], j) and, if given, -1 at (minus[j], j): times rows, it sums
    them. scipy is imported here, by the k-means workers only: the many task workers that import this module for
    its small helpers (shard, dedup, mine) skip its ~0.2 s import."""
    import scipy.sparse as sp

    m = len(plus)
    cols = np.arange(m)
    if minus is None:
        return sp.csr_matrix((np.ones(m), (plus, cols)), shape=(k, m))
    data = np.concatenate([np.ones(m), -np.ones(m)])
    return sp.csr_matrix((data, (np.concatenate([plus, minus]), np.concatenate([cols, cols]))), shape=(k, m))


class LloydWorker:
    """One worker's rows for every iteration: nearest centroids, then per-centroid float64 sums.

    The first step sums every row; later steps only move the rows whose nearest centroid changed
    (add to the new sum, subtract from the old), which after a few iterations is a small fraction.
    For fp16 input in [-1, 1] (what the fit reads) every float64 sum is exact, so the incremental sums
    equal a full recomputation bit for bit, whatever the split over workers; for other input every
    step recomputes the sums in full.
    """

    def __init__(self, x: np.ndarray, use_gpu: bool = False, backend: str = "faiss"):
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.use_gpu, self.backend = use_gpu, backend
        self.incremental = fp16_exact(self.x)
        self.labels: np.ndarray | None = None
        self.sums: np.ndarray | None = None

    def step(self, centroids: np.ndarray) -> Partials:
        """Assignment half of one Lloyd step: per-centroid sums, counts and objective of this worker's rows."""
        k, d = centroids.shape[0], self.x.shape[1]
        sims, labels = nearest_centroid(self.x, centroids, self.use_gpu, self.backend)
        # Sparse (+1/-1) one-hot products sum rows per centroid in float64, ~5x faster than np.add.at, in
        # row blocks so the float64 copy stays in cache (2-3x faster than one pass, same sums).
        block = max(1024, SUM_BLOCK_VALUES // max(1, d))
        moved = None
        if self.incremental and self.labels is not None and self.sums.shape == (k, d):
            moved = np.flatnonzero(labels != self.labels)
            if 2 * len(moved) > len(labels):
                moved = None  # most rows moved: a full recount is cheaper
        if moved is not None:
            for start in range(0, len(moved), block):
                part = moved[start:start + block]
                self.sums += _signed_onehot(k, labels[part], self.labels[part]) @ self.x[part].astype(np.float64)
        else:
            self.sums = np.zeros((k, d), dtype=np.float64)
            for start in range(0, len(labels), block):
                stop = start + block
                self.sums += _signed_onehot(k, labels[start:stop]) @ self.x[start:stop].astype(np.float64)
        self.labels = labels
        counts = np.bincount(labels, minlength=k).astype(np.int64)
        return Partials(self.sums.copy(), counts, float(sims.astype(np.float64).sum()))


def lloyd_partials(x: np.ndarray, centroids: np.ndarray, use_gpu: bool = False, backend: str = "faiss") -> Partials:
    """One stateless Lloyd assignment step on x (rows L2-normalised): per-centroid sums, counts, objective."""
    return LloydWorker(x, use_gpu, backend).step(centroids)


def reduce_partials(parts: list[Partials]) -> Partials:
    """Sum the workers' partials in list order (a fixed order: worker 0, 1, ...)."""
    sums, counts, objective = parts[0].sums.copy(), parts[0].counts.copy(), parts[0].objective
    for p in parts[1:]:
        sums += p.sums
        counts += p.counts
        objective += p.objective
    return Partials(sums, counts, objective)


def update_centroids(total: Partials) -> tuple[np.ndarray, int]:
    """New unit centroids from the reduced sums; empty clusters split the largest one. Returns (C, splits)."""
    sums, counts = total.sums.copy(), total.counts.copy()
    empty = np.flatnonzero(counts == 0)
    for c in empty:
        # Deterministic split of the currently largest cluster (lowest index on ties), like FAISS:
        # both halves start from its mean, nudged apart in opposite directions.
        big = int(np.argmax(counts))
        mean = sums[big] / counts[big]
        sign = np.where(np.arange(sums.shape[1]) % 2 == 0, 1.0, -1.0)
        delta = sign * SPLIT_EPS * np.linalg.norm(mean) / np.sqrt(len(mean))  # additive: zero entries move too
        half = counts[big] // 2
        sums[c], counts[c] = (mean + delta) * max(half, 1), max(half, 1)
        sums[big], counts[big] = (mean - delta) * (counts[big] - half), counts[big] - half
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    norms[norms == 0] = 1.0  # an all-zero sum (antipodal points) stays zero rather than NaN
    return (sums / norms).astype(np.float32), len(empty)


def init_candidates(ids: np.ndarray, x: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """This worker's k rows with the smallest seeded hash of their id: (keys, vectors).

    The driver keeps the k smallest keys over all workers, so the initial centroids (a uniform random
    sample of the fit sample, like FAISS) do not depend on how rows are split over workers.
    """
    keys = hash_unit(ids, salt=seed ^ INIT_SALT)
    top = np.argsort(keys, kind="stable")[:k]
    return keys[top], x[top]


def pick_initial(candidates: list[tuple[np.ndarray, np.ndarray]], k: int) -> np.ndarray:
    keys = np.concatenate([c[0] for c in candidates])
    vectors = np.concatenate([c[1] for c in candidates])
    if len(keys) < k:
        raise ClusteringError(f"The fit sample holds {len(keys)} vectors, fewer than cluster.k={k}: lower "
                              f"cluster.k, raise cluster.max_points_per_centroid, or use cluster.fit_sample=all.")
    chosen = vectors[np.argsort(keys, kind="stable")[:k]].astype(np.float64)
    return (chosen / np.linalg.norm(chosen, axis=1, keepdims=True)).astype(np.float32)


def imbalance_factor(counts: np.ndarray) -> float:
    """k * sum(n_c^2) / n^2: 1.0 when all clusters are equal (FAISS's definition)."""
    return float(len(counts) * np.square(counts.astype(np.float64)).sum() / max(1, counts.sum()) ** 2)


def lloyd(step: Callable[[np.ndarray], list[Partials]], centroids: np.ndarray, niter: int,
          log: Callable[[str], None] | None = None) -> tuple[np.ndarray, dict]:
    """niter Lloyd iterations; `step(centroids)` returns every worker's Partials in worker order."""
    objectives, seconds, splits = [], [], 0
    total = None
    for it in range(niter):
        started = time.perf_counter()
        total = reduce_partials(step(centroids))
        centroids, n_split = update_centroids(total)
        splits += n_split
        objectives.append(total.objective)
        seconds.append(time.perf_counter() - started)
        if log:
            log(f"[fit] iteration {it + 1}/{niter}: objective {total.objective:.2f}, {seconds[-1]:.2f}s"
                + (f", {n_split} empty cluster(s) split" if n_split else ""))
    counts = total.counts
    stats = {"objective": objectives[-1], "objective_per_iteration": objectives,
             "seconds_per_iteration": [round(s, 4) for s in seconds],
             "imbalance_factor": imbalance_factor(counts), "empty_clusters_split": splits,
             "empty_clusters_last_iteration": int((counts == 0).sum()),
             "min_cluster_size": int(counts.min()), "max_cluster_size": int(counts.max())}
    return centroids, stats


def fit_spherical_kmeans(x: np.ndarray, k: int, niter: int, seed: int, ids: np.ndarray | None = None,
                         use_gpu: bool = False, backend: str = "faiss") -> tuple[np.ndarray, dict]:
    """Single-process spherical k-means on x (rows L2-normalised): the reference for the Ray fit.

    `ids` (default: row numbers) seed the initial sample, so the Ray fit on the same rows with their
    pair_ids returns the same centroids.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    check_vectors(x, "the fit sample")
    if k > len(x):
        raise ClusteringError(f"cluster.k={k} is larger than the number of vectors ({len(x)}): lower cluster.k "
                              f"or embed more pairs.")
    ids = np.arange(len(x), dtype=np.int64) if ids is None else ids
    initial = pick_initial([init_candidates(ids, x, k, seed)], k)
    worker = LloydWorker(x, use_gpu, backend)
    return lloyd(lambda c: [worker.step(c)], initial, niter)
