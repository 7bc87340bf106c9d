"""End to end on local Ray with tiny data: every stage for real, and the run-directory contract."""
from __future__ import annotations

import json
import math

import pyarrow.dataset as pads
import pytest
import yaml

from clusterscale import cli
from tests.conftest import shard_ids, tiny_overrides


def _ids(run, folder):
    files = run.files(folder)
    if not files:
        return []
    return pads.dataset(files, format="parquet").to_table(columns=["pair_id"]).column("pair_id").to_pylist()


def _ids_of(run, files):
    return pads.dataset([run.path(f) for f in files], format="parquet").to_table(columns=["pair_id"]) \
        .column("pair_id").to_pylist()


@pytest.fixture(scope="module")
def finished_run(shared_run):
    """conftest's shared run: `run` on 300 pairs + 3 bad rows, then compare, train and report on it."""
    return shared_run.run, shared_run.rows_in


def test_every_row_lands_exactly_once(finished_run):
    run, n_rows = finished_run
    pairs, held, quarantined = _ids(run, "pairs"), _ids(run, "heldout"), _ids(run, "quarantine")
    sharded = shard_ids(run, "shards/k=4")  # the run's shards (compare's random arm has its own set beside them)
    assert len(quarantined) == 3
    assert sorted(pairs) == sorted(sharded)  # every training pair is in exactly one shard
    everything = held + quarantined + sharded
    assert len(everything) == len(set(everything)) == n_rows
    reasons = pads.dataset(run.files("quarantine"), format="parquet").to_table().column("reason").to_pylist()
    assert sorted(reasons) == ["passage_null", "query_empty", "query_empty"]


def test_manifest_matches_disk(finished_run):
    run, _ = finished_run
    manifest = run.read_json("shards/k=4/manifest.json")
    assigned = pads.dataset(run.files("assign/k=4"), format="parquet").to_table(columns=["pair_id", "cluster"])
    cluster_of = dict(zip(*(assigned.column(name).to_pylist() for name in ("pair_id", "cluster"))))
    for c in manifest["clusters"]:
        rows = sum(pads.dataset(run.path(f), format="parquet").count_rows() for f in c["files"])
        assert rows == c["rows"]
        assert all(f"cluster={c['name']}/" in f for f in c["files"])
        clusters_in_files = {cluster_of[pid] for pid in _ids_of(run, c["files"])}  # the shards carry no `cluster`
        assert clusters_in_files <= set(c["members"])
        assert c["mean_intra_cosine"] is None or -1.0 <= c["mean_intra_cosine"] <= 1.0
    assert manifest["stats"]["rows"] == sum(c["rows"] for c in manifest["clusters"])


def test_every_step_every_rank_same_single_cluster(finished_run):
    run, _ = finished_run
    manifest = run.read_json("shards/k=4/manifest.json")
    cluster_of = {}
    for c in manifest["clusters"]:
        table = pads.dataset([run.path(f) for f in c["files"]], format="parquet").to_table(columns=["pair_id"])
        cluster_of.update({pid: c["cluster"] for pid in table.column("pair_id").to_pylist()})
    logs = [[json.loads(line) for line in run.read_bytes(f"train/clustered-seed0/batches/rank-{r}.jsonl")
             .decode().splitlines()] for r in (0, 1)]
    assert len(logs[0]) == len(logs[1]) == 6
    for step0, step1 in zip(*logs):
        assert step0["step"] == step1["step"]
        clusters = {cluster_of[p] for p in step0["pair_ids"] + step1["pair_ids"]}
        assert len(clusters) == 1
        assert len(step0["pair_ids"]) == len(step1["pair_ids"]) == 8
        assert not set(step0["pair_ids"]) & set(step1["pair_ids"])


def test_metrics_eval_report_exist_and_are_finite(finished_run):
    run, _ = finished_run
    lines = [json.loads(x) for x in run.read_bytes("train/clustered-seed0/metrics.jsonl").decode().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    assert all(math.isfinite(x["loss"]) and math.isfinite(x["lr"]) for x in lines)
    for name in ("frozen", "clustered-seed0"):
        result = run.read_json(f"eval/{name}.json")
        assert all(math.isfinite(v) and 0 <= v <= 1 for v in result["metrics"].values())
    report = run.read_bytes("report/report.md").decode()
    assert "Held-out retrieval" in report and "clustered-seed0" in report
    config = yaml.safe_load(run.read_bytes("config.yaml"))
    assert config["config_hash"] and config["cluster"]["k"] == 4
    assert run.exists("train/clustered-seed0/model/model.safetensors")


def test_rerun_reuses_and_different_config_refuses(finished_run, tiny_model, capsys):
    run, _ = finished_run
    data_path = run.read_json("pairs/_DONE.json")["config"]["data"]["path"]
    overrides = tiny_overrides(tiny_model, data_path)
    before = run.read_json("embeddings/_DONE.json")["finished_at"]
    assert cli.main(["embed", "--run-dir", run.uri, "--set", *overrides]) == 0
    assert run.read_json("embeddings/_DONE.json")["finished_at"] == before
    rc = cli.main(["embed", "--run-dir", run.uri, "--set", *overrides, "embed.max_length=16"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "different config; changed: embed.max_length 32 -> 16" in err
    assert "embed.max_length=16 --replace" in err and "fingerprint" not in err
    assert run.read_json("embeddings/_DONE.json")["finished_at"] == before  # the refused rerun wrote nothing


def test_missing_stage_names_the_verb(tmp_path, tiny_model, ray_local, capsys):
    rc = cli.main(["fit", "--run-dir", str(tmp_path / "empty"), "--set", f"embed.model={tiny_model}"])
    assert rc == 2
    assert "clusterscale embed" in capsys.readouterr().err
