"""What a run of N pairs at k clusters looks like, before it runs: cluster sizes, training steps and leftover
pairs (the train code's own schedule functions), files per folder (the stages' own file rules), and the work
each stage does (the quantity its time is proportional to). Pure functions: no Ray, no timing."""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from clusterscale.config import Config
from clusterscale.io.layout import row_group_rows_for
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS
from clusterscale.stages.embed import auto_rows_per_unit
from clusterscale.stages.kmeans import ASSIGN_UNIT_ROWS
from clusterscale.stages.shards import GroupSizes, file_sizes, groups_per_shard, writer_sizing
from clusterscale.train import schedule

DEFAULT_IMBALANCE = 1.5
"""faiss's imbalance factor k x sum(n_c^2) / N^2 assumed when neither the run nor the calibration measured one
(1 = equal clusters); spherical k-means on text embeddings lands at ~1.1-2 (an assumption, printed as one)."""


@dataclass(frozen=True)
class RunShape:
    """N pairs at k clusters under a config: the row counts every stage sees."""

    rows_in: int
    train_rows: int          # pairs/ and embeddings/: rows_in less the held-out share
    heldout_rows: int
    k: int
    dim: int
    cluster_sizes: np.ndarray  # rows per cluster before the small-cluster policy (sums to train_rows)
    sizes_from: str          # where the sizes come from (the run's manifest, or a lognormal at an imbalance)


def lognormal_sizes(rows: int, k: int, imbalance: float) -> np.ndarray:
    """k cluster sizes summing to `rows` whose imbalance factor k sum(n^2)/N^2 is `imbalance`: lognormal
    quantiles, since exp(sigma^2) is a lognormal's E[n^2]/E[n]^2."""
    sigma = math.sqrt(math.log(max(1.0, imbalance)))
    z = np.array([NormalDist().inv_cdf((i + 0.5) / k) for i in range(k)])
    weights = np.exp(sigma * z)
    sizes = np.floor(rows * weights / weights.sum()).astype(np.int64)
    sizes[np.argsort(-weights)[:rows - int(sizes.sum())]] += 1  # hand the rounding rest to the largest
    return sizes


def imbalance_factor(sizes: np.ndarray) -> float:
    n = float(sizes.sum())
    return float(len(sizes) * (sizes.astype(np.float64) ** 2).sum() / (n * n)) if n else 1.0


def run_shape(cfg: Config, rows_in: int, k: int, dim: int, measured_sizes: list[int] | None = None,
              imbalance: float | None = None) -> RunShape:
    """The shape of a run: measured_sizes (a run's clusters at this k) are scaled to the new N, else a lognormal
    at `imbalance` (default DEFAULT_IMBALANCE)."""
    heldout = int(round(rows_in * cfg.data.heldout_fraction))
    train = rows_in - heldout
    if measured_sizes is not None and len(measured_sizes) == k and sum(measured_sizes):
        base = np.asarray(measured_sizes, dtype=np.float64)
        sizes = np.floor(base * train / base.sum()).astype(np.int64)
        sizes[np.argmax(base)] += train - int(sizes.sum())
        source = f"the run's {k} cluster sizes, scaled to {train:,} rows"
    else:
        factor = imbalance or DEFAULT_IMBALANCE
        sizes = lognormal_sizes(train, k, factor)
        source = (f"lognormal sizes at imbalance factor {factor:.2f}"
                  + ("" if imbalance else " (assumed: no run measured one)"))
    return RunShape(rows_in, train, heldout, k, dim, sizes, source)


def shard_sizes(cfg: Config, shape: RunShape) -> np.ndarray:
    """Rows per shard after shard.small_cluster_policy: clusters under one global batch go to a pool shard
    ('pool') or join a large cluster ('merge'; the stage picks the nearest centroid, which the planner does not
    know, so they join the largest: the count of steps is the same either way, the largest shard an upper bound)."""
    batch = cfg.train.schedule.global_batch_size
    counts = shape.cluster_sizes[shape.cluster_sizes > 0]
    small = counts < batch
    if not small.any() or small.all() and cfg.shard.small_cluster_policy == "merge":
        return counts  # all small with merge: the shard stage refuses it, and warnings() says so
    big = counts[~small].copy()
    if cfg.shard.small_cluster_policy == "pool":
        return np.append(big, counts[small].sum())
    big[np.argmax(big)] += counts[small].sum()
    return big


@dataclass(frozen=True)
class TrainShape:
    steps_per_epoch: int
    unused_pairs_per_epoch: int
    batches_per_cluster: tuple[int, float, int]  # min, median, max global batches per shard
    mean_batches_per_cluster: float
    row_group_rows: int


def train_shape(cfg: Config, shards: np.ndarray) -> TrainShape:
    """Steps and leftover pairs of one epoch: the train schedule's functions on the shard sizes."""
    sc = cfg.train.schedule
    batch = sc.global_batch_size
    sizes = [int(s) for s in shards] if sc.sampler != "random" else [int(shards.sum())]
    steps = schedule.batches_per_epoch(sizes, batch)
    unused = schedule.unused_pairs(sizes, batch, sc.sampler, sc.seed, 0, sc.cluster_weighting,
                                   row_group_rows_for(batch)) if steps else int(sum(sizes))
    per = np.asarray(shards) // batch
    return TrainShape(steps, unused, (int(per.min()), float(np.median(per)), int(per.max())),
                      float(np.mean(shards) / batch), row_group_rows_for(batch))


# --- files: the stages' file rules -------------------------------------------------------------------------
def embed_files(cfg: Config, shape: RunShape, embed_actors: int) -> list[int]:
    """Rows of each embeddings/ file: one per embed work unit (a row range of one pairs/ part)."""
    per_unit = cfg.embed.rows_per_unit or auto_rows_per_unit(shape.train_rows, embed_actors, cfg.data.rows_per_part)
    parts = [cfg.data.rows_per_part] * (shape.train_rows // cfg.data.rows_per_part)
    if shape.train_rows % cfg.data.rows_per_part:
        parts.append(shape.train_rows % cfg.data.rows_per_part)
    return [min(per_unit, part - start) for part in parts for start in range(0, part, per_unit)]


def assign_files(embedding_file_rows: list[int]) -> int:
    """assign/k=<k>/ holds one file per assign work unit: runs of whole embeddings row groups, at most
    ASSIGN_UNIT_ROWS rows, never across files (stages/kmeans.assign_units)."""
    per_unit = max(1, ASSIGN_UNIT_ROWS // EMBEDDINGS_ROW_GROUP_ROWS)
    return sum(math.ceil(math.ceil(rows / EMBEDDINGS_ROW_GROUP_ROWS) / per_unit) for rows in embedding_file_rows)


def shard_files(cfg: Config, shards: np.ndarray) -> int:
    """Files of shards/k=<k>/: each shard split into sub-groups of at most shard.max_group_rows, each sub-group in
    files of rows_per_file (stages/shards.file_sizes); sub-groups taken as equal (a seeded hash split)."""
    rows_per_file, _ = file_sizes(cfg)
    groups = groups_per_shard(np.asarray(shards, dtype=np.int64), cfg.shard.max_group_rows)
    return int(sum(g * math.ceil(math.ceil(rows / g) / rows_per_file) for rows, g in zip(shards, groups) if g))


def fit_sample_rows(cfg: Config, shape: RunShape) -> int:
    """Rows the fit reads: about min(N, max_points_per_centroid x k), or every row with cluster.fit_sample=all."""
    if cfg.cluster.fit_sample == "all":
        return shape.train_rows
    return min(shape.train_rows, cfg.cluster.max_points_per_centroid * shape.k)


# --- work: what each stage's time is proportional to ------------------------------------------------------
def search_work(stage: str, cfg: Config, shape: RunShape) -> float:
    """Rows x centroids x dimensions of a stage's nearest-centroid searches (0 for a stage without one)."""
    if stage == "fit":
        return float(fit_sample_rows(cfg, shape)) * shape.k * shape.dim * cfg.cluster.niter
    if stage == "assign":
        return float(shape.train_rows) * shape.k * shape.dim
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
    through local files a cost per block and partition (benchmarks/RESULTS.md, session 21)."""
    blocks = float(math.ceil(shape.train_rows / EMBEDDINGS_ROW_GROUP_ROWS))
    if stage == "dedup":
        return ShuffleWork(float(shape.k + 1), blocks) if cfg.dedup.semantic_threshold else ShuffleWork()
    if stage != "shard":
        return ShuffleWork()
    shards = shard_sizes(cfg, shape).astype(np.int64)
    groups = groups_per_shard(shards, cfg.shard.max_group_rows)
    largest = int((shards / np.maximum(groups, 1)).max(initial=0))
    sizes = GroupSizes(int(shards.sum()), int(groups.sum()), largest, cfg.shard.max_group_rows)
    return ShuffleWork(float(writer_sizing(sizes, 1.0)[0]), blocks)


def semantic_work(stage: str, cfg: Config, shape: RunShape) -> float:
    """Rows x rows of their cluster x d of dedup's semantic pass (each row against the kept rows of its cluster,
    runtime/dedup_core.semantic_greedy), at the rate `plan --calibrate` measures on that function; 0 otherwise."""
    if stage != "dedup" or not cfg.dedup.semantic_threshold:
        return 0.0
    return float(shape.train_rows) * (shape.train_rows / shape.k) * shape.dim


def stage_work(stage: str, cfg: Config, shape: RunShape) -> float:
    """The quantity a stage's CPU time grows with: rows for the passes that touch each row a fixed number of
    times, and the sample rows the fit reads (the nearest-centroid searches, rows x k x d in assign and sample x k
    x d x niter in the fit, are search_work(), at faiss's calibrated rate; dedup's semantic pass is semantic_work());
    rows x (rows per searched cluster) x d for mine's in-cluster searches."""
    n, k, d = shape.train_rows, shape.k, shape.dim
    if stage == "fit":
        return float(fit_sample_rows(cfg, shape))
    if stage == "mine":
        return float(n) * cfg.mine.nprobe * (n / k) * d
    if stage == "evaluate":
        return float(cfg.eval.max_queries + cfg.eval.num_distractors)
    if stage == "ingest":
        return float(shape.rows_in)
    return float(n)  # embed, shard, train (per pair)
