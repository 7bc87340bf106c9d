"""Embed: one frozen-encoder pass over pairs/ with a Ray Data actor pool, writing embeddings/.

Every output row is the pair's columns plus `emb`: fixed_size_list<float16>[d], L2-normalised.
Run with `clusterscale embed [CONFIG] --run-dir R` (after `ingest`).
"""
from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import ray

from clusterscale.config import Config, EmbedConfig
from clusterscale.encoder import Encoder
from clusterscale.rundir import RunDir


class EmbeddingError(RuntimeError):
    """The encoder produced unusable vectors; the message names the rows."""


def emb_array(vectors: np.ndarray) -> pa.FixedSizeListArray:
    """(n, d) float -> fixed_size_list<float16>[d]."""
    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float16).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])


def emb_matrix(column: pa.ChunkedArray | pa.Array, dtype=np.float32) -> np.ndarray:
    """fixed_size_list<float>[d] column -> (n, d) array without a Python loop."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    d = column.type.list_size
    return column.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(-1, d)


class EmbedBatches:
    """Ray Data callable class: one encoder replica per actor, embeds the configured side."""

    def __init__(self, embed: dict):
        self.cfg = EmbedConfig(**embed)
        self.encoder = Encoder(self.cfg.model, pooling=self.cfg.pooling, max_length=self.cfg.max_length,
                               trust_remote_code=self.cfg.trust_remote_code, threads=self.cfg.threads_per_actor)

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column(self.cfg.side).to_pylist()
        vectors = self.encoder.encode(texts, batch_size=self.cfg.batch_size)
        bad = ~np.isfinite(vectors).all(axis=1)
        if bad.any():
            ids = batch.column("pair_id").to_numpy()[bad][:20].tolist()
            raise EmbeddingError(f"The encoder produced NaN/inf vectors for {int(bad.sum())} rows (pair_ids "
                                 f"{ids}...): the checkpoint at embed.model={self.cfg.model!r} is broken.")
        out = batch.append_column("emb", emb_array(vectors))
        return out.append_column("truncated", pa.array(self.encoder.last_truncated))


def actor_pool_size(cfg: EmbedConfig) -> tuple[int, dict]:
    """(actors, ray_remote_args): one per GPU, else one per CPU with room left for read/write tasks."""
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if gpus:
        return cfg.num_actors or gpus, {"num_gpus": 1}
    cpus = int(resources.get("CPU", 1))
    # Fractional CPUs: whole-CPU actors on a small box starve the read tasks (a known Ray Data deadlock).
    return cfg.num_actors or max(1, cpus // cfg.threads_per_actor), {"num_cpus": 0.5 * cfg.threads_per_actor}


def run_embed(cfg: Config, run: RunDir) -> dict:
    fingerprint = cfg.fingerprint(("data", "embed"))
    run.require("pairs", "ingest", "Ingested pairs")
    if run.is_done("embeddings", fingerprint):
        return run.done_stats("embeddings")
    run.begin("embeddings")
    started = time.time()
    files = run.files("pairs")
    n_rows = run.done_stats("pairs")["pairs"]
    actors, remote_args = actor_pool_size(cfg.embed)
    ds = ray.data.read_parquet(files, filesystem=run.fs)
    # Small inputs arrive as one block: split so that every actor has work.
    ds = ds.repartition(max(actors * 4, n_rows // 20_000 + 1))
    ds = ds.map_batches(EmbedBatches, fn_constructor_kwargs={"embed": cfg.to_dict()["embed"]},
                        batch_size=max(cfg.embed.batch_size * 4, 256), batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=actors), **remote_args)
    ds.write_parquet(run.path("embeddings"), filesystem=run.fs)
    truncated = _count_truncated(run)
    wall = time.time() - started
    stats = {"rows": n_rows, "truncated": truncated, "actors": actors, "wall_s": round(wall, 3),
             "rows_per_s": round(n_rows / wall, 2), "worker_s": round(wall * actors, 3),
             "device": "gpu" if "num_gpus" in remote_args else "cpu"}
    run.mark_done("embeddings", fingerprint, stats, {"embed": cfg.to_dict()["embed"]})
    print(f"[embed] {n_rows} rows in {wall:.1f}s ({n_rows / wall:.1f} rows/s, {actors} actor(s), "
          f"{stats['worker_s']:.0f} {stats['device']}-actor-seconds); {truncated} texts truncated at "
          f"{cfg.embed.max_length} tokens", flush=True)
    return stats


def _count_truncated(run: RunDir) -> int:
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    dataset = pads.dataset(run.files("embeddings"), filesystem=run.fs, format="parquet")
    return int(sum(pc.sum(b.column("truncated").cast(pa.int64())).as_py() or 0
                   for b in dataset.to_batches(columns=["truncated"])))
