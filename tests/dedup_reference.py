"""Brute-force references of dedup's rules (all pairs, one process), and planted-duplicate data, for the tests."""
from __future__ import annotations

import numpy as np

from clusterscale.runtime import dedup_core as core


def brute_force_semantic(x: np.ndarray, cluster: np.ndarray, pair_ids: np.ndarray, cos: np.ndarray, rule: str,
                         seed: int, threshold: float) -> dict[int, tuple[int, float]]:
    """{removed pair_id: (duplicate_of, similarity)}: the full N x N cosine matrix, walked in keep order; a row is
    removed when a kept row of its cluster before it has cosine >= threshold; its duplicate is the most similar
    such kept row (the earliest among equals)."""
    sims = np.asarray(x, np.float64) @ np.asarray(x, np.float64).T
    order = core.keep_order(pair_ids, core.keep_rank(pair_ids, cos, rule, seed))
    kept: list[int] = []
    removed = {}
    for j in order:
        best, best_i = -np.inf, -1
        for i in kept:
            if cluster[i] == cluster[j] and sims[i, j] > best:
                best, best_i = sims[i, j], i
        if best >= threshold:
            removed[int(pair_ids[j])] = (int(pair_ids[best_i]), float(best))
        else:
            kept.append(j)
    return removed


def brute_force_heldout_vectors(x: np.ndarray, cluster: np.ndarray, held_x: np.ndarray, held_ids: np.ndarray,
                                centroids: np.ndarray, nprobe: int, threshold: float) -> dict[int, tuple[int, float]]:
    """{row index: (held-out pair_id, cosine)}: rows whose cosine to a held-out vector is >= threshold, over the
    held-out vectors whose `nprobe` nearest centroids include the row's cluster (all of them when nprobe >= k);
    the most similar such one, the lowest pair_id among equals. The full rows x held-out cosine matrix."""
    order = np.argsort(held_ids, kind="stable")
    held_x, held_ids = np.asarray(held_x, np.float64)[order], held_ids[order]
    probes = np.argsort(-(held_x @ np.asarray(centroids, np.float64).T), axis=1)[:, :nprobe]
    sims = np.asarray(x, np.float64) @ held_x.T
    out = {}
    for i in range(len(x)):
        routed = (probes == cluster[i]).any(axis=1)
        candidates = np.where(routed, sims[i], -np.inf)
        j = int(np.argmax(candidates))
        if candidates[j] >= threshold:
            out[i] = (int(held_ids[j]), float(candidates[j]))
    return out


def brute_force_exact(texts: list[str], pair_ids: np.ndarray, cos: np.ndarray, rule: str, seed: int
                      ) -> dict[int, int]:
    """{removed pair_id: the kept pair_id with the same normalised text}, by a dict in keep order."""
    order = core.keep_order(pair_ids, core.keep_rank(pair_ids, cos, rule, seed))
    first: dict[str, int] = {}
    removed = {}
    for j in order:
        key = core.normalised(texts[j])
        if key in first:
            removed[int(pair_ids[j])] = first[key]
        else:
            first[key] = int(pair_ids[j])
    return removed


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def planted_vectors(n: int, d: int, k: int, copies: int, seed: int = 0, noise: float = 0.02
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x fp16-representable unit vectors, cluster, source row of each planted copy or -1): n clustered rows then
    `copies` near-duplicates (cosine ~0.99+) of random earlier rows, in their source's cluster."""
    rng = np.random.default_rng(seed)
    centers = unit(rng.standard_normal((k, d)))
    cluster = rng.integers(k, size=n)
    x = unit(centers[cluster] + 0.8 * rng.standard_normal((n, d)) / np.sqrt(d))
    source = rng.integers(n, size=copies)
    near = unit(x[source] + noise * rng.standard_normal((copies, d)) / np.sqrt(d))
    x = np.concatenate([x, near]).astype(np.float16).astype(np.float32)
    return x, np.r_[cluster, cluster[source]], np.r_[np.full(n, -1), source]
