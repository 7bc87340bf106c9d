"""The curriculum sampler's schedule (no Ray): at p = 1 it is the clustered sampler and at p = 0 the random one, batch
for batch; a resume anywhere draws the same batches; the share of clustered batches follows the ramp; its keys are
validated. (Training with it on Ray, resumed and on 2 ranks: tests/test_train_resume.py; with mined negatives and
the easy-first phase: tests/test_mine.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from clusterscale import config as config_mod
from clusterscale.train import schedule
from clusterscale.train.samplers.curriculum import Curriculum, probability

SIZES, B, STEPS = [40, 33, 70, 25, 9], 8, 70  # more steps than one epoch of either set: epochs roll over
RANDOM_SIZES = [sum(SIZES)]


def _curriculum(start, end, seed=3, ramp=0, weighting="proportional", blocks=(1, 1)):
    return Curriculum(SIZES, RANDOM_SIZES, B, seed, start, end, ramp, STEPS, weighting, *blocks)


def _key(b, shard_offset=0):
    return b.step, b.shard - shard_offset, b.rows.tolist()


@pytest.mark.parametrize("weighting", ["proportional", "uniform"])
@pytest.mark.parametrize("blocks", [(1, 1), (4, 2)])
def test_probability_one_is_the_clustered_sampler_and_zero_the_random_one(weighting, blocks):
    clustered = schedule.iterate(SIZES, B, "clustered", 3, STEPS, 0, weighting, blocks[0])
    assert [_key(b) for b in _curriculum(1, 1, weighting=weighting, blocks=blocks).iterate()] == \
        [_key(b) for b in clustered]
    shuffled = schedule.iterate(RANDOM_SIZES, B, "random", 3, STEPS, 0, weighting, blocks[1])
    got = list(_curriculum(0, 0, weighting=weighting, blocks=blocks).iterate())
    assert [_key(b, len(SIZES)) for b in got] == [_key(b) for b in shuffled]  # the random set's shard follows
    assert {b.group for b in got} == {-1}


@pytest.mark.parametrize("start", [1, 17, 33, 69])
def test_a_resume_anywhere_draws_the_same_batches(start):
    whole = list(_curriculum(0.2, 0.9, ramp=40).iterate())
    assert [_key(b) for b in _curriculum(0.2, 0.9, ramp=40).iterate(start)] == [_key(b) for b in whole[start:]]
    assert [_key(b) for b in _curriculum(0.2, 0.9, ramp=40).iterate(start, start + 5)] == \
        [_key(b) for b in whole[start:start + 5]]


def test_mixed_batches_come_each_from_one_set_and_follow_both_samplers_orders():
    got = list(_curriculum(0.0, 1.0).iterate())
    clustered = [b for b in got if b.shard < len(SIZES)]
    shuffled = [b for b in got if b.shard >= len(SIZES)]
    assert clustered and shuffled
    assert all(b.group == b.shard for b in clustered) and all(b.group == -1 for b in shuffled)
    # The j-th clustered (random) batch of the curriculum is the clustered (random) sampler's j-th batch.
    ref = list(schedule.iterate(SIZES, B, "clustered", 3, STEPS))
    assert [(b.shard, b.rows.tolist()) for b in clustered] == [(b.shard, b.rows.tolist()) for b in ref[:len(clustered)]]
    ref = list(schedule.iterate(RANDOM_SIZES, B, "random", 3, STEPS))
    assert [b.rows.tolist() for b in shuffled] == [b.rows.tolist() for b in ref[:len(shuffled)]]
    assert [b.epoch for b in got] == [s // (sum(SIZES) // B) for s in range(STEPS)]


def test_the_share_of_clustered_batches_follows_the_linear_ramp():
    plan = Curriculum(SIZES, RANDOM_SIZES, B, 0, 0.0, 0.5, 6000, 12000)
    drawn = plan.clustered_steps(0, 12000)
    assert probability(np.array([0, 3000, 6000, 9000]), 0.0, 0.5, 6000).tolist() == [0.0, 0.25, 0.5, 0.5]
    for lo, hi, expected in ((0, 1000, 1 / 24), (2500, 3500, 0.25), (6000, 12000, 0.5)):
        assert abs(drawn[lo:hi].mean() - expected) < 0.04, (lo, hi)
    assert drawn.tolist() == Curriculum(SIZES, RANDOM_SIZES, B, 0, 0.0, 0.5, 6000, 12000).clustered_steps(0, 12000).tolist()
    assert drawn.tolist() != Curriculum(SIZES, RANDOM_SIZES, B, 1, 0.0, 0.5, 6000, 12000).clustered_steps(0, 12000).tolist()


@pytest.mark.parametrize("text, message", [
    ("train.curriculum_start=1.5", "train.curriculum_start is the probability"),
    ("train.curriculum_end=-0.1", "must be in [0, 1]"),
    ("train.curriculum_steps=-1", "train.curriculum_steps must be >= 0"),
    ("train.negatives_curriculum_steps=-3", "train.negatives_curriculum_steps must be >= 0"),
])
def test_bad_curriculum_keys_are_refused(text, message):
    with pytest.raises(config_mod.ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config_mod.load(None, [text])


def test_curriculum_keys_at_their_defaults_leave_fingerprints_as_they_were():
    base = config_mod.load(None, [])
    assert config_mod.load(None, ["train.curriculum_end=0.5", "train.negatives_curriculum_steps=0"]).hash() == base.hash()
    assert config_mod.load(None, ["train.curriculum_end=0.7"]).hash() != base.hash()
    assert config_mod.load(None, ["train.negatives_curriculum_steps=5"]).hash() != base.hash()


def test_easy_first_phase_and_its_refusal_with_clp():
    objective = config_mod.load(None, ["train.negatives_per_query=2", "train.negatives_curriculum_steps=3"]).train.objective
    assert [objective.mined_at(s) for s in range(5)] == [False, False, False, True, True]
    with pytest.raises(config_mod.ConfigError, match="negatives_curriculum_steps"):
        config_mod.load(None, ["train.negatives_per_query=2", "train.loss=clp", "train.negatives_curriculum_steps=3"])


def test_cli_exits_2_on_a_bad_curriculum_value(tmp_path, capsys):
    from clusterscale import cli

    assert cli.main(["train", "--run-dir", str(tmp_path / "run"), "--set", "train.sampler=curriculum",
                     "train.curriculum_start=1.5"]) == 2
    err = capsys.readouterr().err
    assert "train.curriculum_start" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before any work
