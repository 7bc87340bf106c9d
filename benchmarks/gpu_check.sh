#!/usr/bin/env bash
# GPU rates for `clusterscale plan --gpu-calibration`: run on a GPU node with torch, transformers, pyarrow and numpy
# (no Ray, no faiss needed). Under 8 minutes on one GPU (each of 5 measurements ~20 s plus model set-up).
#   bash benchmarks/gpu_check.sh [OUT.json]          (default benchmarks/results/gpu_check.json)
#   bash benchmarks/gpu_check.sh OUT.json --quick    (tiny models on the CPU: checks the script only)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu_check.json}"
shift || true
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
timeout 470 python benchmarks/gpu_check.py --out "$out" "$@"
