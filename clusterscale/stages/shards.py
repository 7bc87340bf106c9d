"""Shard: write the assigned rows as one seeded-shuffled Parquet set per cluster, then the manifest.

shards/k=<k>/cluster=<c>/part-*.parquet and shards/k=<k>/manifest.json (written last).
Clusters smaller than one global batch follow shard.small_cluster_policy (merge | pool).
Run with `clusterscale shard [CONFIG] --run-dir R` (after `assign`).
"""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import ray

from clusterscale.config import Config, Fingerprint
from clusterscale.stages.kmeans import ClusteringError, load_centroids
from clusterscale.io.layout import assign_dir, manifest_path, shards_dir
from clusterscale.runtime.progress import ProgressLine
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.runtime.vectors import emb_matrix
from clusterscale.train.data import row_group_rows_for

SHARD_COLUMNS = ["pair_id", "query", "passage", "source", "cluster", "cos"]


def mean_pairwise_cosine(vector_sum: np.ndarray, n: int) -> float | None:
    """Mean cosine over distinct pairs of n unit vectors from their sum: (|sum|^2 - n) / (n(n-1))."""
    if n < 2:
        return None
    return float((np.dot(vector_sum, vector_sum) - n) / (n * (n - 1)))


def plan_small_clusters(counts: np.ndarray, centroids: np.ndarray, min_rows: int, policy: str) -> dict:
    """Map every original cluster to the shard that receives its rows.

    Returns {"target": int array (k,), "pool_id": int | None, "moved": {orig: target}}. With 'merge',
    a small cluster goes to the most similar (centroid cosine) cluster that is not small.
    """
    k = len(counts)
    target = np.arange(k)
    small = (counts > 0) & (counts < min_rows)
    big = np.flatnonzero(counts >= min_rows)
    moved: dict[int, int] = {}
    pool_id = None
    if small.any():
        if policy == "pool":
            pool_id = k
            for c in np.flatnonzero(small):
                target[c] = pool_id
                moved[int(c)] = pool_id
        else:
            if len(big) == 0:
                raise ClusteringError(
                    f"Every cluster has fewer rows ({int(counts.max())} at most) than one global batch "
                    f"(train.global_batch_size={min_rows}): lower cluster.k or train.global_batch_size, or use "
                    f"shard.small_cluster_policy=pool.")
            sims = centroids @ centroids[big].T
            for c in np.flatnonzero(small):
                target[c] = int(big[int(np.argmax(sims[c]))])
                moved[int(c)] = int(target[c])
    return {"target": target, "pool_id": pool_id, "moved": moved}


def cluster_counts(run: RunDir, k: int) -> np.ndarray:
    dataset = pads.dataset(run.files(assign_dir(k)), filesystem=run.fs, format="parquet")
    counts = np.zeros(k, dtype=np.int64)
    for batch in dataset.to_batches(columns=["cluster"]):
        counts += np.bincount(batch.column("cluster").to_numpy(), minlength=k)
    return counts


class WriteClusterShard:
    """Ray Data map_groups fn: one call per shard; sorts by pair_id, permutes with a seeded RNG, writes."""

    def __init__(self, run_uri: str, k: int, seed: int, rows_per_file: int, row_group_rows: int, num_samples: int,
                 pool_id: int | None):
        self.run = RunDir(run_uri)
        self.k, self.seed, self.rows_per_file, self.row_group_rows = k, seed, rows_per_file, row_group_rows
        self.num_samples, self.pool_id = num_samples, pool_id

    def __call__(self, group: pa.Table) -> pa.Table:
        shard_id = int(group.column("shard")[0].as_py())
        group = group.sort_by("pair_id")  # arrival order after the shuffle is not deterministic
        perm = np.random.default_rng([self.seed, self.k, shard_id]).permutation(group.num_rows)
        group = group.take(pa.array(perm))
        name = "pool" if shard_id == self.pool_id else str(shard_id)
        files = []
        for part, start in enumerate(range(0, group.num_rows, self.rows_per_file)):
            rel = f"{shards_dir(self.k)}/cluster={name}/part-{part:05d}.parquet"
            # Row groups of row_group_rows: a training rank reads only the groups of its slice (train/data.py).
            self.run.write_parquet(rel, group.slice(start, self.rows_per_file).select(SHARD_COLUMNS),
                                   row_group_size=self.row_group_rows, write_statistics=False)
            files.append(rel)
        vector_sum = emb_matrix(group.column("emb"), dtype=np.float64).sum(axis=0)
        return pa.table({"shard": [shard_id], "name": [name], "rows": [group.num_rows], "files": [files],
                         "members": [sorted(set(group.column("cluster").to_pylist()))],
                         "vector_sum": [vector_sum.tolist()],
                         "mean_cos_to_centroid": [float(np.mean(group.column("cos").to_numpy()))],
                         "samples": [group.column("query").slice(0, self.num_samples).to_pylist()]})


def run_shard(cfg: Config, run: RunDir, fingerprint: Fingerprint) -> StageResult:
    """Write shards/k=<k>/: one shuffled shard set per cluster (small clusters by the policy) and the manifest,
    which records the fingerprint."""
    k = cfg.cluster.k
    started = time.time()
    counts = cluster_counts(run, k)
    centroids = load_centroids(run, k)
    plan = plan_small_clusters(counts, centroids, cfg.train.global_batch_size, cfg.shard.small_cluster_policy)
    target = plan["target"]
    row_group_rows = row_group_rows_for(cfg.train.global_batch_size)
    rows_per_file = max(1, cfg.shard.target_rows_per_file // row_group_rows) * row_group_rows  # whole groups
    ds = ray.data.read_parquet(run.files(assign_dir(k)), filesystem=run.fs)
    ds = ds.map_batches(lambda b: b.append_column("shard", pa.array(target[b.column("cluster").to_numpy()])),
                        batch_format="pyarrow")
    written = ds.groupby("shard", num_partitions=max(1, min(200, int((target >= 0).sum())))).map_groups(
        WriteClusterShard, fn_constructor_args=(run.uri, k, cfg.cluster.seed, rows_per_file, row_group_rows,
                                                cfg.shard.num_samples, plan["pool_id"]),
        batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(min_size=1, max_size=2), num_cpus=0.5)
    progress, rows = ProgressLine("shard", int(counts.sum())), []
    for r in written.iter_rows():
        rows.append(r)
        progress.advance(r["rows"])
    rows.sort(key=lambda r: r["shard"])
    clusters, total_sum, n_total = [], None, 0
    for r in rows:
        vec = np.asarray(r["vector_sum"], dtype=np.float64)
        total_sum = vec if total_sum is None else total_sum + vec
        n_total += r["rows"]
        clusters.append({"cluster": r["shard"], "name": r["name"], "rows": r["rows"], "files": list(r["files"]),
                         "members": [int(m) for m in r["members"]],
                         "mean_intra_cosine": mean_pairwise_cosine(vec, r["rows"]),
                         "mean_cos_to_centroid": r["mean_cos_to_centroid"],
                         "samples": list(r["samples"])})
    if n_total != int(counts.sum()):
        raise RuntimeError(f"Shard row count {n_total} != assigned rows {int(counts.sum())}: rerun `shard`.")
    stats = {"k": k, "shards": len(clusters), "rows": n_total, "files": sum(len(c["files"]) for c in clusters),
             "min_rows": min(c["rows"] for c in clusters), "max_rows": max(c["rows"] for c in clusters),
             "overall_mean_cosine": mean_pairwise_cosine(total_sum, n_total), "wall_s": round(time.time() - started, 3)}
    stats["worker_s"] = stats["wall_s"]
    manifest = {"k": k, "fingerprint": fingerprint, "global_batch_size": cfg.train.global_batch_size,
                "row_group_rows": row_group_rows, "rows_per_file": rows_per_file,
                "small_cluster_policy": cfg.shard.small_cluster_policy, "seed": cfg.cluster.seed,
                "original_counts": counts.tolist(), "moved": {str(a): b for a, b in plan["moved"].items()},
                "empty_clusters": np.flatnonzero(counts == 0).tolist(), "clusters": clusters, "stats": stats}
    run.write_json(manifest_path(k), manifest)
    moved = f", {len(plan['moved'])} small cluster(s) -> {cfg.shard.small_cluster_policy}" if plan["moved"] else ""
    print(f"[shard] {n_total} rows into {len(clusters)} shards ({stats['files']} files), sizes "
          f"{stats['min_rows']}..{stats['max_rows']}{moved}", flush=True)
    moved_rows = int(sum(counts[int(c)] for c in plan["moved"]))
    if moved_rows > n_total / 2:
        print(f"[shard] warning: {moved_rows} of {n_total} rows ({moved_rows / n_total:.0%}) were in clusters smaller "
              f"than one global batch ({cfg.train.global_batch_size}) and went to "
              f"{'the pool' if plan['pool_id'] is not None else 'the nearest large cluster'}: the shards no longer "
              f"follow the clustering. Lower cluster.k (about rows / (4 x batch) = "
              f"{max(1, n_total // (4 * cfg.train.global_batch_size))} here) or train.global_batch_size.", flush=True)
    return StageResult(stats)


def cluster_table(manifest: dict, num_samples: int = 3) -> dict:
    """The paper's Table 1 for one k: rows and mean intra-cluster cosine per shard, the whole-dataset
    mean cosine, and a few sample queries per shard (the paper's Appendix B)."""
    clusters = [{"cluster": c["name"], "rows": c["rows"], "members": c["members"],
                 "mean_intra_cosine": c["mean_intra_cosine"], "mean_cos_to_centroid": c["mean_cos_to_centroid"],
                 "sample_queries": c["samples"][:num_samples]} for c in manifest["clusters"]]
    return {"k": manifest["k"], "rows": manifest["stats"]["rows"], "shards": len(clusters),
            "overall_mean_cosine": manifest["stats"]["overall_mean_cosine"],
            "small_cluster_policy": manifest["small_cluster_policy"], "moved": manifest["moved"],
            "clusters": clusters}


def format_cluster_table(table: dict) -> str:
    overall = table["overall_mean_cosine"]
    lines = [f"k={table['k']}: {table['rows']} rows in {table['shards']} shards; whole-dataset mean cosine "
             + ("-" if overall is None else f"{overall:.3f}")]
    if table["moved"]:
        lines.append(f"small clusters ({table['small_cluster_policy']}): "
                     + ", ".join(f"{a}->{'pool' if b == table['k'] else b}" for a, b in table["moved"].items()))
    lines.append(f"{'cluster':>8} {'rows':>9} {'intra cos':>9}  sample queries")
    for c in table["clusters"]:
        intra = "-" if c["mean_intra_cosine"] is None else f"{c['mean_intra_cosine']:.3f}"
        lines.append(f"{c['cluster']:>8} {c['rows']:>9} {intra:>9}  "
                     + " | ".join(q[:60] for q in c["sample_queries"]))
    return "\n".join(lines)

