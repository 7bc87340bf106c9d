"""Bytes the driver receives for the shard statistics (per-cluster rows, cos sums and float64 vector sums), before
and after issue 27: each row group's k x d sums iterated on the driver, or added up in Ray tasks.

    python benchmarks/bench_shard_stats.py [--row-groups 4 --k 1000 --dim 768 --at-rows 100000000] [--json OUT]

It writes --row-groups row groups of 8,192 rows (uniform cluster labels over --k, as assign writes them: cluster,
cos, fp16 emb), then runs the statistics both ways on a local Ray and counts the Arrow bytes that reach the
driver: before, every block_cluster_stats table (the old loop of np.add.at over iter_batches, kept here); after,
cluster_stats's one ClusterStats (+ 8 bytes per count the progress line reads). Both give the same sums. The
before figure grows with the row groups (~1 k x d block each), the after one does not: --at-rows scales them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from clusterscale.io.rundir import RunDir  # noqa: E402
from clusterscale.runtime.bounded_data import read_row_groups  # noqa: E402
from clusterscale.runtime.vectors import emb_array, emb_matrix  # noqa: E402
from clusterscale.stages import shards  # noqa: E402

ROW_GROUP_ROWS = 8192


def driver_loop_stats(run: RunDir, k: int, folder: str) -> tuple[shards.ClusterStats, int]:
    """The statistics as the driver added them before issue 27, and the bytes of the tables it received."""
    ds = read_row_groups(run, run.files(folder), ["cluster", "cos", "emb"])
    ds = ds.map_batches(shards.block_cluster_stats, batch_size=None, batch_format="pyarrow")
    stats, received = None, 0
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        received += batch.nbytes
        labels, rows = batch.column("cluster").to_numpy(), batch.column("rows").to_numpy()
        vectors = emb_matrix(batch.column("vector_sum"), dtype=np.float64)
        if stats is None:
            stats = shards.ClusterStats(np.zeros(k, np.int64), np.zeros(k), np.zeros((k, vectors.shape[1])))
        np.add.at(stats.rows, labels, rows)
        np.add.at(stats.cos_sum, labels, batch.column("cos_sum").to_numpy())
        np.add.at(stats.vector_sum, labels, vectors)
    return stats, received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--row-groups", type=int, default=4)
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--at-rows", type=int, default=100_000_000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from clusterscale.config import RayConfig
    from clusterscale.runtime.session import init_ray

    rng = np.random.default_rng(0)
    run = RunDir(tempfile.mkdtemp(prefix="bench-shard-stats-"))
    for g in range(args.row_groups):
        x = rng.standard_normal((ROW_GROUP_ROWS, args.dim)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        run.write_parquet(f"assign/part-{g:05d}.parquet", pa.table({
            "cluster": pa.array(rng.integers(args.k, size=ROW_GROUP_ROWS).astype(np.int32)),
            "cos": pa.array(rng.random(ROW_GROUP_ROWS).astype(np.float32)), "emb": emb_array(x)}))
    init_ray(RayConfig(num_cpus=2, include_dashboard=False))
    started = time.perf_counter()
    before, before_bytes = driver_loop_stats(run, args.k, "assign")
    before_s = time.perf_counter() - started
    started = time.perf_counter()
    after = shards.cluster_stats(run, args.k, args.row_groups * ROW_GROUP_ROWS, "assign")
    after_s = time.perf_counter() - started
    counts = math.ceil(args.row_groups / shards.STATS_FAN_IN)
    after_bytes = after.rows.nbytes + after.cos_sum.nbytes + after.vector_sum.nbytes + 8 * counts
    assert (before.rows == after.rows).all() and (before.vector_sum == after.vector_sum).all()
    np.testing.assert_allclose(before.cos_sum, after.cos_sum, rtol=1e-12)
    groups_at = math.ceil(args.at_rows / ROW_GROUP_ROWS)
    result = {"k": args.k, "dim": args.dim, "row_groups": args.row_groups,
              "driver_bytes_before": before_bytes, "driver_bytes_after": after_bytes,
              "before_bytes_per_row_group": before_bytes / args.row_groups,
              "at_rows": args.at_rows, "row_groups_at_rows": groups_at,
              "driver_gb_before_at_rows": round(before_bytes / args.row_groups * groups_at / 1e9, 1),
              "driver_mb_after_at_rows": round((after_bytes - 8 * counts + 8 * math.ceil(
                  groups_at / shards.STATS_FAN_IN)) / 1e6, 2),
              "wall_s_before": round(before_s, 2), "wall_s_after": round(after_s, 2), "load": os.getloadavg()[0]}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
