"""The quick start as a newcomer types it: relative --run-dir, data.path and model folder, from another working
directory, through train and evaluate; then `compare` on the finished run reuses its embeddings, and evaluate
again keeps its cost record."""
from __future__ import annotations

import os

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import yaml

from clusterscale import cli
from clusterscale.io.rundir import RunDir
from tests.conftest import make_pairs, tiny_overrides


def _ids(run: RunDir, folder: str) -> list[int]:
    """pair_ids of folder's Parquet files, not of the shard sets in its subfolders (shards/k=<k>/random/)."""
    sets = ("/random/", "/random_clusters/", "/source/")
    files = [f for f in run.files(folder) if not any(s in f[len(run.path(folder)):] for s in sets)]
    return pads.dataset(files, format="parquet").to_table(columns=["pair_id"]).column("pair_id").to_pylist()


def test_relative_paths_through_train_evaluate_and_compare(tmp_path, tiny_model, ray_local, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("data")
    pq.write_table(make_pairs(240), "data/pairs.parquet")
    overrides = tiny_overrides(os.path.relpath(tiny_model), "data/pairs.parquet") + ["train.log_batches=false"]
    assert cli.main(["run", "--run-dir", "runs/x", "--set", *overrides]) == 0

    run = RunDir(str(tmp_path / "runs" / "x"))
    config = yaml.safe_load(run.read_bytes("config.yaml"))
    assert config["data"]["path"] == str(tmp_path / "data" / "pairs.parquet")
    assert config["embed"]["model"] == config["train"]["init"] == tiny_model
    assert run.exists("train/clustered-seed0/model/model.safetensors") and run.exists("eval/clustered-seed0.json")
    pairs, heldout, shards = _ids(run, "pairs"), _ids(run, "heldout"), _ids(run, "shards/k=4")
    assert sorted(shards) == sorted(pairs) and len(pairs) + len(heldout) == 240

    embedded = run.read_json("embeddings/_DONE.json")["finished_at"]
    trained = run.read_json("train/clustered-seed0/_DONE.json")
    assert cli.main(["compare", "--run-dir", "runs/x", "--samplers", "random", "--seeds", "1"]) == 0
    assert run.read_json("embeddings/_DONE.json")["finished_at"] == embedded  # one embedding pass
    assert run.read_json("train/clustered-seed0/_DONE.json") == trained  # the main training untouched
    assert run.read_json("train/compare-random-seed0/_DONE.json")["stats"]["steps"] == 6
    assert sorted(_ids(run, "shards/k=4")) == sorted(pairs)
    assert sorted(_ids(run, "shards/k=4/random")) == sorted(pairs)  # compare's random arm: its own shard set

    # Evaluating again reuses both cached results (the frozen encoder's and the model's): the cost record keeps
    # the figures of the invocation that did the work instead of the reuse's fraction of a second.
    evaluated = run.read_json("report/costs.json")["evaluate"]
    assert cli.main(["evaluate", "--run-dir", "runs/x"]) == 0
    assert run.read_json("report/costs.json")["evaluate"] == evaluated
