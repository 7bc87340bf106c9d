"""Where the stages' outputs live in a run directory, and the rules of the shard files: what every writer
(stages/shards.py, stages/shard_sets.py) and reader (train/) agree on.

The stages themselves are listed once, in clusterscale.pipeline.STAGES."""
from __future__ import annotations

import os
import posixpath
import re
import shutil
import tempfile

from clusterscale.errors import UserError
from clusterscale.io.records import ShardManifest
from clusterscale.io.rundir import RunDir, StageMissingError, UnreadableFileError

HELDOUT_EMBEDDINGS = "embeddings_heldout"  # the held-out pairs' frozen vectors (embed_heldout; dedup's leak check)
NEGATIVES = "negatives"  # mined hard negatives, one Parquet file per embeddings file
TRAIN = "train"  # training runs: train/<name>/
EVAL = "eval"  # evaluation results: eval/<model>.json, eval/mteb/, eval/by_cluster/
PREDICTION_PATH = "report/plan_prediction.json"  # written by `clusterscale plan ... --save-in RUN`, read by report
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
    """The shards of a set (train/samplers: a sampler's `sets`): shards/k=<k>/ itself for `clustered`,
    shards/k=<k>/<name>/ (a set written from the clustered shards, with its own manifest and done marker) else."""
    return shards_dir(k) if sampler == "clustered" else f"{shards_dir(k)}/{sampler}"


DEDUP_SET = "dedup"  # the clustered shards of the deduplicated pairs (train.dedup=true)


def dedup_set_dir(k: int) -> str:
    """shards/k=<k>/dedup/: the clustered shards of the pairs dedup kept (train.dedup=true)."""
    return shard_set_dir(k, DEDUP_SET)


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


# --- the shard files ---------------------------------------------------------------------------------------
def shard_file(folder: str, partition: str, name: str, sub_group: int, part: int) -> str:
    """One file of a shard set: <folder>/<partition>=<shard name>/part-<sub-group>-<part>.parquet (partition:
    `cluster` for the clustered sets, `stratum` for a sampler's). Sub-group then part in the name: a shard's files
    sort into their manifest order."""
    return f"{folder}/{partition}={name}/part-{sub_group:05d}-{part:05d}.parquet"


def row_group_rows_for(global_batch_size: int) -> int:
    """The Parquet row-group size of the shards: the largest divisor of the global batch that is at most
    max(32, global_batch_size // 64) rows.

    The world size is not known when the shards are written. A global batch is whole row groups, so rank r's
    slice of b = global_batch_size / world_size rows is whole row groups whenever world_size divides
    global_batch_size / row_group_rows (any power of two up to 64 for a batch that 64 divides), and otherwise
    touches at most b / row_group_rows + 1 groups: <= 2x the bytes used while b >= 2 x row_group_rows. The floor
    of 32 rows keeps the footer (~0.4 KB per row group) small next to the data when batches are small; the price
    is whole-group reads when a rank's slice is under 32 rows."""
    cap = max(32, global_batch_size // 64)
    return max(d for d in range(1, min(cap, global_batch_size) + 1) if global_batch_size % d == 0)


class TrainDataError(UserError, ValueError):
    """The shards cannot feed this training config; the message says why and what to do."""


def read_manifest(run: RunDir, path: str) -> ShardManifest:
    """The manifest at `path`; one that does not parse (cut short, overwritten) is an UnreadableFileError naming it
    and what writes it again: `clusterscale shard --replace` for the clustered shards, train for a sampler's set."""
    folder = posixpath.dirname(path)
    advice = run.rebuild_advice(folder, "shard") if re.fullmatch(r"shards/k=\d+", folder) else (
        f"delete {folder}/ and rerun `clusterscale train` (it writes that shard set again from the clustered shards)")
    data = run.read_json(path, advice)
    try:
        return ShardManifest.from_json(data)
    except (KeyError, TypeError, AttributeError) as err:
        raise UnreadableFileError.of(run, path, f"not a shard manifest ({type(err).__name__}: {err})",
                                     advice) from None


def load_manifest(run: RunDir, k: int) -> ShardManifest:
    run.require(shards_dir(k), "shard", f"Shards for k={k}")
    return read_manifest(run, manifest_path(k))


def checked_manifest(run: RunDir, k: int, global_batch_size: int) -> ShardManifest:
    """The manifest of the clustered shards shards/k=<k>/, after checking it matches the config and its files
    exist (the driver checks; training ranks only read it)."""
    if not run.exists(manifest_path(k)) and run.exists(shards_dir(k), "_DONE.json"):
        raise StageMissingError(f"{run.path(manifest_path(k))} is missing although the shard stage "
                                f"is marked done: delete {shards_dir(k)}/ and rerun `clusterscale shard`.")
    manifest = load_manifest(run, k)
    if manifest.k != k:
        raise TrainDataError(f"The manifest in {shards_dir(k)}/ was written for cluster.k={manifest.k}, not "
                             f"cluster.k={k}: it was copied or moved; rerun `clusterscale shard` with cluster.k={k}.")
    _check_set(run, manifest, shards_dir(k), global_batch_size, "clusterscale shard")
    sizes = manifest.strata_sizes
    if not sizes or max(sizes) < global_batch_size:
        raise TrainDataError(f"train.global_batch_size={global_batch_size} is larger than every shard (largest "
                             f"{max(sizes, default=0)} rows): lower it or cluster.k.")
    return manifest


def _check_set(run: RunDir, manifest: ShardManifest, folder: str, global_batch_size: int, rerun: str) -> None:
    if manifest.global_batch_size != global_batch_size:
        raise TrainDataError(f"The shards under {folder} were planned for train.global_batch_size="
                             f"{manifest.global_batch_size}, not {global_batch_size}: rerun `clusterscale shard` "
                             f"with this batch size in a new --run-dir, or keep the batch size.")
    missing = missing_files(run, manifest.files)
    if missing:
        raise StageMissingError(f"{len(missing)} shard file(s) listed in the manifest are missing (first: "
                                f"{run.path(missing[0])}): delete {folder}/ and rerun `{rerun}`.")


def missing_files(run: RunDir, files: list[str]) -> list[str]:
    """The files (relative to the run) not on its filesystem, from one recursive listing of their common folder:
    a request per file took 10-25 min at 25k shard files on an object store, the listing ~1 request per 1,000."""
    if not files:
        return []
    folder = posixpath.commonpath([posixpath.dirname(f) for f in files])
    listed = run.files(*([folder] if folder else []), suffix="", include_private=True)
    present = {posixpath.relpath(p, run.root) for p in listed}
    return [f for f in files if f not in present]


def shard_set_manifest(run: RunDir, k: int, global_batch_size: int, sampler: str,
                       check_files: bool = True) -> ShardManifest:
    """The manifest of the shard set `sampler` trains from. check_files (the driver, once per run): it matches
    the config and every file it lists exists; training ranks skip that and read the manifest only."""
    if sampler == "clustered" and check_files:
        return checked_manifest(run, k, global_batch_size)
    folder = shard_set_dir(k, sampler)
    if not run.exists(folder, "_DONE.json"):
        raise StageMissingError(f"The shards of train.sampler={sampler} are not in {run.path(folder)}: "
                                f"`clusterscale train` writes them from the clustered shards before training (run "
                                f"it with the same config and --run-dir).")
    manifest = read_manifest(run, shard_set_manifest_path(k, sampler))
    if check_files:
        _check_set(run, manifest, folder, global_batch_size, "clusterscale train")
    return manifest


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
