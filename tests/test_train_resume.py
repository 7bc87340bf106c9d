"""Ray Train on local Ray: a run with an injected worker failure, then stopped and resumed, sees exactly the
batches (and losses) of an uninterrupted run; other samplers, GradCache and the MoE adapter run through the
same loop."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from clusterscale import config as config_mod
from clusterscale.io.layout import batches_path, model_dir, train_dir
from clusterscale.modeling.encoder import Encoder
from clusterscale.modeling.moe import moe_layers
from clusterscale.pipeline import run_stage
from clusterscale.train.metrics import read_metrics
from tests.conftest import make_pairs
from tests.train_data import make_sharded_run, train_overrides

STEPS = 8


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_sharded_run(tmp_path_factory.mktemp("train") / "run", row_group_rows=4)  # the shard stage's layout


def _cfg(model: str, name: str, *extra: str):
    return config_mod.load(None, train_overrides(model, steps=STEPS) + [f"train.name={name}", *extra])


def _jsonl(run, rel):
    return [json.loads(line) for line in run.read_bytes(rel).decode().splitlines() if line]


def _batches(run, name):
    return [[(r["step"], r["pair_ids"]) for r in _jsonl(run, batches_path(name, rank))]
            for rank in (0, 1)]


@pytest.fixture(scope="module")
def uninterrupted(sharded, tiny_model, ray_local):
    run_stage("train", _cfg(tiny_model, "full"), sharded)
    return _batches(sharded, "full"), read_metrics(sharded, "full")


def _assert_same_run(run, name, uninterrupted):
    batches, metrics = uninterrupted
    assert _batches(run, name) == batches
    got = read_metrics(run, name)
    assert [m["step"] for m in got] == list(range(STEPS))
    for a, b in zip(got, metrics):
        assert a["cluster"] == b["cluster"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"])  # same weights, optimizer state, dropout
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9)
    assert run.exists(model_dir(name), "model.safetensors") and run.exists(train_dir(name), "_DONE.json")
    assert not run.exists(train_dir(name), "ray")  # train.keep_checkpoint=false: deleted after the final export


def test_a_failed_worker_and_a_stop_then_resume_continue_with_the_same_batches(sharded, tiny_model, uninterrupted):
    """A worker fails at step 3 (Ray Train restarts the group from the step-2 checkpoint), the run stops after step 5
    and is resumed: the uninterrupted clustered run's batches, losses and learning rates. The run is the curriculum
    sampler at p = 1 (start = end = 1), which is the clustered schedule batch for batch (it reads the clustered shards
    through the curriculum's two sets; the random set is written on demand). Metrics-only reports (every step)
    between the checkpoints must not disturb the restart. The resume is compare's (an arm stopped midway with the
    same config continues by itself: `train --resume` underneath); with another config it would train afresh."""
    from clusterscale.experiments import _train
    from clusterscale.pipeline import STAGES
    from clusterscale.stages.train import stopped_attempt

    keys = ("train.sampler=curriculum", "train.curriculum_start=1", "train.curriculum_end=1",
            "train.checkpoint_every_steps=2", "train.max_failures=1", "train.log_every_steps=1")
    stats = run_stage("train", _cfg(tiny_model, "resumed", *keys, "train.stop_after_steps=5"), sharded,
                      fail_at_step=3).stats
    assert stats["stopped_at_step"] == 5 and not sharded.exists("train/resumed/_DONE.json")
    assert sharded.exists("train/resumed/ray")  # unfinished: the checkpoint stays for --resume
    assert len(_jsonl(sharded, "train/resumed/batches/rank-0.jsonl")) == 5  # the steps redone after the restart once
    cfg, other = _cfg(tiny_model, "resumed", *keys), _cfg(tiny_model, "resumed", *keys, "train.lr=5e-4")
    assert stopped_attempt(sharded, "resumed") == STAGES["train"].fingerprint_of(cfg, sharded)
    assert stopped_attempt(sharded, "resumed") != STAGES["train"].fingerprint_of(other, sharded)
    attempt = os.stat(sharded.path("train/resumed/_ATTEMPT.json")).st_mtime_ns
    _train(cfg, sharded, {})
    _assert_same_run(sharded, "resumed", uninterrupted)
    assert os.stat(sharded.path("train/resumed/_ATTEMPT.json")).st_mtime_ns == attempt  # continued, not begun anew
    assert stopped_attempt(sharded, "resumed") is None  # done
    # stopped before Ray Train registered a checkpoint (a start-up, a first step): nothing to continue, starts afresh
    sharded.makedirs("train/early/ray/ray-train")
    sharded.write_json("train/early/_ATTEMPT.json", {"fingerprint": STAGES["train"].fingerprint_of(cfg, sharded)})
    assert stopped_attempt(sharded, "early") is None


def test_moe_with_the_source_sampler_uniform_weighting_and_gradcache(sharded, tiny_model, ray_local):
    """The MoE adapter (3 experts, top 1) on 2 DDP ranks with the source sampler, uniform cluster weighting and
    GradCache: every step's batch is one source, the metrics are complete, the experts diverge, and the exported
    model loads back through clusterscale's own loader (as evaluate and embed do)."""
    import pyarrow.parquet as pq

    run_stage("train", _cfg(tiny_model, "source", "train.sampler=source", "train.cluster_weighting=uniform",
                            "train.grad_cache_chunk=3", "train.steps=4", "train.moe_experts=3", "train.moe_top_k=1"),
              sharded)
    source_of = {}
    for rows in sharded.read_json("shards/k=4/manifest.json")["clusters"]:
        for f in rows["files"]:
            t = pq.read_table(sharded.path(f), columns=["pair_id", "source"])
            source_of.update(zip(t.column("pair_id").to_pylist(), t.column("source").to_pylist()))
    metrics = read_metrics(sharded, "source")
    for (step0, ids0), (step1, ids1), m in zip(*_batches(sharded, "source"), metrics):
        assert {source_of[p] for p in ids0 + ids1} == {m["cluster_name"]}
    for m in metrics:
        assert m["mfu"] is not None and 0 < m["mfu"] < 1 and m["tokens"] > 0 and m["tflops_per_s"] > 0
        assert set(m) >= {"step", "epoch", "cluster", "loss", "lr", "grad_norm", "neg_cos_mean", "neg_cos_max",
                          "pos_cos", "masked_false_negatives", "pairs_per_s", "bytes_read", "bytes_used"}
        assert m["bytes_used"] > 0
    logged = _jsonl(sharded, "train/source/metrics.jsonl")
    assert len(logged) == 4 and all(math.isfinite(m["loss"]) for m in logged)

    model = sharded.path(model_dir("source"))
    assert json.loads(open(f"{model}/config.json").read())["clusterscale_moe"]["experts"] == 3
    encoder = Encoder(model, device="cpu")
    layers = moe_layers(encoder.model)
    assert len(layers) == 2
    # trained copies of one dense layer are no longer identical
    assert any(not torch.equal(layer.experts[0].weight, layer.experts[1].weight) for layer in layers)
    vectors = encoder.encode(make_pairs(4, seed=1).column("p").to_pylist())
    assert vectors.shape == (4, 32) and abs(float((vectors ** 2).sum(1).mean()) - 1) < 1e-5


def test_curriculum_on_two_ranks_reads_what_one_process_reads(sharded, tiny_model, ray_local):
    """A mixed curriculum (p from 0 to 1 over the run): each step's two rank slices make up the global batch that
    the schedule gives one process (tests/test_curriculum.py: at p = 1 it is the clustered schedule, at p = 0 the
    random one, and a resume anywhere draws the same batches), read from the clustered shards or the random set."""
    import numpy as np

    from clusterscale.io.layout import shard_set_manifest
    from clusterscale.train.samplers.curriculum import Curriculum
    from clusterscale.train.data import ShardReader, StackedReader, schedule_block_rows

    run_stage("train", _cfg(tiny_model, "mix", "train.sampler=curriculum", "train.curriculum_end=1", "train.steps=6"),
              sharded)
    sets = [shard_set_manifest(sharded, 4, 16, name) for name in ("clustered", "random")]
    plan = list(Curriculum(sets[0].strata_sizes, sets[1].strata_sizes, 16, 0, 0.0, 1.0, 0, 6, "proportional",
                           *(schedule_block_rows(m) for m in sets)).iterate())
    reader = StackedReader([ShardReader(sharded, m) for m in sets])
    expected = [(b.step, reader._read(b, b.shard, b.rows).table.column("pair_id").to_pylist()) for b in plan]
    rank0, rank1 = _batches(sharded, "mix")
    assert [(s, a + b) for (s, a), (_, b) in zip(rank0, rank1)] == expected
    metrics = read_metrics(sharded, "mix")
    assert [m["step"] for m in metrics] == list(range(6)) and np.isfinite([m["loss"] for m in metrics]).all()
    kinds = [m["cluster"] is None for m in metrics]
    assert kinds == [b.group < 0 for b in plan] and any(kinds) and not all(kinds)
