"""The sizing rules the stages follow and `plan` predicts with: work units, file and row-group sizes, shard writers'
partitions and memory, mine's routed rows. They sit below both (plan computes with the same functions the stages
run), so a stage's rule and plan's prediction of it cannot drift apart."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from clusterscale.config import Config
from clusterscale.io.layout import row_group_rows_for

# embed: automatic work units are small enough for this many per actor. Not more: texts are sorted by length within
# a unit, so smaller units pad more (docstrings at 20k rows: +3% padded tokens at 4 units per actor, +13% at 16,
# against one sort of all rows).
UNITS_PER_ACTOR = 4
# assign: rows per work unit (and output file): consecutive row groups of one embeddings/ file. One actor call holds
# one unit (its table, the assigned table and the written file), so the memory is O(this), not O(N).
ASSIGN_UNIT_ROWS = 32_768
QUERIES_PER_FILE = 25_000  # mine: queries per negatives/ file; bounds the memory of one merge group
ROUTED_ROW_BYTES = 40   # mine: a routed row besides its vector (kind, group, pair_id, two text keys, pos_score)
MIN_PARTITIONS = 200  # shard: Ray Data's default hash-shuffle parallelism, enough tasks to keep every CPU busy
ACTOR_MEMORY_FACTOR = 3  # shard: a writer holds its partition block plus a sorted and a permuted copy of one group
# A Ray worker's own memory before any rows (Python, pyarrow, Ray): a shard writer measured 128-134 MiB USS here, and
# Ray Data warns of an actor that uses more than 1/1.25 of its memory request.
WORKER_PROCESS_BYTES = 192 * 2**20


def auto_rows_per_unit(n_rows: int, actors: int, rows_per_part: int) -> int:
    """embed's rows per unit: whole pairs/ parts when there are plenty; otherwise small enough for UNITS_PER_ACTOR
    per actor."""
    return max(1, min(rows_per_part, math.ceil(n_rows / (UNITS_PER_ACTOR * actors))))


@dataclass(frozen=True)
class GroupSizes:
    """How many rows a shard-set write moves and how they are grouped (sizes the writer actors)."""

    rows: int
    groups: int           # (shard, sub) keys
    largest_group: int    # rows
    max_group_rows: int   # shard.max_group_rows


def groups_per_shard(shard_rows: np.ndarray, max_group_rows: int) -> np.ndarray:
    """How many sub-groups each shard is split into: ceil(rows / max_group_rows), 0 for an empty shard."""
    return -(-shard_rows // max_group_rows)


def writer_sizing(sizes: GroupSizes, row_bytes: float) -> tuple[int, int]:
    """(hash partitions, memory bytes of one writer actor) of a shard-set write: a writer holds its partition's
    rows or its largest group, whichever is more, ACTOR_MEMORY_FACTOR times, beside its process's own memory."""
    partitions = min(sizes.groups, max(MIN_PARTITIONS, math.ceil(2 * sizes.rows / sizes.max_group_rows)))
    rows_held = max(sizes.largest_group, math.ceil(sizes.rows / partitions))
    return partitions, int(WORKER_PROCESS_BYTES + ACTOR_MEMORY_FACTOR * row_bytes * rows_held)


def file_sizes(cfg: Config) -> tuple[int, int]:
    """(rows per shard file, rows per Parquet row group) of every shard set: row groups sized so a global batch
    is whole groups (io/layout.row_group_rows_for); files of shard.batches_per_file global batches (at most
    shard.target_rows_per_file rows), whole row groups.

    A training rank reads the footer of each file it takes a row group from, and a footer describes every row
    group of its file: files sized from the global batch, not from the cluster or N, bound the footer bytes per
    row read (the formula: benchmarks/RESULTS.md, "Shard files of one global batch")."""
    batch = cfg.train.schedule.global_batch_size
    row_group_rows = row_group_rows_for(batch)
    rows = min(cfg.shard.batches_per_file * batch, cfg.shard.target_rows_per_file)
    return max(1, rows // row_group_rows) * row_group_rows, row_group_rows
