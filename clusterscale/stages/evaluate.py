"""Evaluate: held-out queries against a passage pool (held-out passages + training-pool distractors).

FAISS inner-product search; NDCG@10, MRR@10 and Recall@k for the frozen encoder and a trained
model; results in eval/<name>.json, and NDCG@10 per cluster (each held-out pair assigned to its
nearest k-means centroid by its frozen embedding) in eval/by_cluster/k=<k>.json.
Run with `clusterscale evaluate [CONFIG] --run-dir R` (`--mteb TASKS` adds MTEB, see mteb_eval.py).
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import pyarrow as pa
import ray

from clusterscale.runtime.vectors import truncated
from clusterscale.runtime.hashing import hash_unit
from clusterscale.stages.eval_set import EVAL_SALT, distractor_passages, heldout_queries
from clusterscale.stages.kmeans import load_centroids
from clusterscale.io.layout import (EVAL, centroids_path, eval_by_cluster_path, eval_clusters_path, eval_path,
                                    model_dir)
from clusterscale.modeling.model_files import frozen_prompts, with_prompt
from clusterscale.modeling.model_card import write_model_card
from clusterscale.runtime.vector_search import build_index, top_k
from clusterscale.runtime.progress import ProgressLine
from clusterscale.runtime.resources import Resources, plan_actors
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.runtime.stage_context import StageContext
from clusterscale.stages.synthetic import synthetic_embeddings


# --- metrics (binary relevance; a query may have several relevant passages) -------------------------
def dcg(ranked: list[int], relevant: set[int], k: int) -> float:
    return sum(1.0 / math.log2(i + 2) for i, doc in enumerate(ranked[:k]) if doc in relevant)


def ndcg_at_k(ranked: list[int], relevant: set[int], k: int) -> float:
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), k)))
    return dcg(ranked, relevant, k) / ideal if ideal else 0.0


def mrr_at_k(ranked: list[int], relevant: set[int], k: int) -> float:
    for i, doc in enumerate(ranked[:k]):
        if doc in relevant:
            return 1.0 / (i + 1)
    return 0.0


def recall_at_k(ranked: list[int], relevant: set[int], k: int) -> float:
    return len(set(ranked[:k]) & relevant) / len(relevant) if relevant else 0.0


def retrieval_metrics(rankings: list[list[int]], qrels: list[set[int]], k_values: list[int]) -> dict:
    """Mean NDCG@10, MRR@10 and Recall@k over queries (0 for a query whose relevant passages are all missed)."""
    out = {"ndcg_at_10": float(np.mean([ndcg_at_k(r, rel, 10) for r, rel in zip(rankings, qrels)])),
           "mrr_at_10": float(np.mean([mrr_at_k(r, rel, 10) for r, rel in zip(rankings, qrels)]))}
    for k in k_values:
        out[f"recall_at_{k}"] = float(np.mean([recall_at_k(r, rel, k) for r, rel in zip(rankings, qrels)]))
    return out


def mean_by_group(values: list[float], groups: list[int]) -> dict[int, dict]:
    """{group: {"queries": n, "mean": mean of its values}}, groups in ascending order."""
    out: dict[int, dict] = {}
    for g in sorted(set(groups)):
        picked = [v for v, gg in zip(values, groups) if gg == g]
        out[int(g)] = {"queries": len(picked), "mean": float(np.mean(picked))}
    return out


# --- the evaluation set --------------------------------------------------------------------------------
def build_eval_set(run: RunDir, max_queries: int, num_distractors: int) -> dict:
    """Queries, a deduplicated passage pool, and per query the pool indices of all its passages.

    The held-out split keeps every pair of a query on one side, so a held-out query can come with
    several passages: it is scored once, and each of its passages counts as relevant (grouped by the
    key the split hashes). A query stands for its group by its first pair (pair_id, passage, source).
    Chosen inside Ray tasks (eval_set.heldout_queries): the driver holds the chosen groups, not heldout/."""
    held, members = heldout_queries(run, max_queries)
    held_passages = held.column("passage").to_pylist()
    pool_texts: list[str] = []
    index_of: dict[str, int] = {}
    relevant = [held_passages[row] for rows in members for row in rows]
    for text in relevant + distractor_passages(run, num_distractors):
        if text not in index_of:
            index_of[text] = len(pool_texts)
            pool_texts.append(text)
    reps = held.take(pa.array([rows[0] for rows in members], pa.int64()))
    return {"query_ids": reps.column("pair_id").to_pylist(), "queries": reps.column("query").to_pylist(),
            "passages": reps.column("passage").to_pylist(), "sources": reps.column("source").to_pylist(),
            "pool": pool_texts, "qrels": [{index_of[held_passages[row]] for row in rows} for rows in members]}


class EvalEncoder:
    """The encoder process (a Ray actor) of one evaluate call: every model it scores is encoded here, in chunks
    the driver feeds so it can report progress. It keeps the model it last loaded (the frozen encoder serves
    its metrics and the held-out clusters): one process start and one load per model, not one per use."""

    def __init__(self, threads: int):
        self.threads, self.loaded, self.encoder = threads, None, None

    def encode(self, model: str, pooling: str, texts: list[str], max_length: int, batch_size: int) -> np.ndarray:
        if self.loaded != (model, pooling):
            from clusterscale.modeling.encoder import Encoder  # torch: in this actor, not in the CLI's import

            self.encoder = None  # the previous model's memory goes before the next one loads
            self.encoder = Encoder(model, pooling=pooling, threads=self.threads)
            self.loaded = (model, pooling)
        self.encoder.max_length = max_length
        return self.encoder.encode(texts, batch_size)


class EvalEncoders:
    """The evaluate call's EvalEncoder actor: started on first use, on a GPU when there is one (else with every
    CPU as its threads), and killed when the call ends, since it holds those resources."""

    def __init__(self, need: Resources, chunk_size: int = 256):
        self.need, self.chunk_size, self.actor = need, chunk_size, None

    def __enter__(self) -> "EvalEncoders":
        return self

    def __exit__(self, *exc) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None

    def encode(self, model: str, pooling: str, max_lengths: tuple[int, int], queries: list[str], passages: list[str],
               batch_size: int, prompts: tuple[str, str] = ("", "")) -> tuple[np.ndarray, np.ndarray]:
        """Queries and passages embedded by `model`, each at its own max length after its prompt."""
        queries, passages = with_prompt(prompts[0], queries), with_prompt(prompts[1], passages)
        if self.actor is None:
            plan = plan_actors(self.need, max_actors=1)  # one actor: a GPU, or every CPU as its threads
            self.actor = ray.remote(EvalEncoder).options(**plan.options, max_restarts=1,
                                                         max_task_retries=1).remote(plan.threads)
        progress = ProgressLine("evaluate", len(queries) + len(passages), unit="texts")
        out = []
        for texts, max_length in ((queries, max_lengths[0]), (passages, max_lengths[1])):
            chunks = []
            for start in range(0, max(1, len(texts)), self.chunk_size):  # one call for no texts: a (0, d) array
                chunk = texts[start:start + self.chunk_size]
                chunks.append(ray.get(self.actor.encode.remote(model, pooling, chunk, max_length, batch_size)))
                progress.advance(len(chunk))
            out.append(np.concatenate(chunks))
        return out[0], out[1]


class _Together:
    """evaluate_together's state: the encoder process its evaluate calls share, and their eval sets by run."""

    def __init__(self):
        self.encoders: EvalEncoders | None = None
        self.eval_sets: dict[tuple, dict] = {}


_TOGETHER: list[_Together] = []


@contextlib.contextmanager
def evaluate_together():
    """Every evaluate call inside shares one encoder process (started by the first, killed at the end) and builds
    each run's eval set once: compare and sweep evaluate their arms one after the other, and each call would
    otherwise start a process of its own (its imports and the frozen encoder's load: ~4 s a call on a CPU, a model
    load on a GPU). The process holds its CPUs or GPU meanwhile: only evaluate calls may run inside."""
    together = _Together()
    _TOGETHER.append(together)
    try:
        yield
    finally:
        _TOGETHER.remove(together)
        if together.encoders is not None:
            together.encoders.__exit__()


def _eval_set_and_encoders(ctx: StageContext) -> tuple[dict, contextlib.AbstractContextManager]:
    """This call's eval set and encoder process: evaluate_together's when inside it (the set built once per run
    and eval size, before the shared process holds the CPUs its distractor tasks need), else the call's own."""
    cfg, run = ctx.cfg, ctx.run
    if not _TOGETHER:
        return build_eval_set(run, cfg.eval.max_queries, cfg.eval.num_distractors), EvalEncoders(ctx.resources)
    together = _TOGETHER[-1]
    key = (run.uri, cfg.eval.max_queries, cfg.eval.num_distractors)
    if key not in together.eval_sets:
        if together.encoders is not None:
            together.encoders.__exit__()  # its CPUs go to the distractor tasks; the next encode starts it again
        together.eval_sets[key] = build_eval_set(run, cfg.eval.max_queries, cfg.eval.num_distractors)
    if together.encoders is None:
        together.encoders = EvalEncoders(ctx.resources)
    return together.eval_sets[key], contextlib.nullcontext(together.encoders)


def _has_gpu() -> bool:
    """Whether this process (evaluate's driver) sees a CUDA GPU through torch."""
    import torch

    return torch.cuda.is_available()


def search(queries: np.ndarray, pool: np.ndarray, depth: int, backend: str = "faiss") -> list[list[int]]:
    """Top-`depth` pool indices per query by inner product, on ray.vector_backend (vector_search.top_k: the same
    rows and scores on every backend).

    Equal scores are ordered by a fixed pseudo-random key of the pool index, not by the index itself:
    the held-out (relevant) passages come first in the pool, so index order would break every tie in
    their favour."""
    pool = np.ascontiguousarray(pool, dtype=np.float32)
    index = build_index(pool, backend, gpu=_has_gpu())
    scores, ids = top_k(index, pool, queries, min(depth, pool.shape[0]))
    tie_key = hash_unit(np.arange(pool.shape[0]), salt=EVAL_SALT)
    out = []
    for row_scores, row_ids in zip(scores, ids):
        keep = row_ids >= 0
        row_scores, row_ids = row_scores[keep], row_ids[keep]
        order = np.lexsort((tie_key[row_ids], -row_scores))
        out.append([int(i) for i in row_ids[order]])
    return out


def evaluate_model(ctx: StageContext, encoders: EvalEncoders, eval_name: str, model: str, pooling: str,
                   eval_set: dict, fingerprint: str, prompts: tuple[str, str] = ("", ""),
                   dims: tuple[int, ...] = ()) -> dict:
    """Embed the eval set with `model` (on a Ray actor, on a GPU when there is one), search, score, save; with
    `dims` (train.matryoshka_dims) also scored on the first d dimensions, re-normalised (metrics_by_dim).

    A result with the same fingerprint is reused; one from another config is replaced whole."""
    cfg, run, rel = ctx.cfg, ctx.run, eval_path(eval_name)
    if run.exists(rel) and run.read_json(rel).get("fingerprint") == fingerprint:
        return run.read_json(rel)
    started = time.time()
    q, p = encoders.encode(model, pooling, (cfg.train.student.query_max_length, cfg.train.student.passage_max_length),
                           eval_set["queries"], eval_set["pool"], cfg.eval.batch_size, prompts)
    depth = max(max(cfg.eval.k_values), 10)
    rankings = search(q, p, depth, ctx.cfg.ray.vector_backend)
    metrics = retrieval_metrics(rankings, eval_set["qrels"], cfg.eval.k_values)
    by_source: dict[str, list[int]] = {}
    for i, s in enumerate(eval_set["sources"]):
        by_source.setdefault(s or "", []).append(i)
    per_source = {s: retrieval_metrics([rankings[i] for i in idx], [eval_set["qrels"][i] for i in idx],
                                       cfg.eval.k_values)["ndcg_at_10"] for s, idx in sorted(by_source.items())}
    per_query = [ndcg_at_k(r, rel, 10) for r, rel in zip(rankings, eval_set["qrels"])]
    result = {"name": eval_name, "fingerprint": fingerprint, "model": model, "pooling": pooling, "metrics": metrics,
              "ndcg_at_10_by_source": per_source if len(per_source) > 1 else {},
              "per_query": {"pair_id": eval_set["query_ids"], "ndcg_at_10": per_query},
              "num_queries": len(eval_set["queries"]), "pool_size": len(eval_set["pool"]),
              "wall_s": round(time.time() - started, 3)}
    if dims:
        result["metrics_by_dim"] = {str(d): retrieval_metrics(search(truncated(q, d), truncated(p, d), depth,
                                                                     ctx.cfg.ray.vector_backend),
                                                              eval_set["qrels"], cfg.eval.k_values)
                                    for d in dims if d < q.shape[1]}
        result["metrics_by_dim"][str(q.shape[1])] = metrics
    run.write_json(rel, result)
    print(f"[evaluate] {eval_name}: NDCG@10 {metrics['ndcg_at_10']:.4f}  MRR@10 {metrics['mrr_at_10']:.4f}  "
          f"({len(eval_set['queries'])} queries, pool {len(eval_set['pool'])})", flush=True)
    warning = whole_pool_warning(cfg.eval.k_values, len(eval_set["pool"]))
    if warning:
        print(f"[evaluate] warning: {warning}", flush=True)
    return result


def whole_pool_warning(k_values: list[int], pool_size: int) -> str | None:
    """What to say when a Recall@k counts the whole pool (Recall@1000 of a 132-passage pool was 1.0, said as a
    result), or the printed NDCG@10 and MRR@10 rank all of it (a pool of one passage scored 1.0), else None."""
    said = []
    whole = [k for k in k_values if k >= pool_size]
    if whole:
        said.append(f"Recall@{whole[0]} counts every passage of the pool of {pool_size} (1.0 by construction)")
    if pool_size <= 10:
        said.append(f"NDCG@10 and MRR@10 rank every passage of the pool of {pool_size}"
                    + (" (1.0 by construction: every held-out pair has the same passage text)" if pool_size == 1
                       else ""))
    if not said:
        return None
    return "; ".join(said) + ": raise eval.num_distractors or list smaller eval.k_values (the pool holds distinct " \
                             "passage texts only)."


def heldout_clusters(ctx: StageContext, encoders: EvalEncoders, eval_set: dict) -> list[int] | None:
    """Nearest centroid of kmeans/k=<k>/ for each held-out pair, by its frozen embedding of embed.side.

    Held-out pairs are never clustered, so they are embedded here exactly as the embed stage would
    (same model, pooling, max length). None when the fit of this k does not exist."""
    cfg, run = ctx.cfg, ctx.run
    k = cfg.cluster.k
    if not run.exists(centroids_path(k)):
        return None
    if synthetic_embeddings(run):
        print(f"[evaluate] NDCG@10 per cluster skipped: the clusters of this run were fit on synthetic vectors "
              f"(`clusterscale synth`), which {cfg.embed.model} cannot reproduce for held-out pairs.", flush=True)
        return None
    rel = eval_clusters_path(k)
    fingerprint = cfg.fingerprint(("data", "embed", "cluster", "eval"))
    if run.exists(rel):
        cached = run.read_json(rel)
        if cached.get("fingerprint") == fingerprint and cached["pair_id"] == eval_set["query_ids"]:
            return cached["cluster"]
    side = "query" if cfg.embed.side == "query" else cfg.cluster.side  # the vector fit and assign clustered
    queries = eval_set["queries"] if side in ("query", "mean") else []
    passages = eval_set["passages"] if side in ("passage", "mean") else []
    q, p = encoders.encode(cfg.embed.model, cfg.embed.pooling, (cfg.embed.max_length,) * 2, queries, passages,
                           cfg.eval.batch_size, frozen_prompts(cfg.embed))  # as embed/ embedded each side
    dims = cfg.cluster.dims  # on the dimensions the centroids were fit on, as runtime/vectors.clustered_matrix
    q, p = (truncated(np.asarray(x, np.float32), dims) if len(x) else x for x in (q, p))
    vectors = {"query": q, "passage": p}.get(side)
    if vectors is None:  # mean: as runtime/vectors.clustered_matrix
        vectors = q + p
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    clusters = np.argmax(vectors @ load_centroids(run, k).T, axis=1).astype(int).tolist()
    run.write_json(rel, {"k": k, "fingerprint": fingerprint, "pair_id": eval_set["query_ids"], "cluster": clusters})
    return clusters


def cluster_breakdown(ctx: StageContext, encoders: EvalEncoders, eval_set: dict, results: dict) -> dict | None:
    """NDCG@10 per cluster of held-out pairs for every evaluated model; written to eval/by_cluster/k=<k>.json."""
    cfg, run, clusters = ctx.cfg, ctx.run, heldout_clusters(ctx, encoders, eval_set)
    if clusters is None:
        return None
    # Every model evaluated in this run so far (compare arms too), not only this call's.
    everything = {r["name"]: r for f in run.listdir(EVAL) if f.endswith(".json")
                  for r in [run.read_json(f"{EVAL}/{f}")]} | results
    table: dict[str, dict] = {}
    for name, result in everything.items():
        per_query = result.get("per_query")
        if not per_query or per_query["pair_id"] != eval_set["query_ids"]:
            continue  # a result saved before per-query scores existed, or on another eval set
        for c, cell in mean_by_group(per_query["ndcg_at_10"], clusters).items():
            row = table.setdefault(str(c), {"queries": cell["queries"], "ndcg_at_10": {}})
            row["ndcg_at_10"][name] = cell["mean"]
    out = {"k": cfg.cluster.k, "clusters": table}
    run.write_json(eval_by_cluster_path(cfg.cluster.k), out)
    return out


def run_evaluate(ctx: StageContext) -> StageResult:
    """Held-out metrics of the frozen encoder and of train/<name>/ (each cached per model in eval/<name>.json);
    outputs: {"results": per model, "by_cluster": NDCG@10 per cluster or None}."""
    cfg, run = ctx.cfg, ctx.run
    started = time.time()
    eval_set, encoder_process = _eval_set_and_encoders(ctx)
    student = cfg.train.student
    lengths = {"query_max_length": student.query_max_length, "passage_max_length": student.passage_max_length}
    name = cfg.train_name()
    # A URI, not a driver-local copy: the encoding task may run on another node.
    models = {"frozen": (cfg.embed.model, cfg.embed.pooling, cfg.fingerprint(("data", "embed", "eval"), extra=lengths),
                         frozen_prompts(cfg.embed)),
              name: (run.child_uri(model_dir(name)), "auto",
                     cfg.fingerprint(("data", "embed", "cluster", "shard", "train", "eval")),
                     (student.query_prompt, student.passage_prompt))}
    dims = tuple(d for d, _ in cfg.train.objective.matryoshka_terms())  # the student's nested sizes
    cached = {n for n, (_, _, fp, _) in models.items()
              if run.exists(eval_path(n)) and run.read_json(eval_path(n)).get("fingerprint") == fp}
    with encoder_process as encoders:  # one encoder process for every model of this call (or of evaluate_together)
        results = {n: evaluate_model(ctx, encoders, n, model, pooling, eval_set, fp, prompts,
                                     () if n == "frozen" else dims)
                   for n, (model, pooling, fp, prompts) in models.items()}
        write_model_card(cfg, run, name)  # the card now carries the held-out metrics
        by_cluster = cluster_breakdown(ctx, encoders, eval_set, results)
    stats = {"wall_s": round(time.time() - started, 3), "models": list(results)}
    stats["worker_s"] = stats["wall_s"]
    if cached == set(models):  # nothing evaluated now: the cost record of the run that did it stays
        stats["reused"] = True
    return StageResult(stats, outputs={"results": results, "by_cluster": by_cluster})
