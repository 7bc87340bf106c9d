"""faiss with the OpenBLAS kernels its bundled library detects on this CPU, against the kernels clusterscale sets.

    python benchmarks/bench_openblas.py [--run-dir R --stage S [--set KEY=VALUE ...]] [--json OUT]

faiss-cpu's wheels bundle an OpenBLAS (0.3.15 in faiss-cpu 1.15) that takes CPUs newer than it (Ice Lake and Sapphire
Rapids Xeons, Zen 4) for a generic SSE3 one ("Prescott"); clusterscale.runtime.faiss_index sets OPENBLAS_CORETYPE
from the CPU's flags while faiss loads. Measured side by side: a flat inner-product search on one thread (each way
in a fresh process: the kernels are chosen when the library loads), then, with --run-dir, the stage's command with
--replace once with the detected kernels (OPENBLAS_CORETYPE set to what plain `import faiss` detects) and once as
clusterscale ships. Both ways give the same rows (vector_search.top_k rescores in float64).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import machine, write_result  # noqa: E402  (the sibling module: how a benchmark records its run)

SEARCH = """
import sys, time
import numpy as np
{imports}
from threadpoolctl import threadpool_info
faiss.omp_set_num_threads(1)
rng = np.random.default_rng(0)
base = rng.standard_normal(({passages}, {dim}), dtype=np.float32)
queries = rng.standard_normal(({queries}, {dim}), dtype=np.float32)
index = faiss.IndexFlatIP({dim})
index.add(base)
started = time.perf_counter()
index.search(queries, {k})
print([i.get("architecture") for i in threadpool_info() if i.get("prefix") == "libopenblas"][0],
      time.perf_counter() - started)
"""


def search(imports: str, queries: int, passages: int, dim: int, k: int) -> tuple[str, float]:
    """(the kernels faiss's OpenBLAS runs, seconds of one flat search) in a fresh process importing faiss so."""
    code = SEARCH.format(imports=imports, queries=queries, passages=passages, dim=dim, k=k)
    env = {name: value for name, value in os.environ.items() if name != "OPENBLAS_CORETYPE"} | {"PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    core, seconds = out.split()
    return core, round(float(seconds), 3)


def timed_stage(stage: str, run_dir: str, keys: list[str], coretype: str | None, log: str) -> float:
    env = {name: value for name, value in os.environ.items() if name != "OPENBLAS_CORETYPE"} | {"PYTHONPATH": REPO}
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    argv = [sys.executable, "-m", "clusterscale.cli", stage, "--run-dir", run_dir, "--replace",
            *(["--set", *keys] if keys else [])]
    started = time.time()
    with open(log, "w") as out:
        subprocess.run(argv, check=True, stdout=out, stderr=subprocess.STDOUT, env=env)
    return round(time.time() - started, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=20_000)
    parser.add_argument("--passages", type=int, default=6_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--k", type=int, default=34, help="mine's range_max + vector_search.RESCORE_MARGIN")
    parser.add_argument("--run-dir", help="Also time this stage's command both ways (its inputs must be there).")
    parser.add_argument("--stage", default="mine")
    parser.add_argument("--set", nargs="*", default=[], dest="keys", help="Config keys, as for the CLI.")
    parser.add_argument("--json", help="Also write the result here.")
    args = parser.parse_args()
    before = machine()
    shape = (args.queries, args.passages, args.dim, args.k)
    detected, detected_s = search("import faiss", *shape)
    ours, ours_s = search("from clusterscale.runtime.faiss_index import faiss", *shape)
    result = {"search": {"queries": args.queries, "passages": args.passages, "dim": args.dim, "k": args.k,
                         "detected": detected, "detected_s": detected_s, "clusterscale": ours,
                         "clusterscale_s": ours_s, "speedup": round(detected_s / ours_s, 2)}}
    logs = None
    if args.run_dir:
        logs = f"{args.run_dir.rstrip('/')}-{args.stage}-openblas"
        os.makedirs(logs, exist_ok=True)
        slow = timed_stage(args.stage, args.run_dir, args.keys, detected, f"{logs}/detected.log")
        fast = timed_stage(args.stage, args.run_dir, args.keys, None, f"{logs}/clusterscale.log")
        result["stage"] = {"stage": args.stage, "run_dir": args.run_dir, "keys": args.keys, "detected_s": slow,
                           "clusterscale_s": fast, "speedup": round(slow / fast, 2)}
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write_result(result, before, logs, args.json)


if __name__ == "__main__":
    main()
