"""The batch schedule: a pure function of (seed, epoch, shard sizes, global batch size, sampler).

Every rank computes the same list of global batches; rank r reads rows [r*b, (r+1)*b) of each, with
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
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

SAMPLERS = ("clustered", "random", "random_clusters", "source")
WEIGHTINGS = ("proportional", "uniform")


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
    shard: int             # shard index when rows are shard-local, else -1
    rows: np.ndarray       # the stratum's row indices (shard-local or global)


def strata(sizes: Sequence[int], sampler: str, seed: int,
           source_codes: np.ndarray | None = None) -> list[Stratum]:
    """The strata of a sampler; `source_codes` (int per global row) is needed for `source`."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    if sampler == "clustered":
        return [Stratum(i, np.arange(n)) for i, n in enumerate(sizes)]
    if sampler == "random":
        return [Stratum(-1, np.arange(total))]
    if sampler == "random_clusters":
        # Fixed across epochs (like real clusters): one seeded partition, cut to the shards' sizes.
        perm = np.random.default_rng([seed, 0x5EED]).permutation(total)
        bounds = np.cumsum([0] + sizes)
        return [Stratum(-1, np.sort(perm[bounds[i]:bounds[i + 1]])) for i in range(len(sizes))]
    if sampler == "source":
        if source_codes is None or len(source_codes) != total:
            raise ValueError(f"train.sampler=source needs one source code per row ({total}), got "
                             f"{None if source_codes is None else len(source_codes)}.")
        order = np.argsort(source_codes, kind="stable")
        codes, starts = np.unique(source_codes[order], return_index=True)
        ends = list(starts[1:]) + [total]
        return [Stratum(-1, np.sort(order[s:e])) for s, e in zip(starts, ends)]
    raise ValueError(f"train.sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}.")


def _stratum_perm(seed: int, epoch: int, index: int, n: int, cycle: int = 0) -> np.ndarray:
    # cycle 0 keeps the original key, so `proportional` batches do not depend on the weighting code.
    key = [seed, epoch, index] if cycle == 0 else [seed, epoch, index, cycle]
    return np.random.default_rng(key).permutation(n)


def _epoch_plan(parts: list[Stratum], global_batch_size: int, sampler: str, seed: int, epoch: int,
                weighting: str) -> list[tuple[int, int, int]]:
    """[(stratum, cycle, batch index within that cycle's permutation)] in step order."""
    full = [len(s.rows) // global_batch_size for s in parts]
    if weighting == "uniform" and sampler != "random":
        eligible = [i for i, n in enumerate(full) if n]
        if not eligible:
            return []
        draws = np.random.default_rng([seed, epoch, 0x0417]).integers(len(eligible), size=sum(full))
        seen = [0] * len(parts)
        plan = []
        for d in draws:  # the j-th draw of a stratum takes its j-th batch, reshuffled every full pass
            s = eligible[int(d)]
            cycle, index = divmod(seen[s], full[s])
            plan.append((s, cycle, index))
            seen[s] += 1
        return plan
    plan = [(s, 0, b) for s, n in enumerate(full) for b in range(n)]
    if sampler == "random":
        return plan
    order = np.random.default_rng([seed, epoch, 0xC1D5]).permutation(len(plan))
    return [plan[i] for i in order]


def _stratum_key(sampler: str, index: int) -> int:
    return 0x7A11D0 if sampler == "random" else index  # the random sampler's historical key


def epoch_global_batches(sizes: Sequence[int], global_batch_size: int, sampler: str, seed: int, epoch: int,
                         weighting: str = "proportional", source_codes: np.ndarray | None = None,
                         parts: list[Stratum] | None = None) -> list[GlobalBatch]:
    """The global batches of one epoch in step order (step numbers relative to the epoch)."""
    parts = parts if parts is not None else strata(sizes, sampler, seed, source_codes)
    perms: dict[tuple[int, int], np.ndarray] = {}
    out = []
    for step, (s, cycle, index) in enumerate(_epoch_plan(parts, global_batch_size, sampler, seed, epoch, weighting)):
        if (s, cycle) not in perms:
            perms[(s, cycle)] = _stratum_perm(seed, epoch, _stratum_key(sampler, s), len(parts[s].rows), cycle)
        chosen = perms[(s, cycle)][index * global_batch_size:(index + 1) * global_batch_size]
        out.append(GlobalBatch(step, epoch, parts[s].shard, parts[s].rows[chosen], -1 if sampler == "random" else s))
    return out


def unused_pairs(sizes: Sequence[int], global_batch_size: int, sampler: str, seed: int, epoch: int = 0,
                 weighting: str = "proportional", source_codes: np.ndarray | None = None) -> int:
    """Pairs that no global batch of this epoch contains (remainders; strata never drawn)."""
    parts = strata(sizes, sampler, seed, source_codes)
    if weighting == "proportional" or sampler == "random":
        return int(sum(len(s.rows) % global_batch_size for s in parts))
    used = [np.zeros(len(s.rows), dtype=bool) for s in parts]
    for s, cycle, index in _epoch_plan(parts, global_batch_size, sampler, seed, epoch, weighting):
        perm = _stratum_perm(seed, epoch, _stratum_key(sampler, s), len(parts[s].rows), cycle)
        used[s][perm[index * global_batch_size:(index + 1) * global_batch_size]] = True
    return int(sum((~u).sum() for u in used))


def batches_per_epoch(sizes: Sequence[int], global_batch_size: int, sampler: str,
                      source_codes: np.ndarray | None = None, seed: int = 0) -> int:
    """Steps in one epoch: every full batch of every stratum once (uniform weighting keeps the count)."""
    if sampler == "random":
        return int(sum(sizes)) // global_batch_size
    if sampler in ("clustered", "random_clusters"):
        return int(sum(int(s) // global_batch_size for s in sizes))
    return int(sum(len(s.rows) // global_batch_size for s in strata(sizes, sampler, seed, source_codes)))


def total_steps(sizes: Sequence[int], global_batch_size: int, sampler: str, epochs: int, steps: int | None,
                source_codes: np.ndarray | None = None) -> int:
    if steps is not None:
        return steps
    return epochs * batches_per_epoch(sizes, global_batch_size, sampler, source_codes)


def iterate(sizes: Sequence[int], global_batch_size: int, sampler: str, seed: int, num_steps: int,
            start_step: int = 0, weighting: str = "proportional",
            source_codes: np.ndarray | None = None) -> Iterator[GlobalBatch]:
    """Global batches for steps [start_step, num_steps), cycling epochs as needed."""
    parts = strata(sizes, sampler, seed, source_codes)
    per_epoch = sum(len(s.rows) // global_batch_size for s in parts)
    if per_epoch == 0:
        largest = max((len(s.rows) for s in parts), default=0)
        raise ValueError(f"No stratum of train.sampler={sampler} holds a full global batch of {global_batch_size} "
                         f"pairs (largest: {largest}): lower train.global_batch_size or cluster.k.")
    step = start_step
    while step < num_steps:
        epoch, offset = divmod(step, per_epoch)
        batches = epoch_global_batches(sizes, global_batch_size, sampler, seed, epoch, weighting, parts=parts)
        for b in batches[offset:]:
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
