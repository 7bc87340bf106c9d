"""Report: report/report.md with the cluster table, per-stage costs, eval results and the loss curve.

Run with `clusterscale report [CONFIG] --run-dir R` (after any stages; it reports what exists).
"""
from __future__ import annotations

import io
import json

import numpy as np

from clusterscale.config import Config
from clusterscale.rundir import RunDir
from clusterscale.shards import shards_dir

PREPROCESS_STAGES = ("ingest", "embed", "fit", "assign", "shard")


def cluster_table(manifest: dict) -> str:
    lines = ["| cluster | rows | mean intra-cluster cosine | mean cos to centroid | merged from | sample query |",
             "|---|---|---|---|---|---|"]
    for c in manifest["clusters"]:
        intra = "n/a" if c["mean_intra_cosine"] is None else f"{c['mean_intra_cosine']:.3f}"
        members = ",".join(str(m) for m in c["members"]) if len(c["members"]) > 1 else ""
        sample = (c["samples"][0] if c["samples"] else "").replace("|", "\\|")[:80]
        lines.append(f"| {c['name']} | {c['rows']} | {intra} | {c['mean_cos_to_centroid']:.3f} | {members} | {sample} |")
    overall = manifest["stats"]["overall_mean_cosine"]
    lines.append(f"\nWhole dataset: {manifest['stats']['rows']} rows, mean pairwise cosine "
                 f"{'n/a' if overall is None else f'{overall:.3f}'}.")
    return "\n".join(lines)


def cost_table(costs: dict) -> tuple[str, dict]:
    lines = ["| stage | wall s | worker s | rows/s |", "|---|---|---|---|"]
    totals = {"preprocess_s": 0.0, "train_s": 0.0}
    for stage, rec in costs.items():
        rps = rec.get("rows_per_s") or rec.get("pairs_per_s") or ""
        lines.append(f"| {stage} | {rec.get('wall_s', 0):.1f} | {rec.get('worker_s', 0):.1f} | {rps} |")
        if stage in PREPROCESS_STAGES:
            totals["preprocess_s"] += rec.get("worker_s", 0)
        elif stage.startswith("train"):
            totals["train_s"] += rec.get("worker_s", 0)
    if totals["train_s"]:
        totals["preprocess_to_train_ratio"] = totals["preprocess_s"] / totals["train_s"]
    return "\n".join(lines), totals


def eval_table(run: RunDir) -> str:
    rows = []
    for fname in run.listdir("eval"):
        if fname.endswith(".json"):
            rows.append(run.read_json(f"eval/{fname}"))
    if not rows:
        return "No evaluation yet: run `clusterscale evaluate`."
    keys = list(rows[0]["metrics"])
    lines = ["| model | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for r in sorted(rows, key=lambda r: r["name"] != "frozen"):
        lines.append(f"| {r['name']} | " + " | ".join(f"{r['metrics'][k]:.4f}" for k in keys) + " |")
    return "\n".join(lines)


def loss_plot(run: RunDir, out_rel: str) -> bool:
    """Loss per step with a rolling mean for every training run; False when there is none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [n for n in run.listdir("train") if run.exists(f"train/{n}/metrics.jsonl")]
    if not runs:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in runs:
        records = [json.loads(line) for line in run.read_bytes(f"train/{name}/metrics.jsonl").decode().splitlines()
                   if line.strip()]
        loss = np.array([r["loss"] for r in records])
        ax.plot(loss, alpha=0.3)
        window = max(1, len(loss) // 10)
        ax.plot(np.convolve(loss, np.ones(window) / window, mode="valid"), label=f"{name} (rolling {window})")
    ax.set_xlabel("step")
    ax.set_ylabel("InfoNCE loss")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    run.write_bytes(out_rel, buf.getvalue())
    return True


def run_report(cfg: Config, run: RunDir) -> str:
    k = cfg.cluster.k
    parts = ["# clusterscale report", "", f"Run directory: `{run.uri}`  ", f"Config hash: `{cfg.hash()}`", ""]
    if run.exists("pairs", "_DONE.json"):
        s = run.done_stats("pairs")
        parts += ["## Data", f"Rows in {s['rows_in']}: training pairs {s['pairs']}, held out {s['heldout']}, "
                  f"quarantined {s['quarantine']} {s['reasons'] or ''}.", ""]
    if run.exists(shards_dir(k), "manifest.json"):
        manifest = run.read_json(f"{shards_dir(k)}/manifest.json")
        parts += [f"## Clusters (k={k}, small-cluster policy: {manifest['small_cluster_policy']})",
                  cluster_table(manifest), ""]
    costs = run.read_json("report/costs.json") if run.exists("report/costs.json") else {}
    if costs:
        table, totals = cost_table(costs)
        parts += ["## Cost per stage", table, "",
                  f"Preprocessing (ingest..shard): {totals['preprocess_s']:.1f} worker-s; training: "
                  f"{totals['train_s']:.1f} worker-s"
                  + (f"; ratio {totals['preprocess_to_train_ratio']:.2f}." if "preprocess_to_train_ratio" in totals else "."),
                  ""]
    parts += ["## Held-out retrieval", eval_table(run), ""]
    if loss_plot(run, "report/loss.png"):
        parts += ["## Training loss", "![loss](loss.png)", ""]
    text = "\n".join(parts)
    run.write_text("report/report.md", text)
    print(f"[report] {run.path('report/report.md')}", flush=True)
    return run.path("report/report.md")
