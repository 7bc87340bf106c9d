"""The mined negatives' files, as the mine stage writes them and training reads them: negatives/'s fingerprint and
candidate files, the draw a training run reads, and the sidecar layout (paths, markers, columns, pieces). The rules
the mine stage (stages/mine*.py), training (train/negatives.py reads the sidecars) and `plan` (mine's disk) share.

Layout: negatives/part-*.parquet holds every kept candidate of every query (ids and scores); the sidecars,
negatives/rows/<draw key>/<shard file>/piece-<p>.parquet, the texts of one draw, the same rows in the same order as
the shard file, cut into the same row groups, each piece covering `groups_per_piece` consecutive row groups; a
marker per shard set records the shards' fingerprint. train/negatives.py says how training uses them.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
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
