"""Embed: a frozen-encoder pass over pairs/ in restartable work units, writing embeddings/.

Every output row is the pair's columns plus `emb`: fixed_size_list<float16>[d], L2-normalised (the
side that is clustered) and `truncated` (that text was cut at embed.max_length). With
embed.side=both, `emb` is the passage and `emb_query` / `truncated_query` are added.

Work units are fixed row ranges of the pairs/ part files, listed once in embeddings/_units.json
with the config fingerprint. One Ray Data pipeline runs them: read + tokenise on CPUs (the
Rust tokenizer, no torch), forward passes in an actor pool (one encoder replica per actor: one per
GPU, or threads_per_actor CPUs each) that receives token ids only, and write on CPUs; the
three stream, so reads, tokenising and writes overlap the forward passes. Each unit's output is
written to a temporary name and renamed, so a file present under its final name is complete and a
rerun skips it. A killed actor is restarted by Ray Data and its unit redone into the same file
name: no row is lost or duplicated.
Run with `clusterscale embed [CONFIG] --run-dir R` (after `ingest`).
"""
from __future__ import annotations

import posixpath
import time
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config, EmbedConfig
from clusterscale.errors import UserError
from clusterscale.modeling.tokens import TextTokenizer, Tokens, single_threaded
from clusterscale.runtime.nodes import NODE, map_spread, node_stats, this_node, unit_delay_for_tests
from clusterscale.runtime.progress import ProgressLine
from clusterscale.io.sizing import auto_rows_per_unit
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.runtime.resources import ActorPlan, ClusterResources, Resources, plan_actors
from clusterscale.runtime.work_units import load_or_make_plan, split_done
from clusterscale.io.layout import HELDOUT_EMBEDDINGS
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS, emb_array

PLAN = "_units.json"  # inside the output folder: embeddings/_units.json


class EmbeddingError(UserError, RuntimeError):
    """The encoder produced unusable vectors; the message names the rows."""


def output_columns(side: str) -> list[tuple[str, str]]:
    """(text column, output suffix) per embedded side; suffix '' is `emb`, the clustered side."""
    return {"passage": [("passage", "")], "query": [("query", "")],
            "both": [("passage", ""), ("query", "_query")]}[side]


# work units -------------------------------------------------------------------------------------
def plan_units(run: RunDir, rows_per_unit: int, source: str = "pairs", out: str = "embeddings") -> list[dict]:
    """Row ranges of every part file of `source` (pairs/, or heldout/ for embed_heldout), at most rows_per_unit rows
    each, in file order; each unit's file in `out`. Consecutive whole files smaller than a unit (an input of many
    small files: ingest keeps one part per file) share one unit of at most rows_per_unit rows, its pieces listed in
    "inputs" (unit_pieces), so embeddings/ and every later stage get files of about a unit each, not one per input
    file; a unit of one file keeps "input", "start" and "stop" (the plans written before)."""
    units, group, group_rows = [], [], 0
    files = run.files(source)

    def close_group() -> None:
        nonlocal group, group_rows
        if len(group) == 1:
            units.append({**group[0], "output": _output(out, group[0]["input"], 0)})
        elif group:
            units.append({"inputs": group, "output": _output(out, group[0]["input"], 0)})
        group, group_rows = [], 0

    for path, footer in zip(files, run.footers(files)):  # in parallel; one that does not parse is named
        rel = posixpath.relpath(path, run.root)
        rows = footer.num_rows
        if 0 < rows < rows_per_unit:
            if group_rows + rows > rows_per_unit:
                close_group()
            group.append({"input": rel, "start": 0, "stop": rows})
            group_rows += rows
            continue
        close_group()
        for i, start in enumerate(range(0, rows, rows_per_unit)):
            units.append({"input": rel, "start": start, "stop": min(rows, start + rows_per_unit),
                          "output": _output(out, rel, i)})
    close_group()
    return units


def _output(out: str, rel: str, index: int) -> str:
    """The unit's file in `out`: named by its (first) input file and its place in it."""
    return f"{out}/{posixpath.basename(rel)[:-len('.parquet')]}-{index:05d}.parquet"


def unit_pieces(unit: dict) -> list[tuple[str, int, int]]:
    """(input file, first row, end row) of each piece of a unit, in order."""
    return [(piece["input"], piece["start"], piece["stop"]) for piece in unit.get("inputs") or [unit]]


def unit_rows(unit: dict) -> int:
    return sum(stop - start for _, start, stop in unit_pieces(unit))


def make_plan(cfg: Config, actors: int, pairs_run: RunDir, n_rows: int, source: str = "pairs",
              out: str = "embeddings") -> dict:
    """The unit list of a fresh embedding of n_rows rows of `source` (work_units.load_or_make_plan stores it with the
    fingerprint)."""
    rows_per_unit = cfg.embed.rows_per_unit or auto_rows_per_unit(n_rows, actors, cfg.data.rows_per_part)
    return {"rows_per_unit": rows_per_unit, "embed": cfg.embed.to_dict(),
            "units": plan_units(pairs_run, rows_per_unit, source, out)}


# the Ray Data pipeline: read + tokenise (CPU actors) -> encode (encoder actors) -> write (CPU actors) ----
UNIT = "_unit"  # the unit's output path, on every row of it while it travels
UNIT_ROWS = "_unit_rows"  # the unit's row count, so that a writer can check it holds the whole unit
ENCODE_S = "_encode_s"  # each row's share of the encoder's busy seconds
BATCHING = "_batching"  # how the encoder held its texts: 'padded' or 'packed (<attention kernel>)' (Encoder.batching)
TOKENS = "_tokens"  # + the side's suffix: token ids, list<int32>

CPU_ACTOR_SPARE = 0.25
"""CPU that each CPU-only encoder actor leaves unreserved for the tokenise and write actors (CPU_STAGE_CPUS
each); on GPU nodes an encoder actor reserves 1 CPU and the rest of the node is theirs."""
CPU_STAGE_CPUS = 0.125
GPU_STAGE_CPUS = 1.0  # a tokeniser is one single-threaded Rust tokenizer: one CPU of a GPU node


class TokenizeUnits:
    """Ray Data callable class on CPUs: read each unit's rows of pairs/ and tokenise the embedded side(s).

    No torch here. Adds `truncated<suffix>` and the token ids per side, and tags every row with its unit.
    A small pool of long-lived actors, not tasks: where the encoders fill a node's CPUs, Ray keeps no idle
    worker process, and every task would start (import) a new one, ~1 CPU-second each."""

    def __init__(self, pairs_uri: str, tokenizer: TextTokenizer, side: str, prompts: tuple[str, str] = ("", "")):
        single_threaded()
        self.pairs_run = RunDir(pairs_uri)
        self.tokenizer = tokenizer
        self.side = side
        self.prompts = dict(zip(("query", "passage"), prompts))  # the frozen encoder's (encoder.frozen_prompts)

    def __call__(self, units: pa.Table) -> pa.Table:
        return pa.concat_tables([self.tokenize_unit(unit) for unit in units.to_pylist()])

    def tokenize_unit(self, unit: dict) -> pa.Table:
        pieces = []
        for rel, start, stop in unit_pieces(unit):
            with self.pairs_run.fs.open_input_file(self.pairs_run.path(rel)) as f:
                pieces.append(pq.read_table(f).slice(start, stop - start))
        table = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
        for text, suffix in output_columns(self.side):
            prompt = self.prompts[text]
            texts = table.column(text).to_pylist()
            tokens = self.tokenizer([prompt + t for t in texts] if prompt else texts)
            table = table.append_column(f"truncated{suffix}", pa.array(tokens.truncated))
            table = table.append_column(f"{TOKENS}{suffix}", tokens.to_arrow())
        n = table.num_rows
        table = table.append_column(UNIT, pa.array([unit["output"]] * n, pa.string()))
        return table.append_column(UNIT_ROWS, pa.array(np.full(n, n, dtype=np.int64)))


class EncodeTokens:
    """Ray Data callable class: one encoder replica per actor; forward passes on token ids only.

    A batch is one or more whole units (one block each); its texts are sorted by length and batched by
    the token budget across the batch, and the vectors return in row order as `emb<suffix>`."""

    def __init__(self, embed: EmbedConfig, threads: int):
        from clusterscale.modeling.encoder import Encoder  # torch and the model load in the actors only

        self.cfg = embed
        self.encoder = Encoder(self.cfg.model, pooling=self.cfg.pooling, max_length=self.cfg.max_length,
                               trust_remote_code=self.cfg.trust_remote_code, threads=threads,
                               max_tokens_per_batch=self.cfg.max_tokens_per_batch, packing=self.cfg.packing)

    def __call__(self, batch: pa.Table) -> pa.Table:
        unit_delay_for_tests("embed")
        started = time.time()
        for text, suffix in output_columns(self.cfg.side):
            tokens = Tokens.from_arrow(batch.column(f"{TOKENS}{suffix}"), batch.column(f"truncated{suffix}"))
            vectors = self.encoder.encode_tokens(tokens, self.cfg.batch_size)
            check_finite(vectors, batch.column("pair_id").to_numpy(), text, self.cfg.model)
            batch = batch.drop_columns([f"{TOKENS}{suffix}"]).append_column(f"emb{suffix}", emb_array(vectors))
        share = (time.time() - started) / max(1, batch.num_rows)
        batch = batch.append_column(ENCODE_S, pa.array(np.full(batch.num_rows, share)))
        batch = batch.append_column(BATCHING, pa.array([self.encoder.batching] * batch.num_rows, pa.string()))
        return batch.append_column(NODE, pa.array([this_node()] * batch.num_rows, pa.string()))


class WriteUnits:
    """Ray Data callable class on CPUs: write each unit of a batch to its file (temporary name, then rename).

    Returns one row per unit: rows, truncated (of the clustered side), the encoder's busy seconds and its node."""

    def __init__(self, run_uri: str, side: str):
        self.run = RunDir(run_uri)
        self.side = side

    def __call__(self, batch: pa.Table) -> pa.Table:
        results = []
        for output in dict.fromkeys(batch.column(UNIT).to_pylist()):
            rows = batch.filter(pc.equal(batch.column(UNIT), output))
            expected = rows.column(UNIT_ROWS)[0].as_py()
            if rows.num_rows != expected:  # a unit split over blocks would overwrite its file with a part
                raise RuntimeError(f"embed: unit {output} reached its writer with {rows.num_rows} of {expected} rows.")
            self.run.write_parquet(output, output_table(rows, self.side), row_group_size=EMBEDDINGS_ROW_GROUP_ROWS)
            results.append({"rows": rows.num_rows, "truncated": int(np.asarray(rows.column("truncated")).sum()),
                            "busy_s": float(np.asarray(rows.column(ENCODE_S)).sum()),
                            "node": rows.column(NODE)[0].as_py(), "batching": rows.column(BATCHING)[0].as_py()})
        return pa.Table.from_pylist(results, schema=RESULT_SCHEMA)


RESULT_SCHEMA = pa.schema([("rows", pa.int64()), ("truncated", pa.int64()), ("busy_s", pa.float64()),
                           ("node", pa.string()), ("batching", pa.string())])


def output_table(rows: pa.Table, side: str) -> pa.Table:
    """The embeddings/ file layout: the pair columns, then emb<suffix> and truncated<suffix> per side."""
    added = [name for _, suffix in output_columns(side) for name in (f"emb{suffix}", f"truncated{suffix}")]
    internal = {UNIT, UNIT_ROWS, ENCODE_S, NODE, BATCHING}
    pair_columns = [c for c in rows.column_names if c not in internal and c not in added]
    return rows.select(pair_columns + added)


def check_finite(vectors: np.ndarray, pair_ids: np.ndarray, side: str, model: str) -> None:
    bad = ~np.isfinite(vectors).all(axis=1)
    if bad.any():
        ids = pair_ids[bad][:20].tolist()
        raise EmbeddingError(f"The encoder produced NaN/inf vectors for {int(bad.sum())} {side} texts (pair_ids "
                             f"{ids}{'...' if bad.sum() > 20 else ''}): the checkpoint at embed.model={model!r} "
                             f"is broken. Nothing of these rows was written; fix the model and rerun.")


def actor_pool_size(cfg: EmbedConfig, need: Resources) -> ActorPlan:
    """One actor (encoder replica) per `need.gpus` GPUs, else one per embed.threads_per_actor CPUs, each leaving
    CPU_ACTOR_SPARE of its CPUs to the tokenise and write actors."""
    pool = plan_actors(replace(need, cpus=cfg.threads_per_actor), max_actors=cfg.num_actors)
    return pool if pool.on_gpu else replace(pool, num_cpus=pool.num_cpus - CPU_ACTOR_SPARE)


def cpu_stage_pool(pool: ActorPlan, units: int) -> tuple[ray.data.ActorPoolStrategy, float]:
    """(autoscaling pool, CPUs per actor) of the tokenise stage and of the write stage: from one actor up
    to half each of the CPUs the encoders leave free (tokenising one ~80-token text costs ~1/8,000 of a
    CPU-second, so a GPU needs a few tokenisers and a CPU encoder pool one)."""
    cpus = GPU_STAGE_CPUS if pool.on_gpu else CPU_STAGE_CPUS
    free = ClusterResources.current().cpus - pool.actors * (pool.num_cpus or 1)
    most = max(1, min(units, int(free / 2 / cpus)))
    return ray.data.ActorPoolStrategy(min_size=1, max_size=most), cpus


def embed_dataset(run: RunDir, cfg: Config, todo: list[dict], pool: ActorPlan, pairs_run: RunDir,
                  tokenizer: TextTokenizer, prompts: tuple[str, str] = ("", "")) -> ray.data.Dataset:
    """units -> read + tokenise (CPU actors) -> encode (encoder actors) -> write (CPU actors): one result
    row per unit.

    Each stage streams into the next, so reading, tokenising and writing overlap the forward passes. A
    unit is one block from read to write (no block size limit on this dataset), so its writer holds it
    whole; the three operators are actor pools of their own, so Ray Data does not fuse them."""
    # Every item in one form (its pieces, then its file), so every block has the same columns.
    items = [{"inputs": [{"input": rel, "start": start, "stop": stop} for rel, start, stop in unit_pieces(unit)],
              "output": unit["output"]} for unit in todo]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds.context.target_max_block_size = None
    tokenise_pool, cpus = cpu_stage_pool(pool, len(todo))
    ds = ds.map_batches(TokenizeUnits, fn_constructor_args=(pairs_run.uri, tokenizer, cfg.embed.side, prompts),
                        batch_size=None, batch_format="pyarrow", compute=tokenise_pool, num_cpus=cpus)
    # A GPU actor gets its next unit while it runs one (that block may come from another node); a CPU actor
    # takes one at a time (a local fetch), so no unit waits queued at a busy actor while another is free.
    encode_pool = ray.data.ActorPoolStrategy(size=min(pool.actors, len(todo)),
                                             max_tasks_in_flight_per_actor=2 if pool.on_gpu else 1)
    ds = map_spread(ds.map_batches, EncodeTokens, first_actors=encode_pool.min_size, on_gpu=pool.on_gpu,
                    fn_constructor_args=(cfg.embed, pool.threads), batch_size=None, batch_format="pyarrow",
                    compute=encode_pool, **pool.options)
    write_pool, cpus = cpu_stage_pool(pool, len(todo))
    return ds.map_batches(WriteUnits, fn_constructor_args=(run.uri, cfg.embed.side), batch_size=None,
                          batch_format="pyarrow", compute=write_pool, num_cpus=cpus)


def run_units(run: RunDir, cfg: Config, todo: list[dict], pool: ActorPlan, pairs_run: RunDir
              ) -> tuple[list[dict], float]:
    """Embed `todo` (Ray Data restarts a dead actor and retries its task; a retried unit rewrites the same
    file name, so no row is lost or duplicated). Returns (per-unit results, actor seconds)."""
    from clusterscale.modeling.encoder import frozen_prompts, load_tokenizer, resolve_model_path  # torch: driver only

    started = time.time()
    tokenizer = TextTokenizer(load_tokenizer(resolve_model_path(cfg.embed.model), cfg.embed.trust_remote_code),
                              cfg.embed.max_length)
    ds = embed_dataset(run, cfg, todo, pool, pairs_run, tokenizer, frozen_prompts(cfg.embed))
    sides = len(output_columns(cfg.embed.side))
    unit = {"passage": "passages", "query": "queries"}.get(cfg.embed.side, "texts")  # texts/s: what a GPU sustains
    progress = ProgressLine("embed", sides * sum(unit_rows(u) for u in todo), unit=unit)
    results = []
    try:
        for result in ds.iter_rows():
            results.append(result)
            progress.advance(sides * result["rows"])
    except Exception as exc:  # surface our own error (NaN rows) without Ray Data's wrapping
        marker = "EmbeddingError: "
        text = str(exc)
        if marker in text:
            raise EmbeddingError(text.split(marker, 1)[1].splitlines()[0]) from exc
        raise
    return results, (time.time() - started) * min(pool.actors, len(todo))


def _count_done(run: RunDir, units: list[dict]) -> tuple[int, int]:
    """(rows, truncated) of units completed by an earlier attempt."""
    rows = truncated = 0
    for unit in units:
        with run.fs.open_input_file(run.path(unit["output"])) as f:
            column = pq.read_table(f, columns=["truncated"]).column("truncated")
        rows += len(column)
        truncated += int(np.asarray(column).sum())
    return rows, truncated


def run_embed(ctx: StageContext) -> StageResult:
    """Embed every pair not embedded yet (the units of an interrupted attempt with this fingerprint are kept).

    ctx.source: the run directory pairs/ is read from (re-embedding the same pairs with another encoder into a
    child run directory: mining with a trained model, re-clustering). The pairs are read from ctx.input("pairs"):
    pairs/, or the output of a stage registered to stand in for it (a filter between ingest and embed)."""
    folder = ctx.input("pairs")
    stats = ctx.source.done_stats(folder)
    return embed_folder(ctx, folder, "embeddings", stats["pairs"] if "pairs" in stats else stats["rows"])


def run_embed_heldout(ctx: StageContext) -> StageResult:
    """Embed the held-out pairs with the frozen encoder into embeddings_heldout/ (same units, actors and resume as
    embed): the vectors dedup's held-out leak check routes, made on the cluster's GPUs like the training pairs'."""
    return embed_folder(ctx, "heldout", HELDOUT_EMBEDDINGS, ctx.source.done_stats("heldout")["rows"])


def embed_folder(ctx: StageContext, source: str, out: str, expected: int) -> StageResult:
    """Embed the `expected` rows of ctx.source's `source` folder into ctx.run's `out` (embed and embed_heldout)."""
    from clusterscale.modeling.encoder import check_encoder  # torch: in the driver only

    cfg, run, pairs_run, fingerprint = ctx.cfg, ctx.run, ctx.source, ctx.fingerprint
    check_encoder(cfg.embed.model, cfg.embed.trust_remote_code)
    pool = actor_pool_size(cfg.embed, ctx.resources)
    plan = load_or_make_plan(run, out, f"{out}/{PLAN}", fingerprint, "embedding",
                             lambda: make_plan(cfg, pool.actors, pairs_run, expected, source, out))
    done, todo = split_done(run, out, plan["units"])
    if done:
        print(f"[embed] resuming: {len(done)}/{len(plan['units'])} units already complete", flush=True)
    started = time.time()
    results, worker_s = run_units(run, cfg, todo, pool, pairs_run) if todo else ([], 0.0)
    rows_before, truncated_before = _count_done(run, done)
    rows = rows_before + sum(r["rows"] for r in results)
    if rows != expected:
        raise RuntimeError(f"{out}/ holds {rows} rows but {source}/ has {expected}: delete {out}/ and rerun.")
    wall = time.time() - started
    embedded = rows - rows_before
    device = pool.device
    stats = {"rows": rows, "rows_embedded": embedded, "units": len(plan["units"]), "units_skipped": len(done),
             "truncated": truncated_before + sum(r["truncated"] for r in results),
             "actors": min(pool.actors, len(todo)), "wall_s": round(wall, 3),
             "rows_per_s": round(embedded / wall, 2) if wall > 0 else 0.0, "worker_s": round(worker_s, 3),
             "busy_s": round(sum(r["busy_s"] for r in results), 3), "device": device,
             "batching": ", ".join(sorted({r["batching"] for r in results})) or "none (every unit reused)",
             **node_stats(r["node"] for r in results)}
    if device == "gpu":
        stats["gpu_s"] = stats["worker_s"]
    print(f"[embed] {embedded} rows in {wall:.1f}s ({stats['rows_per_s']:.1f} rows/s, {stats['actors']} actor(s), "
          f"{worker_s:.0f} {device}-actor-seconds, {stats['busy_s']:.0f} busy, {stats['batching']} batches); {len(done)} unit(s) reused; "
          f"{stats['truncated']} texts truncated at {cfg.embed.max_length} tokens", flush=True)
    return StageResult(stats, config={"embed": cfg.embed.to_dict(), "rows_per_unit": plan["rows_per_unit"]})
