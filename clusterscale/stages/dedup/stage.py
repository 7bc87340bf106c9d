"""The dedup stage: mark -> exact by key bucket -> (with the routed held-out vectors) semantic and write by
cluster, as Ray Data steps over assign/k=<k>/; its stats and the removed rows it leaves.

A cluster is the unit of resume: once every file of a cluster (each block of a split one) is written, the driver
records its counts in dedup/_units/c<cluster>.json. A rerun of an interrupted attempt (same config: dedup/_plan.json
holds the fingerprint and the block plan) runs the exact step over every row (a kept row of a finished cluster can
be the first copy of a row elsewhere) and sends only the rows of the clusters not recorded on to the semantic step,
which writes the same files as an uninterrupted run."""
from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config
from clusterscale.errors import UserError
from clusterscale.io.layout import DEDUP, DEDUP_KEPT, DEDUP_REMOVED, HELDOUT_EMBEDDINGS, assign_dir
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.bounded_data import (bounded_shuffle_maps, one_key_per_partition, shuffle_for,
                                               read_row_groups)
from clusterscale.runtime.progress import ProgressLine
from clusterscale.runtime.resources import ClusterResources
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.vector_search import wants_gpus
from clusterscale.runtime.vectors import truncated_schema
from clusterscale.runtime.work_units import load_or_make_plan, split_done
from clusterscale.stages.dedup.exact import MARK_FIELDS, mark_rows, resolve_exact
from clusterscale.stages.dedup.heldout import heldout_vector_source, load_heldout_keys, route_heldout, vector_columns
from clusterscale.stages.dedup.partitions import BlockPlan
from clusterscale.stages.dedup.policy import check_config
from clusterscale.stages.dedup.blocks import BLOCKS, cluster_group, cluster_sizes, run_split_clusters
from clusterscale.stages.dedup.semantic import REMOVED_SCHEMA, group_rows_limit
from clusterscale.stages.kmeans import load_centroids
from clusterscale.runtime.nodes import node_stats

PLAN = f"{DEDUP}/_plan.json"  # the fingerprint and the block plan's inputs, fixed at the first attempt
UNITS = f"{DEDUP}/_units"  # one record per finished cluster: its counts rows
ROWS_PER_BUCKET = 25_000  # rows of one exact-dedup reduce task (all columns of its rows are in memory)
MARK_BATCH_ROWS = 4096  # rows per map batch (mark, and routing held-out vectors)
NUM_EXAMPLES = 3  # example groups in the stats (the report shows them)


def removed_table(run: RunDir) -> pa.Table:
    """Every removed row (pair_id, duplicate_of, similarity, reason, cluster) of the finished dedup stage (of the
    clustering dedup/_DONE.json names)."""
    files = run.files(DEDUP_REMOVED)
    if not files:
        return REMOVED_SCHEMA.empty_table()
    return pa.concat_tables([pq.read_table(run.fs.open_input_file(f)) for f in files])


def heldout_vectors_folder(ctx: StageContext) -> str | None:
    """The folder of the held-out pairs' vectors for the semantic leak check: heldout/ where it stores them
    (synthetic runs), else embeddings_heldout/, made by the embed_heldout stage (the frozen encoder on the
    cluster's GPUs, like embed's; reused when done); None without a semantic threshold or held-out pairs."""
    cfg, run = ctx.cfg, ctx.run
    if cfg.dedup.semantic_threshold <= 0 or not run.files("heldout"):
        return None
    with run.fs.open_input_file(run.files(assign_dir(cfg.cluster.k))[0]) as f:
        vectors = vector_columns(pq.read_schema(f).names)
    if heldout_vector_source(cfg, run, vectors) is None:
        return "heldout"
    ctx.stage("embed_heldout", cfg, run)
    return HELDOUT_EMBEDDINGS


def routed_heldout(cfg: Config, run: RunDir, folder: str | None, schema: pa.Schema, plan: BlockPlan
                   ) -> ray.data.Dataset | None:
    """The held-out vectors of `folder` (heldout_vectors_folder) as rows of `schema`, one per (held-out pair, probed
    cluster) (route_heldout); None when there are none to check."""
    if folder is None:
        return None
    columns = ["pair_id", *vector_columns(schema.names)]
    return read_row_groups(run, run.files(folder), columns).map_batches(
        route_heldout, fn_kwargs={"centroids": load_centroids(run, cfg.cluster.k), "nprobe": cfg.dedup.heldout_nprobe,
                                  "schema": schema, "cluster_keys": plan},
        batch_size=MARK_BATCH_ROWS, batch_format="pyarrow")


def _block_plan(cfg: Config, run: RunDir, files: list[str], footer: pq.FileMetaData, n_rows: int) -> dict:
    """A fresh attempt's plan: dedup.max_group_rows resolved (auto: by a row's bytes in memory, Parquet's
    uncompressed size, and its float32 vector) and, when some cluster may be larger, the rows of each cluster id (a
    pass over assign/'s cluster column): a cluster with more rows is split into blocks (stages/dedup/blocks.py)."""
    d = footer.schema.to_arrow_schema().field("emb").type.list_size
    d = min(d, cfg.cluster.dims) if cfg.cluster.dims else d  # the semantic pass compares cluster.dims
    row_bytes = (footer.row_group(0).total_byte_size / max(footer.row_group(0).num_rows, 1)
                 if footer.num_row_groups else 0.0) + 4 * d
    limit = group_rows_limit(cfg.dedup, row_bytes)
    clusters = cfg.cluster.k + 1  # + 1: a pooled small-cluster id may be k
    sizes = cluster_sizes(run, files, clusters).tolist() if n_rows > limit else None
    return {"max_group_rows": limit, "sizes": sizes}


def _recorded(run: RunDir) -> dict[int, list[dict]]:
    """{cluster: its counts rows} of the clusters an earlier attempt finished (one listing, one read each)."""
    names = [n for n in (run.listdir(UNITS) if run.exists(UNITS) else []) if n.endswith(".json")]
    return {int(n[1:-5]): run.read_json(f"{UNITS}/{n}")["results"] for n in sorted(names)}


def _record(run: RunDir, cluster: int, results: list[dict]) -> None:
    run.write_json(f"{UNITS}/c{cluster:06d}.json", {"results": [_plain(r) for r in results]})


def _plain(result) -> dict:
    """A counts row as JSON values (Ray Data hands lists as numpy arrays)."""
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v.item() if isinstance(v, np.generic) else v)
            for k, v in dict(result).items()}


def _drop_parts(batch: pa.Table, done_keys: np.ndarray) -> pa.Table:
    """The rows (and routed held-out vectors) bound for the clusters not finished yet."""
    return batch.filter(pc.invert(pc.is_in(batch.column("part"), pa.array(done_keys, pa.int64()))))


def dedup_all(cfg: Config, run: RunDir, heldout: dict, n_rows: int, fingerprint: str, held_folder: str | None
              ) -> list[dict]:
    """Run mark -> exact by key bucket -> (with the routed held-out vectors) semantic and write by cluster; the
    per-cluster results (those an interrupted attempt with this fingerprint recorded, and the rest)."""
    files = run.files(assign_dir(cfg.cluster.k))
    with run.fs.open_input_file(files[0]) as f:
        footer = pq.read_metadata(f)
    # The rows as dedup moves them: with cluster.dims, the vectors truncated (exact.mark_rows)
    schema = truncated_schema(footer.schema.to_arrow_schema().remove_metadata(), cfg.cluster.dims)
    columns = schema.names
    stored = load_or_make_plan(run, DEDUP, PLAN, fingerprint, "dedup",
                               lambda: _block_plan(cfg, run, files, footer, n_rows))
    limit = int(stored["max_group_rows"])
    dedup_cfg = dataclasses.replace(cfg.dedup, max_group_rows=limit)
    clusters = cfg.cluster.k + 1
    plan = BlockPlan.of(np.asarray(stored["sizes"], np.int64), limit, cfg.dedup.semantic_threshold > 0) \
        if stored["sizes"] is not None else BlockPlan.whole(clusters)
    # One partition per exact bucket and per cluster or block, each grouped by the stand-in that lands in its own
    # partition: a reduce holds one of them, whatever N.
    buckets = max(1, math.ceil(n_rows / ROWS_PER_BUCKET))
    bucket_keys = one_key_per_partition(buckets)
    progress, results, pending = ProgressLine(
        "dedup", n_rows, before_first="the pairs are shuffled to their buckets and clusters first"), [], []
    done = _recorded(run)
    for folder in (DEDUP_KEPT, DEDUP_REMOVED):  # the temp files of writes a kill cut short
        if run.exists(folder):
            split_done(run, folder, [])
    if done:
        print(f"[dedup] resuming: {len(done)} cluster(s) were deduplicated by an earlier attempt", flush=True)
        for found in done.values():
            results += found
            progress.advance(sum(r["rows"] for r in found))
    done_keys = np.concatenate([plan.keys[plan.first[c]:plan.first[c] + plan.blocks[c] + (plan.heldout[c] >= 0)]
                                for c in done]) if done else None
    run.remove(BLOCKS)  # the blocks of an interrupted attempt: a split cluster not finished is redone whole
    # A GPU per semantic task when the cluster has GPUs the backend can use (vector_search.wants_gpus).
    gpus = {"num_gpus": 1} if cfg.dedup.semantic_threshold > 0 and wants_gpus(
        cfg.ray.vector_backend, ClusterResources.current().gpus) else {}
    with bounded_shuffle_maps(shuffle_for(cfg.ray, run, files, n_rows)):  # 64 MiB maps (runtime/bounded_data)
        ds = read_row_groups(run, files, columns)
        ds = ds.map_batches(mark_rows, fn_kwargs={"dc": cfg.dedup, "heldout": heldout, "bucket_keys": bucket_keys,
                                                  "cluster_keys": plan, "dims": cfg.cluster.dims},
                            batch_size=MARK_BATCH_ROWS, batch_format="pyarrow")
        if cfg.dedup.exact:
            ds = ds.groupby("bucket", num_partitions=buckets).map_groups(resolve_exact, batch_format="pyarrow")
        held = routed_heldout(cfg, run, held_folder, pa.schema([*schema, *MARK_FIELDS]), plan)
        if held is not None:
            ds = ds.union(held)
        if done_keys is not None:
            ds = ds.map_batches(_drop_parts, fn_kwargs={"done_keys": done_keys}, batch_format="pyarrow")
        ds = ds.groupby("part", num_partitions=plan.partitions).map_groups(
            cluster_group, fn_kwargs={"run_uri": run.uri, "dc": dedup_cfg, "columns": columns, "plan": plan,
                                      "backend": cfg.ray.vector_backend}, batch_format="pyarrow", **gpus)
        blocks_done: dict[int, list[dict]] = {}  # the blocks of clusters split without a semantic step
        for result in ds.iter_rows():
            if result["pending"]:
                if result["block"] >= 0:  # a split cluster's block, not its held-out vectors
                    pending.append((result["cluster"], result["block"]))
                continue
            results.append(result)
            progress.advance(result["rows"])
            if result["block"] < 0:  # a whole cluster, written
                _record(run, result["cluster"], [result])
            else:
                blocks_done.setdefault(result["cluster"], []).append(result)
        for cluster, found in blocks_done.items():  # every block of theirs is written once the shuffle is done
            _record(run, cluster, found)
    if pending:  # the split clusters' tasks: a line for the chunks decided, then the rows as they are written
        results += _split_clusters(run, pending, columns, dedup_cfg, progress, cfg.ray.vector_backend,
                                   gpus.get("num_gpus", 0))
    run.remove(BLOCKS)
    return results


def _split_clusters(run: RunDir, pending: list[tuple[int, int]], columns: list[str], dc, progress: ProgressLine,
                    backend: str, gpus: float) -> list[dict]:
    """Run the split clusters' chains (blocks.run_split_clusters); their blocks' counts rows, each cluster recorded
    once all its blocks are written."""
    decided, writes = run_split_clusters(run, pending, columns, dc, backend, gpus)
    print(f"[dedup] {len({c for c, _ in pending})} cluster(s) over dedup.max_group_rows={dc.max_group_rows:,} rows: "
          f"{len(decided):,} chunks, each decided in keep order against the rows kept before it", flush=True)
    chunks, decided_ids = ProgressLine("dedup", len(decided), unit="chunks"), {r.hex() for r in decided}
    left = {c: sum(1 for cluster, _ in pending if cluster == c) for c, _ in pending}
    by_cluster: dict[int, list[dict]] = {}
    results, waiting = [], decided + writes
    del decided
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        if ready[0].hex() in decided_ids:
            chunks.advance(1)
            continue
        result = ray.get(ready[0])
        results.append(result)
        progress.advance(result["rows"])
        cluster = result["cluster"]
        by_cluster.setdefault(cluster, []).append(result)
        left[cluster] -= 1
        if not left[cluster]:
            _record(run, cluster, sorted(by_cluster.pop(cluster), key=lambda r: r["block"]))
    return results


def run_dedup(ctx: StageContext) -> StageResult:
    """Write dedup/kept/ and dedup/removed/ from assign/k=<k>/ and heldout/; kept + removed = assigned. The done
    markers (dedup/_DONE.json with the counts, dedup/kept/'s with the kept rows) carry k."""
    cfg, run = ctx.cfg, ctx.run
    check_config(cfg)
    started = time.time()
    n_rows = int(run.done_stats(assign_dir(cfg.cluster.k))["rows"])
    heldout = load_heldout_keys(run)
    held_folder = heldout_vectors_folder(ctx)  # may run embed_heldout first (its own output and lock)
    results = dedup_all(cfg, run, heldout, n_rows, ctx.fingerprint, held_folder)
    stats = stage_stats(cfg, results, n_rows, heldout["pairs"], time.time() - started)
    print(f"[dedup] {n_rows} pairs: kept {stats['rows']}, removed {stats['removed']} (exact {stats['exact']}, "
          f"semantic {stats['semantic']}, held-out leaks {stats['heldout_leak']}) in {stats['wall_s']:.1f}s",
          flush=True)
    if n_rows and not stats["rows"]:
        raise UserError(nothing_kept(cfg, stats, n_rows))
    config = {"dedup": cfg.dedup.to_dict(), "cluster": cfg.cluster.to_dict()}
    kept = StageResult({"rows": stats["rows"], "k": cfg.cluster.k}, config=config)
    return StageResult(stats, outputs={DEDUP_KEPT: kept}, config=config)


def nothing_kept(cfg: Config, stats: dict, n_rows: int) -> str:
    """The error of a dedup that removed every training pair: which rule did, and the key to change."""
    dc = cfg.dedup
    said = (f"dedup removed all {n_rows} training pairs (exact {stats['exact']}, semantic {stats['semantic']}, "
            f"held-out leaks {stats['heldout_leak']}), so there is nothing to shard.")
    if stats["semantic"] + stats["heldout_leak"] >= max(stats["exact"], 1):
        return (f"{said} dedup.semantic_threshold={dc.semantic_threshold:g} is below the cosine of unrelated pairs "
                f"for {cfg.embed.model} (a randomly initialised or untrained encoder puts every text within ~0.9 of "
                f"every other): raise it (near-duplicates sit above 0.95 with a trained encoder) or set it to 0.")
    return (f"{said} Every pair repeats another (dedup.key={dc.key}): check data.query_column and "
            f"data.passage_column, or set dedup.exact=false.")


def stage_stats(cfg: Config, results: list[dict], n_rows: int, n_heldout: int, wall: float) -> dict:
    """The done marker's figures: rows = kept (what shard reads), removed per reason and per cluster, the histogram
    of best cosines near the threshold, example groups; raises when kept + removed != assigned."""
    totals = {name: sum(r[name] for r in results) for name in ("rows", "kept", *core.REASONS.values())}
    removed = sum(totals[name] for name in core.REASONS.values())
    if totals["rows"] != n_rows or totals["kept"] + removed != n_rows:
        raise RuntimeError(f"dedup saw {totals['rows']} rows (kept {totals['kept']}, removed {removed}) but "
                           f"assign/k={cfg.cluster.k}/ holds {n_rows}: rerun `clusterscale dedup`.")
    edges, _ = core.histogram_near(np.zeros(0), cfg.dedup.semantic_threshold)
    histogram = np.sum([r["histogram"] for r in results], axis=0).astype(int).tolist() if results else []
    # a split cluster's results come per block: its removals added up, its largest block's example group
    removed_per_cluster: dict[int, int] = {}
    for r in results:
        removed_per_cluster[r["cluster"]] = removed_per_cluster.get(r["cluster"], 0) + r["rows"] - r["kept"]
    examples = sorted((json.loads(r["example"]) for r in results if r["example"]),
                      key=lambda e: (-e["size"], e["cluster"]))
    examples = [e for n, e in enumerate(examples) if e["cluster"] not in {x["cluster"] for x in examples[:n]}]
    return {"rows": totals["kept"], "assigned": n_rows, "removed": removed,
            **{name: totals[name] for name in core.REASONS.values()}, "heldout_pairs": n_heldout,
            "removed_per_cluster": {str(c): removed_per_cluster[c] for c in sorted(removed_per_cluster)},
            "similarity_histogram": {"edges": edges, "counts": histogram} if cfg.dedup.semantic_threshold else None,
            "examples": examples[:NUM_EXAMPLES], "k": cfg.cluster.k, "wall_s": round(wall, 3),
            "worker_s": round(wall, 3), **node_stats(r["node"] for r in results)}
