"""Shared fixtures: a local Ray, a tiny random BERT saved like a hub model, and tiny topical pair data."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

TOPICS = {
    "astronomy": "star galaxy planet orbit telescope comet nebula moon solar cosmic asteroid eclipse",
    "cooking": "recipe oven flour butter sauce garlic simmer bake pepper onion salad roast",
    "finance": "stock bond interest market price inflation bank loan dividend budget tax credit",
    "football": "goal striker referee league match penalty keeper stadium coach season pass tackle",
}


def make_pairs(n: int, seed: int = 0) -> pa.Table:
    """n (query, passage, source) rows; each topic has its own vocabulary, so clusters exist."""
    rng = np.random.default_rng(seed)
    names = sorted(TOPICS)
    queries, passages, sources = [], [], []
    for i in range(n):
        topic = names[i % len(names)]
        words = TOPICS[topic].split()
        passage = " ".join(rng.choice(words, size=int(rng.integers(12, 30))))
        query = " ".join(rng.choice(passage.split(), size=4)) + f" {i}"
        queries.append(query)
        passages.append(f"{passage} item {i}")
        sources.append(topic)
    return pa.table({"q": queries, "p": passages, "src": sources})


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from clusterscale.config import RayConfig
    from clusterscale.runtime.session import init_ray

    if not ray.is_initialized():
        init_ray(RayConfig(num_cpus=2, include_dashboard=False))  # the CLI's own local start
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A randomly initialised 2-layer BERT (hidden 32) with the bundled uncased vocab, mean pooling."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from clusterscale.modeling.encoder import resolve_model_path, save_sentence_transformers_dir

    out = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("bundled"))
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=128))
    save_sentence_transformers_dir(model, tokenizer, str(out), pooling="mean", max_length=64)
    return str(out)


@pytest.fixture
def pairs_parquet(tmp_path) -> str:
    path = tmp_path / "pairs.parquet"
    pq.write_table(make_pairs(320), path)
    return str(path)


def tiny_overrides(model: str, data_path: str) -> list[str]:
    """A full pipeline in well under a minute: tiny BERT as encoder and student, k=4, 2 workers."""
    return [f"data.path={data_path}", "data.query_column=q", "data.passage_column=p", "data.source_column=src",
            "data.heldout_fraction=0.1", f"embed.model={model}", "embed.max_length=32", "embed.batch_size=32",
            "cluster.k=4", "cluster.niter=10", f"train.init={model}", "train.global_batch_size=16",
            "train.steps=6", "train.query_max_length=16", "train.passage_max_length=32", "train.log_batches=true",
            "train.warmup_steps=2", "train.lr=1e-3", "train.final_lr=1e-4", "eval.num_distractors=100"]


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"
