"""A stage killed at about half and rerun, against the same stage uninterrupted (issue 51: a lost node costs its units).

    python benchmarks/bench_resume.py --run-dir R --stage mine [--set KEY=VALUE ...] [--json OUT]

R must hold the stage's inputs (e.g. a synth run after fit, assign and shard for mine). The stage runs once with
--replace, timed (`full_s`, the command's wall time: Ray's start and stop included); once more with --replace,
killed with SIGKILL at full_s / 2 (the command's process only, as a lost driver or node would be); then the plain
command again, which finishes the killed attempt (`rerun_s`). `ratio` = rerun_s / full_s (issue 51's goal: <= 0.6
for the benchmark, <= 0.7 for the check on synth runs). The rerun's "resuming" lines say what it kept. Run it on a
quiet machine: the machine and its load before and after are recorded (bench_scale.write_result), with the command
and the logs folder (R-<stage>-resume/).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import machine, write_result  # noqa: E402  (the sibling module: how a benchmark records its run)


def command(stage: str, run_dir: str, keys: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "clusterscale.cli", stage, "--run-dir", run_dir, *extra,
            *(["--set", *keys] if keys else [])]


def timed(argv: list[str], log: str) -> float:
    started = time.time()
    with open(log, "w") as out:
        subprocess.run(argv, check=True, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": REPO})
    return time.time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--stage", required=True, help="The stage verb (mine, assign, ...).")
    parser.add_argument("--set", nargs="*", default=[], dest="keys", help="Config keys, as for the CLI.")
    parser.add_argument("--json", help="Also write the result here.")
    args = parser.parse_args()
    logs = f"{args.run_dir.rstrip('/')}-{args.stage}-resume"
    os.makedirs(logs, exist_ok=True)
    before = machine()
    full = timed(command(args.stage, args.run_dir, args.keys, "--replace"), f"{logs}/full.log")
    with open(f"{logs}/killed.log", "w") as out:
        proc = subprocess.Popen(command(args.stage, args.run_dir, args.keys, "--replace"), stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": REPO})
        time.sleep(full / 2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    time.sleep(2)  # the killed command's local Ray goes (runtime/reaper.py)
    rerun = timed(command(args.stage, args.run_dir, args.keys), f"{logs}/rerun.log")
    with open(f"{logs}/rerun.log") as f:
        resumed = [line.strip() for line in f if "resuming" in line]
    result = {"stage": args.stage, "run_dir": args.run_dir, "keys": args.keys, "full_s": round(full, 1),
              "killed_at_s": round(full / 2, 1), "rerun_s": round(rerun, 1), "ratio": round(rerun / full, 3),
              "resumed": resumed, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_result(result, before, logs, args.json)

if __name__ == "__main__":
    main()
