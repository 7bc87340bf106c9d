"""Fit spherical k-means on a seeded sample of embeddings/, and assign every row to its nearest centroid.

fit:    kmeans/k=<k>/centroids.npy + fit_stats.json   (`clusterscale fit`, after `embed`)
assign: assign/k=<k>/  = embeddings rows + cluster:int32 + cos:float32 (`clusterscale assign`)
"""
from __future__ import annotations

import io
import time

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import ray

from clusterscale.config import Config
from clusterscale.embed import emb_matrix
from clusterscale.ingest import hash_unit
from clusterscale.rundir import RunDir


class ClusteringError(ValueError):
    """k-means cannot run on this input; the message names the cause and the fix."""


def kmeans_dir(k: int) -> str:
    return f"kmeans/k={k}"


def assign_dir(k: int) -> str:
    return f"assign/k={k}"


def check_vectors(x: np.ndarray, where: str, dim: int | None = None) -> None:
    if x.ndim != 2 or x.shape[0] == 0:
        raise ClusteringError(f"No embeddings in {where}: run `clusterscale embed` first.")
    if dim is not None and x.shape[1] != dim:
        raise ClusteringError(f"Embeddings in {where} have dimension {x.shape[1]}, the centroids {dim}: they "
                              f"come from different encoders; re-run `clusterscale fit` for this embed.model.")
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        raise ClusteringError(f"{int(bad.sum())} embedding rows in {where} hold NaN/inf: re-run "
                              f"`clusterscale embed` with a working encoder.")


def read_fit_sample(run: RunDir, k: int, max_points_per_centroid: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows whose seeded hash of pair_id is among the smallest min(N, mppc*k): (pair_ids, vectors)."""
    dataset = pads.dataset(run.files("embeddings"), filesystem=run.fs, format="parquet")
    ids = dataset.to_table(columns=["pair_id"]).column("pair_id").to_numpy()
    n_sample = min(len(ids), max_points_per_centroid * k)
    if k > len(ids):
        raise ClusteringError(f"cluster.k={k} is larger than the number of embedded pairs ({len(ids)}): "
                              f"lower cluster.k or ingest more data.")
    keys = hash_unit(ids, salt=seed)
    threshold = np.partition(keys, n_sample - 1)[n_sample - 1]
    chosen_ids, chunks = [], []
    for batch in dataset.to_batches(columns=["pair_id", "emb"]):
        keep = hash_unit(batch.column("pair_id").to_numpy(), salt=seed) <= threshold
        if keep.any():
            chosen_ids.append(batch.column("pair_id").to_numpy()[keep])
            chunks.append(emb_matrix(batch.column("emb"))[keep])
    sample_ids = np.concatenate(chosen_ids)
    order = np.argsort(sample_ids)  # a fixed row order makes the fit independent of file layout
    return sample_ids[order], np.concatenate(chunks)[order]


def fit_spherical_kmeans(x: np.ndarray, k: int, niter: int, seed: int) -> tuple[np.ndarray, dict]:
    """faiss spherical k-means on x (rows L2-normalised). Returns (centroids, stats)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    check_vectors(x, "the fit sample")
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, spherical=True,
                      max_points_per_centroid=max(1, -(-len(x) // k)), min_points_per_centroid=1, verbose=False)
    km.train(x)
    sims, labels = km.index.search(x, 1)
    counts = np.bincount(labels[:, 0], minlength=k)
    stats = {"objective": float(sims.sum()), "objective_per_iteration": [float(o) for o in km.obj],
             "imbalance_factor": float(k * np.square(counts).sum() / max(1, counts.sum()) ** 2),
             "empty_clusters": int((counts == 0).sum())}
    return km.centroids.astype(np.float32), stats


def run_fit(cfg: Config, run: RunDir) -> dict:
    k = cfg.cluster.k
    fingerprint = cfg.fingerprint(("data", "embed", "cluster"))
    run.require("embeddings", "embed", "Embeddings")
    out = kmeans_dir(k)
    if run.is_done(out, fingerprint):
        return run.done_stats(out)
    run.begin(out)
    started = time.time()
    ids, x = read_fit_sample(run, k, cfg.cluster.max_points_per_centroid, cfg.cluster.seed)
    fit_started = time.time()
    centroids, stats = fit_spherical_kmeans(x, k, cfg.cluster.niter, cfg.cluster.seed)
    fit_s = time.time() - fit_started
    buf = io.BytesIO()
    np.save(buf, centroids)
    run.write_bytes(f"{out}/centroids.npy", buf.getvalue())
    stats.update({"k": k, "niter": cfg.cluster.niter, "seed": cfg.cluster.seed, "n_sample": int(len(x)),
                  "dim": int(x.shape[1]), "seconds_per_iteration": round(fit_s / cfg.cluster.niter, 4),
                  "wall_s": round(time.time() - started, 3)})
    stats["worker_s"] = stats["wall_s"]
    run.write_json(f"{out}/fit_stats.json", stats)
    run.mark_done(out, fingerprint, stats, {"cluster": cfg.to_dict()["cluster"]})
    print(f"[fit] k={k} on {len(x)} sampled vectors (d={x.shape[1]}): objective {stats['objective']:.1f}, "
          f"imbalance {stats['imbalance_factor']:.2f}, {stats['wall_s']:.1f}s", flush=True)
    return stats


def load_centroids(run: RunDir, k: int) -> np.ndarray:
    return np.load(io.BytesIO(run.read_bytes(f"{kmeans_dir(k)}/centroids.npy")))


class AssignBatches:
    """Ray Data callable class: nearest centroid by inner product (faiss IndexFlatIP) and its cosine."""

    def __init__(self, centroids: np.ndarray):
        self.index = faiss.IndexFlatIP(centroids.shape[1])
        self.index.add(np.ascontiguousarray(centroids, dtype=np.float32))

    def __call__(self, batch: pa.Table) -> pa.Table:
        x = emb_matrix(batch.column("emb"))
        check_vectors(x, "embeddings/", dim=self.index.d)
        sims, labels = self.index.search(x, 1)
        return batch.append_column("cluster", pa.array(labels[:, 0].astype(np.int32))).append_column(
            "cos", pa.array(sims[:, 0].astype(np.float32)))


def run_assign(cfg: Config, run: RunDir) -> dict:
    k = cfg.cluster.k
    fingerprint = cfg.fingerprint(("data", "embed", "cluster"))
    run.require(kmeans_dir(k), "fit", f"Centroids for k={k}")
    out = assign_dir(k)
    if run.is_done(out, fingerprint):
        return run.done_stats(out)
    run.begin(out)
    started = time.time()
    centroids = load_centroids(run, k)
    n_rows = run.done_stats("embeddings")["rows"]
    cpus = int(ray.cluster_resources().get("CPU", 1))
    ds = ray.data.read_parquet(run.files("embeddings"), filesystem=run.fs)
    ds = ds.map_batches(AssignBatches, fn_constructor_args=(centroids,), batch_size=65_536,
                        batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(min_size=1, max_size=cpus),
                        num_cpus=0.5)
    ds.write_parquet(run.path(out), filesystem=run.fs)
    wall = time.time() - started
    stats = {"k": k, "rows": n_rows, "wall_s": round(wall, 3), "rows_per_s": round(n_rows / wall, 1),
             "worker_s": round(wall, 3)}
    run.mark_done(out, fingerprint, stats)
    print(f"[assign] {n_rows} rows to {k} centroids in {wall:.1f}s", flush=True)
    return stats
