"""The quick start as a newcomer types it: relative --run-dir, data.path and model folder, from another working
directory, through train and evaluate; then `compare` on the finished run reuses its embeddings, and evaluate
again keeps its cost record. conftest's shared_run is made exactly that way; these tests check what it did."""
from __future__ import annotations

import yaml

from tests.conftest import shard_ids


def test_relative_paths_through_train_evaluate_and_compare(shared_run, tiny_model):
    run = shared_run.run
    config = yaml.safe_load(run.read_bytes("config.yaml"))
    assert config["data"]["path"] == str(shared_run.base / "data" / "pairs.parquet")
    assert config["embed"]["model"] == config["train"]["init"] == tiny_model
    assert run.exists("train/clustered-seed0/model/model.safetensors") and run.exists("eval/clustered-seed0.json")
    pairs, heldout, shards = shard_ids(run, "pairs"), shard_ids(run, "heldout"), shard_ids(run, "shards/k=4")
    quarantined = run.done_stats("pairs")["quarantine"]
    assert sorted(shards) == sorted(pairs) and len(pairs) + len(heldout) + quarantined == shared_run.rows_in

    # `compare --samplers clustered,random` without --set ran on the finished run: its config.yaml's 6 steps.
    assert run.read_json("embeddings/_DONE.json")["finished_at"] == shared_run.embedded_at  # one embedding pass
    assert run.read_json("train/clustered-seed0/_DONE.json") == shared_run.trained  # the main training untouched
    assert run.read_json("train/compare-random-seed0/_DONE.json")["stats"]["steps"] == 6
    assert sorted(shard_ids(run, "shards/k=4")) == sorted(pairs)
    assert sorted(shard_ids(run, "shards/k=4/random")) == sorted(pairs)  # compare's random arm: its own shard set

    # Evaluating again reused both cached results (the frozen encoder's and the model's): the cost record keeps
    # the figures of the invocation that did the work instead of the reuse's fraction of a second.
    assert run.read_json("report/costs.json")["evaluate"] == shared_run.evaluate_cost
