"""The batch schedule: a pure function of (seed, epoch, step, strata sizes, global batch size, sampler).

Every rank computes the same global batches; rank r reads rows [r*b, (r+1)*b) of each, with
b = global_batch_size / world_size. So all ranks see the same stratum at the same step and run out
together (no DDP hang).

A sampler (train/samplers/) trains from shard sets whose shards are its strata (train/data.py,
stages/shard_sets.py); this is the schedule of those that draw one stratum per global batch (clustered,
random_clusters, source), and of the global shuffle (random: one stratum of every row, `global_shuffle`).
Row indices are shard-local for every sampler, so a rank reads only the row groups of its slice.

Nothing is materialised per epoch: the step order and each stratum's row order are seeded
permutations evaluated on demand (`SeededPermutation`), so a schedule holds O(strata) numbers and
a batch costs O(global batch). A stratum's rows are permuted in blocks of `block_rows` (the shards'
Parquet row-group size): a global batch is then whole row groups, and a rank reads only the row
groups of its slice. Epochs differ by the blocks' order, so by which blocks share a batch.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from clusterscale.runtime.hashing import SeededPermutation
from clusterscale.train.schedule_config import SAMPLERS

WEIGHTINGS = ("proportional", "uniform")
_DRAW_CHUNK = 4096  # uniform weighting draws strata in seeded chunks of this many steps


@dataclass(frozen=True)
class GlobalBatch:
    step: int
    epoch: int
    shard: int             # index into the shard set's list of shards (its strata)
    rows: np.ndarray       # row indices within the shard
    group: int = -1        # the stratum the batch came from (shard, pseudo-cluster or source); -1 random

    def rank_rows(self, rank: int, world_size: int) -> np.ndarray:
        per_rank = len(self.rows) // world_size
        return self.rows[rank * per_rank:(rank + 1) * per_rank]


class Schedule:
    """The global batches of every epoch, computed on demand; holds O(strata) numbers.

    Proportional weighting visits every full batch of every stratum once per epoch, in a seeded order;
    uniform weighting draws a stratum uniformly at every step (the j-th draw of a stratum takes its
    j-th batch, with a fresh row order every full pass)."""

    def __init__(self, sizes: Sequence[int], global_batch_size: int, sampler: str | Any, seed: int,
                 weighting: str = "proportional", block_rows: int = 1):
        # sampler: a train/samplers class or instance, or its registered name (unknown: a ConfigError naming them)
        self.whole = bool((SAMPLERS.get(sampler) if isinstance(sampler, str) else sampler).global_shuffle)
        self.sizes = np.asarray([int(n) for n in sizes], dtype=np.int64)
        self.batch, self.sampler, self.seed = global_batch_size, sampler, seed
        self.uniform = weighting == "uniform" and not self.whole
        self.block_rows = max(1, int(block_rows))  # a global batch is whole row groups
        self.full = self.sizes // global_batch_size
        self.ends = np.cumsum(self.full)
        self.per_epoch = int(self.ends[-1]) if len(self.ends) else 0
        self.eligible = np.flatnonzero(self.full)

    def _stratum_key(self, index: int) -> int:
        return 0x7A11D0 if self.whole else index  # the random sampler's historical key

    def ordered(self, epoch: int, stratum: int, cycle: int, positions: np.ndarray) -> np.ndarray:
        """Rows at `positions` of a stratum's row order in (epoch, cycle): its blocks of block_rows rows,
        permuted (the last, partial block stays last)."""
        g = self.block_rows
        key = [self.seed, epoch, self._stratum_key(stratum)] + ([cycle] if cycle else [])
        blocks, within = np.divmod(np.asarray(positions, dtype=np.int64), g)
        whole = int(self.sizes[stratum]) // g
        inside = blocks < whole
        blocks[inside] = SeededPermutation(whole, key)(blocks[inside])
        return blocks * g + within

    def rows(self, epoch: int, stratum: int, cycle: int, index: int) -> np.ndarray:
        """Rows of the index-th global batch of a stratum's row order in (epoch, cycle)."""
        return self.ordered(epoch, stratum, cycle, np.arange(index * self.batch, (index + 1) * self.batch))

    def _plan(self, epoch: int, start: int) -> Iterator[tuple[int, int, int]]:
        """(stratum, cycle, batch index) for the steps of an epoch from `start` on."""
        if self.uniform:
            yield from self._uniform_plan(epoch, start)
            return
        order = None if self.whole else SeededPermutation(self.per_epoch, [self.seed, epoch, 0xC1D5])
        for lo in range(start, self.per_epoch, _DRAW_CHUNK):
            slots = np.arange(lo, min(lo + _DRAW_CHUNK, self.per_epoch))
            slots = slots if order is None else order(slots)
            stratum = np.searchsorted(self.ends, slots, side="right")
            for s, slot in zip(stratum.tolist(), slots.tolist()):
                yield s, 0, slot - int(self.ends[s] - self.full[s])

    def _draws(self, epoch: int, chunk: int) -> np.ndarray:
        size = min(_DRAW_CHUNK, self.per_epoch - chunk * _DRAW_CHUNK)
        picks = np.random.default_rng([self.seed, epoch, 0x0417, chunk]).integers(len(self.eligible), size=size)
        return self.eligible[picks]

    def _uniform_plan(self, epoch: int, start: int) -> Iterator[tuple[int, int, int]]:
        if not len(self.eligible):
            return
        seen = np.zeros(len(self.sizes), dtype=np.int64)  # draws of each stratum so far (replayed on resume)
        first = start // _DRAW_CHUNK
        for chunk in range(first):
            seen += np.bincount(self._draws(epoch, chunk), minlength=len(self.sizes))
        for chunk in range(first, -(-self.per_epoch // _DRAW_CHUNK)):
            for i, s in enumerate(self._draws(epoch, chunk).tolist()):
                cycle, index = divmod(int(seen[s]), int(self.full[s]))
                seen[s] += 1
                if chunk * _DRAW_CHUNK + i >= start:
                    yield s, cycle, index

    def epoch(self, epoch: int, start: int = 0) -> Iterator[GlobalBatch]:
        """The global batches of one epoch from step `start` on (step numbers relative to the epoch)."""
        for step, (s, cycle, index) in enumerate(self._plan(epoch, start), start):
            yield GlobalBatch(step, epoch, s, self.rows(epoch, s, cycle, index), -1 if self.whole else s)

    def unused_pairs(self, epoch: int) -> int:
        """Pairs that no global batch of this epoch contains (remainders; strata never drawn)."""
        if not self.uniform:
            return int((self.sizes % self.batch).sum())
        draws = np.zeros(len(self.sizes), dtype=np.int64)
        for chunk in range(-(-self.per_epoch // _DRAW_CHUNK)):
            draws += np.bincount(self._draws(epoch, chunk), minlength=len(self.sizes))
        return sum(self._unused_in(epoch, s, int(d)) for s, d in enumerate(draws.tolist()))

    def _unused_in(self, epoch: int, s: int, draws: int) -> int:
        size, full = int(self.sizes[s]), int(self.full[s])
        if draws <= full:  # one pass: distinct rows
            return size - draws * self.batch
        # Beyond one pass, the rows left out of the first pass (< one batch) may come up in later ones.
        left = set(self.ordered(epoch, s, 0, np.arange(full * self.batch, size)).tolist())
        for j in range(full, draws):
            if not left:
                break
            left -= set(self.rows(epoch, s, *divmod(j, full)).tolist())
        return len(left)


def epoch_global_batches(sizes: Sequence[int], global_batch_size: int, sampler: str | Any, seed: int, epoch: int,
                         weighting: str = "proportional", block_rows: int = 1) -> list[GlobalBatch]:
    """The global batches of one epoch in step order (step numbers relative to the epoch), as a list."""
    return list(Schedule(sizes, global_batch_size, sampler, seed, weighting, block_rows).epoch(epoch))


def unused_pairs(sizes: Sequence[int], global_batch_size: int, sampler: str | Any, seed: int, epoch: int = 0,
                 weighting: str = "proportional", block_rows: int = 1) -> int:
    """Pairs that no global batch of this epoch contains (remainders; strata never drawn)."""
    return Schedule(sizes, global_batch_size, sampler, seed, weighting, block_rows).unused_pairs(epoch)


def batches_per_epoch(sizes: Sequence[int], global_batch_size: int) -> int:
    """Steps in one epoch: every full batch of every stratum once (uniform weighting keeps the count)."""
    return int(sum(int(s) // global_batch_size for s in sizes))


def total_steps(sizes: Sequence[int], global_batch_size: int, epochs: int, steps: int | None) -> int:
    if steps is not None:
        return steps
    return epochs * batches_per_epoch(sizes, global_batch_size)


def iterate(sizes: Sequence[int], global_batch_size: int, sampler: str | Any, seed: int, num_steps: int,
            start_step: int = 0, weighting: str = "proportional", block_rows: int = 1) -> Iterator[GlobalBatch]:
    """Global batches for steps [start_step, num_steps), cycling epochs as needed, computed one at a time.

    sizes: the rows of each stratum (the shard set's shards); block_rows: their Parquet row-group size
    (manifest `row_group_rows`), so a rank's slice of a batch is whole row groups; 1 permutes single rows."""
    plan = Schedule(sizes, global_batch_size, sampler, seed, weighting, block_rows)
    if plan.per_epoch == 0:
        largest = int(plan.sizes.max()) if len(plan.sizes) else 0
        name = sampler if isinstance(sampler, str) else getattr(sampler, "name", sampler)
        raise ValueError(f"No stratum of train.sampler={name} holds a full global batch of {global_batch_size} "
                         f"pairs (largest: {largest}): lower train.global_batch_size or cluster.k.")
    step = start_step
    while step < num_steps:
        epoch, offset = divmod(step, plan.per_epoch)
        for b in plan.epoch(epoch, offset):
            if step >= num_steps:
                return
            yield GlobalBatch(step, epoch, b.shard, b.rows, b.group)
            step += 1


def segment_seed(seed: int, segment: int) -> int:
    """The schedule seed of a segment; segment 0 keeps the run's seed (same batches as without re-clustering)."""
    if segment == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/segment/{segment}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")
