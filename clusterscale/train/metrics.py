"""Per-step training logs: metrics.jsonl (rank 0), batches/rank-<r>.jsonl, MFU, optional TensorBoard."""
from __future__ import annotations

import json
import time

import torch

from clusterscale.rundir import RunDir

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
