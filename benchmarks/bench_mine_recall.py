"""Recall of cluster-sharded mining vs exact search: the brute-force top-10 negatives found at each mine.nprobe.

    python benchmarks/bench_mine_recall.py [--run-dir DIR] [--rows 20000 --topics 50 --k 64]
                                           [--nprobe 1 4 16] [--stage] [--json PATH]

Makes a `clusterscale synth` run, fits and assigns k clusters (Ray, the CLI verbs), then runs the mine
stage's three steps (clusterscale.stages.mine_search: route, search per cluster, merge per query) in this
process at each nprobe and at nprobe = k (exact search over all passages; checked against a numpy full
sort). Synthetic runs hold passage vectors only, so each query vector is its passage's vector plus seeded
Gaussian noise (cos ~0.8 to its passage). recall@10 = mean over queries with any exact negative of
|top-10 kept at nprobe  intersect  top-10 kept by exact search| / min(10, exact kept).
--stage also runs `clusterscale mine` (Ray Data) at the first --nprobe on the same vectors and checks it
writes the same negatives as this process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clusterscale import cli  # noqa: E402
from clusterscale.config import MineConfig  # noqa: E402
from clusterscale.io.layout import assign_dir  # noqa: E402
from clusterscale.io.rundir import RunDir  # noqa: E402
from clusterscale.runtime.vectors import emb_array, emb_matrix  # noqa: E402
from clusterscale.stages.kmeans import load_centroids  # noqa: E402
from clusterscale.stages.mine_search import merge_candidates, route_rows, search_cluster  # noqa: E402
from clusterscale.io.negatives import candidate_files  # noqa: E402

QUERY_NOISE = 0.038  # per dimension at d=384: |noise| ~0.75, so cos(query, passage) ~0.8


def add_query_vectors(run: RunDir, k: int, seed: int = 0) -> pa.Table:
    """assign/k=<k>/ with an emb_query column (passage + noise), rewritten in place; returns all rows."""
    rng = np.random.default_rng(seed)
    tables = []
    for path in run.files(assign_dir(k)):
        table = pq.read_table(path)
        if "emb_query" not in table.column_names:
            p = emb_matrix(table.column("emb"))
            q = p + QUERY_NOISE * rng.standard_normal(p.shape).astype(np.float32)
            table = table.append_column("emb_query", emb_array(q / np.linalg.norm(q, axis=1, keepdims=True)))
            pq.write_table(table, path)
        tables.append(table)
    return pa.concat_tables(tables)


def mine_in_process(table: pa.Table, centroids: np.ndarray, mc: MineConfig) -> dict[int, list[int]]:
    """pair_id -> kept negatives (best first), by the stage's own route / search / merge functions."""
    routed = pa.concat_tables([route_rows(table.slice(s, 4096), centroids, mc.nprobe, True)
                               for s in range(0, table.num_rows, 4096)])
    clusters = routed.column("group").to_numpy()  # one search group per cluster (no split groups)
    order = np.argsort(clusters, kind="stable")
    routed, clusters = routed.take(pa.array(order)), clusters[order]
    bounds = np.flatnonzero(np.diff(clusters)) + 1
    found = pa.concat_tables([search_cluster(routed.slice(a, b - a), mc, 1)
                              for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(clusters)])])
    negatives, _ = merge_candidates(found, mc)
    return dict(zip(negatives.column("pair_id").to_pylist(), negatives.column("neg_pair_ids").to_pylist()))


def check_exact(table: pa.Table, exact: dict, mc: MineConfig, sample: int = 200) -> None:
    """nprobe = k against a numpy full sort, on a sample of queries (margin off, range_min 0 in this check)."""
    p, q = emb_matrix(table.column("emb")), emb_matrix(table.column("emb_query"))
    ids = table.column("pair_id").to_numpy()
    queries, passages = table.column("query").to_pylist(), table.column("passage").to_pylist()
    for i in np.random.default_rng(1).choice(len(ids), size=min(sample, len(ids)), replace=False):
        scores = p @ q[i]
        ranked = np.lexsort((ids, -scores))[:mc.range_max]
        pos = float(p[i] @ q[i])
        kept = [int(ids[j]) for j in ranked if queries[j] != queries[i] and passages[j] != passages[i]
                and scores[j] <= mc.margin * pos]
        assert kept == exact[int(ids[i])], f"exact mining differs from the full sort for pair {ids[i]}"


def recall_at_10(found: dict, exact: dict) -> float:
    hits = [len(set(found[i][:10]) & set(e[:10])) / min(10, len(e)) for i, e in exact.items() if e]
    return float(np.mean(hits))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir")
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--topics", type=int, default=50)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--nprobe", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--stage", action="store_true", help="also run `clusterscale mine` at the first --nprobe")
    ap.add_argument("--json")
    args = ap.parse_args()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="bench-mine-")
    overrides = [f"cluster.k={args.k}", "ray.num_cpus=2"]
    assert cli.main(["synth", "--run-dir", run_dir, "--rows", str(args.rows), "--topics", str(args.topics)]) == 0
    for verb in ("fit", "assign", "shard"):  # mine writes the negatives' sidecars next to the shards
        assert cli.main([verb, "--run-dir", run_dir, "--set", *overrides]) == 0
    run = RunDir(run_dir)
    table = add_query_vectors(run, args.k)
    centroids = load_centroids(run, args.k)
    exact = mine_in_process(table, centroids, MineConfig(nprobe=args.k))
    check_exact(table, exact, MineConfig(nprobe=args.k))
    result = {"rows": table.num_rows, "k": args.k, "topics": args.topics, "range_max": MineConfig().range_max,
              "margin": MineConfig().margin, "load_avg_1m": os.getloadavg()[0], "nprobe": {}}
    for nprobe in args.nprobe:
        t0 = time.time()
        found = mine_in_process(table, centroids, MineConfig(nprobe=nprobe))
        result["nprobe"][nprobe] = {"recall_at_10": round(recall_at_10(found, exact), 4),
                                    "in_process_s": round(time.time() - t0, 2)}
        print(f"nprobe {nprobe}: recall@10 {result['nprobe'][nprobe]['recall_at_10']:.4f}", flush=True)
    if args.stage:
        nprobe = args.nprobe[0]
        t0 = time.time()
        assert cli.main(["mine", "--run-dir", run_dir, "--set", *overrides, f"mine.nprobe={nprobe}"]) == 0
        mined = pa.concat_tables([pq.read_table(f) for f in candidate_files(run)])
        staged = dict(zip(mined.column("pair_id").to_pylist(), mined.column("neg_pair_ids").to_pylist()))
        assert staged == mine_in_process(table, centroids, MineConfig(nprobe=nprobe)), "stage != in-process"
        result["stage"] = {"nprobe": nprobe, "wall_s": round(time.time() - t0, 2), "equal_to_in_process": True}
        print(f"stage at nprobe {nprobe}: {result['stage']['wall_s']} s, same negatives as in-process", flush=True)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
