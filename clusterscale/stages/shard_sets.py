"""Shard sets of the baseline samplers, written from the clustered shards with the shard stage's writer.

shards/k=<k>/<sampler>/stratum=<s>/part-<group>-<part>.parquet and shards/k=<k>/<sampler>/manifest.json
(written last) for train.sampler
  random           one stratum: every row, globally shuffled (a seeded permutation of the rows' positions)
  random_clusters  seeded pseudo-clusters with exactly the cluster shards' sizes (the same permutation, cut)
  source           one stratum per value of the `source` column; names and counts from per-file Ray tasks
Row groups are sized to the per-rank batch like the clustered shards', so every sampler trains from files a
rank reads row group by row group. The train stage builds the set its sampler needs through the executor
(the shard_set stage of pipeline.STAGES: fingerprinted, reused by every training run of the same clustering,
such as compare's arms and seeds; rebuilt whole after an interrupted attempt). Positions and source codes are computed per
shard file in Ray tasks: no process holds a row per pair.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from clusterscale.config import Config
from clusterscale.io.layout import TrainDataError, checked_manifest, shard_set_dir, shard_set_manifest_path, shards_dir
from clusterscale.io.records import ShardEntry, ShardManifest
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.stages.shards import (GROUPS_DIR, LABELED_COLUMNS, SHARD_COLUMNS, GroupSizes, SetLayout,
                                        file_sizes, sub_groups, write_groups)
from clusterscale.runtime.bounded_data import bounded_shuffle_maps, shuffle_for
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.hashing import SeededPermutation

SET_SAMPLERS = ("random", "random_clusters", "source")
PERMUTATION_SALT = {"random": 0x7A11D0, "random_clusters": 0x5EED}
NO_SOURCE = "(none)"  # the stratum of rows whose source is null
MAX_READ_TASKS = 200  # read tasks over the clustered files (each reads whole files, one at a time)


@dataclass(frozen=True)
class SetKeys:
    """Which stratum (`shard`) and sub-group (`sub`) of the set each row goes to.

    random / random_clusters: a row at position p of the clustered shards (concatenated in manifest order)
    lands at perm(p) of the set, a seeded permutation; strata are consecutive ranges of that order (`starts`)
    and sub-groups ranges of `group_rows` inside them (whole row groups, so that only a stratum's last file
    ends on a partial row group and a global batch stays whole row groups). source: the code of its source
    (index in `names`) and a seeded hash of pair_id into `num_groups` sub-groups, as the clustered shards split
    a cluster."""

    sampler: str
    total: int
    seed: int
    group_rows: int
    starts: np.ndarray | None = None      # first set position of each stratum (permuted samplers)
    names: tuple[str, ...] = ()           # source names, sorted (source)
    num_groups: np.ndarray | None = None  # sub-groups per source (source)

    def __call__(self, table: pa.Table, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.sampler == "source":
            values = table.column("source").fill_null(NO_SOURCE)
            shard = pc.index_in(values, value_set=pa.array(self.names, pa.string())).to_numpy(zero_copy_only=False)
            return shard.astype(np.int64), sub_groups(table.column("pair_id").to_numpy(), self.num_groups[shard],
                                                      self.seed)
        where = SeededPermutation(self.total, [self.seed, PERMUTATION_SALT[self.sampler]])(positions)
        shard = np.searchsorted(self.starts, where, side="right") - 1
        return shard, (where - self.starts[shard]) // self.group_rows


def read_keyed_files(batch: dict, run_uri: str, keys: SetKeys, columns: list[str]) -> pa.Table:
    """Ray Data map_batches fn over (file, offset) items: reads each clustered shard file whole (at most
    file_sizes rows: a few global batches) and adds every row's `shard` and `sub` in the set."""
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


def count_sources(batch: dict, run_uri: str) -> pa.Table:
    """Ray Data map_batches fn over file items: (source, count) of the `source` values of these files, nulls
    counted as NO_SOURCE."""
    run = RunDir(run_uri)
    columns = [pq.read_table(run.fs.open_input_file(run.path(rel)), columns=["source"]).column("source")
               .cast(pa.string()) for rel in batch["file"].tolist()]
    counts = pc.value_counts(pa.chunked_array(columns, pa.string()).fill_null(NO_SOURCE))
    return pa.table({"source": counts.field("values"), "count": counts.field("counts")})


def source_counts(run: RunDir, files: list[str]) -> tuple[list[str], np.ndarray]:
    """(sorted source names, rows of each): Ray tasks count the values of batches of files (many small files:
    a task reads a batch of them), the driver adds the counts up (O(sources))."""
    schema = pq.read_schema(run.fs.open_input_file(run.path(files[0])))
    if "source" not in schema.names:
        raise TrainDataError("train.sampler=source needs a `source` column in the shards, and they have none: "
                             "set data.source_column when ingesting (in a new --run-dir), or use another sampler.")
    ds = ray.data.from_items([{"file": f} for f in files], override_num_blocks=min(len(files), MAX_READ_TASKS))
    totals: dict[str, int] = {}
    for batch in ds.map_batches(count_sources, fn_args=(run.uri,), batch_size=None, batch_format="numpy") \
            .iter_batches(batch_size=None, batch_format="pyarrow"):
        for name, n in zip(batch.column("source").to_pylist(), batch.column("count").to_pylist()):
            totals[name] = totals.get(name, 0) + n
    counts = sorted(totals.items())
    if [name for name, _ in counts] == [NO_SOURCE]:
        raise TrainDataError("train.sampler=source: every row's `source` is empty. Set data.source_column to the "
                             "input column naming each pair's source (in a new --run-dir), or use another sampler.")
    return [name for name, _ in counts], np.array([n for _, n in counts], dtype=np.int64)


def set_strata(cfg: Config, run: RunDir, base: ShardManifest) -> tuple[SetKeys, np.ndarray, list[str]]:
    """(row keys, rows per stratum, stratum names) of the set of cfg.train.schedule.sampler."""
    sampler, seed, max_group = cfg.train.schedule.sampler, cfg.cluster.seed, cfg.shard.max_group_rows
    row_group_rows = file_sizes(cfg)[1]
    base_sizes = np.array(base.strata_sizes, dtype=np.int64)
    total = int(base_sizes.sum())
    if sampler == "source":
        names, sizes = source_counts(run, base.files)
        keys = SetKeys(sampler, total, seed, max_group, names=tuple(names), num_groups=-(-sizes // max_group))
        return keys, sizes, names
    sizes = np.array([total]) if sampler == "random" else base_sizes
    group_rows = max(1, max_group // row_group_rows) * row_group_rows
    keys = SetKeys(sampler, total, seed, group_rows, starts=np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    names = ["random"] if sampler == "random" else [f"random-{s}" for s in range(len(sizes))]
    return keys, sizes, names


def run_shard_set(ctx: StageContext) -> StageResult:
    """Write shards/k=<k>/<train.sampler>/ from the clustered shards: the set's files and its manifest."""
    cfg, run, fingerprint = ctx.cfg, ctx.run, ctx.fingerprint
    k, sampler, started = cfg.cluster.k, cfg.train.schedule.sampler, time.time()
    if sampler not in SET_SAMPLERS:
        raise ValueError(f"train.sampler={sampler} trains from the clustered shards, not from a shard set.")
    base = checked_manifest(run, k, cfg.train.schedule.global_batch_size)
    keys, sizes, names = set_strata(cfg, run, base)
    files = file_offsets(base)
    schema = pq.read_schema(run.fs.open_input_file(run.path(files[0]["file"])))
    columns = [c for c in SHARD_COLUMNS + LABELED_COLUMNS if c in schema.names]
    rows_per_file, row_group_rows = file_sizes(cfg)
    layout = SetLayout(shard_set_dir(k, sampler), "stratum", cfg.cluster.seed, rows_per_file, row_group_rows,
                       cfg.shard.num_samples)
    num_groups = -(-sizes // keys.group_rows)
    group_sizes = GroupSizes(keys.total, int(num_groups.sum()), int((sizes / np.maximum(num_groups, 1)).max()),
                             cfg.shard.max_group_rows)
    paths = [run.path(f["file"]) for f in files]
    # The same bounded hash shuffle as the clustered shards' (64 MiB maps, through files when large): made inside.
    with bounded_shuffle_maps(shuffle_for(cfg.ray, run, paths[:1], keys.total)):
        ds = ray.data.from_items(files, override_num_blocks=min(len(files), MAX_READ_TASKS))
        ds = ds.map_batches(read_keyed_files, fn_args=(run.uri, keys, columns), batch_size=1, batch_format="numpy")
        groups = write_groups(ds, run, k, layout, columns, group_sizes, paths, f"shard {sampler}", ctx.resources)
    strata = [set_entry(s, names[s], groups.get(s, []), int(sizes[s]), cfg.shard.num_samples)
              for s in range(len(sizes))]
    stats = {"k": k, "sampler": sampler, "shards": len(strata), "rows": keys.total,
             "files": sum(len(c.files) for c in strata), "min_rows": int(sizes.min()),
             "max_rows": int(sizes.max()), "wall_s": round(time.time() - started, 3)}
    stats["worker_s"] = stats["wall_s"]
    run.write_json(shard_set_manifest_path(k, sampler), ShardManifest(
        k=k, fingerprint=fingerprint, global_batch_size=cfg.train.schedule.global_batch_size, clusters=strata, stats=stats,
        row_group_rows=row_group_rows, rows_per_file=rows_per_file, seed=cfg.cluster.seed, sampler=sampler,
        clustered_fingerprint=base.fingerprint).to_json())
    run.remove(shard_set_dir(k, sampler), GROUPS_DIR)
    print(f"[shard] train.sampler={sampler}: {keys.total} rows into {len(strata)} shards ({stats['files']} files) "
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
