"""Preprocessing on a truncated frozen embedding (cluster.dims): what it buys and what it costs, against the full width.

    python benchmarks/bench_matryoshka.py --run-dir R [--dims 64,128,256] [--seeds 2] [--set KEY=VALUE ...]
                                          [--core-rows 100000] [--json OUT]

Two parts, each measured in this one run:
1. The pipeline, on real pairs: R is made (or reused) by `clusterscale run --set embed.side=both` (the embedded
   default: local Ray, the bundled MiniLM encoder, the docstring pairs; --set to change it). Then for the full width
   and each d of --dims: fit, assign, dedup (semantic 0.9, not applied to the shards), shard and mine at
   cluster.dims=d, each stage's own wall time (report/costs.json) and the peak USS of its largest process (sampled,
   bench_scale.TreeSampler), and what the smaller width changes: the NMI of its clusters against the full width's,
   the pairs dedup removes, the recall of the full width's mined candidates (top M per query) among its own, and the
   held-out NDCG@10 of a student trained on its clusters (clustered sampler, --seeds seeds, each evaluated).
2. The compute cores on --core-rows synthetic unit vectors of the encoder's width, in this process, timed at each
   width: the k-means fit (faiss, k = 100, 10 iterations), dedup's semantic pass on one 10,000-row cluster, and mine's
   exact top-50 search of 10,000 queries over 20,000 passages. At the pipeline's small size Ray's fixed costs hide
   the width; these are the terms that grow with the data.

The machine, its load before and after, and the command are recorded (bench_scale.write_result). MiniLM is not a
Matryoshka-trained encoder: its first dimensions carry less than a Matryoshka model's would, so the quality figures
are a lower bound of what such a model keeps.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time

import numpy as np
import pyarrow.parquet as pq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench_scale import machine, run_sampled, stage_wall_s, write_result  # noqa: E402

STAGES = ("fit", "assign", "dedup", "shard", "mine")
DEDUP_KEYS = ["dedup.semantic_threshold=0.9", "dedup.apply_to_shards=false"]
TOP_M = 10  # mined candidates compared per query


def cli(verb: str, run_dir: str, keys: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "clusterscale.cli", verb, "--run-dir", run_dir, *extra, "--set", *keys]


def nmi(a: np.ndarray, b: np.ndarray) -> float:
    """Normalised mutual information of two labelings (arithmetic mean of the entropies)."""
    _, ai = np.unique(a, return_inverse=True)
    _, bi = np.unique(b, return_inverse=True)
    joint = np.zeros((ai.max() + 1, bi.max() + 1))
    np.add.at(joint, (ai, bi), 1)
    joint /= joint.sum()
    pa_, pb = joint.sum(1), joint.sum(0)
    nz = joint > 0
    mi = float((joint[nz] * np.log(joint[nz] / np.outer(pa_, pb)[nz])).sum())
    entropy = [float(-(p[p > 0] * np.log(p[p > 0])).sum()) for p in (pa_, pb)]
    return mi / max(np.mean(entropy), 1e-12)


def labels(run_dir: str, k: int) -> dict[int, int]:
    table = pq.read_table(sorted(glob.glob(f"{run_dir}/assign/k={k}/*.parquet")), columns=["pair_id", "cluster"])
    return dict(zip(table.column("pair_id").to_pylist(), table.column("cluster").to_pylist()))


def candidates(run_dir: str) -> dict[int, list[int]]:
    table = pq.read_table(sorted(glob.glob(f"{run_dir}/negatives/part-*.parquet")), columns=["pair_id", "neg_pair_ids"])
    return {p: list(c or [])[:TOP_M] for p, c in zip(table.column("pair_id").to_pylist(),
                                                     table.column("neg_pair_ids").to_pylist())}


def recall(full: dict[int, list[int]], cut: dict[int, list[int]]) -> float:
    hits = [len(set(c) & set(cut.get(p, []))) / len(c) for p, c in full.items() if c]
    return float(np.mean(hits)) if hits else float("nan")


def pipeline(args, keys: list[str], logs: str) -> list[dict]:
    run_dir = args.run_dir
    if not os.path.exists(os.path.join(run_dir, "embeddings", "_DONE.json")):
        out = run_sampled(cli("run", run_dir, keys + ["embed.side=both"]), f"{logs}/run.log", 0.5)
        if out["returncode"]:
            raise SystemExit(f"clusterscale run failed: {out.get('error')}")
    rows, full_labels, full_cands = [], None, None
    for dims in [0, *args.dims]:
        dkeys = keys + ["embed.side=both", f"cluster.dims={dims}", *DEDUP_KEYS]
        row = {"dims": dims or "full", "stages": {}}
        for stage in STAGES:
            out = run_sampled(cli(stage, run_dir, dkeys, "--replace"), f"{logs}/{stage}-{dims}.log", 0.2)
            if out["returncode"]:
                raise SystemExit(f"{stage} at cluster.dims={dims} failed: {out.get('error')}")
            row["stages"][stage] = {"wall_s": stage_wall_s(run_dir, stage), "command_s": out["seconds"],
                                    "peak_uss_mb": out["peak_uss_mb"], "largest_process": out["largest_process"]}
        k = int(json.load(open(os.path.join(run_dir, "report", "costs.json")))["fit"]["k"])
        got_labels, got_cands = labels(run_dir, k), candidates(run_dir)
        if dims == 0:
            full_labels, full_cands = got_labels, got_cands
        ids = sorted(full_labels)
        row["nmi_vs_full"] = round(nmi(np.array([full_labels[i] for i in ids]), np.array([got_labels[i] for i in ids])), 4)
        row["mined_recall_at_10_vs_full"] = round(recall(full_cands, got_cands), 4)
        row["dedup_removed"] = json.load(open(os.path.join(run_dir, "dedup", "_DONE.json")))["stats"]["removed"]
        row["ndcg_at_10"] = []
        for seed in range(args.seeds):
            name = f"dims{dims or 'full'}-seed{seed}"
            tkeys = dkeys + [f"train.name={name}", f"train.seed={seed}"]
            for verb in ("train", "evaluate"):
                out = run_sampled(cli(verb, run_dir, tkeys), f"{logs}/{verb}-{name}.log", 1.0)
                if out["returncode"]:
                    raise SystemExit(f"{verb} {name} failed: {out.get('error')}")
            result = json.load(open(os.path.join(run_dir, "eval", f"{name}.json")))
            row["ndcg_at_10"].append(round(result["metrics"]["ndcg_at_10"], 4))
        frozen = os.path.join(run_dir, "eval", "frozen.json")
        if os.path.exists(frozen):
            row["frozen_ndcg_at_10"] = round(json.load(open(frozen))["metrics"]["ndcg_at_10"], 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timed(fn, repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def cores(width: int, dims: list[int], rows: int) -> list[dict]:
    from clusterscale.runtime import dedup_core as core
    from clusterscale.runtime.faiss_index import faiss
    from clusterscale.runtime.vectors import truncated

    faiss.omp_set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(100, width)).astype(np.float32)
    x = centres[rng.integers(100, size=rows)] + 0.8 * rng.normal(size=(rows, width)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    out = []
    for dims in [width, *dims]:
        y = truncated(x, dims)

        def fit():
            km = faiss.Kmeans(dims, 100, niter=10, spherical=True, seed=1, verbose=False)
            km.train(y)

        def search():
            index = faiss.IndexFlatIP(dims)
            index.add(np.ascontiguousarray(y[:20_000]))
            index.search(np.ascontiguousarray(y[20_000:30_000]), 50)

        cluster = np.ascontiguousarray(y[:10_000])
        out.append({"dims": dims, "fit_s": round(timed(fit), 3),
                    "dedup_semantic_s": round(timed(lambda: core.semantic_greedy(cluster, 0.95, 2048)), 3),
                    "mine_search_s": round(timed(search), 3)})
        print(json.dumps(out[-1]), flush=True)
    for row in out:
        for key in ("fit_s", "dedup_semantic_s", "mine_search_s"):
            row[key[:-2] + "_vs_full"] = round(row[key] / out[0][key], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], dest="keys")
    parser.add_argument("--core-rows", type=int, default=100_000)
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.dims = [int(d) for d in args.dims.split(",") if d]
    before = machine()
    logs = f"{args.run_dir.rstrip('/')}-matryoshka-logs"
    shutil.rmtree(logs, ignore_errors=True)
    os.makedirs(logs)
    result = {"dims": args.dims, "keys": args.keys}
    if not args.skip_pipeline:
        result["pipeline"] = pipeline(args, args.keys, logs)
    width = pq.read_schema(sorted(glob.glob(f"{args.run_dir}/embeddings/*.parquet"))[0]).field("emb").type.list_size \
        if os.path.exists(os.path.join(args.run_dir, "embeddings")) else 384
    result["cores"] = cores(width, args.dims, args.core_rows)
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write_result(result, before, logs, args.json)


if __name__ == "__main__":
    main()
