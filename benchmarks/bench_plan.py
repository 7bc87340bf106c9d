"""Does `clusterscale plan` predict runs it was not calibrated on? Calibrate on one synth run, predict larger ones,
run them, compare per stage: wall time (RUN/report/costs.json) and the largest worker's peak USS (sampled as
benchmarks/bench_scale.py samples it).

    python benchmarks/bench_plan.py [--calibrate-rows 50000] [--rows 150000,600000] [--k 50,200]
                                    [--calibration FILE] [--out-dir DIR] [--json OUT] [--keep]

1. `clusterscale synth` + fit, assign, dedup (exact + semantic at 0.9), shard at --calibrate-rows (first k), each
   stage its own CLI process;
2. for every (rows, k): `clusterscale plan --run-dir CAL --rows N --k K --save-in RUN --json` (rates from CAL's
   costs.json, start-ups and process footprints from --calibration when given), then synth + fit, assign, dedup,
   shard into RUN, sampled;
3. a table per (rows, k, stage): predicted / measured wall s and largest task MB, errors; RESULTS-ready markdown
   with the load average. Heavy: the lead schedules real runs (`flock /tmp/cs-heavy.lock`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import cli, run_sampled, stage_wall_s  # noqa: E402

STAGES = ("fit", "assign", "dedup", "shard")
# dedup with both passes, as `plan --calibrate` times it; the other stages with dedup off (shard reads assign/)
STAGE_KEYS = {"dedup": ["dedup.exact=true", "dedup.semantic_threshold=0.9"]}
DIM, TOPICS = 384, 100


def run_stages(run_dir: str, rows: int, k: int, logs: str) -> dict:
    keys = [f"cluster.k={k}"]
    out = {}
    for stage, argv in [("synth", cli("synth", run_dir, keys, ["--rows", str(rows), "--dim", str(DIM),
                                                               "--topics", str(TOPICS)])),
                        *[(s, cli(s, run_dir, keys + STAGE_KEYS.get(s, []))) for s in STAGES]]:
        result = run_sampled(argv, os.path.join(logs, f"{os.path.basename(run_dir)}-{stage}.log"), 0.2)
        if result["returncode"]:
            raise SystemExit(f"{stage} at {rows} rows failed:\n{result.get('error')}")
        out[stage] = {"wall_s": stage_wall_s(run_dir, stage), "worker_peak_uss_mb": result.get("worker_peak_uss_mb"),
                      "driver_peak_uss_mb": result.get("driver_peak_uss_mb")}
    return out


def plan(cal_dir: str, rows: int, k: int, target: str, calibration: str | None, json_path: str, log: str) -> dict:
    """The plan with dedup on (its keys change no other stage's plan)."""
    argv = [sys.executable, "-m", "clusterscale.cli", "plan", "--run-dir", cal_dir, "--rows", str(rows), "--k", str(k),
            "--save-in", target, "--json", json_path, "--set", f"cluster.k={k}", *STAGE_KEYS["dedup"]]
    if calibration:
        argv += ["--calibration", calibration]
    result = run_sampled(argv, log, 1.0)
    if result["returncode"]:
        raise SystemExit(f"plan failed:\n{result.get('error')}")
    with open(json_path) as f:
        return json.load(f)


def error(predicted: float | None, measured: float | None) -> float | None:
    return (predicted - measured) / measured if predicted is not None and measured else None


def markdown(rows: list[dict], load: tuple[float, float]) -> str:
    lines = [f"Load average {load[0]:.2f} before, {load[1]:.2f} after.", "",
             "| rows | k | stage | predicted s | measured s | time error | predicted task MB | measured worker MB "
             "| memory error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        te, me = r["time_error"], r["memory_error"]
        lines.append(f"| {r['rows']:,} | {r['k']} | {r['stage']} | {r['predicted_s']:.1f} | {r['measured_s']:.1f} | "
                     f"{'-' if te is None else f'{te:+.0%}'} | {r['predicted_mb']:.0f} | "
                     f"{r['measured_mb'] or 0:.0f} | {'-' if me is None else f'{me:+.0%}'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate-rows", type=int, default=50_000)
    parser.add_argument("--rows", default="150000,600000")
    parser.add_argument("--k", default="50,200")
    parser.add_argument("--calibration", help="A `clusterscale plan --calibrate` file (start-ups, footprints).")
    parser.add_argument("--out-dir")
    parser.add_argument("--json")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    root = args.out_dir or tempfile.mkdtemp(prefix="bench-plan-")
    logs = os.path.join(root, "logs")
    os.makedirs(logs, exist_ok=True)
    load_before = os.getloadavg()[0]
    cal_dir = os.path.join(root, f"cal-{args.calibrate_rows}")
    run_stages(cal_dir, args.calibrate_rows, ks[0], logs)
    table = []
    for k in ks:
        for rows in (int(n) for n in args.rows.split(",")):
            target = os.path.join(root, f"rows={rows}-k={k}")
            predicted = plan(cal_dir, rows, k, target, args.calibration, os.path.join(root, f"plan-{rows}-{k}.json"),
                             os.path.join(logs, f"plan-{rows}-{k}.log"))
            measured = run_stages(target, rows, k, logs)
            for stage in STAGES:
                p, m = predicted["stages"][stage], measured[stage]
                table.append({"rows": rows, "k": k, "stage": stage, "predicted_s": p["wall_s"],
                              "measured_s": m["wall_s"], "time_error": error(p["wall_s"], m["wall_s"]),
                              "predicted_mb": p["peak_task_mb"], "measured_mb": m["worker_peak_uss_mb"],
                              "memory_error": error(p["peak_task_mb"], m["worker_peak_uss_mb"])})
            if not args.keep:
                shutil.rmtree(target, ignore_errors=True)
    text = markdown(table, (load_before, os.getloadavg()[0]))
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "markdown": text}, f, indent=2)
    if not args.keep and not args.out_dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
