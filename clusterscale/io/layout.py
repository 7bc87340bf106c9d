"""The stages by name and where their outputs live in a run directory: what every stage and reader agree on."""
from __future__ import annotations

import os
import shutil
import tempfile

from clusterscale.io.rundir import RunDir

# The stages in pipeline order (clusterscale.pipeline runs them; costs and the report group by them).
STAGES = ("ingest", "embed", "fit", "assign", "shard", "mine", "train", "evaluate", "report")
PREPROCESS = STAGES[:STAGES.index("mine")]  # what compare and sweep share across their arms
PER_K_STAGES = STAGES[STAGES.index("fit"):STAGES.index("mine")]  # one output per cluster.k (kmeans/k=<k>/ ...)
NEGATIVES = "negatives"  # mined hard negatives, one Parquet file per embeddings file


def kmeans_dir(k: int) -> str:
    return f"kmeans/k={k}"


def assign_dir(k: int) -> str:
    return f"assign/k={k}"


def shards_dir(k: int) -> str:
    return f"shards/k={k}"


def load_manifest(run: RunDir, k: int) -> dict:
    run.require(shards_dir(k), "shard", f"Shards for k={k}")
    return run.read_json(f"{shards_dir(k)}/manifest.json")


def local_model_dir(run: RunDir, name: str) -> str:
    """A local folder with the exported model (downloaded from an object store when needed)."""
    if run.is_local:
        return run.path(f"train/{name}/model")
    target = tempfile.mkdtemp(prefix=f"clusterscale-{name}-")
    prefix = run.path(f"train/{name}/model")
    for f in run.files(f"train/{name}/model", suffix=""):
        rel = os.path.relpath(f, prefix)
        os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
        with run.fs.open_input_stream(f) as src, open(os.path.join(target, rel), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target
