"""The cluster shuffle's partitions: one per cluster, or, for a cluster over dedup.max_group_rows rows, one per
block of it plus one for the held-out vectors routed to it (stages/dedup/blocks.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from clusterscale.runtime.bounded_data import one_key_per_partition
from clusterscale.runtime.hashing import splitmix64


@dataclass(frozen=True)
class BlockPlan:
    """The cluster shuffle's partitions: blocks[c] of cluster id c (1: the cluster is one group, as before), from
    partition first[c] on; a split cluster's held-out vectors go to partition heldout[c] (-1 when not split).
    keys: the stand-in shuffle key of each partition (bounded_data.one_key_per_partition)."""
    blocks: np.ndarray
    first: np.ndarray
    heldout: np.ndarray
    keys: np.ndarray

    @classmethod
    def of(cls, sizes: np.ndarray, max_group_rows: int, semantic: bool) -> BlockPlan:
        """sizes: the rows of each cluster id (0..k; k is the pooled small clusters' id). A split cluster gets a
        held-out partition only with a semantic threshold (held-out vectors are compared only then)."""
        blocks = np.maximum(1, -(-np.asarray(sizes, np.int64) // max(1, max_group_rows)))
        split = blocks > 1
        extra = (split & semantic).astype(np.int64)
        first = np.r_[0, np.cumsum(blocks + extra)[:-1]].astype(np.int64)
        heldout = np.where(split & semantic, first + blocks, -1)
        return cls(blocks, first, heldout, one_key_per_partition(int((blocks + extra).sum())))

    @classmethod
    def whole(cls, clusters: int) -> BlockPlan:
        """One partition per cluster id (no cluster is split)."""
        return cls.of(np.zeros(clusters, np.int64), 1, False)

    @property
    def partitions(self) -> int:
        return len(self.keys)

    @property
    def split(self) -> list[int]:
        return np.flatnonzero(self.blocks > 1).tolist()

    def row_keys(self, clusters: np.ndarray, pair_ids: np.ndarray) -> np.ndarray:
        """The shuffle key of training rows: their cluster's block that their pair_id hashes to."""
        blocks = self.blocks[clusters]
        block = (splitmix64(np.asarray(pair_ids, np.int64)) % blocks.astype(np.uint64)).astype(np.int64)
        return self.keys[self.first[clusters] + block]

    def heldout_keys(self, clusters: np.ndarray) -> np.ndarray:
        """The shuffle key of held-out vectors routed to `clusters`: the cluster's group, or its held-out
        partition when it is split."""
        return self.keys[np.where(self.heldout[clusters] >= 0, self.heldout[clusters], self.first[clusters])]

    def block_of(self, part_key: int) -> tuple[int, int]:
        """(cluster, block) of a training partition's key; block -1 for a split cluster's held-out partition."""
        index = int(np.flatnonzero(self.keys == part_key)[0])
        cluster = int(np.searchsorted(self.first, index, side="right") - 1)
        return cluster, (-1 if index == self.heldout[cluster] else index - int(self.first[cluster]))
