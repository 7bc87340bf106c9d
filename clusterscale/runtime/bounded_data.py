"""Ray Data with bounded tasks: Parquet reads of one row group per task, hash-shuffle maps of ~64 MiB each.

Ray Data's read_parquet (2.60, datasource V2) packs 128 MiB bins of row groups from several files into one
read task and reads ahead inside it: a read worker measured ~0.9-1.4 GB at 150k-600k rows of d=384 pairs
(benchmarks/bench_scale.py), growing with the number of files. Reading one row group per task with pyarrow
keeps a read task at O(one row group) (embed, synth and assign write 8,192-row groups), and a following
map_batches fuses into the same task.

Ray Data's hash shuffle (groupby, repartition by key) coalesces up to DataContext.shuffle_input_batch_bytes
(default 1 GiB) of input blocks into one map task: at these sizes that is all the rows of the stage in one task
that partitions them (~4x its input), and the upstream blocks wait in the object store until the batch is
full. bounded_shuffle_maps makes those batches SHUFFLE_MAP_BATCH_BYTES.

A hash shuffle is a barrier: no reduce starts before every map is done, so all the shuffled rows wait somewhere.
In Ray's object store they sit in shared memory pages that stay resident in the worker that wrote them (USS
1.1 -> 2.9 GB for mine's shuffle maps at 150k -> 600k rows, benchmarks/RESULTS.md). With disk=True (config key
ray.disk_shuffle, the default) bounded_shuffle_maps switches the datasets made inside to Ray Data's disk-based
hash shuffle: map tasks write their partitions to local files and reduce tasks fetch their own partition's byte
ranges (from other nodes over an Arrow Flight server per node, bound to the node's IP and not covered by Ray's
token auth: keep the cluster network private, as the shipped configs do).

Ray Data tasks run one after another in long-lived workers, and Arrow's allocator keeps what a task freed for
the next one: release_arrow_pool() at the end of a task hands it back, so a worker's heap follows its largest
task, not the number of tasks it ran (assign's actor crept 1.05 -> 1.18 over 5 -> 19 units without it).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from clusterscale.io.rundir import RunDir

SHUFFLE_MAP_BATCH_BYTES = 64 * 1024 * 1024


def _read_units(units: pa.Table, run_uri: str, columns: list[str]) -> pa.Table:
    """Ray Data map fn: the rows of the (path, row_group) units in `units`, read with pyarrow."""
    run, tables = RunDir(run_uri), []
    release_arrow_pool()  # what the worker's previous task freed
    for path, group in zip(units.column("path").to_pylist(), units.column("row_group").to_pylist()):
        with run.fs.open_input_file(path) as f:
            tables.append(pq.ParquetFile(f).read_row_group(group, columns=columns))
    return pa.concat_tables(tables)


def release_arrow_pool() -> None:
    """Return the memory Arrow's default pool holds but no longer uses to the OS (end of a task, of a unit)."""
    pa.default_memory_pool().release_unused()


def read_row_groups(run: RunDir, files: list[str], columns: list[str]) -> ray.data.Dataset:
    """`columns` of every row of `files` (full paths on run's filesystem), one block per Parquet row group.
    The driver reads the footers only and holds one small (path, group) item per row group."""
    units = []
    for path in files:
        with run.fs.open_input_file(path) as f:
            groups = pq.ParquetFile(f).metadata.num_row_groups
        units += [{"path": path, "row_group": g} for g in range(groups)]
    return ray.data.from_items(units, override_num_blocks=max(1, len(units))).map_batches(
        _read_units, fn_kwargs={"run_uri": run.uri, "columns": columns}, batch_size=1, batch_format="pyarrow")


@contextlib.contextmanager
def bounded_shuffle_maps(disk: bool = True) -> Iterator[None]:
    """Datasets made inside have hash-shuffle map tasks of about SHUFFLE_MAP_BATCH_BYTES of input each and, with
    disk, shuffle through local files instead of the object store (ray.disk_shuffle). Make the datasets inside:
    a Dataset copies the DataContext current when it is created."""
    ctx = ray.data.DataContext.get_current()
    before = ctx.shuffle_input_batch_bytes, ctx.use_disk_based_hash_shuffle
    ctx.shuffle_input_batch_bytes = SHUFFLE_MAP_BATCH_BYTES
    ctx.use_disk_based_hash_shuffle = disk
    try:
        yield
    finally:
        ctx.shuffle_input_batch_bytes, ctx.use_disk_based_hash_shuffle = before
