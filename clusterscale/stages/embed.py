"""Embed: a frozen-encoder pass over pairs/ in restartable work units, writing embeddings/.

Every output row is the pair's columns plus `emb`: fixed_size_list<float16>[d], L2-normalised (the
side that is clustered) and `truncated` (that text was cut at embed.max_length). With
embed.side=both, `emb` is the passage and `emb_query` / `truncated_query` are added.

Work units are fixed row ranges of the pairs/ part files, listed once in embeddings/_units.json
with the config fingerprint. Ray Data `map_batches` with a callable class over the
unit list (an actor pool, one encoder replica per actor: one per GPU, or threads_per_actor CPUs
each) embeds units; each unit's output is written to a temporary name and renamed, so a file
present under its final name is complete and a rerun skips it. A killed actor is restarted by Ray
Data and its unit redone into the same file name: no row is lost or duplicated.
Run with `clusterscale embed [CONFIG] --run-dir R` (after `ingest`).
"""
from __future__ import annotations

import math
import posixpath
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config, EmbedConfig, Fingerprint
from clusterscale.errors import UserError
from clusterscale.modeling.encoder import Encoder, check_encoder
from clusterscale.runtime.progress import ProgressLine
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.runtime.resources import ActorPlan, Resources, plan_actors
from clusterscale.runtime.work_units import load_or_make_plan, split_done
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS, emb_array, emb_matrix  # noqa: F401 - emb_matrix is part of this module's API

PLAN = "embeddings/_units.json"


class EmbeddingError(UserError, RuntimeError):
    """The encoder produced unusable vectors; the message names the rows."""


def output_columns(side: str) -> list[tuple[str, str]]:
    """(text column, output suffix) per embedded side; suffix '' is `emb`, the clustered side."""
    return {"passage": [("passage", "")], "query": [("query", "")],
            "both": [("passage", ""), ("query", "_query")]}[side]


# work units -------------------------------------------------------------------------------------
def plan_units(run: RunDir, rows_per_unit: int) -> list[dict]:
    """Row ranges of every pairs/ part file, at most rows_per_unit rows each, in file order."""
    units = []
    for path in run.files("pairs"):
        rel = posixpath.relpath(path, run.root)
        stem = posixpath.basename(rel)[:-len(".parquet")]
        with run.fs.open_input_file(path) as f:
            rows = pq.ParquetFile(f).metadata.num_rows
        for i, start in enumerate(range(0, rows, rows_per_unit)):
            units.append({"input": rel, "start": start, "stop": min(rows, start + rows_per_unit),
                          "output": f"embeddings/{stem}-{i:05d}.parquet"})
    return units


def auto_rows_per_unit(n_rows: int, actors: int, rows_per_part: int) -> int:
    """Whole pairs/ parts when there are plenty; otherwise small enough for >= 4 units per actor."""
    return max(1, min(rows_per_part, math.ceil(n_rows / (4 * actors))))


def make_plan(cfg: Config, actors: int, pairs_run: RunDir) -> dict:
    """The unit list of a fresh embedding (work_units.load_or_make_plan stores it with the fingerprint)."""
    n_rows = pairs_run.done_stats("pairs")["pairs"]
    rows_per_unit = cfg.embed.rows_per_unit or auto_rows_per_unit(n_rows, actors, cfg.data.rows_per_part)
    return {"rows_per_unit": rows_per_unit, "embed": cfg.to_dict()["embed"],
            "units": plan_units(pairs_run, rows_per_unit)}


# the actor ---------------------------------------------------------------------------------------
class EmbedWorker:
    """One encoder replica; embeds whole work units and writes each one atomically."""

    def __init__(self, run_uri: str, embed: dict, threads: int, pairs_uri: str | None = None):
        self.cfg = EmbedConfig(**embed)
        self.run = RunDir(run_uri)
        self.pairs_run = RunDir(pairs_uri) if pairs_uri else self.run
        self.encoder = Encoder(self.cfg.model, pooling=self.cfg.pooling, max_length=self.cfg.max_length,
                               trust_remote_code=self.cfg.trust_remote_code, threads=threads,
                               max_tokens_per_batch=self.cfg.max_tokens_per_batch)

    def embed_unit(self, unit: dict) -> dict:
        """Read, tokenise, encode, check, write. Returns the unit's counts."""
        started = time.time()
        with self.pairs_run.fs.open_input_file(self.pairs_run.path(unit["input"])) as f:
            table = pq.read_table(f).slice(unit["start"], unit["stop"] - unit["start"])
        sides = output_columns(self.cfg.side)
        tokens = [self.encoder.tokenize(table.column(text).to_pylist()) for text, _ in sides]
        vectors = [self.encoder.encode_tokens(t, self.cfg.batch_size) for t in tokens]
        for (text, _), v in zip(sides, vectors):
            check_finite(v, table.column("pair_id").to_numpy(), text, self.cfg.model)
        for (_, suffix), v, t in zip(sides, vectors, tokens):
            table = table.append_column(f"emb{suffix}", emb_array(v))
            table = table.append_column(f"truncated{suffix}", pa.array(t.truncated))
        self.run.write_parquet(unit["output"], table, row_group_size=EMBEDDINGS_ROW_GROUP_ROWS)
        return {"rows": table.num_rows, "truncated": int(tokens[0].truncated.sum()),
                "busy_s": time.time() - started}


def check_finite(vectors: np.ndarray, pair_ids: np.ndarray, side: str, model: str) -> None:
    bad = ~np.isfinite(vectors).all(axis=1)
    if bad.any():
        ids = pair_ids[bad][:20].tolist()
        raise EmbeddingError(f"The encoder produced NaN/inf vectors for {int(bad.sum())} {side} texts (pair_ids "
                             f"{ids}{'...' if bad.sum() > 20 else ''}): the checkpoint at embed.model={model!r} "
                             f"is broken. Nothing of these rows was written; fix the model and rerun.")


def actor_pool_size(cfg: EmbedConfig) -> ActorPlan:
    """One actor (encoder replica) per GPU, else one per threads_per_actor CPUs."""
    return plan_actors(Resources(cpus=cfg.threads_per_actor, gpus=1), max_actors=cfg.num_actors)


class EmbedUnits:
    """Ray Data callable class: one EmbedWorker (encoder replica) per actor; each row is a work unit."""

    def __init__(self, run_uri: str, embed: dict, threads: int, pairs_uri: str | None = None):
        self.worker = EmbedWorker(run_uri, embed, threads, pairs_uri)

    def __call__(self, units: pa.Table) -> pa.Table:
        results = [self.worker.embed_unit(u) for u in units.to_pylist()]
        return pa.Table.from_pylist(results, schema=pa.schema([("rows", pa.int64()), ("truncated", pa.int64()),
                                                               ("busy_s", pa.float64())]))


def run_units(run: RunDir, cfg: Config, todo: list[dict], pool: ActorPlan, pairs_run: RunDir | None = None
              ) -> tuple[list[dict], float]:
    """Embed `todo` with a Ray Data actor pool (one unit per task; Ray Data restarts a dead actor and retries).

    A unit's output name is fixed, so a task Ray retries after an actor death rewrites the same file:
    no row is lost or duplicated. Returns (per-unit results, actor seconds)."""
    started = time.time()
    pool_size = min(pool.actors, len(todo))
    ds = ray.data.from_items(todo, override_num_blocks=len(todo))
    ds = ds.map_batches(EmbedUnits, fn_constructor_args=(run.uri, cfg.to_dict()["embed"], pool.threads,
                                                            pairs_run.uri if pairs_run else None),
                        batch_size=1, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=pool_size),
                        **pool.options)
    progress = ProgressLine("embed", sum(u["stop"] - u["start"] for u in todo))
    results = []
    try:
        for result in ds.iter_rows():
            results.append(result)
            progress.advance(result["rows"])
    except Exception as exc:  # surface our own error (NaN rows) without Ray Data's wrapping
        marker = "EmbeddingError: "
        text = str(exc)
        if marker in text:
            raise EmbeddingError(text.split(marker, 1)[1].splitlines()[0]) from exc
        raise
    return results, (time.time() - started) * pool_size


def _count_done(run: RunDir, units: list[dict]) -> tuple[int, int]:
    """(rows, truncated) of units completed by an earlier attempt."""
    rows = truncated = 0
    for unit in units:
        with run.fs.open_input_file(run.path(unit["output"])) as f:
            column = pq.read_table(f, columns=["truncated"]).column("truncated")
        rows += len(column)
        truncated += int(np.asarray(column).sum())
    return rows, truncated


def run_embed(cfg: Config, run: RunDir, fingerprint: Fingerprint, pairs_run: RunDir | None = None) -> StageResult:
    """Embed every pair not embedded yet (the units of an interrupted attempt with this fingerprint are kept).

    pairs_run: read pairs/ from this run directory instead of `run` (re-embedding the same pairs with
    another encoder into a child run directory: mining with a trained model, re-clustering)."""
    pairs_run = pairs_run or run
    check_encoder(cfg.embed.model, cfg.embed.trust_remote_code)
    pool = actor_pool_size(cfg.embed)
    plan = load_or_make_plan(run, "embeddings", PLAN, fingerprint, "embedding",
                             lambda: make_plan(cfg, pool.actors, pairs_run))
    done, todo = split_done(run, "embeddings", plan["units"])
    if done:
        print(f"[embed] resuming: {len(done)}/{len(plan['units'])} units already complete", flush=True)
    started = time.time()
    results, worker_s = run_units(run, cfg, todo, pool, pairs_run) if todo else ([], 0.0)
    rows_before, truncated_before = _count_done(run, done)
    rows = rows_before + sum(r["rows"] for r in results)
    expected = pairs_run.done_stats("pairs")["pairs"]
    if rows != expected:
        raise RuntimeError(f"embeddings/ holds {rows} rows but pairs/ has {expected}: delete embeddings/ and rerun.")
    wall = time.time() - started
    embedded = rows - rows_before
    device = pool.device
    stats = {"rows": rows, "rows_embedded": embedded, "units": len(plan["units"]), "units_skipped": len(done),
             "truncated": truncated_before + sum(r["truncated"] for r in results),
             "actors": min(pool.actors, len(todo)), "wall_s": round(wall, 3),
             "rows_per_s": round(embedded / wall, 2) if wall > 0 else 0.0, "worker_s": round(worker_s, 3),
             "busy_s": round(sum(r["busy_s"] for r in results), 3), "device": device}
    if device == "gpu":
        stats["gpu_s"] = stats["worker_s"]
    print(f"[embed] {embedded} rows in {wall:.1f}s ({stats['rows_per_s']:.1f} rows/s, {stats['actors']} actor(s), "
          f"{worker_s:.0f} {device}-actor-seconds, {stats['busy_s']:.0f} busy); {len(done)} unit(s) reused; "
          f"{stats['truncated']} texts truncated at {cfg.embed.max_length} tokens", flush=True)
    return StageResult(stats, config={"embed": cfg.to_dict()["embed"], "rows_per_unit": plan["rows_per_unit"]})
