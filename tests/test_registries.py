"""The registries of the choices users extend (knobs.Registry): samplers (train/samplers/), losses (train/losses/),
dedup keep rules (runtime/keep_rules/). A new choice is a class its module registers; the config then accepts its name, an unknown
name is refused naming every registered one, and the code that uses the choice calls the registered class.
tests/test_extending.py trains with a sampler added this way."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from clusterscale import arm_costs, config
from clusterscale.config import ConfigError, DedupConfig
from clusterscale.config.sections import KEEP_RULES
from clusterscale.knobs import Registry
from clusterscale.stages.dedup import heldout_keys, mark_rows, resolve_exact
from clusterscale.runtime.keep_rules import KeepRule
from clusterscale.train import samplers, schedule
from clusterscale.train.loss_config import LOSSES, LossConfig
from clusterscale.train.losses import Loss, LossInputs
from clusterscale.train.losses.infonce import info_nce_of
from clusterscale.train.schedule_config import SAMPLERS


def test_the_built_ins_are_registered_in_their_order_and_unknown_names_are_refused_by_name():
    assert SAMPLERS.names()[:5] == ("clustered", "random", "random_clusters", "source", "curriculum")
    assert KEEP_RULES.names()[:3] == ("hard", "easy", "random")
    assert LOSSES.names()[:2] == ("infonce", "clp")
    with pytest.raises(ConfigError, match=r"train.sampler must be one of clustered, random, .*clusterscale/train/"
                                          r"samplers/"):
        SAMPLERS.get("clusterd")
    with pytest.raises(ConfigError, match="dedup.keep must be one of hard, easy, random"):
        config.load(None, ["dedup.keep=longest"])


def test_a_name_is_registered_once():
    registry = Registry("x.y", "clusterscale.runtime.keep_rules")

    class A:
        name = "a"

    class B:
        name = "a"

    assert registry.register(A) is A and registry.register(A) is A  # the same class again: a re-import
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(B)
    with pytest.raises(TypeError, match="needs a non-empty `name`"):
        registry.register(object())


@pytest.mark.parametrize("name, sets, needs", [
    ("clustered", ("clustered",), ["ingest", "embed", "fit", "assign", "shard"]),
    ("random", ("random",), ["ingest", "shard:random"]),
    ("random_clusters", ("random_clusters",), ["ingest", "embed", "fit", "assign", "shard", "shard:random_clusters"]),
    ("source", ("source",), ["ingest", "shard:source"]),
    ("curriculum", ("clustered", "random"), ["ingest", "embed", "fit", "assign", "shard", "shard:random"])])
def test_each_built_in_sampler_declares_its_sets_and_preprocessing(name, sets, needs):
    """What the built-ins declare: the sets training reads (the dedup set with train.dedup) and the preprocessing an
    arm with them needs (arm_costs), the same as before the registry."""
    cfg = config.load(None, [f"train.sampler={name}"])
    assert samplers.training_sets(name, False) == sets and samplers.training_sets(name, True) == ("dedup",)
    assert arm_costs.arm_stages(cfg) == needs
    assert samplers.sampler(name).writes_set() == (name in ("random", "random_clusters", "source"))


def test_an_epoch_is_counted_by_the_last_set_s_sampler():
    """The curriculum's epoch and its unused pairs are the random shuffle's (one stratum of every row)."""
    sc = config.load(None, ["train.global_batch_size=8"]).train.schedule
    assert samplers.sampler("curriculum").epoch_sampler().name == "random"
    assert samplers.unused_pairs("curriculum", sc, [45]) == 45 % 8
    assert samplers.unused_pairs("clustered", sc, [9, 13]) == 1 + 5
    with pytest.raises(ConfigError, match="train.sampler must be one of"):
        schedule.Schedule([10], 4, "nonesuch", 0)


class Longest(KeepRule):
    """Keep the pair with the longest passage (a rule of the user's own)."""
    name = "longest"
    doc = "the pair with the longest passage stays"
    columns = ("pair_id", "passage")

    def rank(self, rows: pa.Table, seed: int) -> np.ndarray:
        return -np.asarray(pc.utf8_length(rows.column("passage")).to_numpy(), np.float64)


@pytest.fixture
def longest_registered():
    KEEP_RULES.register(Longest)
    try:
        yield
    finally:
        KEEP_RULES.unregister("longest")


def test_a_registered_keep_rule_decides_which_duplicate_stays(longest_registered):
    """dedup.keep=longest is accepted, and exact dedup by query keeps each group's longest passage: the rule sees
    every column of the rows (here `passage`, which the built-ins never read)."""
    dc = config.load(None, ["dedup.keep=longest", "dedup.exact=true", "dedup.key=query"]).dedup
    assert isinstance(dc, DedupConfig) and dc.keep == "longest"
    passages = ["short", "a much longer passage", "mid length", "x", "the longest passage of this group"]
    rows = pa.table({"pair_id": pa.array([0, 1, 2, 3, 4], pa.int64()), "query": ["a", "a", "a", "b", "b"],
                     "passage": passages, "cluster": pa.array([0] * 5, pa.int32()),
                     "cos": pa.array([0.1, 0.9, 0.5, 0.2, 0.8], pa.float32())})
    no_heldout = heldout_keys(pa.table({"pair_id": pa.array([], pa.int64()), "query": pa.array([], pa.string()),
                                        "passage": pa.array([], pa.string())}))
    marked = mark_rows(rows, dc, no_heldout, np.zeros(1, np.int64), np.zeros(1, np.int64))
    out = resolve_exact(marked).sort_by("pair_id")
    kept = [pid for pid, reason in zip(out.column("pair_id").to_pylist(), out.column("reason").to_pylist())
            if reason == 0]
    assert kept == [1, 4]
    hard = mark_rows(rows, DedupConfig(exact=True, key="query"), no_heldout, np.zeros(1, np.int64),
                     np.zeros(1, np.int64))
    out = resolve_exact(hard).sort_by("pair_id")
    assert [p for p, r in zip(out.column("pair_id").to_pylist(), out.column("reason").to_pylist()) if r == 0] == [0, 3]


class Scaled(Loss):
    """Twice InfoNCE (a loss of the user's own, by its class and registration only)."""
    name = "scaled_infonce"
    doc = "2 x InfoNCE"

    def __call__(self, x: LossInputs, objective):
        loss, stats = info_nce_of(x, objective)
        return 2 * loss, stats

    def chance(self, infonce_chance: float, objective) -> float:
        return 2 * infonce_chance


@pytest.fixture
def scaled_registered():
    LOSSES.register(Scaled)
    try:
        yield
    finally:
        LOSSES.unregister(Scaled.name)


def test_a_registered_loss_is_what_the_step_minimises(scaled_registered, tiny_model):
    """train.loss=scaled_infonce is accepted, and contrastive_backward computes it: twice InfoNCE's loss and
    gradients on the same batch, and the collapse guard's chance level is its own."""
    import torch

    from clusterscale.train.metrics import chance_loss
    from clusterscale.train.step import contrastive_backward
    from tests.test_train_grad import _grads, _model, _settings, _texts

    assert config.load(None, ["train.loss=scaled_infonce"]).train.objective.loss == "scaled_infonce"
    results = {}
    for name in ("infonce", "scaled_infonce"):
        model, tokenizer = _model(tiny_model, dropout=False)
        loss, _ = contrastive_backward(model, tokenizer, *_texts(), _settings(loss=name), torch.device("cpu"))
        results[name] = float(loss), _grads(model)
    assert results["scaled_infonce"][0] == pytest.approx(2 * results["infonce"][0], rel=1e-6)
    assert torch.allclose(results["scaled_infonce"][1], 2 * results["infonce"][1], rtol=1e-5, atol=1e-7)
    assert chance_loss(16, LossConfig(loss="scaled_infonce")) == pytest.approx(2 * np.log(16))
