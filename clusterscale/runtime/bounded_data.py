"""Ray Data with bounded tasks: Parquet reads of one row group per task, hash-shuffle maps of ~64 MiB each.

Ray Data's read_parquet (2.60, datasource V2) packs 128 MiB bins of row groups from several files into one
read task and reads ahead inside it: a read worker measured ~0.9-1.4 GB at 150k-600k rows of d=384 pairs
(benchmarks/bench_scale.py), growing with the number of files, and lists the files' footers on a pool of up to 32
actors of its own per read (each a new worker process: ~1-2 s a read on a 2-CPU node). Reading one row group per task
with pyarrow keeps a read task at O(one row group) (embed, synth and assign write 8,192-row groups), and a following
map_batches fuses into the same task. Every stage reads through read_row_groups.

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
token auth: keep the cluster network private, as the shipped configs do). A shuffle of less than
ray.disk_shuffle_min_mib of rows (shuffle_for) stays in the object store: starting the file servers costs
~5-10 s per shuffle, and such rows fit in it with room to spare.

Ray Data tasks run one after another in long-lived workers, and both Arrow's allocator and glibc's malloc keep
what a task freed for the next one: release_freed_memory() at a task's start or end hands it back, so a worker's
heap follows its largest task, not the number of tasks it ran (assign's actor crept 1.05 -> 1.18 over 5 -> 19
units without it).

A hash shuffle puts key k in partition hash(k) % P, so with one partition per key some partitions get several
keys: the largest reduce holds 3 of 6 keys, 4 of 24, 5 of 187, 6 of 4,000 (Ray 2.60's hash), and a reduce
holding whole groups grows with the number of keys. one_key_per_partition gives each key a stand-in value
that Ray Data's own partition function sends to a partition of its own.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from clusterscale.config import RayConfig
from clusterscale.io.rundir import RunDir

SHUFFLE_MAP_BATCH_BYTES = 64 * 1024 * 1024


def _read_units(units: pa.Table, run_uri: str, columns: list[str]) -> pa.Table:
    """Ray Data map fn: the rows of the (path, row_group) units in `units`, read with pyarrow."""
    run, tables = RunDir(run_uri), []
    release_freed_memory()  # what the worker's previous task freed
    for path, group in zip(units.column("path").to_pylist(), units.column("row_group").to_pylist()):
        with run.fs.open_input_file(path) as f:
            tables.append(pq.ParquetFile(f).read_row_group(group, columns=columns))
    return pa.concat_tables(tables)


def release_freed_memory() -> None:
    """Return to the OS the memory that Arrow's default pool and glibc's malloc hold but no longer use (between
    the tasks or units a long-lived worker runs)."""
    pa.default_memory_pool().release_unused()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (not musl, not macOS)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()


def one_key_per_partition(num_keys: int, num_partitions: int | None = None) -> np.ndarray:
    """Distinct int64 stand-ins for keys 0..num_keys-1 such that Ray Data's hash shuffle into num_partitions
    (default num_keys) partitions sends key i to partition i % num_partitions: group by the stand-in column
    instead of the key. Uses Ray Data's partition function; if it is not importable (another Ray version), the
    keys themselves (still correct, only less balanced)."""
    parts = num_partitions or num_keys
    try:
        from ray.data._internal.arrow_ops.transform_pyarrow import hash_partition
    except ImportError:
        return np.arange(num_keys, dtype=np.int64)
    needed = np.bincount(np.arange(num_keys) % parts, minlength=parts)
    found: list[list[int]] = [[] for _ in range(parts)]
    start, span = 0, max(1024, 8 * num_keys)
    while any(len(found[p]) < needed[p] for p in range(parts)):
        values = np.arange(start, start + span, dtype=np.int64)
        for p, table in hash_partition(pa.table({"key": values}), hash_cols=["key"], num_partitions=parts).items():
            found[p].extend(table.column("key").to_numpy()[:needed[p] - len(found[p])].tolist())
        start += span
    return np.array([found[i % parts][i // parts] for i in range(num_keys)], dtype=np.int64)


def read_row_groups(run: RunDir, files: list[str], columns: list[str]) -> ray.data.Dataset:
    """`columns` of every row of `files` (full paths on run's filesystem), one block per Parquet row group.
    The driver reads the footers only and holds one small (path, group) item per row group."""
    units = [{"path": path, "row_group": g} for path, footer in zip(files, run.footers(files))
             for g in range(footer.num_row_groups)]
    return ray.data.from_items(units, override_num_blocks=max(1, len(units))).map_batches(
        _read_units, fn_kwargs={"run_uri": run.uri, "columns": columns}, batch_size=1, batch_format="pyarrow")


@dataclass(frozen=True)
class ShuffleSettings:
    """How a stage's hash shuffles run (shuffle_for): through local files or the object store, and at most how many
    aggregator actors Ray Data starts for one (None: its default, min(cluster CPUs, 128))."""
    disk: bool = True
    aggregators: int | None = None


def shuffle_for(rc: RayConfig, run: RunDir, files: list[str], rows: int, row_bytes: float | None = None
                ) -> ShuffleSettings:
    """How a hash shuffle of `rows` rows like those of `files` runs, by their bytes in memory (row_bytes, or the first
    file's uncompressed Parquet bytes per row, times rows; one footer read): through local files with
    ray.disk_shuffle from ray.disk_shuffle_min_mib on; else in the object store, with one aggregator per
    SHUFFLE_MAP_BATCH_BYTES of rows (Ray Data would start one per cluster CPU, up to 128, each an actor process of its
    own, even for a few hundred rows). Pass row_bytes when the shuffled rows are not the files' rows (mine shuffles
    routed vectors without their texts, then search results)."""
    if not rc.disk_shuffle_min_mib and rc.disk_shuffle:
        return ShuffleSettings(disk=True)
    if rows <= 0 or (row_bytes is None and not files):
        return ShuffleSettings(disk=False, aggregators=1)
    if row_bytes is None:
        with run.fs.open_input_file(files[0]) as f:
            footer = pq.ParquetFile(f).metadata
        stored = sum(footer.row_group(g).total_byte_size for g in range(footer.num_row_groups))
        row_bytes = stored / max(footer.num_rows, 1)
    input_bytes = row_bytes * rows
    if rc.disk_shuffle and input_bytes >= rc.disk_shuffle_min_mib * 2**20:
        return ShuffleSettings(disk=True)
    return ShuffleSettings(disk=False, aggregators=max(1, math.ceil(input_bytes / SHUFFLE_MAP_BATCH_BYTES)))


@contextlib.contextmanager
def bounded_shuffle_maps(settings: ShuffleSettings = ShuffleSettings()) -> Iterator[None]:
    """Datasets made inside have hash-shuffle map tasks of about SHUFFLE_MAP_BATCH_BYTES of input each and, with
    settings.disk, shuffle through local files instead of the object store (ray.disk_shuffle); at most
    settings.aggregators aggregators each. Make the datasets inside: a Dataset copies the DataContext current when
    it is created."""
    ctx = ray.data.DataContext.get_current()
    before = ctx.shuffle_input_batch_bytes, ctx.use_disk_based_hash_shuffle, ctx.max_hash_shuffle_aggregators
    ctx.shuffle_input_batch_bytes = SHUFFLE_MAP_BATCH_BYTES
    ctx.use_disk_based_hash_shuffle = settings.disk
    if settings.aggregators is not None:
        ctx.max_hash_shuffle_aggregators = min(settings.aggregators,
                                               before[2] or ray.data.context.DEFAULT_MAX_HASH_SHUFFLE_AGGREGATORS)
    try:
        yield
    finally:
        ctx.shuffle_input_batch_bytes, ctx.use_disk_based_hash_shuffle, ctx.max_hash_shuffle_aggregators = before
