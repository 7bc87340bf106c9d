"""What a run of N pairs at k clusters looks like, before it runs: cluster sizes, training steps and leftover
pairs (the train code's own schedule functions), files per folder (the stages' own file rules), and the work
each stage does (the quantity its time is proportional to). Pure functions: no Ray, no timing. Sizes are
plan/sizes.SizeCounts (bounded whatever N and k), so a plan's memory and time do not grow with either."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from clusterscale.config import Config
from clusterscale.io.layout import row_group_rows_for
from clusterscale.plan.sizes import EXACT_ITEMS, SizeCounts, expected_uniform_unused, lognormal_sizes, scaled_sizes
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS
from clusterscale.io.sizing import (ASSIGN_UNIT_ROWS, GroupSizes, auto_rows_per_unit, file_sizes, groups_per_shard,
                                    writer_sizing)
from clusterscale.train import samplers, schedule

DEFAULT_IMBALANCE = 1.5
"""faiss's imbalance factor k x sum(n_c^2) / N^2 assumed when neither the run nor the calibration measured one
(1 = equal clusters); spherical k-means on text embeddings lands at ~1.1-2 (an assumption, printed as one)."""
EXACT_SCHEDULE_STEPS = 100_000
"""Up to this many steps an epoch (and EXACT_ITEMS shards) the leftover pairs of uniform cluster weighting are
the train schedule's own seeded draw; beyond, their mean over seeds (sizes.expected_uniform_unused)."""


@dataclass(frozen=True)
class RunShape:
    """N pairs at k clusters under a config: the row counts every stage sees."""

    rows_in: int
    train_rows: int          # pairs/ and embeddings/: rows_in less the held-out share
    heldout_rows: int
    k: int
    dim: int
    cluster_sizes: SizeCounts  # rows per cluster before the small-cluster policy (sums to train_rows; or a list)
    sizes_from: str          # where the sizes come from (the run's manifest, or a lognormal at an imbalance)
    ingest_unit_rows: int = 0  # the rows of ingest's largest work unit (one task reads it), 0 = unknown

    def __post_init__(self):
        object.__setattr__(self, "cluster_sizes", SizeCounts.of(self.cluster_sizes))


def imbalance_factor(sizes) -> float:
    return SizeCounts.of(sizes).imbalance_factor()


def run_shape(cfg: Config, rows_in: int, k: int, dim: int, measured_sizes: list[int] | None = None,
              imbalance: float | None = None, ingest_unit_share: float | None = None) -> RunShape:
    """The shape of a run: measured_sizes (a run's clusters at this k) are scaled to the new N, else a lognormal
    at `imbalance` (default DEFAULT_IMBALANCE); ingest_unit_share: ingest's largest work unit as a share of the input
    rows (the input files read; the same files scaled), else a unit of data.rows_per_part rows (Parquet's)."""
    heldout = int(round(rows_in * cfg.data.heldout_fraction))
    train = rows_in - heldout
    if measured_sizes is not None and len(measured_sizes) == k and sum(measured_sizes):
        sizes = scaled_sizes(SizeCounts.of(measured_sizes), train)
        source = f"the run's {k} cluster sizes, scaled to {train:,} rows"
    else:
        factor = imbalance or DEFAULT_IMBALANCE
        sizes = lognormal_sizes(train, k, factor)
        source = (f"lognormal sizes at imbalance factor {factor:.2f}"
                  + ("" if imbalance else " (assumed: no run measured one)")
                  + ("" if k <= EXACT_ITEMS else f", in quantile bins beyond {EXACT_ITEMS:,} clusters"))
    unit = math.ceil(ingest_unit_share * rows_in) if ingest_unit_share else min(rows_in, cfg.data.rows_per_part)
    return RunShape(rows_in, train, heldout, k, dim, sizes, source, unit)


def shard_sizes(cfg: Config, shape: RunShape) -> SizeCounts:
    """Rows per shard after shard.small_cluster_policy: clusters under one global batch go to a pool shard
    ('pool') or join a large cluster ('merge'; the stage picks the nearest centroid, which the planner does not
    know, so they join the largest: the count of steps is the same either way, the largest shard an upper bound)."""
    batch = cfg.train.schedule.global_batch_size
    counts = shape.cluster_sizes.where(shape.cluster_sizes.sizes > 0)
    small = counts.sizes < batch
    if not small.any() or small.all() and cfg.shard.small_cluster_policy == "merge":
        return counts  # all small with merge: the shard stage refuses it, and warnings() says so
    big, small_rows = counts.where(~small), counts.where(small).total
    if cfg.shard.small_cluster_policy == "pool":
        return big.with_item(small_rows)
    return big.largest_grown(small_rows)


def group_sizes(cfg: Config, shards) -> GroupSizes:
    """How the shard stage groups its write: (shard, sub-group) keys of at most shard.max_group_rows rows."""
    shards = SizeCounts.of(shards)
    groups = groups_per_shard(shards.sizes, cfg.shard.max_group_rows)
    largest = int((shards.sizes / np.maximum(groups, 1)).max(initial=0))
    return GroupSizes(shards.total, shards.sum_of(groups), largest, cfg.shard.max_group_rows)


@dataclass(frozen=True)
class TrainShape:
    steps_per_epoch: int
    unused_pairs_per_epoch: int
    batches_per_cluster: tuple[int, float, int]  # min, median, max global batches per shard
    mean_batches_per_cluster: float
    row_group_rows: int


def train_shape(cfg: Config, shards) -> TrainShape:
    """Steps and leftover pairs of one epoch: the train schedule's rules on the shard sizes (its own seeded draw
    for uniform cluster weighting up to EXACT_SCHEDULE_STEPS steps, the draw's mean beyond)."""
    shards = SizeCounts.of(shards)
    sc = cfg.train.schedule
    batch = sc.global_batch_size
    # The epoch's set (train/samplers: the last one a sampler reads) and its rules: the global shuffle is one stratum
    # of every row; any other set is taken to have the clusters' sizes (a source set's are unknown before it exists).
    epoch = samplers.sampler(sc.sampler).epoch_sampler()
    strata = shards if not epoch.global_shuffle else SizeCounts.of([shards.total])
    steps = strata.sum_of(strata.sizes // batch)  # schedule.batches_per_epoch
    if not steps or sc.cluster_weighting != "uniform" or epoch.global_shuffle:
        unused = strata.sum_of(strata.sizes % batch)  # no full batch: every row; else each stratum's remainder
    elif strata.items <= EXACT_ITEMS and steps <= EXACT_SCHEDULE_STEPS:
        unused = schedule.unused_pairs(strata.tolist(), batch, epoch, sc.seed, 0, sc.cluster_weighting,
                                       row_group_rows_for(batch))
    else:
        unused = expected_uniform_unused(strata, batch, row_group_rows_for(batch))
    per = shards.map(shards.sizes // batch)
    return TrainShape(steps, unused, (per.smallest, per.median(), per.largest),
                      shards.total / max(1, shards.items) / batch, row_group_rows_for(batch))


# --- files: the stages' file rules -------------------------------------------------------------------------
def embed_files(cfg: Config, shape: RunShape, embed_actors: int) -> SizeCounts:
    """Rows of the embeddings/ files: one per embed work unit (a row range of one pairs/ part)."""
    per_unit = cfg.embed.rows_per_unit or auto_rows_per_unit(shape.train_rows, embed_actors, cfg.data.rows_per_part)
    whole_parts, last_part = divmod(shape.train_rows, cfg.data.rows_per_part)
    sizes, counts = [], []
    for part_rows, parts in ((cfg.data.rows_per_part, whole_parts), (last_part, 1)):
        units, rest = divmod(part_rows, per_unit)
        sizes += [per_unit, rest]
        counts += [units * parts, parts if rest else 0]
    return SizeCounts.from_pairs(sizes, counts)


def assign_files(embedding_file_rows) -> int:
    """assign/k=<k>/ holds one file per assign work unit: runs of whole embeddings row groups, at most
    ASSIGN_UNIT_ROWS rows, never across files (stages/kmeans.assign_units)."""
    files = SizeCounts.of(embedding_file_rows)
    per_unit = max(1, ASSIGN_UNIT_ROWS // EMBEDDINGS_ROW_GROUP_ROWS)
    row_groups = -(-files.sizes // EMBEDDINGS_ROW_GROUP_ROWS)
    return files.sum_of(-(-row_groups // per_unit))


def shard_files(cfg: Config, shards) -> int:
    """Files of shards/k=<k>/: each shard split into sub-groups of at most shard.max_group_rows, each sub-group in
    files of rows_per_file (stages/shards.file_sizes); sub-groups taken as equal (a seeded hash split)."""
    shards = SizeCounts.of(shards)
    rows_per_file, _ = file_sizes(cfg)
    groups = groups_per_shard(shards.sizes, cfg.shard.max_group_rows)
    rows_per_group = -(-shards.sizes // np.maximum(groups, 1))
    return shards.sum_of(groups * -(-rows_per_group // rows_per_file))


def fit_sample_rows(cfg: Config, shape: RunShape) -> int:
    """Rows the fit reads: about min(N, max_points_per_centroid x k), or every row with cluster.fit_sample=all."""
    if cfg.cluster.fit_sample == "all":
        return shape.train_rows
    return min(shape.train_rows, cfg.cluster.max_points_per_centroid * shape.k)


# --- work: what each stage's time is proportional to ------------------------------------------------------
def cluster_dim(cfg: Config, shape: RunShape) -> int:
    """The dimensions fit, assign, dedup and mine compare: cluster.dims when set (the frozen vectors truncated),
    else the embeddings'."""
    return min(shape.dim, cfg.cluster.dims) if cfg.cluster.dims else shape.dim


def search_work(stage: str, cfg: Config, shape: RunShape) -> float:
    """Rows x centroids x dimensions of a stage's nearest-centroid searches (0 for a stage without one)."""
    if stage == "fit":
        return float(fit_sample_rows(cfg, shape)) * shape.k * cluster_dim(cfg, shape) * cfg.cluster.niter
    if stage == "assign":
        return float(shape.train_rows) * shape.k * cluster_dim(cfg, shape)
    return 0.0


@dataclass(frozen=True)
class ShuffleWork:
    """The terms of a stage's Ray Data hash shuffle that grow with k: its hash partitions (a reduce task each) and
    its input blocks x partitions (every map task cuts each block into one piece per partition)."""
    partitions: float = 0.0
    blocks: float = 0.0

    @property
    def pieces(self) -> float:
        return self.partitions * self.blocks


def shuffle_work(stage: str, cfg: Config, shape: RunShape) -> ShuffleWork:
    """The hash shuffle of a stage whose partitions grow with k (none otherwise). shard's partitions are its
    (shard, sub-group) keys, so k of them up to MIN_PARTITIONS (stages/shards.writer_sizing); dedup's shuffle by
    cluster has one per cluster (k + 1: a pooled small-cluster id; more where a cluster is split into blocks). Its
    exact pass's key buckets (one per ROWS_PER_BUCKET rows) are not counted: their number grows with N, not k. Both
    read assign/ one Parquet row group (EMBEDDINGS_ROW_GROUP_ROWS rows) per block. The time is not rows x partitions:
    `plan --calibrate` timed the same partitions over 4x the rows at the same cost through the object store, and
    through local files a cost per block and partition (benchmarks/RESULTS.md "bench_plan")."""
    blocks = float(math.ceil(shape.train_rows / EMBEDDINGS_ROW_GROUP_ROWS))
    if stage == "dedup":
        return ShuffleWork(float(shape.k + 1), blocks) if cfg.dedup.semantic_threshold else ShuffleWork()
    if stage != "shard":
        return ShuffleWork()
    return ShuffleWork(float(writer_sizing(group_sizes(cfg, shard_sizes(cfg, shape)), 1.0)[0]), blocks)


def semantic_work(stage: str, cfg: Config, shape: RunShape) -> float:
    """Rows x rows of their cluster x d of dedup's semantic pass (each row against the kept rows of its cluster,
    runtime/dedup_core.semantic_greedy), at the rate `plan --calibrate` measures on that function; 0 otherwise."""
    if stage != "dedup" or not cfg.dedup.semantic_threshold:
        return 0.0
    return float(shape.train_rows) * (shape.train_rows / shape.k) * cluster_dim(cfg, shape)


def stage_work(stage: str, cfg: Config, shape: RunShape) -> float:
    """The quantity a stage's CPU time grows with: rows for the passes that touch each row a fixed number of
    times, and the sample rows the fit reads (the nearest-centroid searches, rows x k x d in assign and sample x k
    x d x niter in the fit, are search_work(), at faiss's calibrated rate; dedup's semantic pass is semantic_work());
    rows x (rows per searched cluster) x d for mine's in-cluster searches."""
    n, k, d = shape.train_rows, shape.k, cluster_dim(cfg, shape)
    if stage == "fit":
        return float(fit_sample_rows(cfg, shape))
    if stage == "mine":
        return float(n) * cfg.mine.nprobe * (n / k) * d
    if stage == "evaluate":
        return float(cfg.eval.max_queries + cfg.eval.num_distractors)
    if stage == "ingest":
        return float(shape.rows_in)
    return float(n)  # embed, shard, train (per pair)
