#!/usr/bin/env bash
# The issue-6 "done when" evidence on the default data (bundled docstring pairs, MiniLM-L6):
# compare with 3 seeds, sweep with 3 values of k. Reduced sizing for a 2-core CPU box; run it when
# the machine is otherwise idle (the Ray Train start-up alone is ~8 s per arm on a quiet box).
#   bash benchmarks/run_experiments.sh [OUT_DIR]      (log: OUT_DIR/experiments.log)
set -euo pipefail
OUT=${1:-runs/experiments}
mkdir -p "$OUT"
SET=(train.steps=20 data.limit=2000)
{
  date -u
  time clusterscale compare --run-dir "$OUT/compare" --samplers clustered,random --seeds 3 --set "${SET[@]}"
  time clusterscale sweep --run-dir "$OUT/sweep" --k 4,8,32 --set "${SET[@]}"
  date -u
} 2>&1 | tee "$OUT/experiments.log"
