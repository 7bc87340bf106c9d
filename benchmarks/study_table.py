"""The study's tables for benchmarks/RESULTS.md, printed from a compare run's report/compare.json (issue 18), so
the figures in RESULTS.md are the run's own, every seed included:

    python benchmarks/study_table.py RUN_DIR [--frozen-name "frozen MiniLM-L6 (reference)"]

Prints three Markdown tables: per arm the held-out NDCG@10 and MRR@10 (mean ± sample sd over seeds, min..max), the
mean final loss and in-batch negative cosine; then the seed-paired differences with their 95% t-intervals and how
many seeds the first arm won; then quality against cost (issue 30): per arm NDCG@10 and MRR@10, their seed-paired
difference to random with its interval, the preprocessing the arm needs (worker-seconds of its stages, from the run's
own cost records; each stage once, shared stages counted in every arm that needs them), its training worker-seconds
per seed, and the NDCG@10 gained over random per extra preprocessing worker-hour.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def arm_rows(summary: dict, frozen_name: str) -> list[str]:
    """The per-arm table: one row for the frozen encoder (when evaluated), then one per arm."""
    lines = ["| arm | held-out NDCG@10 (mean ± sd, seeds) | MRR@10 | final loss | in-batch neg cos |",
             "|---|---|---|---|---|"]
    frozen = summary.get("frozen")
    if frozen:
        lines.append(f"| {frozen_name} | {frozen['ndcg_at_10']:.4f} | {frozen['mrr_at_10']:.4f} | - | - |")
    for name, arm in summary["arms"].items():
        ndcg, mrr = arm["metrics"]["ndcg_at_10"], arm["metrics"]["mrr_at_10"]
        lines.append(f"| {name} | {ndcg['mean']:.4f} ± {ndcg['std']:.4f} ({ndcg['min']:.4f}..{ndcg['max']:.4f}) | "
                     f"{mrr['mean']:.4f} ± {mrr['std']:.4f} | {_num(arm.get('final_loss_mean'), 2)} | "
                     f"{_num(arm.get('neg_cos_mean'), 3)} |")
    return lines


def paired_rows(summary: dict) -> list[str]:
    """The seed-paired differences: mean [95% interval] for NDCG@10 and MRR@10, and wins out of the seeds."""
    lines = ["| difference | NDCG@10 mean [95% interval] | MRR@10 mean [95% interval] | seeds better (NDCG, MRR) |",
             "|---|---|---|---|"]
    for name, metrics in summary.get("paired", {}).items():
        ndcg, mrr = metrics["ndcg_at_10"], metrics["mrr_at_10"]
        lines.append(f"| {name} | {_interval(ndcg)} | {_interval(mrr)} | {ndcg['wins']}/{ndcg['n']}, "
                     f"{mrr['wins']}/{mrr['n']} |")
    return lines


def cost_rows(summary: dict) -> list[str]:
    """Quality against cost, one row per arm (compare.json written since issue 30; older ones have no costs)."""
    if not all("preprocess" in arm for arm in summary["arms"].values()):
        return ["(this compare.json predates the per-arm costs: rerun `clusterscale compare` on the run, which reuses "
                "every finished arm, to add them)"]
    lines = ["| arm | NDCG@10 | MRR@10 | NDCG@10 - random [95% interval] | MRR@10 - random [95% interval] | "
             "preprocessing (stages) | preprocessing worker-s (extra over random) | training worker-s / seed | "
             "NDCG@10 gain per extra preprocessing hour |",
             "|---|---|---|---|---|---|---|---|---|"]
    paired = summary.get("paired", {})
    for name, arm in summary["arms"].items():
        diff, pre = paired.get(f"{name} - random"), arm["preprocess"]
        gain = (arm.get("gain_per_preprocess_hour") or {}).get("ndcg_at_10")
        lines.append(f"| {name} | {arm['metrics']['ndcg_at_10']['mean']:.4f} | {arm['metrics']['mrr_at_10']['mean']:.4f} | "
                     f"{_interval(diff['ndcg_at_10']) if diff else '-'} | {_interval(diff['mrr_at_10']) if diff else '-'} "
                     f"| {', '.join(pre['stages'])} | {pre['worker_s']:.0f} ({pre['extra']['worker_s']:+.0f}) | "
                     f"{arm['train']['worker_s_per_seed']:.0f} | {'-' if gain is None else f'{gain:+.4f}'} |")
    total = summary["preprocess_total"]
    lines.append(f"\nPreprocessing of the whole compare, each stage once: {total['worker_s']:.0f} worker-s "
                 f"({total['wall_s']:.0f} s wall; {', '.join(total['stages'])}).")
    return lines


def _interval(d: dict) -> str:
    if not d.get("ci95"):  # one seed: no interval
        return f"{d['mean']:+.4f} (1 seed, no interval)"
    low, high = d["ci95"]
    return f"{d['mean']:+.4f} [{low:+.4f}, {high:+.4f}]"


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the compare run's directory (holds report/compare.json)")
    parser.add_argument("--frozen-name", default="frozen encoder (reference)")
    args = parser.parse_args(argv)
    path = Path(args.run_dir) / "report" / "compare.json"
    if not path.is_file():
        print(f"error: {path} not found: run `clusterscale compare --run-dir {args.run_dir} ...` to the end first "
              f"(it writes report/compare.json when every arm is evaluated)", file=sys.stderr)
        return 2
    summary = json.loads(path.read_text())
    print("\n".join(arm_rows(summary, args.frozen_name)))
    print()
    print("\n".join(paired_rows(summary)))
    print()
    print("\n".join(cost_rows(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
