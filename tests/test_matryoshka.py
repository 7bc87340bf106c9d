"""Matryoshka (issue 54 item 2): train.matryoshka_dims adds the loss on the first d dimensions of every embedding
(re-normalised, weighted), and evaluate scores the student at each d (metrics_by_dim)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clusterscale import config
from clusterscale.config import TrainConfig
from clusterscale.train.loss import info_nce
from clusterscale.train.step import contrastive_backward
from tests.conftest import make_pairs


def test_matryoshka_keys_are_checked():
    cfg = config.load(None, ["train.matryoshka_dims=[32, 16]", "train.matryoshka_weights=[0.5, 1]"])
    assert cfg.train.objective.matryoshka_terms() == [(16, 1.0), (32, 0.5)]
    assert config.load(None, ["train.matryoshka_dims=[8]"]).train.objective.matryoshka_terms() == [(8, 1.0)]
    for keys, match in ((["train.matryoshka_dims=[0]"], "distinct positive integers"),
                        (["train.matryoshka_dims=[8, 8]"], "distinct positive integers"),
                        (["train.matryoshka_dims=[8]", "train.matryoshka_weights=[1, 2]"], "one non-negative")):
        with pytest.raises(config.ConfigError, match=match):
            config.load(None, keys)
    default = config.load(None, [])
    assert default.fingerprint(("train",)) == config.load(None, ["train.matryoshka_dims=[]"]).fingerprint(("train",))


def test_the_step_adds_each_nested_dimensions_loss(tiny_model):
    """contrastive_backward's loss with matryoshka_dims [8, 16] and weights [0.5, 2] is InfoNCE at 32 (the tiny
    BERT's) + 0.5 x InfoNCE on the first 8 dimensions re-normalised + 2 x on the first 16, from the same vectors."""
    from clusterscale.modeling.encoder import load_model, load_tokenizer
    from clusterscale.modeling.student import embed, text_keys

    table = make_pairs(6, seed=5)
    queries, passages = table.column("q").to_pylist(), table.column("p").to_pylist()
    model, tokenizer = load_model(tiny_model).eval(), load_tokenizer(tiny_model)
    tc = TrainConfig.of(temperature=0.05, query_max_length=16, passage_max_length=32, pooling="mean",
                        matryoshka_dims=[16, 8], matryoshka_weights=[2.0, 0.5])
    loss, _ = contrastive_backward(model, tokenizer, queries, passages, tc, torch.device("cpu"))
    with torch.no_grad():
        q = embed(model, tokenizer, queries, 16, "mean", torch.device("cpu"))
        p = embed(model, tokenizer, passages, 32, "mean", torch.device("cpu"))
        keys = (text_keys(queries), text_keys(passages))
        expected = info_nce(q, p, 0.05, *keys)[0]
        for dim, weight in ((8, 0.5), (16, 2.0)):
            expected += weight * info_nce(F.normalize(q[:, :dim], dim=-1), F.normalize(p[:, :dim], dim=-1), 0.05,
                                          *keys)[0]
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    too_big = TrainConfig.of(temperature=0.05, query_max_length=16, passage_max_length=32, pooling="mean",
                             matryoshka_dims=[32])
    with pytest.raises(config.ConfigError, match="not below the model's 32"):
        contrastive_backward(model, tokenizer, queries, passages, too_big, torch.device("cpu"))


class FixedEncoders:
    """EvalEncoders' interface over fixed vectors (no Ray, no model)."""

    def __init__(self, q: np.ndarray, p: np.ndarray):
        self.q, self.p = q, p

    def encode(self, model, pooling, max_lengths, queries, passages, batch_size, prompts=("", "")):
        return self.q[:len(queries)], self.p[:len(passages)]


def test_evaluate_scores_the_student_at_each_nested_dimension(tmp_path):
    from clusterscale.io.rundir import RunDir
    from clusterscale.stages.evaluate import evaluate_model, retrieval_metrics, search, truncated

    rng = np.random.default_rng(0)
    p = rng.standard_normal((40, 12)).astype(np.float32)
    q = p[:10] + 0.8 * rng.standard_normal((10, 12)).astype(np.float32)  # query i's positive is passage i
    q, p = truncated(q, 12), truncated(p, 12)
    eval_set = {"queries": [f"q{i}" for i in range(10)], "pool": [f"p{i}" for i in range(40)],
                "qrels": [{i} for i in range(10)], "sources": [None] * 10, "query_ids": list(range(10))}
    cfg = config.load(None, ["train.matryoshka_dims=[4]"])
    ctx = SimpleNamespace(cfg=cfg, run=RunDir(str(tmp_path / "run")))
    result = evaluate_model(ctx, FixedEncoders(q, p), "student", "m", "mean", eval_set, "fp", dims=(4, 64))
    assert set(result["metrics_by_dim"]) == {"4", "12"}  # 64 is not below 12: the full size is scored once
    assert result["metrics_by_dim"]["12"] == result["metrics"]
    at4 = retrieval_metrics(search(truncated(q, 4), truncated(p, 4), 100), eval_set["qrels"], cfg.eval.k_values)
    assert result["metrics_by_dim"]["4"] == at4 and at4 != result["metrics"]
    assert "metrics_by_dim" not in evaluate_model(ctx, FixedEncoders(q, p), "frozen", "m", "mean", eval_set, "fp2")
