"""The k-means fit sample: which row groups of embeddings/ to read, and reading only the rows kept. No Ray here.

The sample is a two-stage seeded sample, the same whatever the number of fit workers or the cluster shape:
  1. row groups in the order of a seeded hash of (file name inside embeddings/, row group index), taken
     whole until they hold >= SPREAD_FACTOR x the wanted rows and number >= MIN_SAMPLE_ROW_GROUPS (or
     all of them);
  2. inside those groups, the rows whose seeded hash of pair_id is < wanted / rows of the chosen groups.
So a fit reads about max(SPREAD_FACTOR x wanted, MIN_SAMPLE_ROW_GROUPS groups) rows instead of every row,
and converts only the kept rows to float32. Step 2 is a Bernoulli draw, so the sample holds about
`wanted` rows (its count is binomial), as it did when every row was hashed.

Reading whole row groups is a cluster sample: when the input order follows the content (files sorted by
source, say), a few groups could miss part of it. Hence rows are drawn from SPREAD_FACTOR times more
groups than the wanted rows fill, and from at least MIN_SAMPLE_ROW_GROUPS groups; embed and synth write
row groups of EMBEDDINGS_ROW_GROUP_ROWS rows, so that this stays a small fraction of a large corpus.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from clusterscale.io.rundir import RunDir
from clusterscale.runtime.hashing import hash_unit, text_hashes
from clusterscale.runtime.vectors import SIDE_COLUMNS, clustered_matrix

MIN_SAMPLE_ROW_GROUPS = 16  # the fewest groups a capped sample is drawn from (see the module docstring)
SPREAD_FACTOR = 4  # groups holding this many times the wanted rows are read, each giving ~1/4 of its rows
SAMPLE_COLUMNS = ("pair_id", "emb")  # all the fit reads of a row
GROUP_SALT = 0x6F17  # the group keys must not correlate with the row keys (salt = seed)


@dataclass(frozen=True)
class RowGroupUnit:
    """One row group of one embeddings/ file: the unit the fit sample reads."""

    path: str  # full path on the run's filesystem
    name: str  # path relative to embeddings/: what the seeded group key hashes, so moving the run changes nothing
    group: int
    rows: int
    sample_bytes: int  # compressed bytes of the pair_id and emb columns: what reading the group costs


def row_group_units(run: RunDir) -> list[RowGroupUnit]:
    """Every row group of embeddings/, from the Parquet footers only."""
    root = run.path("embeddings")
    units = []
    files = run.files("embeddings")
    for path, meta in zip(files, run.footers(files)):
        name = posixpath.relpath(path, root)
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            size = sum(group.column(c).total_compressed_size for c in range(group.num_columns)
                       if group.column(c).path_in_schema.split(".")[0] in SAMPLE_COLUMNS)
            units.append(RowGroupUnit(path, name, g, group.num_rows, size))
    return units


def group_keys(units: list[RowGroupUnit], seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per row group, fixed for a seed."""
    ids = text_hashes([f"{u.name}#{u.group}" for u in units])
    return hash_unit(ids, salt=seed ^ GROUP_SALT)


def choose_sample_units(units: list[RowGroupUnit], wanted_rows: int, seed: int,
                        min_groups: int = MIN_SAMPLE_ROW_GROUPS, spread: int = SPREAD_FACTOR
                        ) -> tuple[list[RowGroupUnit], float]:
    """(the row groups to read, in file order; the fraction of their rows to keep by pair_id hash).

    wanted_rows >= all rows means every group and every row (fit_sample=all, or a small corpus)."""
    total = sum(u.rows for u in units)
    if wanted_rows >= total:
        return list(units), 1.0
    chosen, rows = [], 0
    for i in np.argsort(group_keys(units, seed), kind="stable"):
        if rows >= spread * wanted_rows and len(chosen) >= min_groups:
            break
        chosen.append(int(i))
        rows += units[i].rows
    return [units[i] for i in sorted(chosen)], min(1.0, wanted_rows / rows)


def read_sample_rows(run: RunDir, units: list[RowGroupUnit], keep_fraction: float, seed: int, side: str = "passage",
                     dims: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    """The kept rows of `units`: (pair_ids, [float32 matrices] of cluster.side's vectors, on their first cluster.dims
    dimensions when set); only kept rows are converted from fp16."""
    ids, chunks = [], []
    for unit in units:
        with run.fs.open_input_file(unit.path) as f:
            table = pq.ParquetFile(f).read_row_group(unit.group, columns=["pair_id", *SIDE_COLUMNS[side]])
        pid = table.column("pair_id").to_numpy()
        keep = hash_unit(pid, salt=seed) < keep_fraction if keep_fraction < 1 else np.ones(len(pid), bool)
        if keep.any():
            ids.append(pid[keep])
            chunks.append(clustered_matrix(table.filter(pa.array(keep)), side, dims))
    return (np.concatenate(ids) if ids else np.zeros(0, np.int64)), chunks
