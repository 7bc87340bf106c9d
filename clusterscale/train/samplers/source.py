"""source: every global batch from one value of the `source` column (data.source_column), strata counted by Ray
tasks over the clustered shards' files (the driver adds O(sources) counts)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clusterscale.io.layout import TrainDataError
from clusterscale.io.records import ShardManifest
from clusterscale.io.rundir import RunDir
from clusterscale.runtime.hashing import sub_groups
from clusterscale.train.samplers import Sampler, SetStrata
from clusterscale.train.schedule_config import SAMPLERS

NO_SOURCE = "(none)"  # the stratum of rows whose source is null
MAX_COUNT_TASKS = 200  # counting tasks over the clustered files (each reads a batch of whole files' `source`)


@dataclass(frozen=True)
class SourceKeys:
    """(stratum, sub-group) of rows: the index of their source in `names`, and a seeded hash of pair_id into that
    source's `num_groups` sub-groups (as the clustered shards split a cluster)."""
    names: tuple[str, ...]
    num_groups: np.ndarray
    seed: int

    def __call__(self, table: pa.Table, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values = table.column("source").fill_null(NO_SOURCE)
        shard = pc.index_in(values, value_set=pa.array(self.names, pa.string())).to_numpy(zero_copy_only=False)
        shard = shard.astype(np.int64)
        return shard, sub_groups(table.column("pair_id").to_numpy(), self.num_groups[shard], self.seed)


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
    import ray  # here, not at import: looking a sampler up (the config's check) imports this module

    schema = pq.read_schema(run.fs.open_input_file(run.path(files[0])))
    if "source" not in schema.names:
        raise TrainDataError("train.sampler=source needs a `source` column in the shards, and they have none: "
                             "set data.source_column when ingesting (in a new --run-dir), or use another sampler.")
    ds = ray.data.from_items([{"file": f} for f in files], override_num_blocks=min(len(files), MAX_COUNT_TASKS))
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


@SAMPLERS.register
class Source(Sampler):
    name = "source"
    doc = "every global batch from one value of the `source` column"
    sets = ("source",)
    needs_clustering = False

    def set_strata(self, cfg, run, base: ShardManifest, row_group_rows: int) -> SetStrata:
        names, sizes = source_counts(run, base.files)
        max_group = cfg.shard.max_group_rows
        return SetStrata(SourceKeys(tuple(names), -(-sizes // max_group), cfg.cluster.seed), sizes, names, max_group)
