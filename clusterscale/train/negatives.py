"""Mined negatives at training time: each row's candidate texts travel with the row, in sidecar files aligned
to the shard files; and the fingerprint of negatives/ that the mine stage writes and training checks.

The mine stage writes, for every shard file of the set training reads, sidecar pieces under
negatives/rows/<shard file>/piece-<p>.parquet: the same rows in the same order, cut into the same row groups,
each piece covering `groups_per_piece` consecutive row groups (so one writer task holds one piece, never a
whole large file). A rank reads row group g of the sidecar when it reads row group g of the shard
(NegativeSidecars.attach, called by train/data.py's ShardReader), so it holds only its rows' negatives.

Each row carries every kept candidate (best first), not M draws per epoch: the output then depends on the
mine config and the shards only, so train.negatives_per_query, train.seed and the number of epochs can change
without re-mining, and a resumed run draws the same negatives. The choice of M among a row's candidates is a
pure function of (seed, step, pair_id). Rows with fewer than M candidates are topped up from a fixed-size pool
of random training passages (negatives/padding.parquet, counted as `negatives_padded`), because every rank
must embed the same number of negatives for the cross-rank gather.
"""
from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clusterscale.config import Config
from clusterscale.errors import UserError
from clusterscale.io.layout import NEGATIVES, read_manifest, shard_set_dir, shard_set_manifest_path, train_dir
from clusterscale.io.records import ShardManifest
from clusterscale.io.rundir import DONE, RunDir


MINE_SECTIONS = ("data", "embed", "cluster", "mine")  # the config sections negatives/ depends on (mining is
# sharded by the clusters of cluster.k); the sidecars follow whichever shard set training reads (sidecar_marker)
SIDECAR_DIR = f"{NEGATIVES}/rows"
PADDING_PATH = f"{NEGATIVES}/padding.parquet"
PADDING_POOL_ROWS = 4096  # random training passages every rank holds for topping up short candidate lists
SIDECAR_PIECE_ROWS = 8192  # rows per sidecar piece (rounded to whole row groups): bounds one writer task
SIDECAR_COLUMNS = ["neg_pair_ids", "neg_passages", "neg_queries"]


class NegativesError(UserError, ValueError):
    """The mined negatives do not fit the shards training reads; the message says what to rerun."""


# --- which shards, and the fingerprint --------------------------------------------------------------------
def training_manifest(cfg: Config, run: RunDir) -> tuple[str, ShardManifest] | None:
    """(folder, manifest) of the shard set training reads (train.sampler's); None before it was written."""
    folder = shard_set_dir(cfg.cluster.k, cfg.train.schedule.sampler)
    path = shard_set_manifest_path(cfg.cluster.k, cfg.train.schedule.sampler)
    return (folder, read_manifest(run, path)) if run.exists(path) else None


def shard_files(manifest: ShardManifest) -> list[tuple[str, int]]:
    """(shard file, its rows) of every file in a manifest, in manifest order."""
    out = []
    for cluster in manifest.clusters:
        rows = cluster.file_rows
        if rows is None:  # every file but the last holds rows_per_file rows
            per_file = manifest.rows_per_file
            rows = [min(per_file, cluster.rows - start) for start in range(0, cluster.rows, per_file)]
        out += list(zip(cluster.files, rows))
    return out


def mine_extra(cfg: Config, run: RunDir) -> dict | None:
    """The fingerprint of the training run whose model mines (mine.encoder=train:<name>); None otherwise."""
    if not cfg.mine.encoder.startswith("train:"):
        return None
    trained = train_dir(cfg.mine.encoder.split(':', 1)[1])
    return {"encoder_run": run.done_marker(trained).fingerprint if run.exists(trained, DONE) else None}


def mine_fingerprint(cfg: Config, run: RunDir) -> str:
    """The fingerprint of negatives/: MINE_SECTIONS, and the training run when mining with its model."""
    return cfg.fingerprint(MINE_SECTIONS, extra=mine_extra(cfg, run))


# --- the candidate lists the search wrote ------------------------------------------------------------------
def candidate_files(run: RunDir) -> list[str]:
    """negatives/part-*.parquet: each query's candidate pair_ids, by hash bucket of its pair_id."""
    return [run.path(NEGATIVES, name) for name in run.listdir(NEGATIVES)
            if name.startswith("part-") and name.endswith(".parquet")]


def load_negatives(run: RunDir) -> tuple[np.ndarray, list[np.ndarray]]:
    """(sorted pair_ids, their negative pair_id arrays, best first) from negatives/: all of them, for tests and
    inspection; training reads the sidecars instead."""
    run.require(NEGATIVES, "mine", "Mined negatives")
    table = pa.concat_tables([pq.read_table(run.fs.open_input_file(path), columns=["pair_id", "neg_pair_ids"])
                              for path in candidate_files(run)])
    order = np.argsort(table.column("pair_id").to_numpy(), kind="stable")
    table = table.take(pa.array(order))
    lists = table.column("neg_pair_ids").combine_chunks()
    offsets, values = np.asarray(lists.offsets), np.asarray(lists.values)
    return table.column("pair_id").to_numpy(), [values[offsets[i]:offsets[i + 1]] for i in range(len(table))]


# --- sidecar layout ----------------------------------------------------------------------------------------
def groups_per_piece(manifest: ShardManifest) -> int:
    """Row groups per sidecar piece for shards written with the manifest's row-group size."""
    return max(1, SIDECAR_PIECE_ROWS // int(manifest.row_group_rows))


def sidecar_marker(set_dir: str) -> str:
    """Records the manifest fingerprint of the shard set under set_dir that its sidecars were written for."""
    return f"{SIDECAR_DIR}/{set_dir}/_SHARDS.json"


def sidecar_path(shard_file: str, piece: int) -> str:
    """negatives/rows/<shard file without .parquet>/piece-<p>.parquet (relative to the run holding the shards)."""
    return f"{SIDECAR_DIR}/{shard_file.removesuffix('.parquet')}/piece-{piece:05d}.parquet"


def sidecar_table(pair_ids: np.ndarray, found: pa.Table) -> pa.Table:
    """The sidecar rows of `pair_ids` (a piece of a shard file, in its order) from `found`: one row per
    (anchor, slot) with the candidate's pair_id `cand` and texts `neg_passage`, `neg_query`. Lists keep the
    slots' order (best first); a row without candidates gets empty lists."""
    found = found.sort_by([("anchor", "ascending"), ("slot", "ascending")])
    unique, starts, counts = np.unique(found.column("anchor").to_numpy(), return_index=True, return_counts=True)
    at = np.searchsorted(unique, pair_ids)
    hit = at < len(unique)
    hit[hit] = unique[at[hit]] == pair_ids[hit]
    lengths = np.zeros(len(pair_ids), dtype=np.int64)
    lengths[hit] = counts[at[hit]]
    first = np.zeros(len(pair_ids), dtype=np.int64)
    first[hit] = starts[at[hit]]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    # value j of row r sits at found row first[r] + j
    values = np.repeat(first - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
    take = pa.array(values, type=pa.int64())
    lists = {name: pa.ListArray.from_arrays(pa.array(offsets), found.column(source).take(take).combine_chunks())
             for name, source in (("neg_pair_ids", "cand"), ("neg_passages", "neg_passage"),
                                  ("neg_queries", "neg_query"))}
    return pa.table({"pair_id": pa.array(pair_ids, type=pa.int64()), **lists})


class NegativeSidecars:
    """Reads the sidecar rows of shard row groups (ShardReader calls `attach` after reading the groups)."""

    def __init__(self, run: RunDir, manifest: dict):
        self.run, self.per_piece = run, groups_per_piece(manifest)
        self.bytes_read = 0  # on-disk bytes of the sidecar row groups read (footers not counted)
        self._lock = threading.Lock()  # prefetch attaches in several threads

    def attach(self, rows: pa.Table, shard_file: str, groups: list[int]) -> pa.Table:
        """`rows` (row groups `groups` of shard_file, ascending, concatenated) with their negatives' columns."""
        pieces = []
        for piece in sorted({g // self.per_piece for g in groups}):
            local = [g - piece * self.per_piece for g in groups if g // self.per_piece == piece]
            rel = sidecar_path(shard_file, piece)
            try:
                handle = self.run.fs.open_input_file(self.run.path(rel))
            except FileNotFoundError as error:
                raise NegativesError(f"{self.run.path(rel)} is missing: the mined negatives do not cover the shards "
                                     f"training reads; rerun `clusterscale mine --replace`.") from error
            with handle:
                parquet = pq.ParquetFile(handle)
                pieces.append(parquet.read_row_groups(local, columns=["pair_id", *SIDECAR_COLUMNS], use_threads=False))
            read = sum(parquet.metadata.row_group(g).column(c).total_compressed_size
                       for g in local for c in range(parquet.metadata.num_columns))
            with self._lock:
                self.bytes_read += read
        side = pa.concat_tables(pieces)
        if not side.column("pair_id").equals(rows.column("pair_id")):
            raise NegativesError(f"The negatives of {shard_file} are not aligned to it (the shards were rewritten "
                                 f"after mining): rerun `clusterscale mine --replace`.")
        for name in SIDECAR_COLUMNS:
            rows = rows.append_column(name, side.column(name))
        return rows


# --- the draw ----------------------------------------------------------------------------------------------
class MinedNegatives:
    """Draws M negatives per row from the candidates its sidecar carries; tops up from the padding pool."""

    def __init__(self, run: RunDir, per_query: int, seed: int):
        self.per_query, self.seed = per_query, seed
        run.require(NEGATIVES, "mine", "Mined negatives")
        pool = pq.read_table(run.fs.open_input_file(run.path(PADDING_PATH)), columns=["pair_id", "query", "passage"])
        if pool.num_rows < 2:
            raise NegativesError(f"{run.path(PADDING_PATH)} holds {pool.num_rows} passage(s): too few training "
                                 f"pairs to top up short candidate lists; rerun `clusterscale mine --replace`.")
        self.pool_ids = pool.column("pair_id").to_numpy()
        self.pool_queries, self.pool_passages = pool.column("query").to_pylist(), pool.column("passage").to_pylist()

    def for_rows(self, rows: pa.Table, step: int) -> tuple[list[str], list[str], int]:
        """(negative passages, their pairs' queries), M per row grouped by row; and how many were padded.
        `rows`: pair_id and the sidecar columns (NegativeSidecars.attach)."""
        chosen, padded = [], 0  # >= 0: a candidate (index into the flattened lists); < 0: pool row -1 - value
        lengths = pc.list_value_length(rows.column("neg_passages")).to_numpy(zero_copy_only=False)
        offsets = np.concatenate([[0], np.cumsum(lengths)])  # into the flattened lists (same lengths in both)
        for i, pid in enumerate(rows.column("pair_id").to_numpy().tolist()):
            rng = np.random.default_rng([self.seed, step, pid >> 32, pid & 0xFFFF_FFFF])
            count = int(offsets[i + 1] - offsets[i])
            take = rng.choice(count, size=min(self.per_query, count), replace=False) if count else []
            chosen += (int(offsets[i]) + np.sort(np.asarray(take, dtype=np.int64))).tolist()  # best first kept
            while len(chosen) < (i + 1) * self.per_query:
                other = int(rng.integers(len(self.pool_ids)))
                if self.pool_ids[other] != pid:  # a random training passage; masking handles any collision
                    chosen.append(-1 - other)
                    padded += 1
        mined = pa.array([c for c in chosen if c >= 0], type=pa.int64())
        texts = {name: iter(rows.column(name).combine_chunks().flatten().take(mined).to_pylist())
                 for name in ("neg_passages", "neg_queries")}
        passages = [next(texts["neg_passages"]) if c >= 0 else self.pool_passages[-1 - c] for c in chosen]
        queries = [next(texts["neg_queries"]) if c >= 0 else self.pool_queries[-1 - c] for c in chosen]
        return passages, queries, padded
