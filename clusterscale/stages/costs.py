"""Cost model of a run: measured stage costs (report/costs.json), FLOP estimates, the preprocessing /
training ratio and its extrapolation to a target number of pairs. Used by `clusterscale report`.

costs.json keys are stage names, optionally qualified: `fit:k=100` (a sweep), `train:<name>`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from clusterscale.config import Config
from clusterscale.io.layout import read_manifest, shard_set_manifest_path
from clusterscale.io.rundir import RunDir
from clusterscale.train import samplers, schedule
from clusterscale.train.metrics import read_metrics

TOKEN_SAMPLE_ROWS = 256
# Preprocessing stages whose output does not depend on k; the others (fit, assign, dedup, shard) run per k, and
# shard is the last: a summary without it describes preprocessing so far. An extrapolation needs embed (the part
# that grows with N); ingest alone says nothing about the cost of preprocessing at scale.
BEFORE_CLUSTERING = ("ingest", "embed")
LAST_PREPROCESS = "shard"
EXTRAPOLATED_FROM = "embed"


def stage_of(key: str) -> str:
    return key.split(":", 1)[0]


def device_seconds_label(record: dict) -> str:
    """'GPU-s' for work that ran on GPUs, 'CPU worker-s' otherwise (worker_s counts workers x wall)."""
    return "GPU-s" if record.get("device") == "gpu" else "CPU worker-s"


def param_count(model: str) -> int | None:
    """Parameters of a local safetensors model from the file headers (no weights loaded); None if unknown."""
    try:
        from safetensors import safe_open

        from clusterscale.modeling.encoder import resolve_model_path  # torch: not at import (the CLI imports this)

        files = sorted(Path(resolve_model_path(model)).glob("*.safetensors"))
        total = 0
        for f in files:
            with safe_open(str(f), framework="np") as st:
                total += sum(int(np.prod(st.get_slice(name).get_shape())) for name in st.keys())
        return total or None
    except Exception:  # a hub id without network, or an unreadable folder: FLOPs stay unestimated
        return None


def student_param_count(cfg: Config) -> int | None:
    """Parameters of the student: its init weights, or a from-scratch BERT built on the meta device (no memory)."""
    if cfg.train.student.init != "scratch":
        return param_count(cfg.train.student.init)
    import torch

    from clusterscale.modeling.encoder import load_tokenizer, resolve_model_path
    from clusterscale.modeling.student import scratch_bert

    try:
        vocab = len(load_tokenizer(resolve_model_path(cfg.train.student.tokenizer)))
    except Exception:
        return None
    with torch.device("meta"):
        model = scratch_bert(cfg.train.student, vocab)
    return sum(p.numel() for p in model.parameters())


def mean_tokens(run: RunDir, cfg: Config) -> dict | None:
    """Mean tokens per query and per passage over a sample of pairs/, each capped at the stage's max length (embed: per
    pair, both texts with embed.side=both): embed's counted by the frozen encoder's tokenizer, training's by the
    student's (train.init's, or train.tokenizer's from scratch; the encoder's when the student's cannot be loaded)."""
    import pyarrow.dataset as pads

    from clusterscale.modeling.encoder import load_tokenizer, resolve_model_path

    files = run.files("pairs")
    if not files:
        return None
    st = cfg.train.student
    try:
        frozen_path = resolve_model_path(cfg.embed.model)
        tokenizer = load_tokenizer(frozen_path)
    except Exception:
        return None
    try:
        student_path = resolve_model_path(st.tokenizer if st.init == "scratch" else st.init)
        student = tokenizer if student_path == frozen_path else load_tokenizer(student_path)
    except Exception:  # a hub id without network: the encoder's counts stand in
        student = tokenizer
    table = pads.dataset(files, filesystem=run.fs, format="parquet").head(TOKEN_SAMPLE_ROWS, columns=["query", "passage"])

    def lengths(tok, most: int) -> dict[str, np.ndarray]:
        # Cut at the longest cap used (a count above it is capped anyway): a long document costs no more than that,
        # and transformers does not warn that a text longer than the model's maximum "will result in indexing errors".
        return {side: np.array([len(ids) for ids in tok(table.column(side).to_pylist(), truncation=True,
                                                          max_length=most, verbose=False)["input_ids"]])
                for side in ("query", "passage")}

    embedded = lengths(tokenizer, cfg.embed.max_length)
    trained = lengths(student, max(st.query_max_length, st.passage_max_length))
    sides = ("query", "passage") if cfg.embed.side == "both" else (cfg.embed.side,)  # embed.side=both: each pair twice
    return {"embed": float(sum(embedded[side].mean() for side in sides)),
            "train_query": float(np.minimum(trained["query"], st.query_max_length).mean()),
            "train_passage": float(np.minimum(trained["passage"], st.passage_max_length).mean()),
            "sample_rows": table.num_rows}


def estimate_flops(cfg: Config, run: RunDir, costs: dict) -> dict[str, float]:
    """Forward-only 2*P*tokens for embedding, 6*P*tokens (forward + backward) for training; non-padding tokens."""
    tokens = mean_tokens(run, cfg)
    if tokens is None:
        return {}
    out = {}
    embed_params = param_count(cfg.embed.model)
    if embed_params and "embed" in costs:
        out["embed"] = 2.0 * embed_params * costs["embed"].get("rows", 0) * tokens["embed"]
    student = student_param_count(cfg)
    for key, rec in costs.items():
        if stage_of(key) == "train" and rec.get("steps"):
            if student:
                pairs = rec["steps"] * rec.get("global_batch_size", cfg.train.schedule.global_batch_size)
                out[key] = 6.0 * student * pairs * (tokens["train_query"] + tokens["train_passage"])
    return out


def extrapolate(points: list[tuple[float, float]], target: float) -> dict:
    """Cost at `target` rows from measured (rows, cost) points: proportional from one point, a least-squares
    line a + b*rows from two or more (intercept = fixed cost such as startup and the sample-capped fit).

    A fit the numbers cannot carry is flagged in `warning` (value None when refused): a per-row cost b <= 0
    (start-up noise decides the slope) is refused; a fixed cost a larger than the per-row part b x rows at
    every measured point, or a single point (its start-up is scaled up with the rows), is kept but flagged."""
    points = sorted(points)
    if len(points) == 1 or len({n for n, _ in points}) == 1:
        n, c = points[-1]
        return {"value": c * target / n, "method": "proportional to rows", "points": points,
                "warning": f"one measured size ({int(n)} rows): its fixed start-up cost is scaled up with the rows "
                           f"too, so this is an upper bound; measure a second, larger size (`clusterscale sweep`)"}
    slope, intercept = (float(v) for v in np.polyfit([n for n, _ in points], [c for _, c in points], 1))
    method = f"least-squares line a + b*rows (a={intercept:.3g} s, b={slope:.3g} s/row)"
    if slope <= 0:
        return {"value": None, "method": method, "points": points,
                "warning": f"refused: the fitted per-row cost b={slope:.3g} s/row is not positive, so the measured "
                           f"sizes differ by less than their start-up noise; measure sizes further apart"}
    out = {"value": intercept + slope * target, "method": method, "points": points}
    largest = points[-1][0]
    if intercept > slope * largest:
        out["warning"] = (f"start-up dominated: the fixed cost a={intercept:.3g} s exceeds the per-row part "
                          f"b x rows ({slope * largest:.3g} s) even at the largest measured size ({int(largest)} "
                          f"rows), so b, and the value, rest on noise; measure larger sizes")
    return out


def train_per_epoch(run: RunDir, cfg: Config, key: str, record: dict) -> dict | None:
    """Worker-seconds of one epoch of a training run: startup overhead + batches per epoch x mean step time."""
    name = key.split(":", 1)[1] if ":" in key else cfg.train_name()
    steps = [r["step_s"] for r in read_metrics(run, name)]
    sampler = record.get("sampler", cfg.train.schedule.sampler)
    # The epoch is the last set's (the curriculum's: the random set's, every pair once; its batches come from two).
    manifest = shard_set_manifest_path(cfg.cluster.k, samplers.sampler(sampler).sets[-1])
    if not (record.get("steps") and steps and run.exists(manifest)):
        return None
    sizes = read_manifest(run, manifest).strata_sizes
    batches = schedule.batches_per_epoch(sizes, record.get("global_batch_size", cfg.train.schedule.global_batch_size))
    workers = record["worker_s"] / record["wall_s"] if record.get("wall_s") else cfg.train.compute.num_workers
    overhead = max(0.0, record["wall_s"] - sum(steps))
    epoch_wall = overhead + batches * float(np.mean(steps))
    return {"name": name, "rows": int(sum(sizes)), "batches_per_epoch": batches, "mean_step_s": float(np.mean(steps)),
            "overhead_s": overhead, "epoch_worker_s": epoch_wall * workers}


def preprocess_cost(costs: dict, k: int) -> tuple[float, list[str]]:
    """Worker-seconds of the preprocessing stages at k (ingest + embed + fit/assign/shard: the records the
    executor marked `preprocess`), and the cost keys used. A stage recorded at several k (a sweep: `fit:k=100`)
    counts its record at k, else its plain one."""
    total, used = 0.0, []
    for key, record in costs.items():
        stage = stage_of(key)
        if not record.get("preprocess") or key not in (stage, f"{stage}:k={k}"):
            continue
        if key == stage and f"{stage}:k={k}" in costs:
            continue
        total += record.get("worker_s", 0.0)
        used.append(key)
    return total, used


def summarize(cfg: Config, run: RunDir, costs: dict, train_names: list[str] | None = None,
              extra_points: list[dict] | None = None) -> dict:
    """The preprocessing/training comparison of a run at cfg.cluster.k. `train_names`: the training runs to
    count (default: every one in costs.json); `extra_points`: other runs' summaries (a sweep over data.limit)
    used as further measured points of the extrapolation."""
    pre_s, used = preprocess_cost(costs, cfg.cluster.k)
    rows = costs.get("embed", {}).get("rows") or costs.get("ingest", {}).get("pairs")
    stages = list(dict.fromkeys(stage_of(key) for key in used))
    out: dict = {"k": cfg.cluster.k, "rows": rows, "preprocess_worker_s": pre_s, "preprocess_stages": used,
                 "preprocess_stage_names": stages, "preprocess_complete": LAST_PREPROCESS in stages,
                 "flops": estimate_flops(cfg, run, costs), "epochs": cfg.train.schedule.epochs}
    train_keys = [key for key in costs if stage_of(key) == "train"
                  and (train_names is None or key.split(":", 1)[-1] in train_names)]
    epochs = [e for key in train_keys for e in [train_per_epoch(run, cfg, key, costs[key])] if e]
    if epochs:
        epoch_s = float(np.mean([e["epoch_worker_s"] for e in epochs]))
        out.update({"train_runs": [e["name"] for e in epochs], "train_epoch_worker_s": epoch_s,
                    "train_total_worker_s": epoch_s * cfg.train.schedule.epochs, "train_rows": epochs[0]["rows"],
                    "ratio_per_epoch": pre_s / epoch_s if epoch_s else None,
                    "ratio_total": pre_s / (epoch_s * cfg.train.schedule.epochs) if epoch_s else None})
    target = cfg.eval.extrapolate_to_rows
    if target and rows and pre_s and EXTRAPOLATED_FROM in stages:
        points = [(rows, pre_s)] + [(p["rows"], p["preprocess_worker_s"]) for p in extra_points or []
                                    if p.get("rows") and p.get("preprocess_worker_s")]
        out["extrapolation"] = {"target_rows": target, "preprocess": extrapolate(points, target), "stages": stages,
                                "complete": out["preprocess_complete"]}
        if epochs:
            tpoints = [(out["train_rows"], out["train_epoch_worker_s"])] + [
                (p["train_rows"], p["train_epoch_worker_s"]) for p in extra_points or [] if p.get("train_epoch_worker_s")]
            ext = out["extrapolation"]
            ext["train_epoch"] = extrapolate(tpoints, target * out["train_rows"] / rows)
            pre_v, train_v = ext["preprocess"]["value"], ext["train_epoch"]["value"]
            ext["ratio_per_epoch"] = pre_v / train_v if pre_v is not None and train_v else None
    return out
