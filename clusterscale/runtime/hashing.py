"""Stable hashes of pair ids (fit samples, evaluation picks) and of texts (masking equal texts), and the
seeded permutation that places rows in the random shard sets (their writer) and orders blocks in a schedule.

numpy only: k-means workers import it and must not load torch or Ray Data.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

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


GROUP_SALT = 0x5A4D  # sub-group keys must not correlate with the fit-sample keys (salt = seed)


def sub_groups(pair_ids: np.ndarray, num_groups: np.ndarray, seed: int) -> np.ndarray:
    """The sub-group of each row (of a shard split into num_groups groups of files): a seeded hash of its pair_id,
    so any number of workers agrees on it."""
    return np.minimum(hash_unit(pair_ids, salt=seed ^ GROUP_SALT) * num_groups, num_groups - 1).astype(np.int64)


def text_hashes(texts: list[str]) -> np.ndarray:
    """Stable int64 keys of texts: equal texts (after ingest normalisation) get equal keys."""
    return np.array([int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little", signed=True)
                     for t in texts], dtype=np.int64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): the Feistel round function."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class SeededPermutation:
    """A pseudo-random permutation of range(n), evaluated at any positions in O(1) memory.

    A 4-round Feistel network over the smallest even-bit domain >= n; values that land at or past n
    are encrypted again (cycle walking), which keeps it a bijection of range(n). Seeded by `key`."""

    ROUNDS = 4

    def __init__(self, n: int, key: Sequence[int]):
        self.n = int(n)
        self.half = max(1, (max(self.n - 1, 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng([int(k) for k in key]).integers(0, 2 ** 63, self.ROUNDS, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << shift) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._encrypt(np.asarray(positions, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)
