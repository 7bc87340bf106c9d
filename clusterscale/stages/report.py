"""Report: report/report.md with PNG plots — clusters (the paper's Table 1), costs (preprocessing vs
training, extrapolated), held-out and MTEB results, compare and sweep results, loss and hardness curves
(the paper's Figure 2).

Run with `clusterscale report [CONFIG] --run-dir R` (after any stages; it reports what exists).
"""
from __future__ import annotations

import math
import re

import numpy as np

from clusterscale.stages import report_plots
from clusterscale.config import Config, ConfigError
from clusterscale.stages.ingest import more_pairs
from clusterscale.stages.costs import BEFORE_CLUSTERING, EXTRAPOLATED_FROM, device_seconds_label, stage_of, summarize
from clusterscale.io.layout import (DEDUP, DEDUP_REMOVED, EVAL, MTEB_EVAL, PREDICTION_PATH, TRAIN, collapse_path,
                                    eval_by_cluster_path, manifest_path, read_manifest)
from clusterscale.io.records import ShardManifest
from clusterscale.io.rundir import RunDir, StageMissingError, StageResult
from clusterscale.runtime.stage_context import StageContext
from clusterscale.train.metrics import read_metrics

PAPER_TABLE1 = "the paper, MS MARCO passages at k=10: 0.263..0.493 vs 0.305"
# Fewer held-out queries (per model or per cluster) or seeds than this and a figure is marked as a tiny sample.
MIN_SAMPLE = 30
MIN_SEEDS = 3


def _fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def cluster_table(manifest: ShardManifest) -> str:
    lines = ["| cluster | rows | mean intra-cluster cosine | mean cos to centroid | merged from | sample query |",
             "|---|---|---|---|---|---|"]
    for c in manifest.clusters:
        members = ",".join(str(m) for m in c.members) if len(c.members) > 1 else ""
        sample = (c.samples[0] if c.samples else "").replace("|", "\\|")[:80]
        lines.append(f"| {c.name} | {c.rows} | {_fmt(c.mean_intra_cosine)} | "
                     f"{c.mean_cos_to_centroid:.3f} | {members} | {sample} |")
    overall = manifest.stats["overall_mean_cosine"]
    lines.append(f"\nWhole dataset: {manifest.stats['rows']} rows, mean pairwise cosine {_fmt(overall)}.")
    return "\n".join(lines)


def table1_line(manifest: ShardManifest) -> str:
    """The paper's Table 1: spread of cluster sizes and intra-cluster cosine against the whole set."""
    clusters = [c for c in manifest.clusters if c.mean_intra_cosine is not None]
    if not clusters:
        return ""
    rows = [c.rows for c in manifest.clusters]
    cos = [c.mean_intra_cosine for c in clusters]
    weighted = sum(c.mean_intra_cosine * c.rows for c in clusters) / sum(c.rows for c in clusters)
    return (f"Table 1 analogue: shards of {min(rows)}..{max(rows)} rows; mean intra-cluster cosine "
            f"{min(cos):.3f}..{max(cos):.3f} (row-weighted {weighted:.3f}) vs "
            f"{_fmt(manifest.stats['overall_mean_cosine'])} over the whole set ({PAPER_TABLE1}).")


def dedup_section(run: RunDir, k: int, max_clusters: int = 20) -> list[str]:
    """Markdown of the dedup/ results (of the clustering they were made at; `k`: the report's, named when they
    differ): counts per reason, removed per cluster (the most first), the histogram of each pair's highest cosine
    to an earlier kept pair around the threshold, and example groups."""
    done = run.done_marker(DEDUP)
    s, dc = done.stats, done.config["dedup"]
    lines = [f"## Dedup (k={s['k']}, key={dc['key']}, keep={dc['keep']}, exact={dc['exact']}, "
             f"semantic_threshold={dc['semantic_threshold']})"]
    if s["k"] != k:
        lines.append(f"(dedup/ holds one clustering at a time: the last dedup ran at k={s['k']}, not at this "
                     f"report's k={k}.)  ")
    lines += [f"Assigned {s['assigned']} pairs: kept {s['rows']}, removed {s['removed']} (exact {s['exact']}, "
              f"semantic {s['semantic']}, held-out leaks {s['heldout_leak']} against {s['heldout_pairs']} held-out "
              f"pairs). Removed rows: `{DEDUP_REMOVED}/`.", ""]
    per_cluster = sorted(s["removed_per_cluster"].items(), key=lambda kv: (-kv[1], int(kv[0])))
    lines += ["| cluster | removed |", "|---|---|"] + [f"| {c} | {n} |" for c, n in per_cluster[:max_clusters]]
    if len(per_cluster) > max_clusters:
        lines.append(f"| ({len(per_cluster) - max_clusters} more) | {sum(n for _, n in per_cluster[max_clusters:])} |")
    histogram = s.get("similarity_histogram")
    if histogram:
        edges, counts = histogram["edges"], histogram["counts"]
        lines += ["", "Highest cosine of each pair to a pair kept before it in its cluster (>= threshold: removed):",
                  "", "| cosine | pairs |", "|---|---|"]
        lines += [f"| [{a:.3f}, {b:.3f}){' removed' if a >= dc['semantic_threshold'] else ''} | {n} |"
                  for a, b, n in zip(edges, edges[1:], counts)]
    for example in s.get("examples", []):
        kept = example["kept"]
        lines += ["", f"Group of {example['size']} in cluster {example['cluster']}: kept pair {kept['pair_id']} "
                      f"({kept['query']!r} -> {kept['passage'][:80]!r})"]
        lines += [f"- removed {r['pair_id']} (cosine {r['similarity']}): {r['query']!r} -> {r['passage'][:80]!r}"
                  for r in example["removed"]]
    return lines + [""]


def stage_kind(key: str, record: dict) -> str:
    stage = stage_of(key)
    if record.get("preprocess"):
        return "preprocess"
    return stage if stage in ("train", "evaluate") else "other"


def cost_table(costs: dict, flops: dict | None = None) -> str:
    lines = ["| stage | device | wall s | worker s | rows/s | est. FLOPs |", "|---|---|---|---|---|---|"]
    for key, rec in costs.items():
        rps = rec.get("rows_per_s") or rec.get("pairs_per_s") or ""
        flop = (flops or {}).get(key)
        lines.append(f"| {key} | {device_seconds_label(rec)} | {rec.get('wall_s', 0):.1f} | "
                     f"{rec.get('worker_s', 0):.1f} | {rps} | {'' if flop is None else f'{flop:.2e}'} |")
    return "\n".join(lines)


def preprocess_title(summary: dict) -> str:
    """'ingest + embed + fit + assign + shard at k=4': the preprocessing stages this run measured, and only them."""
    stages = summary.get("preprocess_stage_names") or sorted({stage_of(key) for key in summary["preprocess_stages"]})
    at_k = f" at k={summary['k']}" if any(s not in BEFORE_CLUSTERING for s in stages) else ""
    return " + ".join(stages) + at_k


def cost_summary_text(summary: dict) -> list[str]:
    if not summary["preprocess_stages"]:
        lines = ["Preprocessing: no preprocessing stage has recorded a cost in this run yet."]
    else:
        so_far = "" if summary.get("preprocess_complete", True) else \
            " (so far: the later preprocessing stages have not run in this run directory)"
        lines = [f"Preprocessing ({preprocess_title(summary)}; cost keys {', '.join(summary['preprocess_stages'])}) "
                 f"on {summary['rows']} pairs: **{summary['preprocess_worker_s']:.1f} worker-s**{so_far}."]
    if "train_epoch_worker_s" in summary:
        lines.append(f"Training ({', '.join(summary['train_runs'])}; one epoch = startup + batches per epoch x "
                     f"measured mean step time): **{summary['train_epoch_worker_s']:.1f} worker-s per epoch**, "
                     f"{summary['train_total_worker_s']:.1f} for train.epochs={summary['epochs']}. "
                     f"Preprocessing / training ratio: **{_fmt(summary['ratio_per_epoch'], 2)} per epoch, "
                     f"{_fmt(summary['ratio_total'], 2)} in total**.")
    ext = summary.get("extrapolation")
    if ext:
        lines += extrapolation_text(ext)
    elif summary["preprocess_stages"] and EXTRAPOLATED_FROM not in (summary.get("preprocess_stage_names") or []):
        lines.append(f"No extrapolation: it needs at least the {EXTRAPOLATED_FROM} stage's measured cost.")
    return lines


def _estimate(part: dict, what: str) -> str:
    return f"{what} not extrapolated" if part["value"] is None else f"{what} ~{part['value']:.3g} worker-s"


def extrapolation_text(ext: dict) -> list[str]:
    """The extrapolation line, with every flagged fit spelled out under it (never a bare number from a bad fit).
    It names the stages it covers (ext['stages']): a run whose preprocessing is incomplete extrapolates only those."""
    pre = ext["preprocess"]
    pts = ", ".join(f"({int(n)} rows, {c:.1f} s)" for n, c in pre["points"])
    covers = f" of {' + '.join(ext['stages'])}" if ext.get("stages") else ""
    what = "preprocessing" if ext.get("complete", True) else f"preprocessing so far ({' + '.join(ext['stages'])})"
    text = (f"Extrapolation (not a measurement) to {ext['target_rows']:,} pairs{covers}, {pre['method']} from the "
            f"measured points {pts}: {_estimate(pre, what)}")
    if "train_epoch" in ext:
        ratio = ext["ratio_per_epoch"]
        text += (f", {_estimate(ext['train_epoch'], 'training')} per epoch, ratio "
                 f"{'n/a' if ratio is None else f'~{ratio:.3g}'} per epoch")
    lines = [text + ". Same hardware and settings assumed; the fit's sample is capped at max_points_per_centroid x "
             "k, so it grows with k rather than with N."]
    for label, part in (("preprocessing", pre), ("training", ext.get("train_epoch"))):
        if part and part.get("warning"):
            lines.append(f"**Unreliable {label} extrapolation**: {part['warning']}.")
    return lines


def eval_rows(run: RunDir) -> list[dict]:
    return [run.read_json(f"{EVAL}/{f}") for f in run.listdir(EVAL) if f.endswith(".json")]


def _standard_error(values: list[float]) -> float | None:
    """Standard error of the mean (None from a single value)."""
    arr = np.asarray(values, dtype=float)
    return float(arr.std(ddof=1) / np.sqrt(len(arr))) if len(arr) > 1 else None


def _small(n: int, minimum: int = MIN_SAMPLE) -> str:
    """A marker on figures measured on fewer than `minimum` queries or seeds (explained under each table)."""
    return " *" if n < minimum else ""


def mteb_means(run: RunDir) -> dict[str, tuple[float, int]]:
    """{model name: (mean NDCG@10 over its MTEB tasks, task count)} from eval/mteb/ (`evaluate --mteb`)."""
    out = {}
    for f in run.listdir(MTEB_EVAL):
        if f.endswith(".json"):
            r = run.read_json(f"{MTEB_EVAL}/{f}")
            scores = [t["ndcg_at_10"] for t in r["tasks"].values() if t.get("ndcg_at_10") is not None]
            if scores:
                out[r["model_name"]] = (float(np.mean(scores)), len(scores))
    return out


def eval_table(run: RunDir) -> str | None:
    """Held-out metrics per model with the query count and NDCG@10's standard error, plus the MTEB mean where
    `evaluate --mteb` ran; None when nothing was evaluated."""
    rows, mteb = eval_rows(run), mteb_means(run)
    if not rows:
        return None
    keys = list(rows[0]["metrics"])
    lines = ["| model | queries | " + " | ".join(keys) + " | NDCG@10 s.e. | MTEB NDCG@10 (tasks) |",
             "|---|---|" + "---|" * len(keys) + "---|---|"]
    small = False
    for r in sorted(rows, key=lambda r: (r["name"] != "frozen", r["name"])):
        n = r.get("num_queries", 0)
        small |= n < MIN_SAMPLE
        se = _standard_error(r["per_query"]["ndcg_at_10"]) if r.get("per_query") else None
        m = mteb.get(r["name"])
        lines.append(f"| {r['name']} | {n}{_small(n)} | " + " | ".join(f"{r['metrics'][k]:.4f}" for k in keys) +
                     f" | {_fmt(se, 4)} | {'' if m is None else f'{m[0]:.4f} ({m[1]})'} |")
    if small:
        lines.append(f"\n\\* fewer than {MIN_SAMPLE} held-out queries: differences below a few standard errors "
                     "are noise; raise data.heldout_fraction or eval.max_queries.")
    return "\n".join(lines)


def by_cluster_table(breakdown: dict) -> str:
    models = sorted({m for row in breakdown["clusters"].values() for m in row["ndcg_at_10"]},
                    key=lambda m: (m != "frozen", m))
    lines = ["| centroid | held-out queries | " + " | ".join(models) + " |", "|---|---|" + "---|" * len(models)]
    small = False
    for c, row in sorted(breakdown["clusters"].items(), key=lambda kv: int(kv[0])):
        small |= row["queries"] < MIN_SAMPLE
        lines.append(f"| {c} | {row['queries']}{_small(row['queries'])} | " +
                     " | ".join(_fmt(row["ndcg_at_10"].get(m), 4) for m in models) + " |")
    if small:
        lines.append(f"\n\\* fewer than {MIN_SAMPLE} held-out queries in this cluster: its NDCG@10 is a tiny sample "
                     "(with one query it is that query's single score), not a measure of the cluster.")
    return "\n".join(lines)


def mteb_table(run: RunDir) -> str | None:
    results = [run.read_json(f"{MTEB_EVAL}/{f}") for f in run.listdir(MTEB_EVAL) if f.endswith(".json")]
    if not results:
        return None
    tasks = sorted({t for r in results for t in r["tasks"]})
    lines = ["| model | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for r in sorted(results, key=lambda r: (r["model_name"] != "frozen", r["model_name"])):
        lines.append(f"| {r['model_name']} | " + " | ".join(_fmt(r["tasks"].get(t, {}).get("ndcg_at_10"), 4)
                                                          for t in tasks) + " |")
    return "NDCG@10 per task (mteb " + results[0].get("mteb_version", "?") + "):\n\n" + "\n".join(lines)


def compare_table(compare: dict) -> str:
    lines = ["| arm | seeds | NDCG@10 mean ± std (min..max) | MRR@10 mean ± std | mean loss, last 10 steps | "
             "neg cos mean | neg cos max | masked false negatives / step | train worker-s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, arm in compare["arms"].items():
        n, m = arm["metrics"]["ndcg_at_10"], arm["metrics"]["mrr_at_10"]
        seeds = f"{len(arm['seeds'])}{_small(len(arm['seeds']), MIN_SEEDS)}"
        lines.append(f"| {name} | {seeds} | {n['mean']:.4f} ± {n['std']:.4f} ({n['min']:.4f}..{n['max']:.4f}) | "
                     f"{m['mean']:.4f} ± {m['std']:.4f} | {_fmt(arm.get('final_loss_mean'))} | "
                     f"{_fmt(arm.get('neg_cos_mean'))} | {_fmt(arm.get('neg_cos_max'))} | "
                     f"{_fmt(arm.get('masked_false_negatives'), 2)} | {arm.get('train_worker_s', 0):.0f} |")
    if any(len(arm["seeds"]) < MIN_SEEDS for arm in compare["arms"].values()):
        lines.append(f"\n\\* fewer than {MIN_SEEDS} seeds: the std and min..max are not a spread to trust; "
                     "run more seeds (`clusterscale compare --seeds`).")
    keys = {name: arm.get("train_keys") for name, arm in compare["arms"].items() if arm.get("train_keys")}
    if keys:
        lines.append("\nArms differ from the config in: " + "; ".join(
            f"{name}: " + ", ".join(f"train.{k}={v}" for k, v in kv.items()) for name, kv in keys.items()) + ".")
    pre = compare.get("preprocess_worker_s") or {}
    if "mine" in pre:
        per_k = compare.get("per_k_stages", ())
        clustering = sum(pre.get(s, 0) or 0 for s in per_k)
        lines.append(f"\nPreprocessing worker-seconds: embed {_fmt(pre.get('embed'))}, clustering ({' + '.join(per_k)}) "
                     f"{clustering:.1f}, mining negatives {_fmt(pre['mine'])}; arms with mined negatives "
                     f"also embed M more passages per query in every step (their train worker-s above).")
    paired = compare.get("paired") or {f"{name} - random": {"ndcg_at_10": d}
                                       for name, d in compare.get("paired_vs_random", {}).items()}
    for name, by_metric in paired.items():
        lines.append(f"\n{name}, paired by seed: " + "; ".join(_paired_text(key, d) for key, d in by_metric.items()) + ".")
    return "\n".join(lines)


def compare_cost_table(compare: dict) -> str:
    """Per arm: quality against random (seed-paired, 95% interval), the preprocessing it needs (each stage of the
    run's cost records; `extra` = beyond random's), its training cost, and the gain per extra preprocessing hour."""
    if not any("preprocess" in arm for arm in compare["arms"].values()):
        return ""  # a compare.json written before the arms' costs were recorded
    lines = ["| arm | NDCG@10 | MRR@10 | NDCG@10 - random [95%] | MRR@10 - random [95%] | preprocessing needed | "
             "preprocessing wall s / CPU-s / GPU-s | extra over random (worker-s) | training worker-s / seed | "
             "NDCG@10 gain per extra preprocessing hour |", "|---|---|---|---|---|---|---|---|---|---|"]
    paired = compare.get("paired") or {}
    for name, arm in compare["arms"].items():
        pre, diff = arm["preprocess"], paired.get(f"{name} - random", {})
        gain = (arm.get("gain_per_preprocess_hour") or {}).get("ndcg_at_10")
        lines.append(f"| {name} | {arm['metrics']['ndcg_at_10']['mean']:.4f} | {arm['metrics']['mrr_at_10']['mean']:.4f} "
                     f"| {_diff_cell(diff.get('ndcg_at_10'))} | {_diff_cell(diff.get('mrr_at_10'))} | "
                     f"{', '.join(pre['stages'])} | {pre['wall_s']:.1f} / {pre['cpu_s']:.1f} / {pre['gpu_s']:.1f} | "
                     f"{pre['extra']['worker_s']:.1f} | {arm['train']['worker_s_per_seed']:.1f} | "
                     f"{'-' if gain is None else f'{gain:+.3g}'} |")
    total = compare["preprocess_total"]
    lines.append(f"\nPreprocessing of this compare, each stage counted once ({', '.join(total['stages'])}): "
                 f"{total['wall_s']:.1f} s wall, {total['cpu_s']:.1f} CPU worker-s, {total['gpu_s']:.1f} GPU-s"
                 + (f"; no cost record for {', '.join(total['unrecorded'])}" if total["unrecorded"] else "") + ".")
    return "\n".join(lines)


def _diff_cell(d: dict | None) -> str:
    if not d:
        return "-"
    low, high = d["ci95"] or (None, None)
    return f"{d['mean']:+.4f}" + (f" [{low:+.4f}, {high:+.4f}]" if low is not None else " (1 seed)")


def compare_mteb_table(compare: dict) -> str:
    """compare --mteb: each task's main score per arm (mean ± std over seeds) beside the frozen encoder's, then the
    seed-paired differences to the baselines."""
    mteb = compare.get("mteb")
    if not mteb:
        return ""
    lines = ["| task | frozen | " + " | ".join(mteb["arms"]) + " |", "|---|---|" + "---|" * len(mteb["arms"])]
    for task in mteb["tasks"]:
        cells = [f"{arm[task]['main_score']['mean']:.4f} ± {arm[task]['main_score']['std']:.4f}"
                 if "main_score" in arm[task] else "-" for arm in mteb["arms"].values()]
        lines.append(f"| {task} | {_fmt(mteb['frozen'][task].get('main_score'))} | " + " | ".join(cells) + " |")
    for name, by_task in mteb["paired"].items():
        lines.append(f"\n{name}, paired by seed: " + "; ".join(
            _paired_text("main_score", d["main_score"]).replace("main_score", task)
            for task, d in by_task.items() if "main_score" in d) + ".")
    return "\n".join(lines)


def _paired_text(key: str, d: dict) -> str:
    label = {"ndcg_at_10": "NDCG@10", "mrr_at_10": "MRR@10"}.get(key, key)
    if not d.get("ci95"):
        return f"{label} {d['mean']:+.4f} ({d['n']} seed: no interval)"
    low, high = d["ci95"]
    verdict = "no difference shown" if low <= 0 <= high else ("better" if low > 0 else "worse")
    return (f"{label} {d['mean']:+.4f}, 95% interval [{low:+.4f}, {high:+.4f}] ({verdict}; "
            f"{d['wins']}/{d['n']} seeds better)")


def sweep_table(sweep: dict) -> str:
    lines = ["| N | k | shards | size min..max | intra cos (mean, min..max) | fit s | assign s | shard s | NDCG@10 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in sweep["points"]:
        if "error" in p:
            lines.append(f"| {p['rows']} | {p['k']} | skipped: {p['error'][:120]} ||||||")
            continue
        lines.append(f"| {p['rows']} | {p['k']} | {p['shards']} | {p['min_rows']}..{p['max_rows']} | "
                     f"{_fmt(p['mean_intra_cosine'])} ({_fmt(p['min_intra_cosine'])}..{_fmt(p['max_intra_cosine'])}) | "
                     f"{p['fit_s']:.1f} | {p['assign_s']:.1f} | {p['shard_s']:.1f} | {_fmt(p.get('ndcg_at_10'), 4)} |")
    for c in sweep.get("cost_points", []):
        text = f"\nN={c['rows']} (k={c['k']}): preprocessing {c['preprocess_worker_s']:.1f} worker-s"
        if c.get("train_epoch_worker_s"):
            text += (f", training {c['train_epoch_worker_s']:.1f} worker-s per epoch, ratio "
                     f"{_fmt(c['ratio_per_epoch'], 2)} per epoch / {_fmt(c['ratio_total'], 2)} in total")
        lines.append(text + ".")
    return "\n".join(lines)


def training_runs(run: RunDir) -> dict[str, dict[str, list[dict]]]:
    """{group: {run name: metrics records}}; group = the run name without its '-seed<N>' suffix."""
    groups: dict[str, dict[str, list[dict]]] = {}
    for name in run.listdir(TRAIN):
        records = read_metrics(run, name)
        if records:
            groups.setdefault(re.sub(r"-seed\d+$", "", name), {})[name] = records
    return groups


def collapse_warnings(run: RunDir) -> list[str]:
    """One line per training run the collapse guard flagged (train/<name>/collapse.json)."""
    lines = []
    for name in run.listdir(TRAIN):
        if run.exists(collapse_path(name)):
            flag = run.read_json(collapse_path(name))
            how = "stopped" if flag["stopped"] else "went on (train.stop_on_collapse=false); its metrics are suspect"
            lines.append(f"- **`{name}` collapsed** at step {flag['step']} and {how}: {flag['message']}")
    return lines


def _figure(run: RunDir, parts: list[str], filename: str, png: bytes | None, caption: str) -> None:
    if png:
        run.write_bytes(f"report/{filename}", png)
        parts += [f"![{caption}]({filename})", ""]


def prediction_table(prediction: dict, costs: dict) -> str:
    """Predicted (by `clusterscale plan --save-in`) vs measured wall time per stage, with the error."""
    lines = ["| stage | predicted wall s | measured wall s | error |", "|---|---|---|---|"]
    for name, s in prediction.get("stages", {}).items():
        record = costs.get(name) or next((rec for key, rec in costs.items() if key.split(":")[0] == name), None)
        predicted = s.get("wall_s")
        if record is None or predicted is None or (isinstance(predicted, float) and math.isnan(predicted)):
            continue
        measured = record.get("wall_s")
        if name == "train" and record.get("steps") and prediction.get("train_shape", {}).get("steps_per_epoch"):
            predicted *= record["steps"] / prediction["train_shape"]["steps_per_epoch"]  # the steps it ran
        error = f"{(predicted - measured) / measured:+.0%}" if measured else "-"
        lines.append(f"| {name} | {predicted:,.1f} | {measured:,.1f} | {error} |")
    return "\n".join(lines)


def run_report(ctx: StageContext) -> StageResult:
    """The report stage: report/report.md rewritten from what the run holds now (no done marker). A run clustered at
    other k only is refused: a report at this k would credit it with their costs and overwrite the right one; so is
    a run directory that holds no finished stage (a mistyped --run-dir)."""
    k, run = ctx.cfg.cluster.k, ctx.run
    made = sorted(name for name in (run.listdir("kmeans") if run.exists("kmeans") else []) if name.startswith("k="))
    if made and f"k={k}" not in made:
        raise ConfigError(f"cluster.k={k}: this run holds no clustering at k={k}, only {', '.join(made)}: report on "
                          f"one of them (--set cluster.k=...), or run `clusterscale fit`, `assign` and `shard` "
                          f"--set cluster.k={k} first.")
    if not any(run.exists(*path) for path in (("pairs", "_DONE.json"), ("embeddings", "_DONE.json"),
                                              ("report", "costs.json"), ("report", "cost_points.json"),
                                              ("report", "sweep.json"))):  # a sweep's top run: its table
        raise StageMissingError(f"{run.uri} holds no finished stage: nothing to report. Check --run-dir, or run "
                                f"`clusterscale run --run-dir {run.uri} ...` first.")
    return StageResult({}, outputs={"report": write_report(ctx.cfg, run)})


def write_report(cfg: Config, run: RunDir) -> str:
    """Write report/report.md (with its plots); its path."""
    k = cfg.cluster.k
    parts = ["# clusterscale report", "", f"Run directory: `{run.uri}`  ", f"Config hash: `{cfg.hash()}`", ""]
    if not report_plots.available():
        parts += ["Plots: none here, matplotlib is not installed (`pip install matplotlib`, then `clusterscale report "
                  "--run-dir ...`).", ""]
    flagged = collapse_warnings(run)
    if flagged:
        parts += ["## Warnings", *flagged, ""]
    if run.exists("pairs", "_DONE.json"):
        s = run.done_stats("pairs")
        parts += ["## Data", f"Rows in {s['rows_in']}{more_pairs(s)}: training pairs {s['pairs']}, held out {s['heldout']}, "
                  f"quarantined {s['quarantine']}" + (f" {s['reasons']}" if s['reasons'] else "") + ".", ""]
    if run.exists(manifest_path(k)):
        manifest = read_manifest(run, manifest_path(k))
        parts += [f"## Clusters (k={k}, small-cluster policy: {manifest.small_cluster_policy})",
                  table1_line(manifest), "", cluster_table(manifest), ""]
        _figure(run, parts, "cluster_sizes.png", report_plots.cluster_sizes(manifest), "cluster sizes")
    if run.exists(DEDUP, "_DONE.json"):  # the clustering dedup last ran at (its section names k)
        parts += dedup_section(run, k)
    costs = run.read_json("report/costs.json") if run.exists("report/costs.json") else {}
    if costs:
        sweep_points = run.read_json("report/cost_points.json") if run.exists("report/cost_points.json") else None
        summary = summarize(cfg, run, costs, extra_points=sweep_points)
        run.write_json("report/cost_summary.json", summary)
        parts += ["## Cost: preprocessing vs training", *cost_summary_text(summary), "",
                  cost_table(costs, summary["flops"]), "",
                  "FLOPs are estimates on non-padding tokens (embedding 2 x params x tokens, training 6 x params "
                  "x tokens; token counts from a sample of pairs). worker-s = workers x wall seconds (GPU-s on GPUs).", ""]
        if run.exists(PREDICTION_PATH):
            prediction = run.read_json(PREDICTION_PATH)
            parts += ["## Plan vs measured", f"`clusterscale plan` predicted this run ({prediction.get('rows', 0):,} "
                      f"pairs at k={prediction.get('k')}, {prediction.get('cluster', '')}) before it ran; error = "
                      f"(predicted - measured) / measured. Train: the predicted epoch scaled to the steps run.", "",
                      prediction_table(prediction, costs), ""]
        _figure(run, parts, "costs.png", report_plots.cost_breakdown(
            [(key, rec.get("worker_s", 0.0), stage_kind(key, rec)) for key, rec in costs.items()], summary),
            "cost per stage; preprocessing vs training")
    evaluated = eval_table(run)
    if evaluated:
        parts += ["## Held-out retrieval", evaluated, ""]
    elif not (run.exists("report/compare.json") or run.exists("report/sweep.json")):
        parts += ["## Held-out retrieval", "No evaluation yet: run `clusterscale evaluate`.", ""]
    if run.exists(eval_by_cluster_path(k)):
        parts += [f"NDCG@10 per cluster (each held-out pair assigned to its nearest centroid at k={k} by its frozen "
                  "embedding):", "", by_cluster_table(run.read_json(eval_by_cluster_path(k))), ""]
    mteb = mteb_table(run)
    if mteb:
        parts += ["## MTEB retrieval", mteb, ""]
    if run.exists("report/compare.json"):
        compare = run.read_json("report/compare.json")
        parts += ["## Compare: samplers over seeds", compare.get("description", ""), "", compare_table(compare), ""]
        if compare.get("mteb"):
            parts += ["### MTEB main score per arm (mean ± std over seeds)", "", compare_mteb_table(compare), ""]
        _figure(run, parts, "compare.png", report_plots.compare_arms(compare), "compare")
        costs_table = compare_cost_table(compare)
        if costs_table:
            parts += ["Quality against cost: each arm's preprocessing (from this run's cost records) and training, "
                      "and what it gains over random per extra preprocessing worker-hour.", "", costs_table, ""]
            _figure(run, parts, "compare_cost.png", report_plots.gain_against_cost(compare),
                    "gain over random against extra preprocessing")
        _figure(run, parts, "paired.png", report_plots.paired_differences(compare),
                "seed-paired differences with 95% intervals")
    if run.exists("report/sweep.json"):
        sweep = run.read_json("report/sweep.json")
        parts += ["## Sweep over k and N", sweep.get("description", ""), "", sweep_table(sweep), ""]
        _figure(run, parts, "sweep.png", report_plots.sweep_curves(sweep), "sweep")
    curves = training_runs(run)
    if curves:
        parts += ["## Training dynamics", "Loss per step (the paper's Figure 2: clustered batches should show higher "
                  "loss and variance than random ones) and negative hardness (cosine of each query to its in-batch "
                  "negatives: mean, and the hardest per query).", ""]
        _figure(run, parts, "loss.png", report_plots.training_curves(curves, ("loss",), ("InfoNCE loss",),
                                                                     "Training loss"), "loss")
        _figure(run, parts, "hardness.png", report_plots.training_curves(
            curves, ("neg_cos_mean", "neg_cos_max"), ("mean cosine to negatives", "max cosine to a negative"),
            "Negative hardness"), "hardness")
    text = "\n".join(parts)
    run.write_text("report/report.md", text)
    print(f"[report] {run.path('report/report.md')}", flush=True)
    return run.path("report/report.md")
