"""The rates a plan multiplies by: measured, never guessed.

CPU stages: time = fixed_s + cpu_s_per_work x work / CPUs (work: plan/shape.stage_work), fitted from
  - a run's own report/costs.json (--run-dir; one size: it scales the calibration file's line for the stage when
    there is one, else it is proportional, an upper bound: merge_run_costs), or
  - the calibration file `clusterscale plan --calibrate` writes (two synth sizes: a least-squares line per stage).
GPU stages: passages/s and pairs/s from the model's FLOPs at an MFU: the one a GPU calibration JSON
(benchmarks/gpu_check.sh) measured, else DATASHEET_MFU of the GPU's datasheet peak (printed as datasheet
arithmetic).

The calibration file (JSON, default ~/.clusterscale/plan_calibration.json, or --calibration PATH):
  {"format": CALIBRATION_FORMAT, "measured_at", "machine": {"cpus", "load_avg"}, "runs": [{"rows", "k", "dim"}],
   "stages": {"<stage>": {"points": [[work, wall_s], ...], "fixed_s", "cpu_s_per_work", "cpus",
                          "task_base_mb", "driver_base_mb"}},
   "bytes_per_row": {"<run-dir folder>": bytes on disk per row}, "imbalance_factor",
   "cpu_flops_per_s_per_cpu" (fp32 matmul), "search_cpu_s_per_row_k_d" (faiss flat inner-product search),
   "shuffle_cpu_s": {"object store" | "local files": {"per_partition", "per_block_partition"}} (a Ray Data hash
   shuffle by where it goes: CPU-s per hash partition and per input block x partition; an older file's
   "shuffle_cpu_s_per_row_partition", timed on 8,192-row blocks, is read as per block x partition),
   "semantic_cpu_s_per_row_row_d" (dedup's semantic pass: a cluster of m rows compared with itself, per m x m x d),
   "cpu_encoder_mfu" (the bundled encoder's forward on one CPU thread over its fp32 matmul rate: the CPU MFU of
   embed, evaluate and train without a measured rate),
   "dedup_shuffle_worker_mb": {"object store": peak USS MB of dedup's largest worker with a full 64 MiB shuffle
   batch through the object store; "local files" is read too, when a file has it}}
The search, shuffle and semantic terms (plan/shape.search_work, shuffle_work, semantic_work: they grow with k, or
with rows x rows / k) are added to a stage's line and taken out of the walls a line is fitted to or scaled by.
task_base_mb / driver_base_mb: the measured peak (USS) of the stage's largest task and of the driver, less what
the memory formula gives at the calibration size: the process's own footprint (Python, pyarrow, Ray).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from clusterscale.config import Config, ConfigError
from clusterscale.plan.shape import ShuffleWork

CALIBRATION_FORMAT = "clusterscale-plan-calibration/1"
GPU_CALIBRATION_FORMAT = "clusterscale-gpu-check/1"
DEFAULT_CALIBRATION = os.path.join("~", ".clusterscale", "plan_calibration.json")
DATASHEET_MFU = 0.35
"""Fraction of the datasheet bf16 peak assumed for the encoder and the training step when no GPU calibration
exists: BERT-base-sized encoders at 256 tokens reach ~30-45% on A100/H100 class GPUs in published training
logs. An assumption: every figure that rests on it is marked 'datasheet'."""


SHUFFLE_PATHS = ("object store", "local files")  # where a hash shuffle goes (runtime/bounded_data.shuffle_for)
OLD_SHUFFLE_BLOCK_ROWS = 8_192  # the block size an old calibration's per-row-partition shuffle rate was timed at


@dataclass(frozen=True)
class ShuffleRate:
    """CPU-seconds of a hash shuffle per partition (its reduce task and output) and per input block x partition
    (the piece each map task cuts from a block for each partition)."""
    per_partition: float = 0.0
    per_block_partition: float = 0.0


@dataclass(frozen=True)
class StageRate:
    fixed_s: float
    cpu_s_per_work: float
    source: str
    task_base_mb: float = 0.0
    driver_base_mb: float = 0.0


@dataclass
class Rates:
    stages: dict[str, StageRate] = field(default_factory=dict)
    bytes_per_row: dict[str, float] = field(default_factory=dict)
    imbalance_factor: float | None = None
    cpu_flops_per_s_per_cpu: float | None = None
    search_cpu_s_per_row_k_d: float | None = None  # faiss IndexFlatIP search, one thread
    shuffle: dict[str, ShuffleRate] = field(default_factory=dict)  # Ray Data hash shuffle, by SHUFFLE_PATHS
    semantic_cpu_s_per_row_row_d: float | None = None  # dedup's in-cluster compare (dedup_core), one thread
    cpu_encoder_mfu: float | None = None  # the bundled encoder's forward / the fp32 matmul rate, one CPU thread
    dedup_shuffle_worker_mb: dict[str, float] = field(default_factory=dict)  # by where the shuffle goes
    dedup_shuffle_source: str = ""
    gpu: dict | None = None  # a GPU calibration JSON (benchmarks/gpu_check.sh)
    gpu_source: str = ""
    notes: list[str] = field(default_factory=list)

    def mfu(self, what: str) -> tuple[float, str]:
        """(MFU, source) of 'encoder' or 'train' on a GPU."""
        if self.gpu:
            key = "bert-base" if what == "encoder" else "train_step"
            part = self.gpu.get("encoder", {}).get(key) if what == "encoder" else self.gpu.get(key)
            if part and part.get("mfu"):
                return float(part["mfu"]), f"measured on {self.gpu.get('gpu', 'a GPU')} ({self.gpu_source})"
        return DATASHEET_MFU, f"datasheet peak x {DATASHEET_MFU:.0%} MFU (assumed)"


def read_json_file(path: str, what: str) -> dict:
    path = os.path.expanduser(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist.") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {path} cannot be read as JSON ({exc}): rewrite it (see its producer).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} holds {type(data).__name__}, not a JSON object.")
    return data


def line_fit(points: list[list[float]]) -> tuple[float, float]:
    """(fixed seconds, seconds per work) of a least-squares line through (work, wall_s) points. One point is
    proportional (its start-up scaled with the work: an upper bound); a negative intercept is taken as 0 with the
    slope through the largest point; a slope <= 0 (the work part under the noise at these sizes) keeps the
    smallest wall as start-up and 0 per work, which rates_from_calibration flags."""
    points = sorted(points)
    work, wall = points[-1]
    if len(points) > 1 and len({p[0] for p in points}) > 1:
        slope, intercept = (float(v) for v in np.polyfit([p[0] for p in points], [p[1] for p in points], 1))
        if slope > 0 and intercept >= 0:
            return intercept, slope
        if slope > 0:
            return 0.0, wall / work
        return min(p[1] for p in points), 0.0
    return 0.0, wall / work if work else 0.0


# A source checkout ships the calibration measured on its CI box (docs/scaling.md, "Sizing"); the user's own comes first.
SHIPPED_CALIBRATION = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                   "benchmarks", "results", "plan_calibration.json")


def load_calibration(path: str | None) -> tuple[dict | None, str]:
    """The calibration file at `path`, else ~/.clusterscale/plan_calibration.json, else the one a source checkout
    ships; None when there is none."""
    if path and not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"--calibration {path} does not exist: write it with `clusterscale plan --calibrate "
                          f"--calibration {path}`.")
    chosen = path or next((p for p in (DEFAULT_CALIBRATION, SHIPPED_CALIBRATION)
                           if os.path.exists(os.path.expanduser(p))), None)
    if chosen is None:
        return None, ""
    data = read_json_file(chosen, "Calibration file")
    if data.get("format") != CALIBRATION_FORMAT:
        raise ConfigError(f"Calibration file {chosen} has format {data.get('format')!r}, not {CALIBRATION_FORMAT!r}: "
                          f"rewrite it with `clusterscale plan --calibrate`.")
    return data, chosen


def rates_from_calibration(data: dict, path: str) -> Rates:
    when = data.get("measured_at", "?")
    rates = Rates(bytes_per_row=dict(data.get("bytes_per_row", {})), imbalance_factor=data.get("imbalance_factor"),
                  cpu_flops_per_s_per_cpu=data.get("cpu_flops_per_s_per_cpu"),
                  search_cpu_s_per_row_k_d=data.get("search_cpu_s_per_row_k_d"),
                  shuffle=shuffle_rates(data),
                  semantic_cpu_s_per_row_row_d=data.get("semantic_cpu_s_per_row_row_d"),
                  cpu_encoder_mfu=data.get("cpu_encoder_mfu"),
                  dedup_shuffle_worker_mb=dict(data.get("dedup_shuffle_worker_mb", {})),
                  dedup_shuffle_source=f"measured by --calibrate {when} ({path})")
    for stage, rec in data.get("stages", {}).items():
        if stage == "dedup" and rates.semantic_cpu_s_per_row_row_d is None:
            # Written before the semantic term had a rate of its own: its dedup line is per rows x rows / k x d.
            rates.notes.append(f"dedup: {path} predates dedup's two terms (per row, and the semantic rate): its "
                               f"dedup line is not used; rewrite the file with `clusterscale plan --calibrate`")
            continue
        if not rec["cpu_s_per_work"]:
            rates.notes.append(f"{stage}: the calibration saw no growth with the work between its sizes (noise "
                               f"larger than the per-row time): its time is the start-up only; calibrate with larger "
                               f"--calibrate-rows on a quiet machine")
        rates.stages[stage] = StageRate(rec["fixed_s"], rec["cpu_s_per_work"], f"calibrated {when} ({path})",
                                        rec.get("task_base_mb", 0.0), rec.get("driver_base_mb", 0.0))
    return rates


def folder_bytes(root: str) -> dict[str, int]:
    """Bytes on disk under each top-level folder of a local run dir (kmeans/k=8 and the like one level down)."""
    out: dict[str, int] = {}
    for top in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            rel = os.path.relpath(dirpath, root).split(os.sep)
            key = "/".join(rel[:2]) if len(rel) > 1 and rel[1].startswith("k=") else rel[0]
            out[key] = out.get(key, 0) + sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return out


def stage_of_cost_key(key: str) -> str:
    return key.split(":", 1)[0]


def shuffle_rates(data: dict) -> dict[str, ShuffleRate]:
    """A calibration file's shuffle rates by path; an older file's one rate per row and partition (timed through the
    object store on OLD_SHUFFLE_BLOCK_ROWS-row blocks) stands for both paths, per block and partition."""
    if "shuffle_cpu_s" in data:
        return {path: ShuffleRate(rec.get("per_partition", 0.0), rec.get("per_block_partition", 0.0))
                for path, rec in data["shuffle_cpu_s"].items()}
    old = data.get("shuffle_cpu_s_per_row_partition")
    return {path: ShuffleRate(0.0, old * OLD_SHUFFLE_BLOCK_ROWS) for path in SHUFFLE_PATHS} if old else {}


def k_terms_s(rates: Rates, search: float, shuffle: ShuffleWork, cpus: int, semantic: float = 0.0,
              shuffle_path: str = "object store") -> float:
    """Seconds of a stage's terms that grow with k (a search's rows x k x d, a shuffle's partitions and blocks x
    partitions at the rate of the path it takes) or with rows x rows / k (dedup's semantic pass: rows x cluster
    rows x d) at the calibrated rates; 0 for a rate not measured."""
    shuffle_rate = rates.shuffle.get(shuffle_path) or ShuffleRate()
    return ((rates.search_cpu_s_per_row_k_d or 0.0) * search
            + shuffle_rate.per_partition * shuffle.partitions + shuffle_rate.per_block_partition * shuffle.pieces
            + (rates.semantic_cpu_s_per_row_row_d or 0.0) * semantic) / max(1, cpus)


def merge_run_costs(rates: Rates, costs: dict, run_work: dict[str, float], run_cpus: int, source: str,
                    k_terms: dict[str, float] | None = None) -> None:
    """Rates of the stages a run measured (report/costs.json). A stage the calibration has a line for (start-up +
    per work, from two sizes) keeps that line's split, scaled by measured / the line's wall at the run's work and
    CPUs: the run says how fast this machine and data are, the calibration how the time divides between start-up
    and rows (one size cannot tell them apart: its start-up read as per-row time overestimated 600k pairs from a
    50k run by 2-3x, benchmarks/RESULTS.md "bench_plan"). A stage without a calibrated line is proportional
    (its start-up scaled with the work: an upper bound, flagged). k_terms: seconds of each stage's k-dependent
    terms at the run's own size (k_terms_s), which the plan adds on top of the line: taken out of its wall first."""
    proportional = []
    for key, record in costs.items():
        stage = stage_of_cost_key(key)
        work = run_work.get(key) or run_work.get(stage)
        if not work or not record.get("wall_s") or (stage != key and stage in costs):
            continue
        known = rates.stages.get(stage)
        wall = max(0.1 * record["wall_s"], record["wall_s"] - (k_terms or {}).get(stage, 0.0))
        line_wall = known.fixed_s + known.cpu_s_per_work * work / max(1, run_cpus) if known else 0.0
        if known and line_wall > 0:
            scale = wall / line_wall
            fixed, per_work = known.fixed_s * scale, known.cpu_s_per_work * scale
        else:
            fixed, per_work = 0.0, wall * run_cpus / work
            proportional.append(stage)
        rates.stages[stage] = StageRate(fixed, per_work, source, known.task_base_mb if known else 0.0,
                                        known.driver_base_mb if known else 0.0)
    if proportional:
        rates.notes.append(f"{', '.join(proportional)}: one measured size and no calibrated start-up, so the start-up "
                           f"is scaled with the work (an upper bound); `clusterscale plan --calibrate` measures it")


def load_gpu_calibration(path: str | None, rates: Rates) -> None:
    if not path:
        return
    data = read_json_file(path, "GPU calibration")
    if data.get("format") != GPU_CALIBRATION_FORMAT:
        raise ConfigError(f"GPU calibration {path} has format {data.get('format')!r}, not "
                          f"{GPU_CALIBRATION_FORMAT!r}: write it with benchmarks/gpu_check.sh.")
    rates.gpu, rates.gpu_source = data, path


def embedding_dim(cfg: Config, run_dim: int | None) -> tuple[int, str]:
    """The embedding dimension: the run's embeddings, else the local model's config.json, else BERT-base's 768."""
    if run_dim:
        return run_dim, "the run's embeddings"
    from clusterscale.modeling.encoder import resolve_model_path

    try:
        with open(os.path.join(resolve_model_path(cfg.embed.model), "config.json")) as f:
            return int(json.load(f)["hidden_size"]), f"{cfg.embed.model}'s config.json"
    except Exception:  # a hub id without network: the paper's encoders are BERT-base sized
        return 768, f"768 (assumed: {cfg.embed.model} is not a local folder)"
