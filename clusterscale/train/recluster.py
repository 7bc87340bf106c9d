"""Re-clustering during training (train.recluster_every): training runs in segments of N steps.

After each segment the driver exports the current model, re-embeds every training pair with it,
re-fits k-means and re-assigns and re-shards (the ordinary embed, fit, assign and shard stages, run
as Ray work while training waits) into train/<name>/recluster/seg-<s>/, a child run directory with
its own done markers, so a killed run redoes only what is missing. Segment s then trains on those
shards, continuing from the checkpoint (model, optimizer, LR schedule). The batches of a segment
are a pure function of (seed, segment, epoch within the segment) and its shards.
"""
from __future__ import annotations

import hashlib
import time

from clusterscale.config import Config, variant
from clusterscale.stages.embed import run_embed
from clusterscale.stages.kmeans import run_assign, run_fit
from clusterscale.io.layout import train_dir
from clusterscale.io.rundir import RunDir
from clusterscale.stages.shards import run_shard


def segment_bounds(num_steps: int, every: int) -> list[tuple[int, int]]:
    """[(first step, stop step)] of each segment; one segment when re-clustering is off."""
    if not every or every >= num_steps:
        return [(0, num_steps)]
    return [(s, min(s + every, num_steps)) for s in range(0, num_steps, every)]


def segment_seed(seed: int, segment: int) -> int:
    """The schedule seed of a segment; segment 0 keeps the run's seed (same batches as without re-clustering)."""
    if segment == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/segment/{segment}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def segment_dir(name: str, segment: int) -> str:
    return f"{train_dir(name)}/recluster/seg-{segment}"


def recluster(cfg: Config, run: RunDir, name: str, segment: int, model_dir: str) -> tuple[RunDir, dict]:
    """Embed, fit, assign and shard the training pairs with the model at `model_dir` into the segment's
    child run directory; returns (child run, seconds and worker-seconds per stage)."""
    child = RunDir(run.child_uri(segment_dir(name, segment)))
    child_cfg = variant(cfg, embed={"model": model_dir, "pooling": "auto"})
    costs = {}
    print(f"[recluster] segment {segment}: re-embedding, re-fitting (k={cfg.cluster.k}) and re-sharding the "
          f"training pairs with the model after step {segment_start_step(cfg, segment)}", flush=True)
    for stage, fn in (("embed", lambda: run_embed(child_cfg, child, pairs_run=run)),
                      ("fit", lambda: run_fit(child_cfg, child)), ("assign", lambda: run_assign(child_cfg, child)),
                      ("shard", lambda: run_shard(child_cfg, child))):
        started = time.time()
        stats = fn()
        costs[stage] = {"wall_s": round(time.time() - started, 3), "worker_s": float(stats.get("worker_s", 0.0))}
        run.record_cost(f"recluster:{name}:seg-{segment}:{stage}",
                        {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
                        | {"invocation_s": costs[stage]["wall_s"]})
    return child, costs


def segment_start_step(cfg: Config, segment: int) -> int:
    return segment * cfg.train.recluster_every
