"""Per-step training logs: metrics.jsonl (rank 0), batches/rank-<r>.jsonl, MFU, optional TensorBoard."""
from __future__ import annotations

import json
import math
import time

import torch

from clusterscale.io.layout import metrics_path
from clusterscale.io.rundir import RunDir

# Dense bf16 peak TFLOP/s per GPU (vendor datasheets, no sparsity), matched on the device name.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0,
                   "A10": 125.0, "V100": 125.0, "T4": 65.0}


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one worker: train.peak_tflops, a datasheet value, or a measured fp32 matmul on CPU."""
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v * 1e12 for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)
    n = 1024  # CPU: what this worker's threads reach on a square fp32 matmul (~0.1 s)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    started = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * n ** 3 / (time.perf_counter() - started)


def read_metrics(run: RunDir, name: str) -> list[dict]:
    """The per-step records of train/<name>/metrics.jsonl; [] when that run has none."""
    rel = metrics_path(name)
    if not run.exists(rel):
        return []
    return [json.loads(line) for line in run.read_bytes(rel).decode().splitlines() if line.strip()]


class JsonlLog:
    """A jsonl file in the run directory rewritten whole at each flush (object stores cannot append).

    On resume it keeps only the records of steps before the cursor, so no step appears twice.
    """

    def __init__(self, run: RunDir, rel: str, resume_step: int | None):
        self.run, self.rel, self.lines = run, rel, []
        if resume_step is not None and run.exists(rel):
            old = run.read_bytes(rel).decode().splitlines()
            self.lines = [line for line in old if line and json.loads(line)["step"] < resume_step]

    def append(self, record: dict) -> None:
        self.lines.append(json.dumps(record))

    def flush(self) -> None:
        self.run.write_text(self.rel, "\n".join(self.lines) + "\n")


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


def chance_loss(global_batch_size: int, negatives_per_query: int = 0, loss: str = "infonce",
                clp_lambda: float = 0.0) -> float:
    """InfoNCE of an encoder that cannot tell texts apart: ln(candidates per query)."""
    chance = math.log(global_batch_size * (1 + negatives_per_query))
    return (1 - clp_lambda) * chance if loss == "clp" else chance
