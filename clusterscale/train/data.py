"""Reading training rows from the shards: the manifest checks, a row reader, and source labels."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.errors import UserError
from clusterscale.io.rundir import RunDir, StageMissingError
from clusterscale.io.layout import load_manifest, manifest_path, shards_dir


class TrainDataError(UserError, ValueError):
    """The shards cannot feed this training config; the message says why and what to do."""


def checked_manifest(run: RunDir, k: int, global_batch_size: int) -> dict:
    """The manifest of shards/k=<k>/, after checking it matches the config and its files exist."""
    if not run.exists(manifest_path(k)) and run.exists(shards_dir(k), "_DONE.json"):
        raise StageMissingError(f"{run.path(manifest_path(k))} is missing although the shard stage "
                                f"is marked done: delete {shards_dir(k)}/ and rerun `clusterscale shard`.")
    manifest = load_manifest(run, k)
    if manifest.get("k") != k:
        raise TrainDataError(f"The manifest in {shards_dir(k)}/ was written for cluster.k={manifest.get('k')}, not "
                             f"cluster.k={k}: it was copied or moved; rerun `clusterscale shard` with cluster.k={k}.")
    if manifest["global_batch_size"] != global_batch_size:
        raise TrainDataError(f"The shards under {shards_dir(k)} were planned for train.global_batch_size="
                             f"{manifest['global_batch_size']}, not {global_batch_size}: rerun `clusterscale shard` "
                             f"with this batch size in a new --run-dir, or keep the batch size.")
    missing = [f for c in manifest["clusters"] for f in c["files"] if not run.exists(f)]
    if missing:
        raise StageMissingError(f"{len(missing)} shard file(s) listed in the manifest are missing (first: "
                                f"{run.path(missing[0])}): delete {shards_dir(k)}/ and rerun `clusterscale shard`.")
    sizes = [c["rows"] for c in manifest["clusters"]]
    if not sizes or max(sizes) < global_batch_size:
        raise TrainDataError(f"train.global_batch_size={global_batch_size} is larger than every shard (largest "
                             f"{max(sizes, default=0)} rows): lower it or cluster.k.")
    return manifest


def source_codes(run: RunDir, manifest: dict) -> tuple[np.ndarray, list[str]]:
    """(int code per row, shards concatenated in manifest order; the source name of each code)."""
    files = [f for c in manifest["clusters"] for f in c["files"]]
    schema = pq.read_schema(run.fs.open_input_file(run.path(files[0])))
    if "source" not in schema.names:
        raise TrainDataError("train.sampler=source needs a `source` column in the shards, and they have none: "
                             "set data.source_column when ingesting (in a new --run-dir), or use another sampler.")
    column = pa.chunked_array([pq.read_table(run.fs.open_input_file(run.path(f)), columns=["source"]).column(0)
                               for f in files])
    if column.null_count == len(column):
        raise TrainDataError("train.sampler=source: every row's `source` is empty. Set data.source_column to the "
                             "input column naming each pair's source (in a new --run-dir), or use another sampler.")
    values = np.array(column.fill_null("(none)").to_pylist(), dtype=object)
    names, codes = np.unique(values, return_inverse=True)
    return codes.astype(np.int64), [str(n) for n in names]


def strata_inputs(run: RunDir, manifest: dict, sampler: str) -> tuple[list[int], np.ndarray | None, list[str] | None]:
    """What the batch schedule of `sampler` needs: (shard sizes, source code per row or None, source names or None).

    Every caller of schedule.* (the training loop, the cost model) goes through here, so the source sampler
    never sees sizes without codes."""
    sizes = [c["rows"] for c in manifest["clusters"]]
    if sampler != "source":
        return sizes, None, None
    codes, names = source_codes(run, manifest)
    return sizes, codes, names


class ShardReader:
    """Reads rows of a shard by index; keeps the last few shards in memory."""

    def __init__(self, run: RunDir, manifest: dict, cache_size: int = 2):
        self.run, self.clusters, self.cache, self.cache_size = run, manifest["clusters"], OrderedDict(), cache_size
        self._all: pa.Table | None = None

    def _read(self, files: list[str]) -> pa.Table:
        tables = [pq.read_table(self.run.fs.open_input_file(self.run.path(f)),
                                columns=["pair_id", "query", "passage"]) for f in files]
        return pa.concat_tables(tables)

    def shard(self, index: int) -> pa.Table:
        if index not in self.cache:
            self.cache[index] = self._read(self.clusters[index]["files"])
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        self.cache.move_to_end(index)
        return self.cache[index]

    def rows(self, shard: int, rows: np.ndarray) -> pa.Table:
        if shard >= 0:
            return self.shard(shard).take(pa.array(rows))
        if self._all is None:  # global row indices: the shards concatenated in manifest order
            self._all = self._read([f for c in self.clusters for f in c["files"]])
        return self._all.take(pa.array(rows))
