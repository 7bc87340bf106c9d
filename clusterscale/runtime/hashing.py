"""Stable hashes of pair ids (fit samples, evaluation picks) and of texts (masking equal texts).

numpy only: k-means workers import it and must not load torch or Ray Data.
"""
from __future__ import annotations

import hashlib

import numpy as np


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mix of int64 ids: the stable hash behind fit samples and evaluation picks."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_unit(pair_ids: np.ndarray, salt: int = 0) -> np.ndarray:
    """A uniform number in [0, 1) per pair_id, fixed for a given salt."""
    mixed = splitmix64(np.asarray(pair_ids, dtype=np.int64) ^ np.int64(salt))
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def text_hashes(texts: list[str]) -> np.ndarray:
    """Stable int64 keys of texts: equal texts (after ingest normalisation) get equal keys."""
    return np.array([int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little", signed=True)
                     for t in texts], dtype=np.int64)
