"""The batch schedule: a pure function of (seed, epoch, shard sizes, global batch size).

Every rank computes the same list of global batches; rank r reads rows [r*b, (r+1)*b) of each, with
b = global_batch_size / world_size. So all ranks see the same cluster at the same step and run out
together (no DDP hang).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class GlobalBatch:
    step: int
    epoch: int
    shard: int             # index into the manifest's shard list; -1 for the random sampler
    rows: np.ndarray       # row indices: within the shard, or global (shards concatenated) for random

    def rank_rows(self, rank: int, world_size: int) -> np.ndarray:
        per_rank = len(self.rows) // world_size
        return self.rows[rank * per_rank:(rank + 1) * per_rank]


def epoch_batches(sizes: list[int], global_batch_size: int, sampler: str, seed: int, epoch: int
                  ) -> tuple[list[tuple[int, np.ndarray]], int]:
    """([(shard, row indices)] in step order, pairs left unused this epoch)."""
    if sampler == "random":
        total = int(sum(sizes))
        perm = np.random.default_rng([seed, epoch, 0x7A11D0]).permutation(total)
        n = total // global_batch_size
        batches = [(-1, perm[i * global_batch_size:(i + 1) * global_batch_size]) for i in range(n)]
        return batches, total - n * global_batch_size
    batches, unused = [], 0
    for shard, size in enumerate(sizes):
        perm = np.random.default_rng([seed, epoch, shard]).permutation(size)
        n = size // global_batch_size
        unused += size - n * global_batch_size
        batches.extend((shard, perm[i * global_batch_size:(i + 1) * global_batch_size]) for i in range(n))
    order = np.random.default_rng([seed, epoch, 0xC1D5]).permutation(len(batches))
    return [batches[i] for i in order], unused


def batches_per_epoch(sizes: list[int], global_batch_size: int, sampler: str) -> int:
    if sampler == "random":
        return int(sum(sizes)) // global_batch_size
    return int(sum(s // global_batch_size for s in sizes))


def total_steps(sizes: list[int], global_batch_size: int, sampler: str, epochs: int, steps: int | None) -> int:
    return steps if steps is not None else epochs * batches_per_epoch(sizes, global_batch_size, sampler)


def iterate(sizes: list[int], global_batch_size: int, sampler: str, seed: int, num_steps: int,
            start_step: int = 0) -> Iterator[GlobalBatch]:
    """Global batches for steps [start_step, num_steps), cycling epochs as needed."""
    per_epoch = batches_per_epoch(sizes, global_batch_size, sampler)
    if per_epoch == 0:
        raise ValueError(f"No shard holds a full global batch of {global_batch_size} pairs "
                         f"(largest: {max(sizes) if sizes else 0}): lower train.global_batch_size or cluster.k.")
    step = start_step
    while step < num_steps:
        epoch, offset = divmod(step, per_epoch)
        batches, _ = epoch_batches(sizes, global_batch_size, sampler, seed, epoch)
        for shard, rows in batches[offset:]:
            if step >= num_steps:
                return
            yield GlobalBatch(step, epoch, shard, rows)
            step += 1
