"""The collapse guard: a from-scratch CLS student that cannot learn is stopped with the causes named; one that learns is not."""
from __future__ import annotations

import json
import math

import pytest
import torch

from clusterscale import config as config_mod
from clusterscale.config import TrainConfig
from clusterscale.pipeline import run_stage
from clusterscale.stages.train import TrainingCollapsedError
from clusterscale.train.optim import lr_at
from clusterscale.train.loss_config import LossConfig
from clusterscale.train.metrics import CollapseGuard, chance_loss
from clusterscale.modeling.student import build_student
from clusterscale.train.step import contrastive_backward
from tests.conftest import make_pairs
from tests.train_data import make_sharded_run

# A 2-layer hidden-32 BERT from scratch with the paper's recipe (CLS pooling, tau 0.02, lr 4e-4): it does not learn.
SCRATCH = dict(init="scratch", scratch_hidden_size=32, scratch_num_layers=2, scratch_num_heads=2,
               scratch_intermediate_size=64, query_max_length=16, passage_max_length=32, temperature=0.02,
               lr=4e-4, final_lr=4e-5, warmup_steps=4, log_every_steps=4, global_batch_size=32)


def test_guard_needs_both_signs_for_patience_intervals_after_warmup():
    chance = math.log(32)
    guard = CollapseGuard(chance, warmup_steps=4, interval=2, patience=3)
    for step in range(4):  # warm-up: ignored however bad
        assert guard.observe(step, chance + 1, 0.99) is None
    # chance-level loss with diverse embeddings, then low loss with similar ones: neither alone is collapse
    for step, (loss, cos) in enumerate([(chance, 0.5)] * 6 + [(1.0, 0.95)] * 6, start=4):
        assert guard.observe(step, loss, cos) is None
    verdicts = [guard.observe(step, chance, 0.95) for step in range(16, 22)]
    assert verdicts[:-1] == [None] * 5
    assert "looks collapsed at step 22" in verdicts[-1] and "train.pooling=mean" in verdicts[-1]
    assert guard.observe(22, chance, 0.95) is None  # said once


def test_guard_strikes_reset_when_an_interval_learns():
    chance = math.log(16)
    guard = CollapseGuard(chance, warmup_steps=0, interval=1, patience=3)
    seq = [(chance, 0.95), (chance, 0.95), (1.0, 0.95), (chance, 0.95), (chance, 0.95)]
    assert [guard.observe(s, loss, cos) for s, (loss, cos) in enumerate(seq)] == [None] * 5


def test_chance_loss_counts_mined_negatives_and_clp_weight():
    assert chance_loss(64) == pytest.approx(math.log(64))
    assert chance_loss(64, LossConfig(negatives_per_query=1)) == pytest.approx(math.log(128))
    assert chance_loss(64, LossConfig(loss="clp", clp_lambda=0.1, negatives_per_query=1)) == \
        pytest.approx(0.9 * math.log(128))


def _verdict_of_core_loop(steps: int = 28, **overrides) -> str | None:
    """The training step core on 640 topical pairs, its figures fed to the guard as the trainer does."""
    tc = TrainConfig.of(**(SCRATCH | overrides))
    pairs = make_pairs(640)
    queries, passages = pairs.column("q").to_pylist(), pairs.column("p").to_pylist()
    torch.set_num_threads(1)
    model, tokenizer, pooling = build_student(tc)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.optimizer.lr)
    guard = CollapseGuard(chance_loss(tc.schedule.global_batch_size), tc.optimizer.warmup_steps,
                          tc.logging.log_every_steps)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, tc.optimizer, steps)
        rows = slice(step * 32 % 640, step * 32 % 640 + 32)
        optimizer.zero_grad()
        loss, stats = contrastive_backward(model, tokenizer, queries[rows], passages[rows], tc,
                                           torch.device("cpu"), pooling=pooling)
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.optimizer.max_grad_norm)
        optimizer.step()
        verdict = guard.observe(step, float(loss), float(stats["neg_cos_mean"]))
        if verdict:
            return verdict
    return None


def test_scratch_cls_collapses_and_mean_pooling_learns():
    verdict = _verdict_of_core_loop(pooling="cls")
    assert verdict is not None and "CLS pooling" in verdict
    assert _verdict_of_core_loop(pooling="mean") is None


def test_collapsed_run_is_stopped_with_the_message(tmp_path, ray_local, capsys):
    run = make_sharded_run(tmp_path / "run", rows_per_topic=64, global_batch_size=16)
    overrides = [f"train.{k}={v}" for k, v in (SCRATCH | {"global_batch_size": 16, "log_every_steps": 2,
                                                          "warmup_steps": 2, "pooling": "cls"}).items()]
    cfg = config_mod.load(None, ["cluster.k=4", "train.steps=24", "train.num_workers=1"] + overrides)
    with pytest.raises(TrainingCollapsedError, match=r"looks collapsed at step \d+.*train.pooling=mean"):
        run_stage("train", cfg, run)
    record = json.loads(run.read_bytes(f"train/{cfg.train_name()}/collapse.json"))
    assert record["stopped"] and record["step"] < 24
    assert not run.exists(f"train/{cfg.train_name()}", "model") and not run.exists(f"train/{cfg.train_name()}",
                                                                                    "_DONE.json")
    steps_logged = run.read_bytes(f"train/{cfg.train_name()}/metrics.jsonl").decode().splitlines()
    assert len(steps_logged) == record["step"]  # every step up to the stop is logged, none after


def test_report_flags_a_collapsed_run(tmp_path):
    from clusterscale.stages.report import collapse_warnings

    run = make_sharded_run(tmp_path / "run")
    run.write_json("train/a/collapse.json", {"step": 12, "stopped": False, "message": "the run looks collapsed ..."})
    run.write_json("train/b/metrics.jsonl", {})
    lines = collapse_warnings(run)
    assert len(lines) == 1 and "`a` collapsed** at step 12" in lines[0] and "suspect" in lines[0]
