"""Reading training rows from a sampler's shard set: a row-group reader with prefetch, several reads in flight
(the manifest and its checks are io/layout's, shared with the writers).

Every sampler trains from a shard set (io/layout.shard_set_dir): the clustered shards for `clustered`, a set
written from them for `random`, `random_clusters` and `source` (stages/shard_sets.py), both the clustered shards
and the random set for `curriculum` (StackedReader). A set's shards are the sampler's strata; its manifest lists
each shard's files and their rows, so a rank reads only the row groups of its rows and never lists or opens the
other files.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.io.records import ShardManifest
from clusterscale.io.rundir import RunDir
from clusterscale.train.schedule import GlobalBatch

READ_COLUMNS = ["pair_id", "query", "passage"]
READ_THREADS = 4
"""Reads in flight at once per rank: an object store serves each request in ~10-100 ms whatever its size, so
reads must overlap, not queue behind one another (4 x 8 batches ahead kept a step's reads off its critical path
at +30 ms a request, benchmarks/bench_train_reads.py --latency-ms)."""


class _CountingFile:
    """A file object over a pyarrow input file that counts the bytes read through it (pyarrow reads Python
    file objects with ranged seek + read, so this is exactly what the filesystem served)."""

    def __init__(self, native):
        self.native, self.bytes_read, self.closed = native, 0, False

    def read(self, size: int = -1) -> bytes:
        data = self.native.read(size)
        self.bytes_read += len(data)
        return data

    def seek(self, position: int, whence: int = 0) -> int:
        return self.native.seek(position, whence)

    def tell(self) -> int:
        return self.native.tell()

    def size(self) -> int:
        return self.native.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.native.close()
        self.closed = True


def _chunk_bytes(metadata: pq.FileMetaData, groups: Iterable[int], read: list[str] = READ_COLUMNS) -> int:
    """On-disk (compressed) bytes of the `read` columns (a list column by its leaf) in these row groups."""
    tops = [metadata.schema.column(i).path.split(".")[0] for i in range(metadata.num_columns)]
    columns = [i for i, name in enumerate(tops) if name in read]
    return sum(metadata.row_group(g).column(c).total_compressed_size for g in groups for c in columns)


def _read_footer(handle: _CountingFile) -> pq.FileMetaData:
    """A Parquet file's metadata from exactly its footer bytes (pyarrow would fetch the last 64 KB, more than a
    rank's rows of a step when footers are small): the 8-byte tail gives the footer's length, then one ranged
    read of the footer, parsed as a file made of the magic and that tail."""
    size = handle.size()
    handle.seek(size - 8)
    tail = handle.read(8)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or length + 12 > size:  # not a plain Parquet footer: let pyarrow read it
        handle.seek(0)
        return pq.ParquetFile(handle).metadata
    handle.seek(size - 8 - length)
    return pq.ParquetFile(pa.BufferReader(b"PAR1" + handle.read(length) + tail)).metadata


@dataclass(frozen=True)
class _Footer:
    metadata: pq.FileMetaData
    group_starts: np.ndarray    # first row of each row group in the file, plus the file's row count


@dataclass(frozen=True)
class RankRows:
    """One rank's rows of one global batch, with what reading them cost."""
    batch: GlobalBatch
    table: pa.Table
    bytes_read: int             # fetched from the filesystem (footers included)
    bytes_used: int             # the on-disk bytes of the rows returned (their share of the groups read)
    footer_bytes: int = 0       # the part of bytes_read that was Parquet footers
    wait_s: float = 0.0         # how long the step waited for these rows (prefetch: 0 when they were ready)


class ShardReader:
    """Reads training rows from a shard set: a shard's rows come from the Parquet row groups holding them, and
    nothing else (`ParquetFile.read_row_groups` through the run's filesystem: ranged reads on object stores);
    footers are kept in an LRU of `footer_cache_bytes`. `bytes_read` / `bytes_used` / `footer_bytes_read` count
    the whole life of the reader."""

    def __init__(self, run: RunDir, manifest: ShardManifest, footer_cache_bytes: int = 64 << 20, sidecars=None,
                 labeled_negatives: bool = False):
        self.run, self.clusters = run, manifest.clusters
        self.columns = READ_COLUMNS + (["negatives"] if labeled_negatives else [])  # data.negative_column's texts
        self.sidecars = sidecars  # train/negatives.NegativeSidecars: each row's mined negatives, read with it
        self.rows_per_file = manifest.rows_per_file
        self.footers: OrderedDict[str, _Footer] = OrderedDict()
        self.footer_cache_bytes, self._footer_bytes = footer_cache_bytes, 0
        self.bytes_read = self.bytes_used = self.footer_bytes_read = 0
        self._lock = threading.Lock()  # the footer cache and the counters: prefetch reads in several threads

    def _open(self, rel: str) -> _CountingFile:
        return _CountingFile(self.run.fs.open_input_file(self.run.path(rel)))

    def _footer(self, rel: str, handle: _CountingFile | None = None) -> tuple[_Footer, int]:
        """(footer of a shard file, bytes read to get it: 0 when cached), through `handle` when the caller has the
        file open (one open request less on an object store). Read outside the lock, so two threads may both read
        a footer not yet cached; the cache keeps one."""
        with self._lock:
            if rel in self.footers:
                self.footers.move_to_end(rel)
                return self.footers[rel], 0
        own = handle is None
        handle = self._open(rel) if own else handle
        before = handle.bytes_read
        try:
            md = _read_footer(handle)
        finally:
            if own:
                handle.close()
        counts = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        footer = _Footer(md, np.cumsum([0] + counts))
        with self._lock:
            if rel not in self.footers:
                self.footers[rel] = footer
                self._footer_bytes += md.serialized_size
            while self._footer_bytes > self.footer_cache_bytes and len(self.footers) > 1:
                self._footer_bytes -= self.footers.popitem(last=False)[1].metadata.serialized_size
        return footer, handle.bytes_read - before

    def _file_starts(self, shard: int) -> tuple[np.ndarray, int]:
        """(first row of each file of a shard, plus its row count; bytes read to learn them)."""
        cluster = self.clusters[shard]
        if cluster.file_rows is not None:  # each file's rows, as the shard stage wrote them (split clusters)
            return np.cumsum([0] + cluster.file_rows), 0
        if self.rows_per_file:  # every file but the last holds rows_per_file rows
            starts = np.arange(0, cluster.rows, self.rows_per_file)
            return np.append(starts, cluster.rows), 0
        footers = [self._footer(f) for f in cluster.files]
        counts = [int(f.group_starts[-1]) for f, _ in footers]
        return np.cumsum([0] + counts), sum(n for _, n in footers)

    def _read_shard_rows(self, shard: int, rows: np.ndarray, epoch: int = 0) -> tuple[pa.Table, int, int, int]:
        """(rows of a shard in the order asked, bytes read, bytes used, footer bytes read): only the row groups
        holding them, and the footers of their files unless cached; with sidecars, their negatives of `epoch`."""
        file_starts, footers_read = self._file_starts(shard)
        data_read = 0
        files = np.searchsorted(file_starts, rows, side="right") - 1
        pieces, offset, where, used = [], 0, np.empty(len(rows), dtype=np.int64), 0.0
        for index in np.unique(files).tolist():
            rel = self.clusters[shard].files[index]
            handle = self._open(rel)
            try:
                footer, footer_read = self._footer(rel, handle)
                mine = np.flatnonzero(files == index)
                local = rows[mine] - file_starts[index]
                groups_of_rows = np.searchsorted(footer.group_starts, local, side="right") - 1
                groups = np.unique(groups_of_rows)
                pieces.append(pq.ParquetFile(handle, metadata=footer.metadata).read_row_groups(
                    groups.tolist(), columns=self.columns, use_threads=False))
                if self.sidecars is not None:
                    pieces[-1] = self.sidecars.attach(pieces[-1], rel, groups.tolist(), epoch)
            finally:
                handle.close()
            sizes = footer.group_starts[groups + 1] - footer.group_starts[groups]
            group_offsets = offset + np.cumsum(np.concatenate([[0], sizes[:-1]]))
            slot = np.searchsorted(groups, groups_of_rows)
            where[mine] = group_offsets[slot] + local - footer.group_starts[groups_of_rows]
            for group, n_rows in zip(groups.tolist(), np.bincount(slot, minlength=len(groups)).tolist()):
                used += _chunk_bytes(footer.metadata, [group], self.columns) * n_rows / \
                    footer.metadata.row_group(group).num_rows
            offset += int(sizes.sum())
            footers_read += footer_read
            data_read += handle.bytes_read - footer_read
        table = pa.concat_tables(pieces).take(pa.array(where))
        return table, data_read + footers_read, int(round(used)), footers_read

    def _read(self, batch: GlobalBatch | None, shard: int, rows: np.ndarray) -> RankRows:
        """A shard's `rows` and what reading them cost, added to the reader's counters."""
        rows = np.asarray(rows, dtype=np.int64)
        table, read, used, footers = self._read_shard_rows(shard, rows, batch.epoch if batch is not None else 0)
        with self._lock:
            self.bytes_read += read
            self.bytes_used += used
            self.footer_bytes_read += footers
        return RankRows(batch, table, read, used, footers)

    def read(self, shard: int, rows: np.ndarray) -> tuple[pa.Table, int, int]:
        """(pair_id, query, passage of a shard's `rows`; bytes read; bytes used)."""
        got = self._read(None, shard, rows)
        return got.table, got.bytes_read, got.bytes_used

    def rows(self, shard: int, rows: np.ndarray) -> pa.Table:
        return self.read(shard, rows)[0]

    def prefetch(self, batches: Iterable[GlobalBatch], rank: int, world_size: int,
                 depth: int = 8) -> Iterator[RankRows]:
        """This rank's rows of each batch, read up to `depth` batches ahead (see `prefetch`)."""
        return prefetch(self._read, batches, rank, world_size, depth)


class StackedReader:
    """Reads from several shard sets as one: their shards stacked in order (the curriculum sampler's strata are
    the clustered shards, then the random set's), each set read by its own ShardReader."""

    def __init__(self, readers: list[ShardReader]):
        self.readers = readers
        self.firsts = np.cumsum([0] + [len(r.clusters) for r in readers])  # first stacked shard of each set

    def _read(self, batch: GlobalBatch | None, shard: int, rows: np.ndarray) -> RankRows:
        which = int(np.searchsorted(self.firsts, shard, side="right")) - 1
        return self.readers[which]._read(batch, shard - int(self.firsts[which]), rows)

    def prefetch(self, batches: Iterable[GlobalBatch], rank: int, world_size: int,
                 depth: int = 8) -> Iterator[RankRows]:
        return prefetch(self._read, batches, rank, world_size, depth)


def prefetch(read, batches: Iterable[GlobalBatch], rank: int, world_size: int, depth: int = 8,
             threads: int = READ_THREADS) -> Iterator[RankRows]:
    """This rank's rows of each batch (read(batch, shard, rows) -> RankRows), in order, read up to `depth`
    batches ahead by `threads` reading threads; each item's wait_s is how long the consumer waited for it. A read
    error is raised at its batch; closing the iterator cancels the reads not started."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(threads, depth)), thread_name_prefix=f"shard-read-{rank}")
    pending: deque[Future] = deque()
    source = iter(batches)
    try:
        while True:
            for gb in source:  # top up to `depth` reads in flight or done
                pending.append(pool.submit(read, gb, gb.shard, gb.rank_rows(rank, world_size)))
                if len(pending) >= depth:
                    break
            if not pending:
                return
            started = time.perf_counter()
            item = pending.popleft().result()
            yield replace(item, wait_s=time.perf_counter() - started)
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def schedule_block_rows(manifest: ShardManifest) -> int:
    """The `block_rows` of the schedule for these shards: their row-group size (1 for shards written before
    the shard stage recorded it, whose row groups are whole files)."""
    return int(manifest.row_group_rows)
