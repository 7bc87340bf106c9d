"""Shard sets of the samplers that read a set of their own, written from the clustered shards with the shard
stage's writer.

shards/k=<k>/<sampler>/stratum=<s>/part-<group>-<part>.parquet and shards/k=<k>/<sampler>/manifest.json (written last)
for a train.sampler whose own name is in its `sets` (train/samplers/: random, random_clusters, source, or a new one):
its set_strata says which stratum and sub-group each row goes to. Row groups are sized to the per-rank batch like the
clustered shards', so every sampler trains from files a rank reads row group by row group. The train stage builds
the sets its sampler needs through the executor (the shard_set stage of pipeline.STAGES: fingerprinted, reused by
every training run of the same clustering, such as compare's arms and seeds; rebuilt whole after an interrupted
attempt). Row keys are computed per shard file in Ray tasks: no process holds a row per pair.
"""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config
from clusterscale.io.layout import TrainDataError, checked_manifest, shard_set_dir, shard_set_manifest_path, shards_dir
from clusterscale.io.records import ShardEntry, ShardManifest
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.io.sizing import GroupSizes, file_sizes
from clusterscale.stages.shards import GROUPS_DIR, LABELED_COLUMNS, SHARD_COLUMNS, SetLayout, write_groups
from clusterscale.runtime.bounded_data import bounded_shuffle_maps, shuffle_for
from clusterscale.runtime.stage_context import StageContext
from clusterscale.train.samplers import SetStrata, sampler as get_sampler

MAX_READ_TASKS = 200  # read tasks over the clustered files (each reads whole files, one at a time)


def read_keyed_files(batch: dict, run_uri: str, keys, columns: list[str]) -> pa.Table:
    """Ray Data map_batches fn over (file, offset) items: reads each clustered shard file whole (at most
    file_sizes rows: a few global batches) and adds every row's `shard` and `sub` in the set (keys: SetStrata.keys)."""
    run, tables = RunDir(run_uri), []
    for rel, offset in zip(batch["file"].tolist(), batch["offset"].tolist()):
        table = pq.read_table(run.fs.open_input_file(run.path(rel)), columns=columns)
        shard, sub = keys(table, offset + np.arange(table.num_rows, dtype=np.int64))
        tables.append(table.append_column("shard", pa.array(shard)).append_column("sub", pa.array(sub)))
    return pa.concat_tables(tables)


def file_offsets(base: ShardManifest) -> list[dict]:
    """(file, first row position) of every clustered shard file, shards concatenated in manifest order."""
    items, offset = [], 0
    for cluster in base.clusters:
        if cluster.file_rows is None:
            raise TrainDataError(f"The manifest of {shards_dir(base.k)}/ lists no rows per file (written by an "
                                 f"older shard stage): rerun `clusterscale shard` with --replace.")
        for rel, rows in zip(cluster.files, cluster.file_rows):
            items.append({"file": rel, "offset": offset})
            offset += int(rows)
    return items


def set_strata(cfg: Config, run: RunDir, base: ShardManifest) -> SetStrata:
    """The strata of the set of cfg.train.schedule.sampler (its sampler's set_strata)."""
    return get_sampler(cfg.train.schedule.sampler).set_strata(cfg, run, base, file_sizes(cfg)[1])


def run_shard_set(ctx: StageContext) -> StageResult:
    """Write shards/k=<k>/<train.sampler>/ from the clustered shards: the set's files and its manifest."""
    cfg, run, fingerprint = ctx.cfg, ctx.run, ctx.fingerprint
    k, sampler, started = cfg.cluster.k, cfg.train.schedule.sampler, time.time()
    if not get_sampler(sampler).writes_set():
        raise ValueError(f"train.sampler={sampler} trains from {', '.join(get_sampler(sampler).sets)}, not from a "
                         f"shard set of its own.")
    base = checked_manifest(run, k, cfg.train.schedule.global_batch_size)
    strata = set_strata(cfg, run, base)
    keys, sizes, names = strata.keys, np.asarray(strata.sizes, np.int64), strata.names
    total = int(sum(base.strata_sizes))
    files = file_offsets(base)
    schema = pq.read_schema(run.fs.open_input_file(run.path(files[0]["file"])))
    columns = [c for c in SHARD_COLUMNS + LABELED_COLUMNS if c in schema.names]
    rows_per_file, row_group_rows = file_sizes(cfg)
    layout = SetLayout(shard_set_dir(k, sampler), "stratum", cfg.cluster.seed, rows_per_file, row_group_rows,
                       cfg.shard.num_samples)
    num_groups = -(-sizes // strata.group_rows)
    group_sizes = GroupSizes(total, int(num_groups.sum()), int((sizes / np.maximum(num_groups, 1)).max()),
                             cfg.shard.max_group_rows)
    paths = [run.path(f["file"]) for f in files]
    # The same bounded hash shuffle as the clustered shards' (64 MiB maps, through files when large): made inside.
    with bounded_shuffle_maps(shuffle_for(cfg.ray, run, paths[:1], total)):
        ds = ray.data.from_items(files, override_num_blocks=min(len(files), MAX_READ_TASKS))
        ds = ds.map_batches(read_keyed_files, fn_args=(run.uri, keys, columns), batch_size=1, batch_format="numpy")
        groups = write_groups(ds, run, k, layout, columns, group_sizes, paths, f"shard {sampler}", ctx.resources)
    entries = [set_entry(s, names[s], groups.get(s, []), int(sizes[s]), cfg.shard.num_samples)
               for s in range(len(sizes))]
    stats = {"k": k, "sampler": sampler, "shards": len(entries), "rows": total,
             "files": sum(len(c.files) for c in entries), "min_rows": int(sizes.min()),
             "max_rows": int(sizes.max()), "wall_s": round(time.time() - started, 3)}
    stats["worker_s"] = stats["wall_s"]
    run.write_json(shard_set_manifest_path(k, sampler), ShardManifest(
        k=k, fingerprint=fingerprint, global_batch_size=cfg.train.schedule.global_batch_size, clusters=entries, stats=stats,
        row_group_rows=row_group_rows, rows_per_file=rows_per_file, seed=cfg.cluster.seed, sampler=sampler,
        clustered_fingerprint=base.fingerprint).to_json())
    run.remove(shard_set_dir(k, sampler), GROUPS_DIR)
    print(f"[shard] train.sampler={sampler}: {total} rows into {len(entries)} shards ({stats['files']} files) "
          f"under {shard_set_dir(k, sampler)}/", flush=True)
    return StageResult(stats)


def set_entry(stratum: int, name: str, groups: list[dict], expected: int, num_samples: int) -> ShardEntry:
    """The manifest entry of one shard of a set (the clustered manifest's record, so one reader reads both)."""
    rows = sum(g["rows"] for g in groups)
    if rows != expected:
        raise RuntimeError(f"Shard {name!r} of the set holds {rows} rows, expected {expected}: rerun `train`.")
    return ShardEntry(cluster=stratum, name=name, rows=rows, files=[f for g in groups for f in g["files"]],
                      file_rows=[int(n) for g in groups for n in g["file_rows"]], groups=len(groups),
                      samples=[q for g in groups for q in g["samples"]][:num_samples])
