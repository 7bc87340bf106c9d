"""curriculum: each global batch from one cluster with a probability that rises linearly
(train.curriculum_start -> train.curriculum_end over train.curriculum_steps), else from the random shuffle.

It reads the two shard sets that already exist (the clustered shards and shards/k=<k>/random/): its strata are the
clustered shards (indices 0..k-1) followed by the random set's (index k), so a GlobalBatch names its set by index.
The batches of either kind are the clustered and the random sampler's own, in their order: the j-th clustered batch
of the curriculum is the clustered sampler's j-th batch (same seed), and likewise for random. So start = end = 1
trains exactly the clustered schedule, start = end = 0 exactly the random one.

Whether step t is clustered is a pure function of (seed, t): a seeded uniform draw u(t) < p(t). A resume at step t
counts the clustered steps before t (one vectorised pass over the draws, O(t) numbers in chunks) and starts each
stream there, so it draws the same batches; every rank computes the same plan, so DDP ranks stay in step.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from clusterscale.train import schedule
from clusterscale.train.samplers import CLUSTERED, Sampler, SetShapes
from clusterscale.train.schedule import GlobalBatch
from clusterscale.train.schedule_config import SAMPLERS, ScheduleConfig

CURRICULUM = "curriculum"
SETS = (CLUSTERED, "random")  # the shard sets it reads, in the order of its strata
_DRAW_SALT = 0xC0B1C  # the seeded draws that pick a batch's kind
_CHUNK = 4096


def probability(steps: np.ndarray, start: float, end: float, ramp_steps: int) -> np.ndarray:
    """p(t): start at step 0, rising (or falling) linearly to `end` at step ramp_steps, `end` from there on."""
    progress = np.minimum(1.0, np.asarray(steps, dtype=np.float64) / ramp_steps) if ramp_steps > 0 else 1.0
    return start + (end - start) * progress


class Curriculum:
    """The curriculum's global batches from the clustered strata sizes and the random set's (one stratum of every
    row). An epoch is the random set's full batches (every pair once, were every batch random)."""

    def __init__(self, cluster_sizes: Sequence[int], random_sizes: Sequence[int], global_batch_size: int, seed: int,
                 start: float, end: float, ramp_steps: int, num_steps: int, weighting: str = "proportional",
                 cluster_block_rows: int = 1, random_block_rows: int = 1):
        self.cluster_sizes, self.random_sizes = list(cluster_sizes), list(random_sizes)
        self.batch, self.seed, self.num_steps, self.weighting = global_batch_size, seed, num_steps, weighting
        self.start, self.end = start, end
        self.ramp_steps = ramp_steps or num_steps  # 0: the ramp spans the run
        self.block_rows = (cluster_block_rows, random_block_rows)
        self.per_epoch = schedule.batches_per_epoch(self.random_sizes, global_batch_size)

    def clustered_steps(self, first: int, stop: int) -> np.ndarray:
        """Whether each step in [first, stop) draws from one cluster."""
        out = []
        for chunk in range(first // _CHUNK, -(-stop // _CHUNK)):
            steps = np.arange(chunk * _CHUNK, (chunk + 1) * _CHUNK)
            draws = np.random.default_rng([self.seed, _DRAW_SALT, chunk]).random(_CHUNK)
            keep = (steps >= first) & (steps < stop)
            out.append((draws < probability(steps, self.start, self.end, self.ramp_steps))[keep])
        return np.concatenate(out) if out else np.zeros(0, dtype=bool)

    def _stream(self, kind: int, start_step: int) -> Iterator[GlobalBatch]:
        sizes = self.cluster_sizes if kind == 0 else self.random_sizes
        return schedule.iterate(sizes, self.batch, SETS[kind], self.seed, self.num_steps, start_step,
                                self.weighting, self.block_rows[kind])

    def iterate(self, start_step: int = 0, stop_step: int | None = None) -> Iterator[GlobalBatch]:
        """Global batches for steps [start_step, stop_step or num_steps); `shard` indexes the clustered shards, then the random
        set's (len(cluster_sizes) + s); `group` is the cluster, -1 for a random batch."""
        done_clustered = int(self.clustered_steps(0, start_step).sum())
        streams = (self._stream(0, done_clustered), self._stream(1, start_step - done_clustered))
        offset = len(self.cluster_sizes)
        stop = self.num_steps if stop_step is None else min(stop_step, self.num_steps)
        for lo in range(start_step, stop, _CHUNK):
            for step, clustered in enumerate(self.clustered_steps(lo, min(lo + _CHUNK, stop)).tolist(), lo):
                got = next(streams[0 if clustered else 1])
                epoch = step // max(1, self.per_epoch)
                if clustered:
                    yield GlobalBatch(step, epoch, got.shard, got.rows, got.shard)
                else:
                    yield GlobalBatch(step, epoch, offset + got.shard, got.rows, -1)


@SAMPLERS.register
class CurriculumSampler(Sampler):
    name = CURRICULUM
    doc = ("each global batch from one cluster with a probability that rises from train.curriculum_start to "
           "train.curriculum_end, else from the random shuffle")
    sets = SETS  # its epoch: the random set's (every pair once, were every batch random)
    cursor_keys = ("curriculum_start", "curriculum_end", "curriculum_steps")  # the ramp decides which batches come

    def batches(self, sc: ScheduleConfig, shapes: SetShapes, seed: int, start: int, stop: int,
                num_steps: int) -> Iterator[GlobalBatch]:
        (clustered, shuffled), (cluster_rows, random_rows) = shapes.sizes, shapes.block_rows
        return Curriculum(clustered, shuffled, sc.global_batch_size, seed, sc.curriculum_start, sc.curriculum_end,
                          sc.curriculum_steps, num_steps, sc.cluster_weighting, cluster_rows,
                          random_rows).iterate(start, stop)
