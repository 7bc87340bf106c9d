"""Mine: hard negatives for every training query from the training passages (the ANCE step), a Ray Data pass.

Run with `clusterscale mine [CONFIG] --run-dir R` (after `embed`). The passage vectors come from
embeddings/ (mine.encoder=frozen) or from a re-embedding of every training pair with another encoder
(a training run's exported model, `train:<name>`, or any model) into the child run directory
mine_encoder/. One Ray Data actor pool holds a faiss inner-product index over all training passages
(flat, or IVF for large N); each task mines one embeddings file and writes negatives/<file>.parquet
atomically, so a rerun skips finished files. Per query it keeps retrieval ranks [range_min,
range_max) that are not a positive of the query (a pair with the same query text) and not a
duplicate of its positive passage text, and, with mine.margin, only candidates scoring <= margin x
the positive's score. Output columns: pair_id, neg_pair_ids list<int64>, neg_scores list<float32>
(best first), pos_score.
"""
from __future__ import annotations

import math
import posixpath
import time
from typing import Callable

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from clusterscale.config import Config, ConfigError, Fingerprint, MineConfig, from_dict, variant
from clusterscale.modeling.encoder import Encoder
from clusterscale.runtime.hashing import text_hashes
from clusterscale.io.layout import NEGATIVES, model_dir
from clusterscale.runtime.progress import ProgressLine
from clusterscale.io.rundir import RunDir, StageMissingError, StageResult
from clusterscale.runtime.faiss_index import build_ip_index
from clusterscale.runtime.resources import ActorPlan, ClusterResources, Resources, plan_actors
from clusterscale.runtime.work_units import load_or_make_plan, split_done
from clusterscale.runtime.session import faiss_runtime_env
from clusterscale.stages.synthetic import synthetic_embeddings
from clusterscale.runtime.vectors import emb_matrix

PLAN = f"{NEGATIVES}/_plan.json"
ENCODER_RUN = "mine_encoder"  # child run directory holding the re-embedding of a non-frozen encoder
DROP_REASONS = ("positive", "duplicate", "margin")
EmbedInto = Callable[[Config, RunDir], dict]  # (config, child run) -> the embed stage's stats


# --- which vectors ----------------------------------------------------------------------------------------
def resolve_encoder(cfg: Config, run: RunDir) -> str | None:
    """None for the frozen encoder, else a local model folder or hub id to re-embed with."""
    encoder = cfg.mine.encoder
    if encoder == "frozen":
        if cfg.embed.side == "query":
            raise ConfigError("mine.encoder=frozen needs passage vectors in embeddings/, but embed.side=query: "
                              "use embed.side=passage or both (new --run-dir), or set mine.encoder to a model.")
        if cfg.embed.side != "both" and synthetic_embeddings(run):
            raise ConfigError("mine.encoder=frozen on a synthetic run (`clusterscale synth`) needs the synthetic "
                              f"query vectors, but this run has embed.side={cfg.embed.side}: {cfg.embed.model} "
                              "cannot embed queries into the space of synthetic passage vectors. Write the synth "
                              "run with --set embed.side=both (new --run-dir).")
        return None
    if encoder.startswith("train:"):
        name = encoder.split(":", 1)[1]
        if not run.exists(model_dir(name)):
            raise StageMissingError(f"mine.encoder={encoder}: no exported model at {run.path(model_dir(name))}; "
                                    f"run `clusterscale train --set train.name={name}` first.")
        return run.child_uri(model_dir(name))  # every node can read it (object stores: copied per node)
    return encoder


def vectors_run(cfg: Config, run: RunDir, encoder: str | None, embed: EmbedInto) -> tuple[RunDir, dict]:
    """(the run directory whose embeddings/ is mined, the stats of making it). `embed` runs the embed stage
    (the pipeline's executor, so the child run has its own done marker) into a child run reading run's pairs."""
    if encoder is None:
        return run, {}
    child = RunDir(run.child_uri(ENCODER_RUN))
    child_cfg = variant(cfg, embed={"model": encoder, "side": "both", "pooling": "auto"})
    print(f"[mine] re-embedding every training pair (queries and passages) with {encoder}", flush=True)
    return child, embed(child_cfg, child)


def load_passages(source: RunDir) -> dict:
    """Every training pair's passage vector and text keys, sorted by pair_id (the index's row order)."""
    tables = []
    for path in source.files("embeddings"):
        with source.fs.open_input_file(path) as f:
            tables.append(pq.read_table(f, columns=["pair_id", "query", "passage", "emb"]))
    table = pa.concat_tables(tables)
    order = np.argsort(table.column("pair_id").to_numpy(), kind="stable")
    table = table.take(pa.array(order))
    return {"pair_id": table.column("pair_id").to_numpy(),
            "emb": np.ascontiguousarray(emb_matrix(table.column("emb"))),
            "passage_key": text_hashes(table.column("passage").to_pylist()),
            "query_key": text_hashes(table.column("query").to_pylist())}


def build_index(emb: np.ndarray, mc: MineConfig) -> faiss.Index:
    """The passage index: exact, or IVF with mine.ivf_nlist lists (default about 4 sqrt(N), >= 39 rows each)."""
    n = emb.shape[0]
    nlist = mc.ivf_nlist or max(1, min(n // 39, int(4 * math.sqrt(n))))
    return build_ip_index(emb, mc.index, nlist=nlist, nprobe=mc.ivf_nprobe)


# --- the per-query rule -------------------------------------------------------------------------------------
def filter_candidates(scores: np.ndarray, rows: np.ndarray, own_rows: np.ndarray, pos_scores: np.ndarray,
                      passage_key: np.ndarray, query_key: np.ndarray, mc: MineConfig
                      ) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """Kept candidate rows and scores per query (best first), and drop counts per reason.

    scores, rows: (b, K) search results (row -1 = no hit); own_rows: (b,) each query's own pair row."""
    b, depth = rows.shape
    valid = (rows >= 0) & (np.arange(depth)[None, :] >= mc.range_min)
    safe = np.where(rows >= 0, rows, 0)
    positive = valid & (query_key[safe] == query_key[own_rows][:, None])          # incl. the pair itself
    duplicate = valid & ~positive & (passage_key[safe] == passage_key[own_rows][:, None])
    margin = np.zeros_like(valid)
    if mc.margin is not None:
        margin = valid & ~positive & ~duplicate & (scores > mc.margin * pos_scores[:, None])
    keep = valid & ~positive & ~duplicate & ~margin
    drops = {"positive": int(positive.sum()), "duplicate": int(duplicate.sum()), "margin": int(margin.sum())}
    return [rows[i][keep[i]] for i in range(b)], [scores[i][keep[i]] for i in range(b)], drops


class MineUnits:
    """Ray Data callable class: one passage index per actor; each input row is one embeddings file to mine."""

    def __init__(self, run_uri: str, source_uri: str, cfg: dict, passages_ref: list, threads: int):
        faiss.omp_set_num_threads(threads)
        torch.set_num_threads(threads)
        self.cfg = from_dict(cfg)
        self.run, self.source = RunDir(run_uri), RunDir(source_uri)
        self.passages = ray.get(passages_ref[0])
        self.index = build_index(self.passages["emb"], self.cfg.mine)
        self.encoder = None

    def query_vectors(self, table: pa.Table) -> np.ndarray:
        if "emb_query" in table.column_names:
            return emb_matrix(table.column("emb_query"))
        if self.encoder is None:  # frozen encoder, passages-only embeddings: embed the queries here
            ec = self.cfg.embed
            self.encoder = Encoder(ec.model, pooling=ec.pooling, max_length=ec.max_length,
                                   trust_remote_code=ec.trust_remote_code,
                                   max_tokens_per_batch=ec.max_tokens_per_batch)
        return self.encoder.encode(table.column("query").to_pylist(), self.cfg.embed.batch_size)

    def mine_file(self, unit: dict) -> dict:
        started, mc, p = time.time(), self.cfg.mine, self.passages
        columns = ["pair_id", "query"] + (["emb_query"] if "emb_query" in self._schema(unit) else [])
        with self.source.fs.open_input_file(self.source.path(unit["input"])) as f:
            table = pq.read_table(f, columns=columns)
        q = np.ascontiguousarray(self.query_vectors(table), dtype=np.float32)
        pair_ids = table.column("pair_id").to_numpy()
        own_rows = np.searchsorted(p["pair_id"], pair_ids)
        pos_scores = np.einsum("ij,ij->i", q, p["emb"][own_rows])
        neg_ids, neg_scores, drops = [], [], dict.fromkeys(DROP_REASONS, 0)
        for start in range(0, len(q), mc.query_batch_size):
            sl = slice(start, start + mc.query_batch_size)
            scores, rows = self.index.search(q[sl], mc.range_max)
            kept_rows, kept_scores, d = filter_candidates(scores, rows, own_rows[sl], pos_scores[sl],
                                                          p["passage_key"], p["query_key"], mc)
            neg_ids += [p["pair_id"][r] for r in kept_rows]
            neg_scores += [s.astype(np.float32) for s in kept_scores]
            drops = {k: drops[k] + d[k] for k in drops}
        out = pa.table({"pair_id": pa.array(pair_ids, pa.int64()),
                        "neg_pair_ids": pa.array([x.tolist() for x in neg_ids], pa.list_(pa.int64())),
                        "neg_scores": pa.array([x.tolist() for x in neg_scores], pa.list_(pa.float32())),
                        "pos_score": pa.array(pos_scores.astype(np.float32))})
        self.run.write_parquet(unit["output"], out)
        counts = [len(x) for x in neg_ids]
        return {"rows": len(pair_ids), "negatives": int(sum(counts)), "without_negatives": int(sum(c == 0 for c in counts)),
                "queries_embedded": 0 if "emb_query" in columns else len(pair_ids), "busy_s": time.time() - started,
                **{f"dropped_{k}": v for k, v in drops.items()}}

    def _schema(self, unit: dict) -> list[str]:
        with self.source.fs.open_input_file(self.source.path(unit["input"])) as f:
            return pq.read_schema(f).names

    def __call__(self, units: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self.mine_file(u) for u in units.to_pylist()])


# --- the stage ---------------------------------------------------------------------------------------------
def plan_units(source: RunDir, cfg: Config) -> dict:
    """One unit per embeddings file of `source` (work_units.load_or_make_plan stores it with the fingerprint)."""
    units = [{"input": posixpath.relpath(path, source.root),
              "output": f"{NEGATIVES}/{posixpath.basename(path)}"} for path in source.files("embeddings")]
    return {"mine": cfg.to_dict()["mine"], "units": units}


def _file_rows(run: RunDir, rel: str) -> int:
    with run.fs.open_input_file(run.path(rel)) as f:
        return pq.ParquetFile(f).metadata.num_rows


def pool_size(mc: MineConfig, units: int) -> ActorPlan:
    """Every actor holds a full index (N x d x 4 bytes), so one per GPU, or on CPU a few actors (one per 8 CPUs)
    sharing the CPUs as faiss/torch threads, not one per core."""
    cluster = ClusterResources.current()
    return plan_actors(Resources(gpus=1, cpus_with_gpu=None), max_actors=mc.num_actors, work_units=units,
                       cpu_actors=max(1, cluster.cpus // 8), cluster=cluster)


def run_mine(cfg: Config, run: RunDir, fingerprint: Fingerprint, embed: EmbedInto) -> StageResult:
    """Mine negatives for every training query not mined yet (the files of an interrupted attempt with this
    fingerprint are kept). `embed`: see vectors_run."""
    started = time.time()
    encoder = resolve_encoder(cfg, run)
    source, embed_cost = vectors_run(cfg, run, encoder, embed)
    plan = load_or_make_plan(run, NEGATIVES, PLAN, fingerprint, "mining", lambda: plan_units(source, cfg))
    _, todo = split_done(run, NEGATIVES, plan["units"])
    passages = load_passages(source)
    if len(passages["pair_id"]) <= cfg.mine.range_min:
        raise ConfigError(f"mine.range_min={cfg.mine.range_min} is not below the number of training passages "
                          f"({len(passages['pair_id'])}): lower it.")
    results, worker_s = [], 0.0
    if todo:
        pool = pool_size(cfg.mine, len(todo))
        options = pool.options | ({} if pool.on_gpu else {"runtime_env": faiss_runtime_env()})
        t0 = time.time()
        ds = ray.data.from_items(todo, override_num_blocks=len(todo))
        ds = ds.map_batches(MineUnits, fn_constructor_args=(run.uri, source.uri, cfg.to_dict(), [ray.put(passages)],
                                                            pool.threads),
                            batch_size=1, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=pool.actors),
                            **options)
        progress = ProgressLine("mine", sum(_file_rows(source, u["input"]) for u in todo))
        for result in ds.iter_rows():
            results.append(result)
            progress.advance(result["rows"])
        worker_s = (time.time() - t0) * pool.actors
    stats = _stage_stats(run, plan, results, len(passages["pair_id"]), time.time() - started, worker_s, embed_cost,
                         encoder)
    print(f"[mine] {stats['rows']} queries in {stats['wall_s']:.1f}s: {stats['negatives_per_query']:.1f} negatives "
          f"per query kept ({stats['without_negatives']} with none); dropped {stats['dropped_positive']} positives, "
          f"{stats['dropped_duplicate']} duplicates of the positive, {stats['dropped_margin']} by the margin",
          flush=True)
    return StageResult(stats, config={"mine": cfg.to_dict()["mine"]})


def _stage_stats(run: RunDir, plan: dict, results: list[dict], n_passages: int, wall: float, worker_s: float,
                 embed_cost: dict, encoder: str | None) -> dict:
    totals = {k: sum(r[k] for r in results) for k in ("rows", "negatives", "without_negatives", "queries_embedded",
                                                      *[f"dropped_{d}" for d in DROP_REASONS])}
    totals["drop_counts_cover_files"] = len(results)  # the dropped_* of files mined by an earlier attempt are not kept
    if len(results) < len(plan["units"]):  # files finished by an earlier attempt: count their rows
        table = pa.concat_tables([pq.read_table(run.fs.open_input_file(run.path(u["output"])),
                                                columns=["neg_pair_ids"]) for u in plan["units"]])
        counts = pc_list_lengths(table.column("neg_pair_ids"))
        totals["rows"], totals["negatives"] = len(counts), int(counts.sum())
        totals["without_negatives"] = int((counts == 0).sum())
    if totals["rows"] != n_passages:
        raise RuntimeError(f"negatives/ covers {totals['rows']} queries but there are {n_passages} training pairs: "
                           f"delete negatives/ and rerun `clusterscale mine`.")
    embedded = totals.pop("queries_embedded") + int(embed_cost.get("rows_embedded", 0)) * (2 if encoder else 1)
    return totals | {"negatives_per_query": round(totals["negatives"] / max(1, totals["rows"]), 3),
                     "passages": n_passages, "encoder": encoder or "frozen", "texts_embedded": embedded,
                     "embed_worker_s": float(embed_cost.get("worker_s", 0.0)), "wall_s": round(wall, 3),
                     "worker_s": round(worker_s + float(embed_cost.get("worker_s", 0.0)), 3),
                     "rows_per_s": round(totals["rows"] / wall, 2) if wall > 0 else 0.0}


def pc_list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    import pyarrow.compute as pc

    return np.asarray(pc.list_value_length(column).fill_null(0))
