"""The batch schedule: determinism, one stratum per global batch, lock-step ranks, exact coverage."""
from __future__ import annotations

import numpy as np
import pytest

from clusterscale.train import schedule

STRATA_SAMPLERS = ("clustered", "random", "random_clusters", "source")  # the samplers train/schedule.py draws for

SIZES = [70, 33, 16, 100]
B = 16


def _sizes(sampler, sizes=SIZES):
    """The strata of a sampler's shard set: random's set is one shard of every row."""
    return [sum(sizes)] if sampler == "random" else list(sizes)


def _batches(sampler, epoch=0, weighting="proportional", seed=0, sizes=SIZES):
    return schedule.epoch_global_batches(_sizes(sampler, sizes), B, sampler, seed, epoch, weighting)


def _global_rows(sizes, b: schedule.GlobalBatch) -> np.ndarray:
    offsets = np.cumsum([0] + list(sizes))
    return b.rows + offsets[b.shard]


@pytest.mark.parametrize("sampler", STRATA_SAMPLERS)
@pytest.mark.parametrize("weighting", schedule.WEIGHTINGS)
def test_deterministic_and_seed_dependent(sampler, weighting):
    a, b = _batches(sampler, weighting=weighting), _batches(sampler, weighting=weighting)
    assert [(x.shard, x.group, x.rows.tolist()) for x in a] == [(x.shard, x.group, x.rows.tolist()) for x in b]
    other = _batches(sampler, weighting=weighting, seed=1)
    assert [x.rows.tolist() for x in a] != [x.rows.tolist() for x in other]
    assert [x.rows.tolist() for x in a] != [x.rows.tolist() for x in _batches(sampler, 1, weighting)]


@pytest.mark.parametrize("sampler", ["clustered", "random_clusters", "source"])
def test_every_global_batch_from_one_stratum(sampler):
    for weighting in schedule.WEIGHTINGS:
        for b in _batches(sampler, weighting=weighting):
            assert b.group == b.shard and 0 <= b.rows.min() and b.rows.max() < SIZES[b.shard]
            assert len(b.rows) == B and len(set(b.rows.tolist())) == B
    assert {b.group for b in _batches("random")} == {-1}


@pytest.mark.parametrize("sampler", STRATA_SAMPLERS)
def test_exactly_once_per_epoch_when_proportional(sampler):
    """Each pair in at most one batch per epoch; exactly the full batches of every stratum are used."""
    sizes = _sizes(sampler)
    for epoch in range(3):
        batches = _batches(sampler, epoch)
        rows = np.concatenate([_global_rows(sizes, b) for b in batches])
        assert len(rows) == len(set(rows.tolist()))
        unused = schedule.unused_pairs(sizes, B, sampler, 0, epoch, "proportional")
        assert len(rows) + unused == sum(SIZES) and unused == sum(s % B for s in sizes)
        assert len(batches) == schedule.batches_per_epoch(sizes, B)


@pytest.mark.parametrize("sampler", STRATA_SAMPLERS)
def test_batches_are_whole_row_groups_for_every_sampler(sampler):
    """block_rows = the set's row-group size: a global batch (and a rank's half of it) is whole row groups."""
    sizes, g = _sizes(sampler, [96, 64, 48]), 8
    for b in schedule.epoch_global_batches(sizes, B, sampler, 0, 1, block_rows=g):
        blocks = b.rows.reshape(-1, g)
        assert (blocks[:, 0] % g == 0).all() and (np.diff(blocks, axis=1) == 1).all()


def test_uniform_weighting_draws_strata_equally_and_counts_unused():
    sizes = [400, 48, 32]  # 25, 3 and 2 full batches
    batches = schedule.epoch_global_batches(sizes, B, "clustered", 0, 0, "uniform")
    assert len(batches) == 30
    counts = np.bincount([b.group for b in batches], minlength=3)
    assert counts.min() >= 5  # ~10 each; proportional would give 25 / 3 / 2
    used = set()
    for b in batches:
        used |= set(_global_rows(sizes, b).tolist())
    assert schedule.unused_pairs(sizes, B, "clustered", 0, 0, "uniform") == sum(sizes) - len(used)
    # A small stratum drawn more often than it has batches repeats rows only across reshuffled passes.
    small = [b for b in batches if b.group == 2]
    for first, second in zip(small[:2], small[2:4]):
        assert first.rows.tolist() != second.rows.tolist()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_split_each_batch_and_exhaust_together(world_size):
    per_epoch = schedule.batches_per_epoch(SIZES, B)
    steps = 2 * per_epoch + 3
    per_rank = [list(schedule.iterate(SIZES, B, "clustered", 0, steps)) for _ in range(world_size)]
    assert all(len(r) == steps for r in per_rank)  # every rank runs the same number of steps
    for step in range(steps):
        batch = per_rank[0][step]
        assert {r[step].shard for r in per_rank} == {batch.shard}  # same cluster on every rank
        slices = [per_rank[r][step].rank_rows(r, world_size) for r in range(world_size)]
        assert np.concatenate(slices).tolist() == batch.rows.tolist()
        assert all(len(s) == B // world_size for s in slices)
    assert [b.epoch for b in per_rank[0]] == [s // per_epoch for s in range(steps)]


@pytest.mark.parametrize("sampler", STRATA_SAMPLERS)
def test_resume_from_any_step_continues_the_same_sequence(sampler):
    sizes = _sizes(sampler)
    full = list(schedule.iterate(sizes, B, sampler, 3, 30, weighting="uniform", block_rows=4))
    for start in (0, 7, 11, 25):
        tail = list(schedule.iterate(sizes, B, sampler, 3, 30, start, "uniform", block_rows=4))
        assert [(b.step, b.shard, b.rows.tolist()) for b in tail] == \
               [(b.step, b.shard, b.rows.tolist()) for b in full[start:]]


def test_no_full_batch_is_an_error():
    with pytest.raises(ValueError, match="lower train.global_batch_size"):
        next(schedule.iterate([10, 12], B, "clustered", 0, 5))
