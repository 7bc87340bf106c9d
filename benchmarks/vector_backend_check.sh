#!/bin/bash
# ray.vector_backend=torch against the default (faiss on this CPU) on two synth runs of the same seed: fit, assign,
# dedup, shard and mine with each, then their outputs compared file by file (issue 52's check).
#   bash benchmarks/vector_backend_check.sh [ROWS] [OUT_DIR]     (default 20000 rows, /tmp/vector-backend-check)
set -euo pipefail
ROWS=${1:-20000}
OUT=${2:-/tmp/vector-backend-check}
K="cluster.k=8 embed.side=both train.negatives_per_query=1 dedup.exact=true dedup.semantic_threshold=0.95"
mkdir -p "$OUT"
for arm in faiss torch; do
  R=$OUT/$arm; rm -rf "$R"
  clusterscale synth --run-dir "$R" --rows "$ROWS" --dim 64 --set $K > "$OUT/$arm.synth.log" 2>&1
  for s in fit assign dedup shard mine; do
    /usr/bin/time -f "$arm $s %e s" clusterscale $s --run-dir "$R" --set $K ray.vector_backend=$arm \
      > "$OUT/$arm.$s.log" 2>&1
    tail -n 1 "$OUT/$arm.$s.log"
  done
done
OUT="$OUT" python - <<'PY'
import glob, os
import numpy as np, pyarrow.parquet as pq
out = os.environ["OUT"]
def load(arm, pattern):
    files = sorted(glob.glob(f"{out}/{arm}/{pattern}"))
    return [pq.read_table(f) for f in files], [os.path.relpath(f, f"{out}/{arm}") for f in files]
for pattern in ("assign/k=8/*.parquet", "dedup/kept/*.parquet", "dedup/removed/*.parquet", "negatives/part-*.parquet"):
    (a, names_a), (b, names_b) = load("faiss", pattern), load("torch", pattern)
    same = names_a == names_b and all(x.equals(y) for x, y in zip(a, b))
    print(pattern, len(names_a), "files", "EQUAL" if same else "DIFFERENT")
c = [np.load(f"{out}/{arm}/kmeans/k=8/centroids.npy") for arm in ("faiss", "torch")]
print("centroids", "EQUAL" if np.array_equal(*c) else "DIFFERENT")
PY
