"""Mined negatives at training time: the negatives each row is trained with travel with the row, in sidecar files
aligned to the shard files (their format, negatives/'s fingerprint and the draw's rules: io/negatives.py).

negatives/part-*.parquet holds every kept candidate of every query (ids and scores: the mine config and the
shards decide them, so train.negatives_per_query, train.seed and the number of epochs can change without
re-mining). The sidecars hold only the texts training draws: for a shard set, a draw (Draw: M =
train.negatives_per_query, train.seed and D epochs' worth) picks for every row and every d < D min(M, its
candidates) of them, a uniform choice keyed by (seed, d, pair_id, candidate) (stages/mine_rows.draw_candidates),
best first. Epoch e trains with draw e % D. D is the epochs the run trains (at most the candidates / M: past that
every candidate has had its turn), so a sidecar holds M x D texts per row, not every candidate's (~30x the shard's
bytes before), and training reads the one draw of its epoch: its own column.

Layout: negatives/rows/<draw key>/<shard file>/piece-<p>.parquet, the same rows in the same order as the shard
file, cut into the same row groups, each piece covering `groups_per_piece` consecutive row groups (so one writer
task holds one piece, never a whole large file); a marker per shard set records the shards' fingerprint. A rank
reads row group g of the sidecar when it reads row group g of the shard (NegativeSidecars.attach, called by
train/data.py's ShardReader), so it holds only its rows' negatives. Rows with fewer than M candidates are topped
up from a fixed-size pool of random training passages (negatives/padding.parquet, counted as `negatives_padded`),
a pure function of (seed, step, pair_id), because every rank must embed the same number of negatives for the
cross-rank gather.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clusterscale.config import Config
from clusterscale.io.negatives import (PADDING_PATH, SIDECAR_COLUMNS, Draw, NegativesError, candidates_per_query,
                                       draws_for, groups_per_piece, sidecar_path)
from clusterscale.io.layout import NEGATIVES
from clusterscale.io.records import ShardManifest
from clusterscale.io.rundir import RunDir
from clusterscale.train import schedule
def training_draw(cfg: Config, manifest: ShardManifest) -> Draw:
    """The draw training with cfg reads from the shard set of `manifest`: train.negatives_per_query per epoch, one
    draw per epoch the run trains, at most ceil(candidates / M) of them (mine.range_max - mine.range_min)."""
    tc = cfg.train
    sizes, batch = manifest.strata_sizes, tc.schedule.global_batch_size
    per_epoch = max(1, schedule.batches_per_epoch(sizes, batch))
    epochs = math.ceil(schedule.total_steps(sizes, batch, tc.schedule.epochs, tc.schedule.steps) / per_epoch)
    per_query = max(1, tc.objective.negatives_per_query)
    return Draw(per_query, tc.schedule.seed, draws_for(per_query, epochs, candidates_per_query(cfg)))


class NegativeSidecars:
    """Reads the sidecar rows of shard row groups (ShardReader calls `attach` after reading the groups): the
    columns of one draw only. bytes_read / bytes_stored count the column chunks read (footers not counted),
    compressed and as stored uncompressed (bench_negatives compares the latter with the texts used)."""

    def __init__(self, run: RunDir, manifest: ShardManifest, draw: Draw, ids: bool = False):
        self.run, self.per_piece, self.draw = run, groups_per_piece(manifest), draw
        self.names = SIDECAR_COLUMNS if ids else SIDECAR_COLUMNS[1:]  # training needs the texts, not the ids
        self.bytes_read = self.bytes_stored = 0
        self._lock = threading.Lock()  # prefetch attaches in several threads

    def attach(self, rows: pa.Table, shard_file: str, groups: list[int], epoch: int = 0) -> pa.Table:
        """`rows` (row groups `groups` of shard_file, ascending, concatenated) with their negatives of epoch
        `epoch`'s draw as neg_passages and neg_queries (and neg_pair_ids when made with ids=True)."""
        d = epoch % self.draw.draws
        wanted = ["pair_id", *(f"{name}_{d}" for name in self.names)]
        pieces = []
        for piece in sorted({g // self.per_piece for g in groups}):
            local = [g - piece * self.per_piece for g in groups if g // self.per_piece == piece]
            rel = sidecar_path(shard_file, piece, self.draw)
            try:
                handle = self.run.fs.open_input_file(self.run.path(rel))
            except FileNotFoundError as error:
                raise NegativesError(f"{self.run.path(rel)} is missing: the mined negatives do not cover the shards "
                                     f"training reads; rerun `clusterscale mine --replace`.") from error
            with handle:
                parquet = pq.ParquetFile(handle)
                pieces.append(parquet.read_row_groups(local, columns=wanted, use_threads=False))
            names = parquet.schema_arrow.names
            chunks = [parquet.metadata.row_group(g).column(c) for g in local for c in range(len(names))
                      if parquet.metadata.schema.column(c).path.split(".")[0] in wanted]
            with self._lock:
                self.bytes_read += sum(c.total_compressed_size for c in chunks)
                self.bytes_stored += sum(c.total_uncompressed_size for c in chunks)
        side = pa.concat_tables(pieces)
        if not side.column("pair_id").equals(rows.column("pair_id")):
            raise NegativesError(f"The negatives of {shard_file} are not aligned to it (the shards were rewritten "
                                 f"after mining): rerun `clusterscale mine --replace`.")
        for name in self.names:
            rows = rows.append_column(name, side.column(f"{name}_{d}"))
        return rows


# --- the draw ----------------------------------------------------------------------------------------------
class MinedNegatives:
    """M negatives per row: its epoch's draw from the sidecar, topped up from the padding pool."""

    def __init__(self, run: RunDir, per_query: int, seed: int):
        self.per_query, self.seed = per_query, seed
        self.texts_used = 0  # UTF-8 bytes of the mined texts handed to training (bench_negatives)
        run.require(NEGATIVES, "mine", "Mined negatives")
        pool = pq.read_table(run.fs.open_input_file(run.path(PADDING_PATH)), columns=["pair_id", "query", "passage"])
        if pool.num_rows < 2:
            raise NegativesError(f"{run.path(PADDING_PATH)} holds {pool.num_rows} passage(s): too few training "
                                 f"pairs to top up short candidate lists; rerun `clusterscale mine --replace`.")
        self.pool_ids = pool.column("pair_id").to_numpy()
        self.pool_queries, self.pool_passages = pool.column("query").to_pylist(), pool.column("passage").to_pylist()

    def for_rows(self, rows: pa.Table, step: int) -> tuple[list[str], list[str], int]:
        """(negative passages, their pairs' queries), M per row grouped by row; and how many were padded.
        `rows`: pair_id and the draw's columns (NegativeSidecars.attach): each row's drawn candidates (at most M,
        best first), then pool passages chosen by (seed, step, pair_id) up to M."""
        lengths = pc.list_value_length(rows.column("neg_passages")).to_numpy(zero_copy_only=False)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        drawn = {name: rows.column(name).combine_chunks().flatten().to_pylist()
                 for name in ("neg_passages", "neg_queries")}
        self.texts_used += sum(len(t.encode()) for name in drawn for t in drawn[name] if t is not None)
        passages, queries, padded = [], [], 0
        for i, pid in enumerate(rows.column("pair_id").to_numpy().tolist()):
            mined = range(int(offsets[i]), int(offsets[i]) + min(self.per_query, int(lengths[i])))
            passages += [drawn["neg_passages"][j] for j in mined]
            queries += [drawn["neg_queries"][j] for j in mined]
            if len(mined) < self.per_query:
                rng = np.random.default_rng([self.seed, step, pid >> 32, pid & 0xFFFF_FFFF])
                while len(passages) < (i + 1) * self.per_query:
                    other = int(rng.integers(len(self.pool_ids)))
                    if self.pool_ids[other] != pid:  # a random training passage; masking handles any collision
                        passages.append(self.pool_passages[other])
                        queries.append(self.pool_queries[other])
                        padded += 1
        return passages, queries, padded
