"""Per-step training figures: the all-reduce across ranks, metrics.jsonl (rank 0), batches/rank-<r>.jsonl, MFU,
optional TensorBoard, the printed line and the collapse guard; read back with `read_metrics`."""
from __future__ import annotations

import functools
import json
import math
import os
import posixpath
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clusterscale.config import TrainConfig
from clusterscale.train.loss_config import LossConfig
from clusterscale.train.losses import loss as get_loss
from clusterscale.io.layout import batches_path, collapse_path, metrics_path, train_dir
from clusterscale.io.rundir import RunDir
from clusterscale.train.schedule import GlobalBatch

if TYPE_CHECKING:  # torch is imported where a function needs it: `clusterscale` starts without it
    import torch

# Dense bf16 peak TFLOP/s per GPU (vendor datasheets, no sparsity), matched on the device name.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0,
                   "A10": 125.0, "V100": 125.0, "T4": 65.0}
# A step's figures: means over ranks (every rank's queries count) and sums of counts. The optional ones exist
# only with some options (mined negatives, CLP, MoE) or when the trainer adds them (the shard bytes its ranks read
# for the step, footers included, the part of it that was Parquet footers, and the on-disk bytes of the rows they
# used: bytes_read / bytes_used is the read amplification).
MEANS = ("pos_cos", "neg_cos_mean", "neg_cos_max")
SUMS = ("masked_false_negatives", "tokens")
OPTIONAL_MEANS = ("mined_neg_cos_mean", "clp_penalty", "moe_aux_loss", "data_wait_s")
OPTIONAL_SUMS = ("mined_negatives", "masked_mined_negatives", "clp_skipped", "negatives_padded",
                 "labeled_negatives_empty", "bytes_read", "bytes_used", "footer_bytes_read")


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one worker: train.peak_tflops, a datasheet value, or a measured fp32 matmul on CPU; None when
    unknown (a GPU not in GPU_PEAK_TFLOPS)."""
    import torch

    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v * 1e12 for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)
    return cpu_matmul_flops(torch.get_num_threads())


CPU_MATMUL_N = 1024  # one square fp32 matmul: 2.1 GFLOP, ~6-12 ms per thread on a 2020s x86 core
CPU_MATMUL_TRIALS = 24


@functools.lru_cache(maxsize=None)
def cpu_matmul_flops(threads: int) -> float:
    """What `threads` CPU threads reach on a large fp32 matmul: the ceiling of a CPU worker (its datasheet peak is
    unknowable in a VM, which reports neither turbo clocks nor FMA units). Measured once per process.

    The fastest of CPU_MATMUL_TRIALS products, not their mean: a measurement shared with other work (another
    rank, a busy box) only ever reads low, and a peak read low gives an MFU over 100% (121.7% was seen with a mean
    of 5). MetricsProcessor still drops an MFU the steps prove impossible."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(CPU_MATMUL_N, CPU_MATMUL_N), torch.randn(CPU_MATMUL_N, CPU_MATMUL_N)
        a @ b  # warm-up: thread pool and caches
        fastest = math.inf
        for _ in range(CPU_MATMUL_TRIALS):
            started = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - started)
    finally:
        torch.set_num_threads(saved)
    return 2 * CPU_MATMUL_N ** 3 / fastest


def model_flops_utilization(flops_per_s: float, peak_per_worker: float | None, world: int) -> float | None:
    """Achieved / peak FLOP/s of the whole group; None when unknown: no peak, or a peak the step itself beat
    (its measurement read low), which would print an impossible MFU over 100%."""
    if not peak_per_worker:
        return None
    mfu = flops_per_s / (peak_per_worker * world)
    return mfu if mfu <= 1.0 else None


def read_metrics(run: RunDir, name: str) -> list[dict]:
    """The per-step records of train/<name>/metrics.jsonl; [] when that run has none."""
    return [json.loads(line) for line in read_jsonl_lines(run, metrics_path(name))]


def _parts_dir(rel: str) -> str:
    return f"{rel}.parts"


def read_jsonl_lines(run: RunDir, rel: str) -> list[str]:
    """The lines of a JsonlLog: the file, or on an object store its parts in step order."""
    if run.exists(rel):
        return [line for line in run.read_bytes(rel).decode().splitlines() if line.strip()]
    parts = run.files(_parts_dir(rel), suffix=".jsonl")
    return [line for part in parts for line in run.fs.open_input_stream(part).read().decode().splitlines()
            if line.strip()]


class JsonlLog:
    """A jsonl file in the run directory that grows by appends: each flush writes only the records since the
    last one. A local (or shared) filesystem appends to <rel>; an object store, which cannot append, gets each
    flush as a new object <rel>.parts/<first step>.jsonl (read back by read_jsonl_lines).

    At the start of an attempt the records of steps at or past its first step (written by an attempt that
    failed after the checkpoint it resumes from, or before any checkpoint) are cut once: the file is truncated
    before the first of them, or those parts are deleted."""

    def __init__(self, run: RunDir, rel: str, resume_step: int | None):
        self.run, self.rel, self.pending = run, rel, []
        if run.is_local:
            self._truncate_from(resume_step or 0)
        else:
            self._drop_parts_from(resume_step or 0)

    def _truncate_from(self, step: int) -> None:
        if not self.run.exists(self.rel):
            return
        offset = 0
        with open(self.run.path(self.rel), "rb") as f:
            for line in f:
                if line.strip() and json.loads(line)["step"] >= step:
                    break
                offset += len(line)
        os.truncate(self.run.path(self.rel), offset)

    def _drop_parts_from(self, step: int) -> None:
        for part in self.run.files(_parts_dir(self.rel), suffix=".jsonl"):
            rel = posixpath.relpath(part, self.run.root)
            lines = self.run.read_bytes(rel).decode().splitlines()
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] < step]
            if not kept:
                self.run.remove(rel)
            elif len(kept) < len(lines):
                self.run.write_text(rel, "\n".join(kept) + "\n")

    def append(self, record: dict) -> None:
        self.pending.append(record)

    def flush(self) -> None:
        if not self.pending:
            return
        text = "".join(json.dumps(r) + "\n" for r in self.pending)
        if self.run.is_local:
            self.run.makedirs(posixpath.dirname(self.rel))
            with self.run.fs.open_append_stream(self.run.path(self.rel)) as out:
                out.write(text.encode())
        else:
            self.run.write_text(f"{_parts_dir(self.rel)}/{self.pending[0]['step']:010d}.jsonl", text)
        self.pending = []


class TensorBoardLog:
    """Scalars of every step, when train.tensorboard is on (rank 0 only)."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("train.tensorboard=true needs the `tensorboard` package: `pip install tensorboard`, "
                              "or set train.tensorboard=false.") from exc
        self.writer = SummaryWriter(log_dir)

    def log(self, record: dict) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "epoch", "cluster"):
                self.writer.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        self.writer.close()


class CollapseGuard:
    """Flags a run that is not learning: loss at or above chance while every text maps to one direction.

    Fed the all-reduced figures of every step, so every rank reaches the same verdict at the same step
    and the ranks can stop together. Steps inside warm-up are ignored; after it, each logging
    interval's mean loss and mean in-batch negative cosine are checked. `patience` intervals in a row
    with loss >= (1 - loss_margin) x chance (ln of the candidates per query, or of what the loss averages
    instead) and negative cosine >= max_neg_cos mean collapse: the embeddings carry no information
    about the text. One of the two alone is common early on (a fresh encoder's vectors are anisotropic).
    """

    def __init__(self, chance_loss: float, warmup_steps: int, interval: int, patience: int = 3,
                 loss_margin: float = 0.02, max_neg_cos: float = 0.9):
        self.chance_loss, self.warmup_steps, self.interval = chance_loss, warmup_steps, max(1, interval)
        self.patience, self.loss_margin, self.max_neg_cos = patience, loss_margin, max_neg_cos
        self.window: list[tuple[float, float]] = []
        self.strikes = 0
        self.verdict: str | None = None

    def observe(self, step: int, loss: float, neg_cos_mean: float) -> str | None:
        """Record one step; returns the warning the first time the run is judged collapsed."""
        if self.verdict is not None or step < self.warmup_steps:
            return None
        self.window.append((loss, neg_cos_mean))
        if len(self.window) < self.interval:
            return None
        mean_loss = sum(v[0] for v in self.window) / len(self.window)
        mean_cos = sum(v[1] for v in self.window) / len(self.window)
        self.window = []
        stuck = mean_loss >= (1 - self.loss_margin) * self.chance_loss and mean_cos >= self.max_neg_cos
        self.strikes = self.strikes + 1 if stuck else 0
        if self.strikes < self.patience:
            return None
        self.verdict = (
            f"the run looks collapsed at step {step + 1}: for {self.patience} logging intervals of {self.interval} "
            f"steps after warm-up the loss stayed at chance level ({mean_loss:.3f} vs ln of the candidates per "
            f"query = {self.chance_loss:.3f}) while the mean cosine of a query to its in-batch negatives was "
            f"{mean_cos:.3f} (>= {self.max_neg_cos}): every text maps to nearly the same direction. Likely causes, "
            f"most likely first: CLS pooling on a model trained from scratch (try train.pooling=mean), a too "
            f"high train.lr, a too low train.temperature (0.02 is the paper's; try 0.05), a too short "
            f"train.warmup_steps. train.stop_on_collapse=false lets such a run go on.")
        return self.verdict


def chance_loss(global_batch_size: int, objective: LossConfig | None = None) -> float:
    """The loss of an encoder that cannot tell texts apart: InfoNCE's ln(candidates per query) with the objective's
    mined negatives, as its train.loss counts it (train/losses: Loss.chance)."""
    objective = objective or LossConfig()
    chance = math.log(global_batch_size * (1 + objective.negatives_per_query))
    return get_loss(objective.loss).chance(chance, objective)


@dataclass(frozen=True)
class StepFigures:
    """A global step's loss and figures, the same on every rank after the all-reduce."""

    loss: float
    means: dict[str, float]
    sums: dict[str, float]

    def values(self) -> dict[str, float]:
        return {**self.means, **self.sums}


def _waited(waited_s: float, elapsed_s: float) -> str:
    """The progress line's note when steps waited for their rows (>= 5% of the time since the last line)."""
    if waited_s < max(0.05 * elapsed_s, 1e-3):
        return ""
    return (f"; waited {waited_s:.1f}s for data ({waited_s / max(elapsed_s, 1e-9):.0%}): raise "
            f"train.prefetch_steps, or read from storage nearer the workers")


def reduce_step_figures(loss: torch.Tensor, stats: dict, world: int) -> StepFigures:
    """This rank's loss share and step stats (step.contrastive_backward) -> the global figures, in one small
    all-reduce. Which optional figures exist depends only on the config, so all ranks send the same layout."""
    import torch

    means = [*MEANS, *(k for k in OPTIONAL_MEANS if k in stats)]
    sums = [*SUMS, *(k for k in OPTIONAL_SUMS if k in stats)]
    values = torch.stack([loss.detach().float()] + [torch.as_tensor(stats[k], dtype=torch.float32).to(loss.device)
                                                    for k in means + sums])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(values)
        values[:1 + len(means)] /= world
    values = values.tolist()
    return StepFigures(values[0], dict(zip(means, values[1:])), dict(zip(sums, values[1 + len(means):])))


@dataclass(frozen=True)
class StepResult:
    """What one global step hands the logs; all but pair_ids are the same on every rank."""

    batch: GlobalBatch
    group: tuple[int | None, str]  # (cluster, cluster_name) of the stratum the batch came from
    figures: StepFigures
    lr: float  # the learning rate this step used
    grad_norm: float  # before clipping
    flops: float  # of the whole global batch
    step_s: float
    pair_ids: list[int] | None  # this rank's rows, when train.log_batches


class MetricsProcessor:
    """One rank's per-step logs. Every rank: batches/rank-<r>.jsonl (train.log_batches) and the collapse guard,
    fed the same all-reduced figures so that all ranks reach the same verdict. Rank 0: metrics.jsonl,
    TensorBoard, and a printed line every train.log_every_steps. Logs are flushed at those lines and by the
    caller before each checkpoint; on resume they keep only the steps before the checkpoint's."""

    def __init__(self, run: RunDir, name: str, tc: TrainConfig, rank: int, world: int, *, peak: float | None,
                 resume_step: int | None, num_steps: int, stop_step: int, segment: int):
        self.run, self.name, self.tc, self.rank, self.world, self.peak = run, name, tc, rank, world, peak
        self.num_steps, self.stop_step, self.segment = num_steps, stop_step, segment
        self.metrics = JsonlLog(run, metrics_path(name), resume_step) if rank == 0 else None
        self.batches = JsonlLog(run, batches_path(name, rank), resume_step) if tc.logging.log_batches else None
        logs, objective = tc.logging, tc.objective
        board = logs.tensorboard and rank == 0
        self.board = TensorBoardLog(run.path(train_dir(name), "tensorboard")) if board else None
        self.guard = CollapseGuard(chance_loss(tc.schedule.global_batch_size, objective),
                                   tc.optimizer.warmup_steps, logs.log_every_steps)
        self.progress: dict = {}  # the latest figures, for Ray's reports
        self.started = self.last_print = time.time()
        self.waited_s = 0.0  # waited for data since the last printed line (the ranks' mean)
        self.said_no_negatives = False  # a step without one in-batch negative is said once per run

    def log(self, result: StepResult) -> None:
        """Append a step to the logs; rank 0 flushes and prints every train.log_every_steps and at the stop."""
        gb, figures = result.batch, result.figures
        if self.batches is not None:
            self.batches.append({"step": gb.step, "epoch": gb.epoch, "shard": gb.shard, "group": gb.group,
                                 "pair_ids": result.pair_ids})
        self.progress = {"epoch": gb.epoch, "loss": figures.loss, "lr": result.lr, **figures.values()}
        if self.rank != 0:
            return
        record = self.record(result)
        self.metrics.append(record)
        self._say_if_no_negatives(record)
        self.waited_s += figures.means.get("data_wait_s", 0.0)
        if self.board is not None:
            self.board.log(record)
        if (gb.step + 1) % self.tc.logging.log_every_steps == 0 or gb.step + 1 == self.stop_step:
            self.flush()
            self._print(record)

    def record(self, result: StepResult) -> dict:
        """A step's line of metrics.jsonl."""
        gb, figures, tc = result.batch, result.figures, self.tc
        flops_per_s = result.flops / result.step_s
        record = {"step": gb.step, "epoch": gb.epoch, "cluster": result.group[0], "cluster_name": result.group[1],
                  "loss": figures.loss, "lr": result.lr, "grad_norm": result.grad_norm, **figures.means,
                  **{k: int(v) for k, v in figures.sums.items()},
                  "pairs_per_s": tc.schedule.global_batch_size / result.step_s, "step_s": result.step_s,
                  "tflops_per_s": flops_per_s / 1e12, "mfu": model_flops_utilization(flops_per_s, self.peak, self.world)}
        if tc.shards.recluster_every:
            record["segment"] = self.segment
        return record

    def _say_if_no_negatives(self, record: dict) -> None:
        """Once per run: a step whose every in-batch candidate was masked (each other passage of the batch repeats a
        query's positive text, or its pair has the same query) had no in-batch negative to learn from: its InfoNCE
        loss is 0. Most often a text column that barely varies (ingest's distinct_sample)."""
        b = self.tc.schedule.global_batch_size
        if self.said_no_negatives or b < 2 or record.get("masked_false_negatives", 0) < b * (b - 1):
            return
        self.said_no_negatives = True
        print(f"[train] warning: step {record['step'] + 1}: every in-batch negative of every query was masked (each "
              f"other passage of the batch has a positive's text or the same query), so the step learned nothing "
              f"from in-batch negatives (loss {record['loss']:.4f}). Check data.query_column and "
              f"data.passage_column: ingest's distinct_sample (pairs/_DONE.json) counts their distinct texts.",
              flush=True)

    def _print(self, record: dict) -> None:
        now = time.time()
        pairs = self.tc.logging.log_every_steps * self.tc.schedule.global_batch_size
        pairs_per_s = pairs / max(now - self.last_print, 1e-9)
        mfu = f"{record['mfu']:.1%}" if record["mfu"] is not None else "unknown"
        waited = _waited(self.waited_s, now - self.last_print)
        self.last_print, self.waited_s = now, 0.0
        print(f"[train] step {record['step'] + 1}/{self.num_steps} epoch {record['epoch']} loss {record['loss']:.4f} "
              f"lr {record['lr']:.2e} neg_cos {record['neg_cos_mean']:.3f} {pairs_per_s:.1f} pairs/s MFU {mfu}{waited}",
              flush=True)

    def check(self, result: StepResult) -> str | None:
        """Raise on a non-finite loss; the collapse guard's verdict the first time it judges the run collapsed
        (rank 0 prints it and writes train/<name>/collapse.json)."""
        loss, step = result.figures.loss, result.batch.step
        if not math.isfinite(loss):
            raise FloatingPointError(f"Loss became {loss} at step {step}: lower train.lr or raise train.temperature.")
        verdict = self.guard.observe(step, loss, result.figures.means["neg_cos_mean"])
        if verdict is not None and self.rank == 0:
            print(f"[train] WARNING: {verdict}", flush=True)
            self.run.write_json(collapse_path(self.name),
                                {"step": step + 1, "stopped": self.tc.logging.stop_on_collapse, "message": verdict})
        return verdict

    def report(self, step: int) -> dict:
        """The metrics of a Ray Train report at `step` (the cursor: the next step to run)."""
        return {**self.progress, "step": step, "train_s": time.time() - self.started}

    def flush(self) -> None:
        for log in (self.metrics, self.batches):
            if log is not None:
                log.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
