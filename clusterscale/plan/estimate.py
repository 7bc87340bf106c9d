"""Per-stage estimates of a run of N pairs at k clusters on a cluster: wall time, GPU- and CPU-hours, cost, peak
memory of the driver and of the largest task / actor / rank, disk written per run-dir folder, files, shuffle and
spill bytes; the training shape; the preprocessing / training ratio; warnings. Memory comes from the sizing rules
the stages themselves use (imported), plus the measured footprint of a process (the calibration)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from clusterscale import pipeline
from clusterscale.config import Config
from clusterscale.executor import Estimate
from clusterscale.plan.cluster import GPU_MEMORY_GB, ClusterSpec
from clusterscale.plan.rates import DATASHEET_MFU, Rates, k_terms_s
from clusterscale.plan.shape import (RunShape, TrainShape, assign_files, cluster_dim, embed_files, fit_sample_rows,
                                     group_sizes, search_work, semantic_work, shard_files, shard_sizes, shuffle_work,
                                     stage_work, train_shape)
from clusterscale.io.layout import HELDOUT_EMBEDDINGS
from clusterscale.runtime.bounded_data import SHUFFLE_MAP_BATCH_BYTES
from clusterscale.runtime.kmeans_core import FP16_CHECK_BLOCK_VALUES
from clusterscale.io.sizing import ASSIGN_UNIT_ROWS, QUERIES_PER_FILE, ROUTED_ROW_BYTES, writer_sizing
from clusterscale.train.data import READ_THREADS
from clusterscale.train.metrics import GPU_PEAK_TFLOPS
from clusterscale.io.negatives import candidates_per_query, draws_for, mine_disk_bytes

# The stages Planner has rules for (memory, disk, files, shuffles, FLOPs); any other stage `clusterscale run` runs (one
# a newcomer registers) is timed per pair from a run's cost record (plan --run-dir) and has no memory or disk rule.
ESTIMATED = ("ingest", "embed", "fit", "assign", "dedup", "shard", "mine", "train", "evaluate")
SKIPPED_WHY = {"dedup": "dedup off (dedup.exact / dedup.semantic_threshold)",
               "mine": "no mined negatives (train.negatives_per_query)"}
MB = 1024 * 1024
ADAM_BYTES_PER_PARAM = 16  # fp32 weights + grads + AdamW's two moments
ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER = 34  # Korthikanti et al. 2022, bf16, no recompute (attention s^2 left out)
ASSIGN_COLUMNS_BYTES = 8  # cluster int32 + cos float32 added to an embeddings row
DEDUP_TASK_MEMORY_FRACTION = 0.25  # stages/dedup/semantic.TASK_MEMORY_FRACTION (dedup.max_group_rows=auto)
OBJECT_STORE_FRACTION = 0.3  # Ray's default object store: 30% of a node's memory
# dedup's largest process is not its per-cluster task but a worker of its hash shuffle, which holds one input batch
# of runtime/bounded_data.SHUFFLE_MAP_BATCH_BYTES (64 MiB) plus up to one row group: bounded, whatever N. Measured
# USS (benchmarks/RESULTS.md, "Dedup"): Ray Data's HashShuffleMap task through the object store (input under
# ray.disk_shuffle_min_mib), dedup alone at 150k rows, d = 384, any passes: 585 MB; through local files, bench_scale
# at 600k rows: the read + mark task and the disk shuffle's reduce, 772 / 784 MB.
# Ray 2.60 on the 2-core CPU box; a plan says so where it uses them.
DEDUP_SHUFFLE_WORKER_MB = {"object store": 585.0, "local files": 784.0}
# A training rank's reads from a run directory on an object store (train/data.py): each step opens the shard file of
# its slice (a new one every step: a file holds a few global batches) and reads its footer and row groups, plus the
# sidecar piece of the same rows with mined negatives; READ_THREADS requests are in flight, train.prefetch_steps ahead.
STORE_REQUEST_S = 0.030  # an object store's time to first byte (S3: ~10-100 ms); RESULTS.md's bench at +30 ms
STORE_STREAM_BYTES_S = 80e6  # one request stream's throughput
REQUESTS_PER_FILE = 4  # open, footer, a row group's columns (benchmarks/bench_train_reads.py counts them)


@dataclass
class StagePlan:
    stage: str
    runs_on: str               # "gpu", "cpu" or "skipped: <why>"
    wall_s: float = 0.0
    gpu_hours: float = 0.0
    cpu_hours: float = 0.0
    cost: float | None = None
    peak_task_mb: float = 0.0  # the largest task, actor or rank
    peak_driver_mb: float = 0.0
    disk_bytes: dict[str, float] = field(default_factory=dict)
    files: int = 0
    shuffle_bytes: float = 0.0
    spill_bytes: float = 0.0
    time_from: str = ""        # where the rate comes from
    memory_from: str = ""
    read_s: float = 0.0        # train: a rank's reads of an epoch from an object store, overlapped (train_read_s)

    def to_json(self) -> dict:
        return {"wall_s": self.wall_s, "gpu_hours": self.gpu_hours, "cpu_hours": self.cpu_hours, "cost": self.cost,
                "peak_task_mb": self.peak_task_mb, "peak_driver_mb": self.peak_driver_mb,
                "disk_bytes": float(sum(self.disk_bytes.values())), "disk_bytes_by_folder": self.disk_bytes,
                "files": self.files, "shuffle_bytes": self.shuffle_bytes, "spill_bytes": self.spill_bytes,
                "runs_on": self.runs_on, "time_from": self.time_from, "memory_from": self.memory_from,
                "read_s": self.read_s}


@dataclass(frozen=True)
class Models:
    """Parameter counts and token counts the FLOP arithmetic uses."""

    embed_params: int
    student_params: int
    embed_flop_params: int    # without the embedding tables: what the FLOPs per token count
    student_flop_params: int
    embed_tokens: float
    train_tokens: float  # query + passage tokens of a pair
    note: str


def plan_stages() -> tuple[str, ...]:
    """The stages a plan estimates: those `clusterscale run` runs, in its order (pipeline.STAGE_VERBS, so a stage a
    newcomer registers appears too), but report (it reads what the others wrote)."""
    return tuple(verb for verb in pipeline.STAGE_VERBS if verb != "report")


def preprocessing_stages() -> tuple[str, ...]:
    """The stages before training: what the preprocessing / training ratio counts as preprocessing."""
    stages = plan_stages()
    return stages[:stages.index("train")] if "train" in stages else stages


def stage_runs(stage: str, cfg: Config) -> str | None:
    """None when the stage runs in this config (its Stage's in_run, as `clusterscale run` decides); else why not."""
    in_run = pipeline.STAGES[stage].in_run
    if in_run is None or in_run(cfg):
        return None
    return f"skipped: {SKIPPED_WHY.get(stage, 'not run for this config')}"


def gpu_encoder_rate(flops_per_item: float, cluster: ClusterSpec, rates: Rates, what: str) -> tuple[float, str]:
    """Items per second per GPU at the calibrated (or datasheet) MFU."""
    mfu, source = rates.mfu(what)
    peak = GPU_PEAK_TFLOPS[cluster.gpu_type] * 1e12
    return peak * mfu / flops_per_item, f"{2 if what == 'encoder' else 6} x params x tokens FLOPs, {source}"


class Planner:
    """Estimates for one (config, N, k, cluster, rates); `plan()` returns every stage."""

    def __init__(self, cfg: Config, shape: RunShape, cluster: ClusterSpec, rates: Rates, models: Models,
                 price_per_gpu_hour: float | None):
        self.cfg, self.shape, self.cluster, self.rates, self.models = cfg, shape, cluster, rates, models
        self.price = price_per_gpu_hour
        self.shards = shard_sizes(cfg, shape)
        self.train: TrainShape = train_shape(cfg, self.shards)
        text = rates.bytes_per_row.get("pairs")
        self.text_bytes_assumed = text is None
        self.text_bytes = text or 400.0  # DESIGN.md's ~0.4 KB of text per pair when nothing measured one
        sides = 2 if cfg.embed.side == "both" else 1
        self.embedding_row_bytes = self.text_bytes + 2 * shape.dim * sides  # fp16 vectors (runtime/vectors)

    # --- time ---------------------------------------------------------------------------------------------------
    def declared(self, stage: str) -> Estimate | None:
        """A registered stage's own estimate (executor.Stage.estimate), None for the built-in stages (their rules are
        here) and for a stage that declares none."""
        estimate = pipeline.STAGES[stage].estimate
        return estimate(self.cfg, self.shape) if stage not in ESTIMATED and estimate is not None else None

    def cpu_time(self, stage: str, work: float, cpus: int) -> tuple[float, str]:
        rate = self.rates.stages.get(stage)
        declared = self.declared(stage)
        if rate is None and declared is not None and declared.cpu_s_per_pair is not None:
            return declared.cpu_s_per_pair * self.shape.train_rows / max(1, cpus), \
                "the stage's own estimate (Stage.estimate: CPU seconds per pair)"
        if rate is None and stage not in ESTIMATED:  # a registered stage: its time per pair from a run's cost record
            return math.nan, ("no estimate: pass --run-dir of a run that ran it (its measured time per pair is "
                              "scaled), or declare Stage.estimate")
        if rate is None:
            return math.nan, "not calibrated: run `clusterscale plan --calibrate`, or pass --run-dir of a run"
        return rate.fixed_s + rate.cpu_s_per_work * work / max(1, cpus), rate.source

    def gpu_time(self, flops: float, gpus: int, what: str, fixed_stage: str) -> tuple[float, str]:
        per_item, source = gpu_encoder_rate(1.0, self.cluster, self.rates, what)  # FLOP/s per GPU
        fixed = self.rates.stages[fixed_stage].fixed_s if fixed_stage in self.rates.stages else 0.0
        return fixed + flops / (per_item * max(1, gpus)), source

    def ingest_unit_s(self) -> float:
        """One task over ingest's largest work unit (a non-Parquet file is read whole): the stage's least time."""
        rate = self.rates.stages.get("ingest")
        return rate.fixed_s + rate.cpu_s_per_work * self.shape.ingest_unit_rows if rate else 0.0

    def unit_note(self) -> str:
        return (f"{self.shape.ingest_unit_rows:,} rows in one task: ingest splits a Parquet file into runs of row "
                f"groups of >= data.rows_per_part rows, an uncompressed JSON lines or TSV file into byte ranges of "
                f"data.range_bytes, and reads any other file (CSV, compressed, a JSON array) whole")

    def eval_texts(self) -> float:
        """The texts evaluate embeds per model: the held-out queries it picks (eval.max_queries, chosen in tasks),
        their passages (one each, as most held-out queries have) and the distractors; never the whole held-out split,
        whatever data.heldout_fraction is."""
        picked = min(self.cfg.eval.max_queries, self.shape.heldout_rows)
        return 2.0 * picked + self.cfg.eval.num_distractors

    def cpu_flops_time(self, name: str) -> tuple[float, str]:
        """An encoder stage on CPUs without a measured rate: its FLOPs at the calibrated matmul FLOP/s per CPU."""
        models, shape = self.models, self.shape
        if name == "embed":
            flops = 2.0 * models.embed_flop_params * models.embed_tokens * shape.train_rows
        elif name == "train":
            flops = self.train_flops_per_pair() * self.train.steps_per_epoch * self.cfg.train.schedule.global_batch_size
        else:
            flops = 2.0 * (models.embed_flop_params + models.student_flop_params) * models.embed_tokens * \
                self.eval_texts()
        mfu = self.rates.cpu_encoder_mfu
        rate = self.rates.cpu_flops_per_s_per_cpu * self.cluster.cpus * (mfu or DATASHEET_MFU)
        if mfu:
            return flops / rate, (f"FLOPs at the calibrated fp32 matmul rate per CPU x {mfu:.0%} (the encoder's "
                                  f"MFU, calibrated)")
        return flops / rate, (f"FLOPs at the calibrated fp32 matmul rate per CPU x {DATASHEET_MFU:.0%} (assumed "
                              f"MFU)")

    # --- memory: the stages' own sizing rules ----------------------------------------------------------------------
    def base(self, stage: str) -> tuple[float, float, str]:
        rate = self.rates.stages.get(stage)
        if rate and (rate.task_base_mb or rate.driver_base_mb):
            return rate.task_base_mb, rate.driver_base_mb, "formula + process footprint measured by --calibrate"
        return 0.0, 0.0, "formula only (data held; no process footprint measured)"

    def task_bytes(self, stage: str) -> tuple[float, float]:
        """(largest task / actor / rank, driver) bytes of data a stage holds, by the rule the stage sizes with."""
        cfg, shape, k = self.cfg, self.shape, self.shape.k
        d = cluster_dim(cfg, shape)  # what fit, assign, shard's sums, dedup and mine hold (cluster.dims)
        centroids = k * d * 4.0
        if stage == "ingest":
            return cfg.data.rows_per_part * self.text_bytes * 2, 0.0
        if stage == "embed":
            return self.models.embed_params * 4.0 + cfg.data.rows_per_part * self.embedding_row_bytes, 0.0
        if stage == "fit":
            actors = self.cluster.gpus or self.cluster.nodes  # stages/kmeans.fit_resources: per GPU, else per node
            # stages/kmeans.SampleShard: the sample's chunks and their concatenation while it starts, then one copy
            # and the blocked fp16 check (abs, fp16 and float32 round trip of FP16_CHECK_BLOCK_VALUES values)
            sample = fit_sample_rows(cfg, shape) / actors * d * 4
            # The driver: every actor's float64 (k, d) sums of a Lloyd step at once (one ray.get), and their total.
            return max(2 * sample, sample + FP16_CHECK_BLOCK_VALUES * 10.0) + 2 * centroids, (actors + 1) * k * d * 8.0
        if stage == "assign":  # one work unit (<= ASSIGN_UNIT_ROWS rows of one embeddings file) in, and out again
            unit = min(ASSIGN_UNIT_ROWS, embed_files(cfg, shape, self.embed_actors()).largest)
            return unit * (2 * self.embedding_row_bytes + ASSIGN_COLUMNS_BYTES) + centroids, centroids
        if stage == "shard":
            return float(writer_sizing(group_sizes(cfg, self.shards), self.text_bytes)[1]), k * d * 8.0 * 2
        if stage == "dedup":  # two blocks of a cluster (edges task; a whole cluster up to dedup.max_group_rows)
            row = self.embedding_row_bytes + ASSIGN_COLUMNS_BYTES
            limit = (DEDUP_TASK_MEMORY_FRACTION * self.cluster.node_memory_bytes / max(1, self.cluster.cpus_per_node)
                     / row if cfg.dedup.max_group_rows == "auto" else float(cfg.dedup.max_group_rows))
            block = min(float(self.shards.largest), limit)
            return 2 * block * row + cfg.dedup.block_rows ** 2 * 8.0, k * 8.0
        if stage == "mine":
            if cfg.mine.max_group_rows == "auto":  # mine_search.auto_group_bounds: a quarter + a half of a task's memory
                return 0.75 * self.cluster.node_memory_bytes / max(1, self.cluster.cpus_per_node), centroids
            return 2 * cfg.mine.max_group_rows * (d * 4.0 + self.text_bytes), centroids
        if stage == "train":
            return self.rank_bytes(), 0.0
        if stage == "evaluate":  # the encoder's vectors; the driver: the eval set's texts (stages/eval_set.py)
            return self.eval_texts() * shape.dim * 4.0, self.eval_texts() * self.text_bytes
        declared = self.declared(stage)
        return (declared.task_bytes, declared.driver_bytes) if declared else (0.0, 0.0)

    def rank_bytes(self) -> float:
        """A training rank: weights + grads + AdamW state, and the activations of the rows it embeds at once
        (its share of the global batch, or a GradCache chunk), query and passage sides."""
        cfg, st = self.cfg, self.cfg.train.student
        ranks = max(1, cfg.train.compute.num_workers)
        rows = cfg.train.schedule.global_batch_size // ranks
        rows = min(rows, cfg.train.compute.grad_cache_chunk or rows)
        hidden, layers = st.scratch_hidden_size, st.scratch_num_layers
        tokens = st.query_max_length + st.passage_max_length
        return (ADAM_BYTES_PER_PARAM * self.models.student_params
                + ACTIVATION_BYTES_PER_TOKEN_HIDDEN_LAYER * tokens * rows * hidden * layers)

    # --- disk and files -------------------------------------------------------------------------------------------
    def outputs(self, stage: str) -> tuple[dict[str, float], int]:
        cfg, shape, k = self.cfg, self.shape, self.shape.k
        bpr = self.rates.bytes_per_row
        if stage == "ingest":
            parts = math.ceil(shape.train_rows / cfg.data.rows_per_part)
            return {"pairs": shape.train_rows * self.text_bytes,
                    "heldout": shape.heldout_rows * bpr.get("heldout", self.text_bytes)}, 2 * parts
        if stage == "embed":
            files = embed_files(cfg, shape, self.embed_actors())
            return {"embeddings": shape.train_rows * self.embedding_row_bytes}, files.items
        if stage == "fit":
            return {f"kmeans/k={k}": k * cluster_dim(cfg, shape) * 4.0}, 2
        if stage == "assign":
            files = assign_files(embed_files(cfg, shape, self.embed_actors()))
            return {f"assign/k={k}": shape.train_rows * (self.embedding_row_bytes + ASSIGN_COLUMNS_BYTES)}, files
        if stage == "shard":
            row = self.text_bytes + (2 * shape.dim if cfg.shard.keep_emb else 0)
            return {f"shards/k={k}": shape.train_rows * row}, shard_files(cfg, self.shards)
        if stage == "dedup":
            held = {HELDOUT_EMBEDDINGS: shape.heldout_rows * self.embedding_row_bytes} \
                if cfg.dedup.semantic_threshold else {}  # embed_heldout's, written when dedup first needs them
            return {"dedup": shape.train_rows * (self.embedding_row_bytes + ASSIGN_COLUMNS_BYTES)} | held, \
                embed_files(cfg, shape, self.embed_actors()).items
        if stage == "mine":  # io/negatives.mine_disk_bytes: the draws of train.epochs; files: buckets and pieces
            per_query, candidates = cfg.train.objective.negatives_per_query, candidates_per_query(cfg)
            draws = draws_for(per_query, cfg.train.schedule.epochs, candidates)
            disk = mine_disk_bytes(shape.train_rows, candidates, per_query, draws, self.text_bytes,
                                   min(cfg.mine.nprobe, k))
            pieces = shard_files(cfg, self.shards) if per_query else 0
            return disk, max(1, math.ceil(shape.train_rows / QUERIES_PER_FILE)) + pieces
        if stage == "train":
            export = 4.0 * self.models.student_params  # safetensors fp32 model
            ckpt = 12.0 * self.models.student_params if cfg.train.checkpoint.keep_checkpoint else 0.0
            return {f"train/{cfg.train_name()}": export + ckpt}, 4
        declared = self.declared(stage)
        return (dict(declared.disk_bytes), declared.files) if declared else ({}, 0)

    def embed_actors(self) -> int:
        if self.cfg.embed.num_actors:
            return self.cfg.embed.num_actors
        return self.cluster.gpus or max(1, self.cluster.cpus // max(1, self.cfg.embed.threads_per_actor))

    def shuffle_input(self, stage: str) -> tuple[float, float]:
        """(bytes the stage's shuffles move, bytes of their input rows as the stage sizes them to choose local files
        or the object store: runtime/bounded_data.shuffle_for, the assign/ rows it reads, vectors included).
        shard moves text (and vectors with shard.keep_emb); mine each passage and each query once per probed
        cluster, their vectors without text; dedup whole assign/ rows, once by cluster and once more by exact key
        bucket."""
        n, dim, row = self.shape.train_rows, self.shape.dim, self.embedding_row_bytes + ASSIGN_COLUMNS_BYTES
        if stage == "shard":
            return n * (self.text_bytes + (2 * dim if self.cfg.shard.keep_emb else 0)), n * row
        if stage == "mine":  # a routed copy is one fp16 vector and its keys, no text (stages/mine.shuffles)
            copies, dim = n * (1 + min(self.cfg.mine.nprobe, self.shape.k)), cluster_dim(self.cfg, self.shape)
            return copies * (2 * dim + ROUTED_ROW_BYTES), copies * (2 * dim + ROUTED_ROW_BYTES)
        if stage == "dedup":
            return n * row * (2 if self.cfg.dedup.exact else 1), n * row
        return 0.0, 0.0

    def through_files(self, input_bytes: float) -> bool:
        """Whether a shuffle of that input goes through local files (runtime/bounded_data.shuffle_for)."""
        rc = self.cfg.ray
        if not rc.disk_shuffle or not rc.disk_shuffle_min_mib:
            return rc.disk_shuffle
        return input_bytes >= rc.disk_shuffle_min_mib * 2**20

    def shuffle_path(self, stage: str) -> str:
        """Where the stage's hash shuffle goes: "local files" or "object store" (rates.SHUFFLE_PATHS)."""
        return "local files" if self.through_files(self.shuffle_input(stage)[1]) else "object store"

    def k_terms(self, stage: str, cpus: int | None = None) -> float:
        """Seconds of the stage's terms that grow with k (rates.k_terms_s), its shuffle at the rate of its path, and
        dedup's critical path: the largest cluster is decided by one chain of tasks (stages/dedup/blocks.py, in keep
        order), so the semantic pass takes at least that cluster's m x m x d on one CPU, however many there are."""
        cfg, shape = self.cfg, self.shape
        cpus = cpus or self.cluster.cpus
        seconds = k_terms_s(self.rates, search_work(stage, cfg, shape), shuffle_work(stage, cfg, shape), cpus,
                            semantic_work(stage, cfg, shape), self.shuffle_path(stage))
        rate = self.rates.semantic_cpu_s_per_row_row_d
        if stage == "dedup" and rate and semantic_work(stage, cfg, shape):
            spread = rate * semantic_work(stage, cfg, shape) / max(1, cpus)
            seconds += max(0.0, rate * float(self.shards.largest) ** 2 * cluster_dim(cfg, shape) - spread)
        return seconds

    def shuffle(self, stage: str) -> tuple[float, float]:
        """(bytes a stage shuffles, bytes spilled beyond the object stores: none through local files)."""
        moved, input_bytes = self.shuffle_input(stage)
        if not moved or self.through_files(input_bytes):
            return moved, 0.0
        store = OBJECT_STORE_FRACTION * self.cluster.node_memory_bytes * self.cluster.nodes
        return moved, max(0.0, moved - store)

    # --- one stage ---------------------------------------------------------------------------------------------
    def stage(self, name: str) -> StagePlan:
        skipped = stage_runs(name, self.cfg)
        if skipped:
            return StagePlan(name, skipped)
        cfg, shape, cluster, models = self.cfg, self.shape, self.cluster, self.models
        gpus_used = 0
        if name == "embed" and cluster.gpus:
            gpus_used = min(self.embed_actors(), cluster.gpus)
            wall, source = self.gpu_time(2.0 * models.embed_flop_params * models.embed_tokens * shape.train_rows,
                                         gpus_used, "encoder", "embed")
        elif name == "train" and cluster.gpus and cfg.train.compute.use_gpu:
            gpus_used = min(cfg.train.compute.num_workers, cluster.gpus)
            flops = self.train_flops_per_pair() * self.train.steps_per_epoch * cfg.train.schedule.global_batch_size
            wall, source = self.gpu_time(flops, gpus_used, "train", "train")
        elif name == "evaluate" and cluster.gpus:
            gpus_used = 1
            flops = 2.0 * (models.embed_flop_params + models.student_flop_params) * models.embed_tokens * \
                self.eval_texts()
            wall, source = self.gpu_time(flops, 1, "encoder", "evaluate")
        else:
            work = stage_work(name, cfg, shape)
            if name == "train":
                work = float(self.train.steps_per_epoch * cfg.train.schedule.global_batch_size)
            wall, source = self.cpu_time(name, work, cluster.cpus)
            if name == "ingest" and self.ingest_unit_s() > wall:  # one task reads the largest unit
                wall, source = self.ingest_unit_s(), f"{source}; bound by its largest work unit ({self.unit_note()})"
            # fit's and assign's searches, shard's and dedup's shuffle partitions, dedup's semantic pass: measured rates
            wall += self.k_terms(name)
            if math.isnan(wall) and name in ("embed", "train", "evaluate") and self.rates.cpu_flops_per_s_per_cpu:
                wall, source = self.cpu_flops_time(name)
        if name == "dedup" and cfg.dedup.semantic_threshold:  # dedup runs embed_heldout first (pipeline: run_by)
            held_s, held_source = self.heldout_embed_s()
            wall, source = wall + held_s, f"{source}; + embed_heldout: {held_source}"
        read_s = self.train_read_s() if name == "train" else 0.0
        if read_s > wall:  # the prefetch overlaps reads with compute: the slower of the two sets the pace
            wall, source = read_s, f"{source}; bound by its reads from an object store ({self.read_source()})"
        task, driver = self.task_bytes(name)
        task_base, driver_base, mem_source = self.base(name)
        task_mb = task / MB + task_base
        if name == "dedup":
            task_mb, mem_source = self.dedup_shuffle_worker(task_mb, mem_source)
        disk, files = self.outputs(name)
        shuffled, spilled = self.shuffle(name)
        hours = wall / 3600 if not math.isnan(wall) else math.nan
        return StagePlan(name, "gpu" if gpus_used else "cpu", wall, gpus_used * hours,
                         (cluster.cpus if not gpus_used else gpus_used) * hours,
                         None if self.price is None else self.price * cluster.gpus * hours,
                         task_mb, driver / MB + driver_base, disk, files, shuffled, spilled, source, mem_source,
                         read_s)

    def heldout_embed_s(self) -> tuple[float, str]:
        """embed_heldout's time (dedup runs it when its semantic check needs the held-out vectors): embed's rate on
        the held-out rows, on the GPUs when the cluster has them."""
        models, rows = self.models, float(self.shape.heldout_rows)
        flops = 2.0 * models.embed_flop_params * models.embed_tokens * rows
        if self.cluster.gpus:
            wall, source = self.gpu_time(flops, min(self.embed_actors(), self.cluster.gpus), "encoder", "embed")
            return wall, f"{rows:,.0f} held-out texts, {source}"
        wall, source = self.cpu_time("embed", rows, self.cluster.cpus)
        if math.isnan(wall) and self.rates.cpu_flops_per_s_per_cpu:
            mfu = self.rates.cpu_encoder_mfu or DATASHEET_MFU
            wall, source = flops / (self.rates.cpu_flops_per_s_per_cpu * self.cluster.cpus * mfu), "FLOPs on CPUs"
        return wall, f"{rows:,.0f} held-out texts, {source}"

    def train_read_s(self) -> float:
        """Seconds a training rank spends reading its rows in an epoch (train's wall is per epoch), if its run
        directory is on an object store:
        per step REQUESTS_PER_FILE requests for its slice's shard file (and as many for its sidecar piece with mined
        negatives) at STORE_REQUEST_S each, plus its bytes at STORE_STREAM_BYTES_S, READ_THREADS at once. The
        prefetch overlaps them with the steps: they set the pace only when longer (a local disk: ~0)."""
        cfg = self.cfg
        rows = cfg.train.schedule.global_batch_size / max(1, cfg.train.compute.num_workers)
        per_query = cfg.train.objective.negatives_per_query
        requests = REQUESTS_PER_FILE * (2 if per_query else 1)
        row_bytes = self.text_bytes + 8 + per_query * (self.text_bytes + 16)  # texts, pair_id; drawn texts and ids
        step = (requests * STORE_REQUEST_S + rows * row_bytes / STORE_STREAM_BYTES_S) / READ_THREADS
        return self.train.steps_per_epoch * step

    @staticmethod
    def read_source() -> str:
        return (f"{REQUESTS_PER_FILE} requests per file at {STORE_REQUEST_S * 1e3:.0f} ms and "
                f"{STORE_STREAM_BYTES_S / 1e6:.0f} MB/s per stream, {READ_THREADS} in flight")

    def dedup_shuffle_worker(self, block_task_mb: float, mem_source: str) -> tuple[float, str]:
        """dedup's largest process: its per-cluster task (block_task_mb) or a worker of its hash shuffle, at the
        size of one full input batch by where the shuffle goes (local files from ray.disk_shuffle_min_mib of input
        on), in proportion below one batch: as `--calibrate` measured it (the object store's), else
        DEDUP_SHUFFLE_WORKER_MB."""
        rows_bytes = self.shuffle_input("dedup")[1]
        path = "local files" if self.through_files(rows_bytes) else "object store"
        measured = self.rates.dedup_shuffle_worker_mb.get(path)
        worker = (measured or DEDUP_SHUFFLE_WORKER_MB[path]) * min(1.0, rows_bytes / SHUFFLE_MAP_BATCH_BYTES)
        if worker <= block_task_mb:
            return block_task_mb, mem_source
        source = self.rates.dedup_shuffle_source if measured else \
            "measured on the 2-core CPU box (Ray 2.60, benchmarks/RESULTS.md, bench_plan), not calibrated here"
        return worker, f"a worker of its shuffle through {path}: {source}"

    def train_flops_per_pair(self) -> float:
        """6 x params x tokens (forward + backward), plus a forward more with GradCache (its re-forward) unless a
        GPU calibration measured the MFU of a GradCache step (benchmarks/gpu_check.py counts 6 x, the re-forward
        inside its time)."""
        factor = 8.0 if self.cfg.train.compute.grad_cache_chunk and not self.rates.gpu else 6.0
        return factor * self.models.student_flop_params * self.models.train_tokens

    def plan(self) -> dict[str, StagePlan]:
        return {name: self.stage(name) for name in plan_stages()}

    # --- warnings ---------------------------------------------------------------------------------------------
    def warnings(self, stages: dict[str, StagePlan]) -> list[str]:
        cfg, t, batch = self.cfg, self.train, self.cfg.train.schedule.global_batch_size
        out = []
        if t.steps_per_epoch == 0:
            out.append(f"no cluster holds a full global batch of {batch} pairs: training cannot start; lower "
                       f"cluster.k or train.global_batch_size")
        elif t.mean_batches_per_cluster < 10:
            out.append(f"the mean cluster holds {t.mean_batches_per_cluster:.1f} global batches (< 10): the "
                       f"batches of a cluster repeat its few neighbourhoods; lower k to about "
                       f"{max(1, self.shape.train_rows // (10 * batch)):,}")
        if self.shape.train_rows and t.unused_pairs_per_epoch > 0.1 * self.shape.train_rows:
            out.append(f"{t.unused_pairs_per_epoch:,} pairs per epoch ({t.unused_pairs_per_epoch / self.shape.train_rows:.0%})"
                       f" are in no global batch (cluster remainders): lower k or the batch size")
        if cfg.shard.small_cluster_policy == "merge" and self.shape.cluster_sizes.largest < batch:
            out.append("every cluster is smaller than one global batch: the shard stage refuses shard."
                       "small_cluster_policy=merge")
        parallel = self.cpu_time("ingest", stage_work("ingest", cfg, self.shape), self.cluster.cpus)[0]
        if self.ingest_unit_s() > 2 * parallel and self.shape.ingest_unit_rows > 2 * cfg.data.rows_per_part:
            out.append(f"ingest: {self.unit_note()} ({self.ingest_unit_s():,.0f} s, against {parallel:,.0f} s over "
                       f"the cluster's CPUs): split big CSV, compressed or JSON array files, lower "
                       f"data.range_bytes for uncompressed JSON lines and TSV, or write Parquet with row groups of "
                       f"~data.rows_per_part rows, for a parallel ingest")
        per_task = self.cluster.node_memory_bytes / MB / max(1, self.cluster.cpus_per_node)
        for s in stages.values():
            if s.runs_on == "cpu" and s.stage != "train" and s.peak_task_mb > per_task:
                out.append(f"{s.stage}: a task may need {s.peak_task_mb:,.0f} MB, more than a node's memory per "
                           f"CPU ({per_task:,.0f} MB): Ray then runs fewer tasks per node (or raise the memory)")
        rank_gb = stages["train"].peak_task_mb * MB / 1e9
        if self.cluster.gpu_type and cfg.train.compute.use_gpu and rank_gb > GPU_MEMORY_GB[self.cluster.gpu_type]:
            out.append(f"train: a rank needs ~{rank_gb:,.0f} GB, more than a {self.cluster.gpu_type}'s "
                       f"{GPU_MEMORY_GB[self.cluster.gpu_type]} GB: set train.grad_cache_chunk or add ranks")
        reads = stages["train"].read_s
        if reads and "bound by its reads" in stages["train"].time_from:
            out.append(f"train: from a run directory on an object store a rank's reads (~{reads:,.0f} s an epoch: "
                       f"{self.read_source()}) take longer than its steps: raise train.global_batch_size per rank, "
                       f"or keep the shards on a disk nearer the GPUs")
        disk = sum(sum(s.disk_bytes.values()) for s in stages.values())
        if self.cluster.node_disk_bytes:
            shuffle_per_node = max(s.shuffle_bytes for s in stages.values()) / self.cluster.nodes
            if shuffle_per_node > self.cluster.node_disk_bytes:
                out.append(f"the largest shuffle puts {shuffle_per_node / 1e9:,.0f} GB on each node's local disk "
                           f"({self.cluster.node_disk_bytes / 1e9:,.0f} GB): add disk or nodes")
            if disk > self.cluster.node_disk_bytes:
                out.append(f"the run writes {disk / 1e9:,.0f} GB, more than one node's disk "
                           f"({self.cluster.node_disk_bytes / 1e9:,.0f} GB): a local --run-dir cannot hold it; use "
                           f"shared or object storage")
        if self.text_bytes_assumed:
            out.append("bytes per pair assumed (400 B of text, DESIGN.md): pass --run-dir of a run on this data or "
                       "calibrate")
        return out


def preprocess_over_train(stages: dict[str, StagePlan], epochs: int) -> float | None:
    """Cluster time of preprocessing / of `epochs` training epochs (the cluster is paid while either runs); stages
    without a rate are left out (make_plan names them)."""
    pre = sum(s.wall_s for n, s in stages.items() if n in preprocessing_stages() and not s.runs_on.startswith("skipped")
              and not math.isnan(s.wall_s))
    train = stages["train"].wall_s * epochs
    return pre / train if train and not math.isnan(train) else None


def uncalibrated(stages: dict[str, StagePlan]) -> list[str]:
    return [n for n, s in stages.items() if not s.runs_on.startswith("skipped") and math.isnan(s.wall_s)]
