"""Which process of `clusterscale dedup` holds the most memory, per set of dedup keys (a diagnosis for `plan`'s
dedup memory, issue 29): synth N rows (d = 384, k = 50), fit and assign once, then dedup once per variant with the
process tree sampled as benchmarks/bench_scale.py samples it; one JSON line per variant (largest process, the
top titles by USS and by private heap). Quiet box only; record `uptime` with the figures.

    python benchmarks/dedup_memory.py --rows 150000 --out-dir /tmp/dm \
        --variant "dedup.exact=true,dedup.semantic_threshold=0.9" --variant "dedup.exact=true,dedup.semantic_threshold=0"
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import cli, run_sampled, stage_wall_s  # noqa: E402

K = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=150_000)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--variant", action="append", required=True,
                        help="Comma-separated dedup/ray keys for one dedup run (repeat the option).")
    args = parser.parse_args()
    run, logs = os.path.join(args.out_dir, f"rows={args.rows}"), os.path.join(args.out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    keys = [f"cluster.k={K}"]
    if not os.path.exists(os.path.join(run, "assign", f"k={K}", "_DONE.json")):
        for verb, extra in (("synth", ["--rows", str(args.rows), "--dim", "384", "--topics", "100"]), ("fit", []),
                            ("assign", [])):
            result = run_sampled(cli(verb, run, keys, extra), os.path.join(logs, f"{verb}.log"), 0.5)
            if result["returncode"]:
                raise SystemExit(f"{verb} failed:\n{result.get('error')}")
    for i, variant in enumerate(args.variant):
        shutil.rmtree(os.path.join(run, "dedup"), ignore_errors=True)  # each variant dedups afresh
        extra = [key for key in variant.split(",") if key]
        result = run_sampled(cli("dedup", run, keys + extra), os.path.join(logs, f"dedup-{i}.log"), 0.2)
        print(json.dumps({"rows": args.rows, "variant": variant, "wall_s": stage_wall_s(run, "dedup"),
                          "returncode": result["returncode"], "largest": result["largest_process"],
                          "worker_peak_uss_mb": result.get("worker_peak_uss_mb"),
                          "by_title_uss_mb": result["worker_peaks_by_title_mb"],
                          "by_title_anon_mb": result["worker_anon_by_title_mb"],
                          "largest_anon_shmem_mb": result["peak_anon_process_shmem_mb"]}), flush=True)


if __name__ == "__main__":
    main()
