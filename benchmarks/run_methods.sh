#!/usr/bin/env bash
# The issue-8 "done when" evidence on the default data (bundled docstring pairs, MiniLM-L6): every method arm
# side by side on the same shards: clustered and random batches, mined negatives (ANCE-style) with random or
# clustered batches, the CLP loss, the MoE adapter, re-clustering halfway. Sized for a 2-core CPU box (one seed,
# 20 steps per arm; about 25 minutes when the box is otherwise idle).
#   bash benchmarks/run_methods.sh [OUT_DIR] [SEEDS]      (log: OUT_DIR/methods.log)
set -euo pipefail
OUT=${1:-runs/methods}
SEEDS=${2:-1}
mkdir -p "$OUT"
{
  date -u
  time clusterscale compare --run-dir "$OUT" --arms clustered,random,mined,clustered_mined,clp,moe,recluster \
      --seeds "$SEEDS" --set train.steps=20 data.limit=2000
  date -u
} 2>&1 | tee "$OUT/methods.log"
