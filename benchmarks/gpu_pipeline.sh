#!/usr/bin/env bash
# The whole pipeline on one GPU node, end to end through the real Ray stages (benchmarks/gpu_pipeline.py): ~6 minutes
# on one H200 (gpu_check.py's rates ~1.5 min, then `clusterscale run` on 200k pairs with a BERT-base-shaped encoder).
#
# Air-gapped GPU nodes (torch, transformers, pyarrow, numpy, but no network, no Ray, no faiss) get Ray from a
# wheelhouse made beforehand on a machine with network access:
#   bash benchmarks/gpu_pipeline.sh --wheelhouse [DIR] [PYTHON_VERSION]   (default .gpu/wheelhouse, 3.12)
# It downloads ray[data,train]==2.60.0 and its dependencies for that CPython on manylinux x86_64, leaves out the
# wheels every such node has (numpy, pandas, pyarrow: 83 MB), repacks Ray's wheel without ray/jars (the Java
# workers' 32 MB, unused from Python) and copies the bundled tokenizer: ~54 MB in all. faiss does not travel (faiss-gpu
# is ~135 MB): ray.vector_backend=auto runs fit, assign, dedup, mine and evaluate on torch on the GPU there.
#
# On the GPU node (the wheelhouse carried to .gpu/wheelhouse, or WHEELHOUSE=DIR):
#   bash benchmarks/gpu_pipeline.sh [OUT_DIR] [--rows N]      (default benchmarks/results/gpu_pipeline, 200000 rows)
# installs Ray from the wheelhouse when `import ray` fails (pip --no-index: nothing is downloaded), then writes
# OUT_DIR/gpu_check.json, OUT_DIR/gpu_pipeline.json (per stage: device, wall, GPU busy, rows/s, plan's wall) and
# the logs. `clusterscale plan --gpu-calibration OUT_DIR/gpu_pipeline.json` reads it.
#   bash benchmarks/gpu_pipeline.sh OUT_DIR --quick           (a tiny BERT on this CPU: checks the script only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--wheelhouse" ]]; then
  wh=${2:-.gpu/wheelhouse}
  pyver=${3:-3.12}
  mkdir -p "$wh"
  tag=cp${pyver/./}
  $PY -m pip download --quiet --disable-pip-version-check "ray[data,train]==2.60.0" --only-binary=:all: \
    --python-version "$pyver" --implementation cp --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$wh"
  rm -f "$wh"/numpy-*.whl "$wh"/pandas-*.whl "$wh"/pyarrow-*.whl
  $PY - "$wh" "$tag" <<'PY'
import base64, glob, hashlib, os, sys, zipfile
wh, tag = sys.argv[1], sys.argv[2]
DROP = ("ray/jars/",)  # the Java workers' jar: Python drivers and workers never load it
for path in glob.glob(os.path.join(wh, f"ray-2.60.0-{tag}-*.whl")):
    if path.endswith(".slim.whl"):
        continue
    slim = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        record = None
        for info in src.infolist():
            if info.filename.startswith(DROP):
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                record = info
                continue
            dst.writestr(info, src.read(info.filename))
        lines = [l for l in src.read(record.filename).decode().splitlines() if not l.startswith(DROP)]
        dst.writestr(record, "\n".join(lines) + "\n")
    os.replace(slim, path)  # the same name: pip installs it as ray 2.60.0
    print(f"{os.path.basename(path)}: {os.path.getsize(path) / 1e6:.1f} MB without {', '.join(DROP)}")
PY
  $PY - "$wh/tokenizer" <<'PY'
import shutil, sys
from clusterscale.modeling.encoder import resolve_model_path
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(resolve_model_path("bundled")).save_pretrained(sys.argv[1])
PY
  du -sh "$wh"
  exit 0
fi

out=${1:-benchmarks/results/gpu_pipeline}
shift || true
wh=${WHEELHOUSE:-.gpu/wheelhouse}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import ray" 2>/dev/null; then
  [[ -d "$wh" ]] || { echo "Ray is not installed and there is no wheelhouse at $wh: make one with" \
                      "\`bash benchmarks/gpu_pipeline.sh --wheelhouse\` where there is network, and carry it." >&2; exit 2; }
  $PY -m pip install --quiet --disable-pip-version-check --no-index --find-links "$wh" "ray[data,train]==2.60.0"
fi
tokenizer=()
[[ -d "$wh/tokenizer" ]] && tokenizer=(--tokenizer "$wh/tokenizer")
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  uptime; $PY -c "import ray, torch, transformers; print('ray', ray.__version__, 'torch', torch.__version__,
'transformers', transformers.__version__)"; } 2>&1 | tee "$out/machine.txt"
if [[ " $* " == *" --quick "* ]]; then
  timeout 100 $PY benchmarks/gpu_check.py --out "$out/gpu_check.json" --quick > "$out/gpu_check.log" 2>&1
else
  timeout 150 $PY benchmarks/gpu_check.py --out "$out/gpu_check.json" --seconds 8 2>&1 | tee "$out/gpu_check.log"
fi
timeout 330 $PY benchmarks/gpu_pipeline.py --out "$out" --gpu-check "$out/gpu_check.json" "${tokenizer[@]}" "$@"
