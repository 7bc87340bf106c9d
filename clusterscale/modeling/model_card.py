"""The model card (README.md) of an exported model, train/<name>/model/README.md: what it was trained from and
on, how, and its held-out metrics once known. Written at export by `clusterscale train`; `clusterscale
evaluate` (held-out and --mteb) rewrites it with the metrics it measured.
"""
from __future__ import annotations

import os

from clusterscale.config import Config
from clusterscale.io.layout import eval_path, model_dir, mteb_eval_path, train_dir
from clusterscale.io.rundir import RunDir

BUNDLED_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"  # what train.init=bundled is a copy of


def _base_model(cfg: Config) -> str:
    student = cfg.train.student
    if student.init == "scratch":
        return (f"none: BERT from scratch ({student.scratch_num_layers} layers, hidden {student.scratch_hidden_size}), "
                f"tokenizer `{student.tokenizer}`")
    return f"`{student.init}`"


def _exported_pooling(run: RunDir, name: str) -> str:
    """The pooling the export uses (train.pooling may say 'auto')."""
    rel = f"{model_dir(name)}/1_Pooling/config.json"
    pooling = run.read_json(rel) if run.exists(rel) else {}
    return "CLS" if pooling.get("pooling_mode_cls_token") else "mean" if pooling.get("pooling_mode_mean_tokens") else "?"


def _hub_base_model(init: str) -> list[str]:
    """The card's `base_model:` line: the hub only accepts a model id there, not a local folder or a URI."""
    from clusterscale.modeling.encoder import BUNDLED  # here: the card's importers (mteb_eval) stay free of torch

    hub_id = BUNDLED_HUB_ID if init == BUNDLED else init
    if init == "scratch" or "://" in hub_id or os.path.exists(os.path.expanduser(hub_id)):
        return []
    return [f"base_model: {hub_id}"]


def _metrics_lines(run: RunDir, name: str) -> list[str]:
    rows = [(label, run.read_json(rel)) for label, rel in (("this model", eval_path(name)),
                                                          ("frozen encoder (reference)", eval_path("frozen")))
            if run.exists(rel)]
    lines = []
    if rows:
        keys = list(rows[0][1]["metrics"])
        lines += ["| model | queries | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        lines += [f"| {label} | {r.get('num_queries', '')} | " + " | ".join(f"{r['metrics'][k]:.4f}" for k in keys)
                  + " |" for label, r in rows]
    if run.exists(mteb_eval_path(name)):
        tasks = run.read_json(mteb_eval_path(name))["tasks"]
        lines += ["", "MTEB retrieval, NDCG@10: " + ", ".join(
            f"{task} {scores['ndcg_at_10']:.4f}" for task, scores in sorted(tasks.items()) if "ndcg_at_10" in scores)]
    return lines or ["Not evaluated yet: `clusterscale evaluate` (same config and --run-dir) adds the held-out "
                     "metrics here."]


def model_card(cfg: Config, run: RunDir, name: str) -> str:
    tc, stats = cfg.train, run.done_stats(train_dir(name)) if run.exists(train_dir(name), "_DONE.json") else {}
    pairs = run.done_stats("pairs").get("pairs") if run.exists("pairs", "_DONE.json") else None
    steps = stats.get("steps", tc.schedule.steps)
    return "\n".join([
        "---", "library_name: sentence-transformers", "pipeline_tag: sentence-similarity",
        "tags: [sentence-transformers, feature-extraction, clusterscale]", *_hub_base_model(tc.student.init), "---",
        f"# {name}", "",
        "A text-embedding model trained with clusterscale: contrastive (InfoNCE, in-batch negatives) training "
        "where every global batch is drawn from one stratum of the data.", "",
        "| | |", "|---|---|",
        f"| base model | {_base_model(cfg)} |",
        f"| data | `{cfg.data.path}`: {pairs if pairs is not None else '?'} training pairs |",
        f"| clusters | k={cfg.cluster.k} (spherical k-means over `{cfg.embed.model}` embeddings) |",
        f"| sampler | {tc.schedule.sampler} ({tc.schedule.cluster_weighting}) |",
        f"| steps | {steps} x {tc.schedule.global_batch_size} pairs, lr {tc.optimizer.lr:g} -> "
        f"{tc.optimizer.final_lr:g}, "
        f"{tc.optimizer.warmup_steps} warm-up steps, temperature {tc.objective.temperature:g} |",
        f"| pooling, lengths | {_exported_pooling(run, name)}, query {tc.student.query_max_length} / passage "
        f"{tc.student.passage_max_length} tokens |",
        f"| seed | {tc.schedule.seed} |", "",
        "## Held-out retrieval", "", *_metrics_lines(run, name), "",
        "## Use", "", "```python", "from sentence_transformers import SentenceTransformer", "",
        "model = SentenceTransformer(\"PATH/TO/THIS/FOLDER\")", *_use_lines(tc), "```", ""])


def _use_lines(tc) -> list[str]:
    """How to encode as the model was trained: with its prompts (train.query_prompt / passage_prompt) when it has
    them, and at each Matryoshka size it was trained for."""
    lines = ["queries = model.encode([\"a query\"], prompt_name=\"query\")  # prompt " + repr(tc.student.query_prompt),
             "passages = model.encode([\"a passage\"], prompt_name=\"passage\")  # prompt "
             + repr(tc.student.passage_prompt)] if tc.student.query_prompt or tc.student.passage_prompt else [
        "vectors = model.encode([\"a query\", \"a passage\"])  # L2-normalised: cosine = dot product"]
    dims = [d for d, _ in tc.objective.matryoshka_terms()]
    if dims:
        lines.append(f"small = SentenceTransformer(\"PATH/TO/THIS/FOLDER\", truncate_dim={dims[0]})  # trained at "
                     f"{', '.join(map(str, dims))} dimensions too (Matryoshka)")
    return lines


def write_model_card(cfg: Config, run: RunDir, name: str) -> None:
    """(Re)write train/<name>/model/README.md; a no-op when the model was not exported."""
    if run.exists(model_dir(name), "config.json"):
        run.write_text(f"{model_dir(name)}/README.md", model_card(cfg, run, name))
