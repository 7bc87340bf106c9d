"""Mined negatives at training time: the negatives each row is trained with travel with the row, in sidecar files
aligned to the shard files; and the fingerprint of negatives/ that the mine stage writes and training checks.

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

import dataclasses
import math
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
from clusterscale.train import schedule


MINE_SECTIONS = ("data", "embed", "cluster", "mine")  # the config sections negatives/ depends on (mining is
# sharded by the clusters of cluster.k); the sidecars follow whichever shard set training reads (sidecar_marker)
SIDECAR_DIR = f"{NEGATIVES}/rows"
PADDING_PATH = f"{NEGATIVES}/padding.parquet"
PADDING_POOL_ROWS = 4096  # random training passages every rank holds for topping up short candidate lists
SIDECAR_PIECE_ROWS = 8192  # rows per sidecar piece (rounded to whole row groups): bounds one writer task
SIDECAR_COLUMNS = ("neg_pair_ids", "neg_passages", "neg_queries")  # per draw d: <name>_<d>; attach renames them


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


# --- the draw and the sidecar layout ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Draw:
    """Which candidates of each row training uses: per_query (M) of them per epoch, chosen with `seed`, for
    `draws` epochs (epoch e trains with draw e % draws)."""
    per_query: int
    seed: int
    draws: int

    @property
    def key(self) -> str:
        """The sidecars' folder under negatives/rows/: another draw writes its own."""
        return f"m{self.per_query}-seed{self.seed}-draws{self.draws}"


def training_draw(cfg: Config, manifest: ShardManifest) -> Draw:
    """The draw training with cfg reads from the shard set of `manifest`: train.negatives_per_query per epoch, one
    draw per epoch the run trains, at most ceil(candidates / M) of them (mine.range_max - mine.range_min)."""
    tc = cfg.train
    sizes, batch = manifest.strata_sizes, tc.schedule.global_batch_size
    per_epoch = max(1, schedule.batches_per_epoch(sizes, batch))
    epochs = math.ceil(schedule.total_steps(sizes, batch, tc.schedule.epochs, tc.schedule.steps) / per_epoch)
    per_query = max(1, tc.objective.negatives_per_query)
    return Draw(per_query, tc.schedule.seed, draws_for(per_query, epochs, candidates_per_query(cfg)))


def candidates_per_query(cfg: Config) -> int:
    """At most how many candidates negatives/ keeps per query (ranks [mine.range_min, mine.range_max))."""
    return max(1, cfg.mine.range_max - cfg.mine.range_min)


def draws_for(per_query: int, epochs: int, candidates: int) -> int:
    """The draws a sidecar holds: one per epoch trained, at most ceil(candidates / M)."""
    return max(1, min(epochs, math.ceil(candidates / max(1, per_query))))


# Bytes a query costs in negatives/ before compression (mine.PARTS_WRITE's zstd stores synth candidates at ~40% of
# them), the sidecars' bytes beyond the texts, and the search results a mine attempt keeps until its merge is done.
PART_ROW_BYTES, PART_CANDIDATE_BYTES = 12, 12  # pair_id + pos_score; a candidate's pair_id + score
SIDECAR_ROW_BYTES, SIDECAR_NEGATIVE_BYTES = 8, 16  # pair_id; a drawn negative's pair_id and two list offsets
SEARCH_CANDIDATE_BYTES = 13  # a search result's candidate: pair_id, score, flag (mine.SEARCH_DIR)


def mine_disk_bytes(rows: int, candidates: int, per_query: int, draws: int, text_bytes: float,
                    nprobe: int) -> dict[str, float]:
    """What `clusterscale mine` (and the training that draws from it) writes, uncompressed: negatives/ (every
    query's candidates and the padding pool), its sidecars (per row M x D drawn negatives, each its pair's query and
    passage texts, about a pair's text bytes; none without train.negatives_per_query) and the search results a mine
    attempt holds until every bucket is merged (each query's top candidates in each probed cluster)."""
    sidecars = rows * (SIDECAR_ROW_BYTES + per_query * draws * (text_bytes + SIDECAR_NEGATIVE_BYTES)) \
        if per_query else 0.0
    return {"negatives": rows * (PART_ROW_BYTES + candidates * PART_CANDIDATE_BYTES) + PADDING_POOL_ROWS * text_bytes,
            "negatives/rows": float(sidecars),
            "negatives/_search": float(rows * nprobe * candidates * SEARCH_CANDIDATE_BYTES)}


def groups_per_piece(manifest: ShardManifest) -> int:
    """Row groups per sidecar piece for shards written with the manifest's row-group size."""
    return max(1, SIDECAR_PIECE_ROWS // int(manifest.row_group_rows))


def sidecar_marker(set_dir: str, draw: Draw) -> str:
    """Records the manifest fingerprint of the shard set under set_dir that its sidecars were written for."""
    return f"{SIDECAR_DIR}/{draw.key}/{set_dir}/_SHARDS.json"


def sidecar_path(shard_file: str, piece: int, draw: Draw) -> str:
    """negatives/rows/<draw>/<shard file without .parquet>/piece-<p>.parquet (relative to the run holding the
    shards)."""
    return f"{SIDECAR_DIR}/{draw.key}/{shard_file.removesuffix('.parquet')}/piece-{piece:05d}.parquet"


def sidecar_table(pair_ids: np.ndarray, found: pa.Table, draws: int) -> pa.Table:
    """The sidecar rows of `pair_ids` (a piece of a shard file, in its order) from `found`: one row per
    (anchor, draw, slot) with the candidate's pair_id `cand` and texts `neg_passage`, `neg_query`. Per draw d the
    columns neg_pair_ids_<d>, neg_passages_<d>, neg_queries_<d>: lists in slot order (best first); a row without
    candidates gets empty lists."""
    columns = {"pair_id": pa.array(pair_ids, type=pa.int64())}
    which = found.column("draw").to_numpy() if found.num_rows else np.zeros(0, np.int32)
    for d in range(draws):
        part = found.filter(pa.array(which == d)).sort_by([("anchor", "ascending"), ("slot", "ascending")])
        unique, starts, counts = np.unique(part.column("anchor").to_numpy(), return_index=True, return_counts=True)
        at = np.searchsorted(unique, pair_ids)
        hit = at < len(unique)
        hit[hit] = unique[at[hit]] == pair_ids[hit]
        lengths = np.zeros(len(pair_ids), dtype=np.int64)
        lengths[hit] = counts[at[hit]]
        first = np.zeros(len(pair_ids), dtype=np.int64)
        first[hit] = starts[at[hit]]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        # value j of row r sits at part row first[r] + j
        take = pa.array(np.repeat(first - offsets[:-1], lengths) + np.arange(int(offsets[-1])), type=pa.int64())
        for name, source in zip(SIDECAR_COLUMNS, ("cand", "neg_passage", "neg_query")):
            columns[f"{name}_{d}"] = pa.ListArray.from_arrays(pa.array(offsets),
                                                               part.column(source).take(take).combine_chunks())
    return pa.table(columns)


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
