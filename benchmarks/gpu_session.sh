#!/usr/bin/env bash
# Everything a lent GPU node checks, in one go (~5 min on one H200): the GPU rates that `clusterscale plan` reads
# (gpu_check.py), bf16 embedding throughput of the embed stage's core against SentenceTransformer.encode
# (bench_embed.py --gpu) and the GPU-marked tests (bf16 GradCache and MoE against their fp32/unchunked paths, the
# search's top-k on the device against the CPU's).
# Needs torch, transformers, sentence-transformers, pyarrow, numpy, pytest; no Ray or faiss (the tests that need
# them are not GPU-marked).
#   bash benchmarks/gpu_session.sh OUT_DIR [DOCSTRINGS.parquet]
# DOCSTRINGS.parquet: a cached bundled harvest (~/.cache/clusterscale/docstrings-*.parquet) so that the embedding
# texts are this project's and not the GPU node's own packages' docstrings.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}
docs=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; uptime
  python3 -c "import torch, transformers, sentence_transformers as s; print(torch.__version__,
transformers.__version__, s.__version__)"; } 2>&1 | tee "$out/machine.txt"
timeout 200 python3 benchmarks/gpu_check.py --out "$out/gpu_check.json" --seconds 12 2>&1 | tee "$out/gpu_check.log"
timeout 200 python3 - "$docs" "$out/embed_gpu.json" <<'PY' 2>&1 | tee "$out/embed_gpu.log"
import runpy, sys
docs, out = sys.argv[1], sys.argv[2]
if docs:
    import clusterscale.io.builtin_data as builtin
    builtin.builtin_docstrings_path = lambda: docs
sys.argv = ["benchmarks/bench_embed.py", "--gpu", "--rows", "20000", "--repeats", "3", "--json", out]
runpy.run_path("benchmarks/bench_embed.py", run_name="__main__")
PY
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_moe.py tests/test_train_grad.py \
  tests/test_train_grad_clp.py tests/test_vector_search_device.py 2>&1 | tee "$out/pytest_gpu.log"
