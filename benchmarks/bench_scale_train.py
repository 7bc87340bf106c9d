"""Peak memory of a training rank and its read amplification at N and 4N rows, per sampler and with mined negatives.

    python benchmarks/bench_scale_train.py [--rows 40000 --k 100 --topics 100 --dim 64 --steps 20
                                            --global-batch-size 64] [--arms clustered,random,...]
                                           [--out-dir DIR] [--keep] [--json OUT]
    python benchmarks/bench_scale.py --train [--train-rows 40000 ...]   (the stage part, then this one)

For N and 4N it writes a synthetic run (`clusterscale synth --set embed.side=both`; its `source` column is each
pair's topic) and prepares it with fit, assign, shard and mine (each its own CLI process). Then each arm trains
`--steps` steps of a tiny from-scratch model (hidden 32, one layer) with 2 Ray Train workers (`clusterscale
train`, its own CLI process and local Ray), and bench_scale.TreeSampler samples the memory of that command's
process tree. Arms: the samplers clustered, random, random_clusters and source, and clustered with mined
negatives (train.negatives_per_query=2).

Per arm: `peak_rss_mb` = the peak USS (private memory, see bench_scale.py) of the largest Ray Train worker
process (a rank: `ray::RayTrainWorker`), at N and 4N; `growth` = 4N / N (goal <= 1.25);
`train_read_amplification` = the shard bytes all ranks read over the run (Parquet footers included) / the on-disk
bytes of the rows they trained on, summed from metrics.jsonl's per-step `bytes_read` / `bytes_used` (the
trainer's ShardReader counters; goal <= 2 for clustered). Mined negatives' sidecar bytes are not in it: it is the
rows' amplification. `footer_bytes_read` is the part of it that is Parquet footers (metrics.jsonl's per-step
`footer_bytes_read`: a rank reads the whole footer of each shard file it takes a row group from, unless its footer
cache holds it) and `read_amplification_without_footers` the rest. `max_train_memory_growth` = the largest
growth over the arms.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scale  # noqa: E402  (the sibling module: its process-tree sampler and CLI helpers)

# The arms: name -> the train keys that make it.
ARMS = {"clustered": ["train.sampler=clustered"],
        "random": ["train.sampler=random"],
        "random_clusters": ["train.sampler=random_clusters"],
        "source": ["train.sampler=source"],
        "clustered_mined_negatives": ["train.sampler=clustered", "train.negatives_per_query=2"]}
WORKERS = 2
# A tiny model, 2 ranks, no checkpoint kept: the rank's memory is then mostly torch and the data side.
TRAIN_KEYS = ["embed.side=both", "mine.index=ivf", "train.init=scratch", "train.scratch_hidden_size=32",
              "train.scratch_num_layers=1", "train.scratch_num_heads=2", "train.scratch_intermediate_size=64",
              "train.warmup_steps=1", f"train.num_workers={WORKERS}"]
RANK_TITLE = "RayTrainWorker"


def read_amplification(records: list[dict], minus_bytes: int = 0) -> float | None:
    """Bytes read (less `minus_bytes`) / bytes used over the steps of a metrics.jsonl (None when the records carry
    no byte counts)."""
    read = sum(r.get("bytes_read", 0) for r in records) - minus_bytes
    used = sum(r.get("bytes_used", 0) for r in records)
    return round(read / used, 3) if used else None


def rank_peak_mb(summary: dict) -> float | None:
    """The peak USS of the largest Ray Train worker process in a TreeSampler summary (None when none ran)."""
    peaks = [mb for title, mb in summary["worker_peaks_by_title_mb"].items() if RANK_TITLE in title]
    return max(peaks) if peaks else None


def metrics_records(run_dir: str, name: str) -> list[dict]:
    path = os.path.join(run_dir, "train", name, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def prepare(run_dir: str, rows: int, keys: list[str], args, logs: str) -> None:
    """synth, fit, assign, shard and mine into run_dir, each a CLI process; raises with the log's tail on failure."""
    synth = ["--rows", str(rows), "--dim", str(args.dim), "--topics", str(args.topics)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([bench_scale.REPO, os.environ.get("PYTHONPATH", "")]))
    for verb, extra in (("synth", synth), ("fit", []), ("assign", []), ("shard", []), ("mine", [])):
        log_path = os.path.join(logs, f"{verb}.log")
        with open(log_path, "w") as log:
            rc = subprocess.run(bench_scale.cli(verb, run_dir, keys, extra), cwd=bench_scale.REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT).returncode
        if rc:
            with open(log_path) as log:
                raise RuntimeError(f"`clusterscale {verb}` failed at {rows} rows:\n{''.join(log.readlines()[-15:])}")


def measure_arms(rows: int, arms: list[str], args, root: str) -> dict:
    """Prepare a run of `rows` pairs, then train each arm on it, sampled; {arm: measurement}."""
    run_dir = os.path.join(root, f"train-rows={rows}")
    logs = os.path.join(root, f"train-logs-{rows}")
    os.makedirs(logs, exist_ok=True)
    keys = [f"cluster.k={args.k}", f"data.rows_per_part={args.rows_per_part}",
            f"train.global_batch_size={args.global_batch_size}", f"train.steps={args.steps}", *TRAIN_KEYS]
    print(f"[bench_scale_train] rows={rows}: synth, fit, assign, shard, mine ...", flush=True)
    prepare(run_dir, rows, keys, args, logs)
    out = {}
    for arm in arms:
        argv = bench_scale.cli("train", run_dir, [*keys, *ARMS[arm], f"train.name={arm}"])
        result = bench_scale.run_sampled(argv, os.path.join(logs, f"train-{arm}.log"), args.interval)
        records = metrics_records(run_dir, arm)
        footers = round(sum(r.get("footer_bytes_read", 0) for r in records))  # the footers' share of the bytes read
        result["footer_bytes_read"] = footers
        result["read_amplification_without_footers"] = read_amplification(records, minus_bytes=footers)
        out[arm] = result | {"rank_peak_uss_mb": rank_peak_mb(result), "steps": len(records),
                             "train_read_amplification": read_amplification(records),
                             "bytes_read_per_step": round(sum(r.get("bytes_read", 0) for r in records)
                                                          / max(1, len(records)))}
        print(f"[bench_scale_train] rows={rows} {arm}: {result['seconds']}s, rank peak {out[arm]['rank_peak_uss_mb']} "
              f"MB, read amplification {out[arm]['train_read_amplification']}"
              f"{' ERROR' if result['returncode'] else ''}", flush=True)
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def arm_entry(rows: list[int], runs: list[dict]) -> dict:
    """An arm's JSON entry over the scales: the goal's keys, then the detail."""
    peaks = [r["rank_peak_uss_mb"] for r in runs]
    entry = {"rows": rows, "peak_rss_mb": peaks,
             "growth": round(peaks[-1] / peaks[0], 3) if all(peaks) else None,
             "train_read_amplification": [r["train_read_amplification"] for r in runs],
             "bytes_read_per_step": [r["bytes_read_per_step"] for r in runs], "steps": [r["steps"] for r in runs],
             "driver_peak_uss_mb": [r.get("driver_peak_uss_mb") for r in runs],
             "footer_bytes_read": [r.get("footer_bytes_read") for r in runs],
             "read_amplification_without_footers": [r.get("read_amplification_without_footers") for r in runs],
             "tree_peak_pss_mb": [r.get("tree_peak_pss_mb") for r in runs], "seconds": [r["seconds"] for r in runs]}
    errors = [r.get("error") for r in runs]
    if any(errors):
        entry["error"] = errors
    return entry


def measure(rows: int, arms: list[str], args, root: str) -> dict:
    """The "train" block and max_train_memory_growth at rows and 4 x rows."""
    scales = [rows, 4 * rows]
    runs = [measure_arms(n, arms, args, root) for n in scales]
    block = {arm: arm_entry(scales, [r[arm] for r in runs]) for arm in arms}
    growths = [e["growth"] for e in block.values() if e["growth"] is not None and "error" not in e]
    return {"train": block, "max_train_memory_growth": max(growths) if growths else None,
            "train_settings": {"k": args.k, "dim": args.dim, "topics": args.topics, "steps": args.steps,
                               "global_batch_size": args.global_batch_size, "workers": WORKERS,
                               "rows_per_part": args.rows_per_part}}


def markdown_table(result: dict) -> str:
    """The RESULTS.md table: per arm the largest rank's peak at N and 4N, growth and read amplification."""
    lines = ["| arm | rows | rank peak MB (USS) | growth | read amplification | bytes read per step |",
             "|---|---|---|---|---|---|"]
    for arm, e in result["train"].items():
        mark = " (error)" if "error" in e else ""
        lines.append(f"| {arm}{mark} | {e['rows'][0]:,} / {e['rows'][1]:,} | {e['peak_rss_mb'][0]} / "
                     f"{e['peak_rss_mb'][1]} | {e['growth']} | {e['train_read_amplification'][0]} / "
                     f"{e['train_read_amplification'][1]} | {e['bytes_read_per_step'][0]:,} / "
                     f"{e['bytes_read_per_step'][1]:,} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The training part's options; bench_scale.py adds them with prefix 'train-' (its --rows, --k, ... are the
    stage part's)."""
    parser.add_argument(f"--{prefix}rows", type=int, default=40_000,
                        help="N of the training runs; the second scale is 4N (default 40000).")
    parser.add_argument(f"--{prefix}k", type=int, default=100, help="cluster.k (default 100).")
    parser.add_argument(f"--{prefix}topics", type=int, default=100,
                        help="Synthetic topics, i.e. sources of the source sampler (default 100).")
    parser.add_argument(f"--{prefix}dim", type=int, default=64, help="Synthetic vector size (default 64).")
    parser.add_argument(f"--{prefix}steps", type=int, default=20, help="Training steps per arm (default 20).")
    parser.add_argument(f"--{prefix}global-batch-size", type=int, default=64, help="Default 64 (32 per rank).")
    parser.add_argument(f"--{prefix}rows-per-part", type=int, default=20_000,
                        help="data.rows_per_part: the synth files are the same size at both scales.")
    parser.add_argument(f"--{prefix}arms", default=",".join(ARMS),
                        help=f"Comma-separated subset of {', '.join(ARMS)} (default: all).")


def train_args(args: argparse.Namespace, prefix: str = "") -> argparse.Namespace:
    """The training part's options without their prefix, plus the shared ones (interval, keep)."""
    prefix = prefix.replace("-", "_")
    names = ("rows", "k", "topics", "dim", "steps", "global_batch_size", "rows_per_part", "arms")
    picked = argparse.Namespace(**{n: getattr(args, prefix + n) for n in names})
    picked.interval, picked.keep = args.interval, args.keep
    unknown = set(picked.arms.split(",")) - set(ARMS)
    if unknown:
        raise SystemExit(f"--{prefix.replace('_', '-')}arms: unknown arm(s) {sorted(unknown)}; choose from "
                         f"{', '.join(ARMS)}.")
    return picked


def run(args: argparse.Namespace, root: str) -> dict:
    """The training part for parsed, unprefixed options (train_args)."""
    return measure(args.rows, args.arms.split(","), args, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--interval", type=float, default=0.2, help="Seconds between memory samples.")
    parser.add_argument("--out-dir", help="Where the synthetic runs go (default: a temporary folder).")
    parser.add_argument("--keep", action="store_true", help="Keep the run directories.")
    parser.add_argument("--json", dest="json_path", help="Write the results here.")
    args = parser.parse_args()
    options = train_args(args)
    root = os.path.abspath(args.out_dir) if args.out_dir else tempfile.mkdtemp(prefix="bench_scale_train-")
    os.makedirs(root, exist_ok=True)
    before = bench_scale.machine()
    result = run(options, root)
    bench_scale.write_result(result, before, root, args.json_path)
    print(markdown_table(result))


if __name__ == "__main__":
    main()
