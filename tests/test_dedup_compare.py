"""compare's clustered_dedup arm on tiny data: the clustered sampler on the shards of the pairs dedup keeps, beside
the run's shards of every assigned pair, for the same steps and seed; the report shows hardness and masked false
negatives per step next to the clustered arm."""
from __future__ import annotations

import json

import pyarrow.dataset as pads
import pytest

from clusterscale import cli
from clusterscale.config import ConfigError, load
from clusterscale.errors import UserError
from clusterscale.experiments import run_compare
from clusterscale.io.layout import DEDUP, DEDUP_KEPT, assign_dir, manifest_path, shard_set_manifest_path
from clusterscale.io.rundir import RunDir
from clusterscale.runtime import dedup_core as core
from clusterscale.stages.dedup import train_dedup_config
from tests.conftest import SHARED_PLANTED_COPIES as COPIES

K, STEPS = 4, 6  # the shared run's cluster.k and train.steps


def shard_keys(run: RunDir, manifest: dict) -> list[str]:
    """The normalised pair text of every row of a shard set."""
    table = pads.dataset([run.path(f) for c in manifest["clusters"] for f in c["files"]], filesystem=run.fs).to_table()
    return [core.normalised(f"{q}\n{p}") for q, p in zip(table.column("query").to_pylist(),
                                                          table.column("passage").to_pylist())]


@pytest.fixture(scope="module")
def compared(tmp_path_factory, shared_run):
    """On a copy of conftest's finished shared run (its data holds planted copies): the run's shards, its clustered
    training (seed 0, reused as the clustered arm) and evaluation are there, so only dedup, the dedup shard set and
    the dedup arm's training run. The run's dedup config (exact) is what the arm deduplicates with; its shards keep
    every assigned pair."""
    import shutil

    path = tmp_path_factory.mktemp("dedup-compare") / "run"
    shutil.copytree(shared_run.run.path(), path)
    rc = cli.main(["compare", "--run-dir", str(path), "--samplers", "clustered,clustered_dedup", "--seeds", "1",
                   "--set", "dedup.exact=true", "dedup.apply_to_shards=false",
                   "train.num_workers=1"])
    assert rc == 0
    return RunDir(str(path))


def arm_run(run: RunDir, arm: str) -> str:
    """The arm's seed-0 training as compare.json names it (clustered: the run's own, clustered-seed0)."""
    return run.read_json("report/compare.json")["arms"][arm]["runs"][0]


def test_dedup_arm_trains_on_the_kept_pairs_beside_every_assigned_pair(compared):
    run = compared
    assigned, dedup = run.done_stats(assign_dir(K))["rows"], run.done_stats(DEDUP)
    main = run.read_json(manifest_path(K))
    deduped = run.read_json(shard_set_manifest_path(K, "dedup"))
    assert main["stats"]["rows"] == assigned and deduped["stats"]["rows"] == dedup["rows"] == assigned - dedup["removed"]
    assert dedup["exact"] >= COPIES * 0.7 and dedup["semantic"] == 0  # the planted copies not held out
    main_keys, kept_keys = shard_keys(run, main), shard_keys(run, deduped)
    assert len(set(main_keys)) < len(main_keys) and len(set(kept_keys)) == len(kept_keys)
    assert run.done_stats(DEDUP_KEPT)["rows"] == dedup["rows"] and dedup["k"] == K
    assert arm_run(run, "clustered") == "clustered-seed0" and arm_run(run, "clustered_dedup") == "compare-clustered_dedup-seed0"
    for arm in ("clustered", "clustered_dedup"):
        done = run.read_json(f"train/{arm_run(run, arm)}/_DONE.json")
        assert done["stats"]["steps"] == STEPS and done["stats"]["sampler"] == "clustered"
        assert done["config"]["train"]["seed"] == 0 and done["config"]["train"]["dedup"] == (arm != "clustered")
        steps = [json.loads(line) for line in run.read_bytes(f"train/{arm_run(run, arm)}/metrics.jsonl").splitlines()]
        assert len(steps) == STEPS and all("masked_false_negatives" in s for s in steps)


def test_compare_report_shows_hardness_and_masked_false_negatives(compared):
    summary = compared.read_json("report/compare.json")
    assert list(summary["arms"]) == ["clustered", "clustered_dedup"]
    for name, arm in summary["arms"].items():
        steps = [json.loads(line) for line in
                 compared.read_bytes(f"train/{arm_run(compared, name)}/metrics.jsonl").splitlines()]
        assert arm["masked_false_negatives"] == pytest.approx(sum(s["masked_false_negatives"] for s in steps) / STEPS)
        assert arm["neg_cos_max"] == pytest.approx(sum(s["neg_cos_max"] for s in steps) / STEPS)
    assert summary["arms"]["clustered_dedup"]["train_keys"] == {"dedup": True}
    # Queries and passages are unique but for the planted copies, so only the clustered arm can mask any.
    assert summary["arms"]["clustered_dedup"]["masked_false_negatives"] == 0
    assert ("clustered_dedup: on the shards of the pairs dedup keeps, dedup.exact=True, key=pair, "
            "semantic_threshold=0.0") in summary["description"]
    report = compared.read_bytes("report/report.md").decode()
    assert "| clustered_dedup | 1" in report and "masked false negatives / step" in report


def test_dedup_arm_uses_the_documented_defaults_when_dedup_is_off():
    cfg = train_dedup_config(load(None, ["train.dedup=true"]))
    assert (cfg.dedup.exact, cfg.dedup.key, cfg.dedup.semantic_threshold) == (True, "pair", 0.95)
    with pytest.raises(ConfigError, match="train.dedup=true trains the clustered sampler"):
        load(None, ["train.dedup=true", "train.sampler=random"])


def test_dedup_arm_with_dedup_applied_to_the_shards_is_refused_before_any_work(tmp_path):
    cfg = load(None, ["dedup.exact=true"])
    with pytest.raises(UserError, match="dedup.apply_to_shards=false"):
        run_compare(cfg, RunDir(str(tmp_path / "run")), ["clustered", "clustered_dedup"], 1)
    assert not (tmp_path / "run").exists()
