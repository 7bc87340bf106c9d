"""The batch schedule: a pure function of (seed, epoch, step, shard sizes, global batch size, sampler).

Every rank computes the same global batches; rank r reads rows [r*b, (r+1)*b) of each, with
b = global_batch_size / world_size. So all ranks see the same stratum at the same step and run out
together (no DDP hang).

A stratum is the set of rows one global batch may come from:
  clustered        one stratum per shard (the method)
  random           one stratum holding every row (global-shuffle baseline)
  random_clusters  a fixed random partition of all rows with the shards' sizes (control: same
                   sizes, no semantics)
  source           one stratum per value of the shards' `source` column
Row indices are shard-local for `clustered` and global (shards concatenated in manifest order)
otherwise.

Nothing is materialised per epoch: the step order and each stratum's row order are seeded
permutations evaluated on demand (`SeededPermutation`), so a schedule holds O(strata) numbers and
a batch costs O(global batch). A stratum's rows are permuted in blocks of `block_rows` (the shards'
Parquet row-group size for `clustered`): a global batch is then whole row groups, and a rank reads
only the row groups of its slice. Epochs differ by the blocks' order, so by which blocks share a batch.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

SAMPLERS = ("clustered", "random", "random_clusters", "source")
WEIGHTINGS = ("proportional", "uniform")
_DRAW_CHUNK = 4096  # uniform weighting draws strata in seeded chunks of this many steps


@dataclass(frozen=True)
class GlobalBatch:
    step: int
    epoch: int
    shard: int             # index into the manifest's shard list; -1 when rows are global indices
    rows: np.ndarray       # row indices: within the shard, or global (shards concatenated)
    group: int = -1        # the stratum the batch came from (shard, pseudo-cluster or source); -1 random

    def rank_rows(self, rank: int, world_size: int) -> np.ndarray:
        per_rank = len(self.rows) // world_size
        return self.rows[rank * per_rank:(rank + 1) * per_rank]


@dataclass(frozen=True)
class Stratum:
    shard: int                       # shard index when rows are shard-local, else -1
    size: int                        # rows in the stratum
    members: np.ndarray | None = None  # its row indices; None = range(size) (no array held)

    @property
    def rows(self) -> np.ndarray:
        return np.arange(self.size) if self.members is None else self.members

    def take(self, positions: np.ndarray) -> np.ndarray:
        return positions if self.members is None else self.members[positions]


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


def strata(sizes: Sequence[int], sampler: str, seed: int,
           source_codes: np.ndarray | None = None) -> list[Stratum]:
    """The strata of a sampler; `source_codes` (int per global row) is needed for `source`."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    if sampler == "clustered":
        return [Stratum(i, n) for i, n in enumerate(sizes)]
    if sampler == "random":
        return [Stratum(-1, total)]
    if sampler == "random_clusters":
        # Fixed across epochs (like real clusters): one seeded partition, cut to the shards' sizes.
        perm = np.random.default_rng([seed, 0x5EED]).permutation(total)
        bounds = np.cumsum([0] + sizes)
        return [Stratum(-1, n, np.sort(perm[bounds[i]:bounds[i + 1]])) for i, n in enumerate(sizes)]
    if sampler == "source":
        if source_codes is None or len(source_codes) != total:
            raise ValueError(f"train.sampler=source needs one source code per row ({total}), got "
                             f"{None if source_codes is None else len(source_codes)}.")
        order = np.argsort(source_codes, kind="stable")
        codes, starts = np.unique(source_codes[order], return_index=True)
        ends = list(starts[1:]) + [total]
        return [Stratum(-1, int(e - s), np.sort(order[s:e])) for s, e in zip(starts, ends)]
    raise ValueError(f"train.sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}.")


class Schedule:
    """The global batches of every epoch, computed on demand; holds O(strata) numbers.

    Proportional weighting visits every full batch of every stratum once per epoch, in a seeded order;
    uniform weighting draws a stratum uniformly at every step (the j-th draw of a stratum takes its
    j-th batch, with a fresh row order every full pass)."""

    def __init__(self, sizes: Sequence[int], global_batch_size: int, sampler: str, seed: int,
                 weighting: str = "proportional", source_codes: np.ndarray | None = None, block_rows: int = 1):
        self.parts = strata(sizes, sampler, seed, source_codes)
        self.batch, self.sampler, self.seed = global_batch_size, sampler, seed
        self.uniform = weighting == "uniform" and sampler != "random"
        # Blocks keep a global batch on whole row groups; only shard-local rows have row groups to keep.
        self.block_rows = max(1, int(block_rows)) if sampler == "clustered" else 1
        self.full = np.array([p.size // global_batch_size for p in self.parts], dtype=np.int64)
        self.ends = np.cumsum(self.full)
        self.per_epoch = int(self.ends[-1]) if len(self.ends) else 0
        self.eligible = np.flatnonzero(self.full)

    def _stratum_key(self, index: int) -> int:
        return 0x7A11D0 if self.sampler == "random" else index  # the random sampler's historical key

    def ordered(self, epoch: int, stratum: int, cycle: int, positions: np.ndarray) -> np.ndarray:
        """Rows at `positions` of a stratum's row order in (epoch, cycle): its blocks of block_rows rows,
        permuted (the last, partial block stays last)."""
        part, g = self.parts[stratum], self.block_rows
        key = [self.seed, epoch, self._stratum_key(stratum)] + ([cycle] if cycle else [])
        blocks, within = np.divmod(np.asarray(positions, dtype=np.int64), g)
        whole = part.size // g
        inside = blocks < whole
        blocks[inside] = SeededPermutation(whole, key)(blocks[inside])
        return part.take(blocks * g + within)

    def rows(self, epoch: int, stratum: int, cycle: int, index: int) -> np.ndarray:
        """Rows of the index-th global batch of a stratum's row order in (epoch, cycle)."""
        return self.ordered(epoch, stratum, cycle, np.arange(index * self.batch, (index + 1) * self.batch))

    def _plan(self, epoch: int, start: int) -> Iterator[tuple[int, int, int]]:
        """(stratum, cycle, batch index) for the steps of an epoch from `start` on."""
        if self.uniform:
            yield from self._uniform_plan(epoch, start)
            return
        order = None if self.sampler == "random" else SeededPermutation(self.per_epoch, [self.seed, epoch, 0xC1D5])
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
        seen = np.zeros(len(self.parts), dtype=np.int64)  # draws of each stratum so far (replayed on resume)
        first = start // _DRAW_CHUNK
        for chunk in range(first):
            seen += np.bincount(self._draws(epoch, chunk), minlength=len(self.parts))
        for chunk in range(first, -(-self.per_epoch // _DRAW_CHUNK)):
            for i, s in enumerate(self._draws(epoch, chunk).tolist()):
                cycle, index = divmod(int(seen[s]), int(self.full[s]))
                seen[s] += 1
                if chunk * _DRAW_CHUNK + i >= start:
                    yield s, cycle, index

    def epoch(self, epoch: int, start: int = 0) -> Iterator[GlobalBatch]:
        """The global batches of one epoch from step `start` on (step numbers relative to the epoch)."""
        for step, (s, cycle, index) in enumerate(self._plan(epoch, start), start):
            yield GlobalBatch(step, epoch, self.parts[s].shard, self.rows(epoch, s, cycle, index),
                              -1 if self.sampler == "random" else s)

    def unused_pairs(self, epoch: int) -> int:
        """Pairs that no global batch of this epoch contains (remainders; strata never drawn)."""
        if not self.uniform:
            return int(sum(p.size % self.batch for p in self.parts))
        draws = np.zeros(len(self.parts), dtype=np.int64)
        for chunk in range(-(-self.per_epoch // _DRAW_CHUNK)):
            draws += np.bincount(self._draws(epoch, chunk), minlength=len(self.parts))
        return sum(self._unused_in(epoch, s, int(d)) for s, d in enumerate(draws.tolist()))

    def _unused_in(self, epoch: int, s: int, draws: int) -> int:
        size, full = self.parts[s].size, int(self.full[s])
        if draws <= full:  # one pass: distinct rows
            return size - draws * self.batch
        # Beyond one pass, the rows left out of the first pass (< one batch) may come up in later ones.
        left = set(self.ordered(epoch, s, 0, np.arange(full * self.batch, size)).tolist())
        for j in range(full, draws):
            if not left:
                break
            left -= set(self.rows(epoch, s, *divmod(j, full)).tolist())
        return len(left)


def epoch_global_batches(sizes: Sequence[int], global_batch_size: int, sampler: str, seed: int, epoch: int,
                         weighting: str = "proportional", source_codes: np.ndarray | None = None,
                         block_rows: int = 1) -> list[GlobalBatch]:
    """The global batches of one epoch in step order (step numbers relative to the epoch), as a list."""
    return list(Schedule(sizes, global_batch_size, sampler, seed, weighting, source_codes, block_rows).epoch(epoch))


def unused_pairs(sizes: Sequence[int], global_batch_size: int, sampler: str, seed: int, epoch: int = 0,
                 weighting: str = "proportional", source_codes: np.ndarray | None = None, block_rows: int = 1) -> int:
    """Pairs that no global batch of this epoch contains (remainders; strata never drawn)."""
    return Schedule(sizes, global_batch_size, sampler, seed, weighting, source_codes, block_rows).unused_pairs(epoch)


def batches_per_epoch(sizes: Sequence[int], global_batch_size: int, sampler: str,
                      source_codes: np.ndarray | None = None, seed: int = 0) -> int:
    """Steps in one epoch: every full batch of every stratum once (uniform weighting keeps the count)."""
    if sampler == "random":
        return int(sum(sizes)) // global_batch_size
    if sampler in ("clustered", "random_clusters"):
        return int(sum(int(s) // global_batch_size for s in sizes))
    return int(sum(s.size // global_batch_size for s in strata(sizes, sampler, seed, source_codes)))


def total_steps(sizes: Sequence[int], global_batch_size: int, sampler: str, epochs: int, steps: int | None,
                source_codes: np.ndarray | None = None) -> int:
    if steps is not None:
        return steps
    return epochs * batches_per_epoch(sizes, global_batch_size, sampler, source_codes)


def iterate(sizes: Sequence[int], global_batch_size: int, sampler: str, seed: int, num_steps: int,
            start_step: int = 0, weighting: str = "proportional",
            source_codes: np.ndarray | None = None, block_rows: int = 1) -> Iterator[GlobalBatch]:
    """Global batches for steps [start_step, num_steps), cycling epochs as needed, computed one at a time.

    block_rows: the shards' Parquet row-group size (manifest `row_group_rows`) for `clustered`, so a
    rank's slice of a batch is whole row groups; 1 permutes single rows."""
    plan = Schedule(sizes, global_batch_size, sampler, seed, weighting, source_codes, block_rows)
    if plan.per_epoch == 0:
        largest = max((p.size for p in plan.parts), default=0)
        raise ValueError(f"No stratum of train.sampler={sampler} holds a full global batch of {global_batch_size} "
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
