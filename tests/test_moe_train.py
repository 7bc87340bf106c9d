"""`clusterscale train` with the MoE adapter on local Ray (2 DDP ranks, GradCache): it trains, the experts
diverge, and the exported model loads back through clusterscale's own loader (as evaluate and embed do)."""
from __future__ import annotations

import json
import math

import torch

from clusterscale import config as config_mod
from clusterscale.modeling.encoder import Encoder
from clusterscale.pipeline import run_stage
from clusterscale.modeling.moe import moe_layers
from tests.conftest import make_pairs
from tests.train_data import make_sharded_run, train_overrides


def test_moe_run_trains_and_exports_a_loadable_model(tmp_path, tiny_model, ray_local):
    run = make_sharded_run(tmp_path / "run")
    cfg = config_mod.load(None, train_overrides(tiny_model, steps=4) + [
        "train.name=moe", "train.moe_experts=3", "train.moe_top_k=1", "train.grad_cache_chunk=3"])
    run_stage("train", cfg, run)
    metrics = [json.loads(line) for line in run.read_bytes("train/moe/metrics.jsonl").decode().splitlines()]
    assert len(metrics) == 4 and all(math.isfinite(m["loss"]) for m in metrics)
    model_dir = run.path("train/moe/model")
    assert json.loads(open(f"{model_dir}/config.json").read())["clusterscale_moe"]["experts"] == 3
    encoder = Encoder(model_dir, device="cpu")
    layers = moe_layers(encoder.model)
    assert len(layers) == 2
    # trained copies of one dense layer are no longer identical
    assert any(not torch.equal(layer.experts[0].weight, layer.experts[1].weight) for layer in layers)
    vectors = encoder.encode(make_pairs(4, seed=1).column("p").to_pylist())
    assert vectors.shape == (4, 32) and abs(float((vectors ** 2).sum(1).mean()) - 1) < 1e-5
