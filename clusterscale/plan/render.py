"""The plan as text (what `clusterscale plan` prints and docs/scaling.md shows) and as the --json
document; and the predicted-vs-measured table `clusterscale report` shows for a run that has a prediction."""
from __future__ import annotations

import math

JSON_STAGE_KEYS = ("wall_s", "gpu_hours", "cpu_hours", "peak_task_mb", "peak_driver_mb", "disk_bytes", "files")


def duration(seconds: float) -> str:
    if seconds is None or math.isnan(seconds):
        return "?"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 3 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def size(n: float) -> str:
    for unit, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n:.0f} B"


def _hours(h: float) -> str:
    return "?" if h is None or math.isnan(h) else ("0" if h == 0 else f"{h:.2g}" if h < 10 else f"{h:,.0f}")


def plan_text(plan: dict) -> str:
    price = plan.get("price_per_gpu_hour")
    lines = [f"Plan: {plan['rows']:,} pairs ({plan['rows_from']}) at k = {plan['k']:,}, {plan['epochs']} epoch(s), "
             f"on {plan['cluster']}; embeddings d = {plan['embedding_dim']} ({plan['embedding_dim_from']})", "",
             "| stage | runs on | wall | GPU-h | CPU-h | " + ("cost | " if price is not None else "")
             + "largest task MB | driver MB | disk written | files | shuffle | time from |",
             "|---|---|---|---|---|" + ("---|" if price is not None else "") + "---|---|---|---|---|---|"]
    for name, s in plan["stages"].items():
        if s["runs_on"].startswith("skipped"):
            lines.append(f"| {name} | {s['runs_on']} |" + " |" * (10 if price is not None else 9))
            continue
        cost = f" {s['cost']:,.0f} |" if price is not None and s["cost"] is not None and not math.isnan(s["cost"]) \
            else (" ? |" if price is not None else "")
        label = name + (" (per epoch)" if name == "train" else "")
        lines.append(f"| {label} | {s['runs_on']} | {duration(s['wall_s'])} | {_hours(s['gpu_hours'])} | "
                     f"{_hours(s['cpu_hours'])} |{cost} {s['peak_task_mb']:,.0f} | {s['peak_driver_mb']:,.0f} | "
                     f"{size(s['disk_bytes'])} | {s['files']:,} | {size(s['shuffle_bytes']) if s['shuffle_bytes'] else '-'}"
                     f"{' (spill ' + size(s['spill_bytes']) + ')' if s['spill_bytes'] else ''} | {s['time_from']} |")
    t = plan["train_shape"]
    per = t["global_batches_per_cluster"]
    ratio = plan["preprocess_over_train"]
    lines += ["", f"Training: {t['steps_per_epoch']:,} steps per epoch over {t['shards']:,} shards; global batches per "
              f"cluster min {per['min']:,} / median {per['median']:,.0f} / max {per['max']:,} (mean "
              f"{t['mean_global_batches_per_cluster']:,.1f}; {t['cluster_sizes_from']}); "
              f"{t['unused_pairs_per_epoch']:,} pairs per epoch in no batch.",
              "Preprocessing / training (cluster time, " + f"{plan['epochs']} epoch(s)): "
              + ("?" if ratio is None else f"{ratio:.3f}"), "",
              "| k | pairs | preprocessing | train per epoch | pre / train | steps per epoch | batches per cluster | "
              "unused |" + (" cost |" if price is not None else ""),
              "|---|---|---|---|---|---|---|---|" + ("---|" if price is not None else "")]
    for row in plan["table"]:
        r = row["preprocess_over_train"]
        lines.append(f"| {row['k']:,} | {row['rows']:,} | {duration(row['preprocess_s'])} | "
                     f"{duration(row['train_epoch_s'])} | {'?' if r is None else f'{r:.3f}'} | "
                     f"{row['steps_per_epoch']:,} | {row['mean_global_batches_per_cluster']:,.1f} | "
                     f"{row['unused_fraction']:.1%} |" + (f" {row['cost']:,.0f} |" if price is not None else ""))
    if plan["warnings"]:
        lines += ["", "Warnings:", *(f"- {w}" for w in plan["warnings"])]
    lines += ["", "Notes:", *(f"- {n}" for n in plan["notes"] if n)]
    return "\n".join(lines)


def plan_json(plan: dict) -> dict:
    """The --json document: the issue's keys first (stages with JSON_STAGE_KEYS, preprocess_over_train,
    warnings), then the rest of the plan."""
    stages = {name: {key: s[key] for key in JSON_STAGE_KEYS} | s for name, s in plan["stages"].items()}
    document = {"stages": stages, "preprocess_over_train": plan["preprocess_over_train"], "warnings": plan["warnings"]} \
        | {key: value for key, value in plan.items() if key not in ("stages", "preprocess_over_train", "warnings")}
    return _no_nan(document)


def _no_nan(value):
    """A stage without a rate has NaN figures; JSON has no NaN, so they are written as null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value
