"""random and random_clusters: sets written by a seeded permutation of the clustered shards' rows.

A row at position p of the clustered shards (concatenated in manifest order) lands at perm(p) of the set; strata are
consecutive ranges of that order and sub-groups ranges of `group_rows` inside them (whole row groups, so that only a
stratum's last file ends on a partial row group and a global batch stays whole row groups).
  random           one stratum of every row, globally shuffled (the baseline)
  random_clusters  seeded pseudo-clusters with exactly the cluster shards' sizes (the control: same sizes, no
                   semantics)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from clusterscale.io.records import ShardManifest
from clusterscale.runtime.hashing import SeededPermutation
from clusterscale.train.samplers import Sampler, SetStrata
from clusterscale.train.schedule_config import SAMPLERS


@dataclass(frozen=True)
class PermutedKeys:
    """(stratum, sub-group) of rows by their positions: a seeded permutation, cut at `starts`."""
    total: int
    seed: int
    salt: int
    starts: np.ndarray
    group_rows: int

    def __call__(self, table, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        where = SeededPermutation(self.total, [self.seed, self.salt])(positions)
        shard = np.searchsorted(self.starts, where, side="right") - 1
        return shard, (where - self.starts[shard]) // self.group_rows


class Permuted(Sampler):
    salt = 0

    def stratum_sizes(self, base_sizes: np.ndarray) -> tuple[np.ndarray, list[str]]:
        raise NotImplementedError

    def set_strata(self, cfg, run, base: ShardManifest, row_group_rows: int) -> SetStrata:
        base_sizes = np.array(base.strata_sizes, dtype=np.int64)
        sizes, names = self.stratum_sizes(base_sizes)
        group_rows = max(1, cfg.shard.max_group_rows // row_group_rows) * row_group_rows
        keys = PermutedKeys(int(base_sizes.sum()), cfg.cluster.seed, self.salt,
                            np.concatenate([[0], np.cumsum(sizes)[:-1]]), group_rows)
        return SetStrata(keys, sizes, names, group_rows)


@SAMPLERS.register
class Random(Permuted):
    name = "random"
    doc = "the global-shuffle baseline: every row in one stratum, globally shuffled"
    sets = ("random",)
    needs_clustering = False  # a user's baseline only shuffles (here its set is written from the clustered shards)
    global_shuffle = True
    salt = 0x7A11D0

    def stratum_sizes(self, base_sizes: np.ndarray) -> tuple[np.ndarray, list[str]]:
        return np.array([int(base_sizes.sum())]), ["random"]


@SAMPLERS.register
class RandomClusters(Permuted):
    name = "random_clusters"
    doc = "the control: a fixed random partition with the clusters' sizes"
    sets = ("random_clusters",)
    salt = 0x5EED

    def stratum_sizes(self, base_sizes: np.ndarray) -> tuple[np.ndarray, list[str]]:
        return base_sizes, [f"random-{s}" for s in range(len(base_sizes))]
