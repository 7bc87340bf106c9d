"""Where the stages' outputs live in a run directory: what every stage and reader agree on.

The stages themselves are listed once, in clusterscale.pipeline.STAGES."""
from __future__ import annotations

import os
import shutil
import tempfile

from clusterscale.io.rundir import RunDir

NEGATIVES = "negatives"  # mined hard negatives, one Parquet file per embeddings file
TRAIN = "train"  # training runs: train/<name>/
EVAL = "eval"  # evaluation results: eval/<model>.json, eval/mteb/, eval/by_cluster/
MTEB_EVAL = f"{EVAL}/mteb"  # eval/mteb/<model>.json
# The dedup stage's output, for one clustering at a time (its semantic pass is per cluster of cluster.k, and the
# done marker's stats carry that k): dedup/_DONE.json (counts), removed/ (pair_id, duplicate_of, similarity,
# reason, cluster) and kept/ (every column of assign/k=<k>/ for the kept rows, with its own marker: what shard
# reads when dedup is on). Dedup at another clustering replaces it (executor.Stage.one_clustering).
DEDUP = "dedup"
DEDUP_REMOVED = f"{DEDUP}/removed"
DEDUP_KEPT = f"{DEDUP}/kept"


def kmeans_dir(k: int) -> str:
    return f"kmeans/k={k}"


def assign_dir(k: int) -> str:
    return f"assign/k={k}"


def shards_dir(k: int) -> str:
    return f"shards/k={k}"


def shard_set_dir(k: int, sampler: str) -> str:
    """The shards a sampler trains from: shards/k=<k>/ itself for `clustered`, shards/k=<k>/<sampler>/ (a set
    written from the clustered shards, with its own manifest and done marker) for the other samplers."""
    return shards_dir(k) if sampler == "clustered" else f"{shards_dir(k)}/{sampler}"


DEDUP_SET = "dedup"  # the clustered shards of the deduplicated pairs (train.dedup=true)


def dedup_set_dir(k: int) -> str:
    """shards/k=<k>/dedup/: the clustered shards of the pairs dedup kept (train.dedup=true)."""
    return shard_set_dir(k, DEDUP_SET)


def training_set(sampler: str, dedup: bool) -> str:
    """The name (for shard_set_dir) of the set a training run reads: its sampler's, or DEDUP_SET with train.dedup."""
    return DEDUP_SET if dedup else sampler


def shard_set_manifest_path(k: int, sampler: str) -> str:
    return f"{shard_set_dir(k, sampler)}/manifest.json"


def centroids_path(k: int) -> str:
    return f"{kmeans_dir(k)}/centroids.npy"


def fit_stats_path(k: int) -> str:
    return f"{kmeans_dir(k)}/fit_stats.json"


def manifest_path(k: int) -> str:
    """shards/k=<k>/manifest.json: per-cluster rows and files, written last by the shard stage."""
    return f"{shards_dir(k)}/manifest.json"


def train_dir(name: str) -> str:
    """train/<name>/: one training run (checkpoints under ray/, metrics, the exported model)."""
    return f"{TRAIN}/{name}"


def model_dir(name: str) -> str:
    """The exported model of training run `name` (a sentence-transformers folder)."""
    return f"{train_dir(name)}/model"


def metrics_path(name: str) -> str:
    """Rank 0's per-step records of training run `name`."""
    return f"{train_dir(name)}/metrics.jsonl"


def batches_path(name: str, rank: int) -> str:
    """The pair_ids rank `rank` trained on per step (train.log_batches)."""
    return f"{train_dir(name)}/batches/rank-{rank}.jsonl"


def collapse_path(name: str) -> str:
    """Written when training run `name` collapsed (see train.stop_on_collapse)."""
    return f"{train_dir(name)}/collapse.json"


def eval_path(name: str) -> str:
    """Held-out retrieval metrics of a model: a training run's name, or 'frozen' for the frozen encoder."""
    return f"{EVAL}/{name}.json"


def mteb_eval_path(model_name: str) -> str:
    return f"{MTEB_EVAL}/{model_name}.json"


def eval_clusters_path(k: int) -> str:
    """The nearest centroid of kmeans/k=<k>/ of each held-out pair (cached by evaluate)."""
    return f"{EVAL}/clusters/k={k}.json"


def eval_by_cluster_path(k: int) -> str:
    """NDCG@10 per cluster of kmeans/k=<k>/ for every evaluated model."""
    return f"{EVAL}/by_cluster/k={k}.json"


def load_manifest(run: RunDir, k: int) -> dict:
    run.require(shards_dir(k), "shard", f"Shards for k={k}")
    return run.read_json(manifest_path(k))


def local_model_dir(run: RunDir, name: str) -> str:
    """A local folder with the exported model (downloaded from an object store when needed)."""
    if run.is_local:
        return run.path(model_dir(name))
    target = tempfile.mkdtemp(prefix=f"clusterscale-{name}-")
    prefix = run.path(model_dir(name))
    for f in run.files(model_dir(name), suffix=""):
        rel = os.path.relpath(f, prefix)
        os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
        with run.fs.open_input_stream(f) as src, open(os.path.join(target, rel), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target
