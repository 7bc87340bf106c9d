"""The report renders from a real tiny run (clustered, compare's clustered and random arms, and source-stratified
training; conftest's shared_run): every figure a valid PNG, costs sane; the exported model is a complete
sentence-transformers folder with a model card."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def reported(shared_run):
    """`run` (eval.extrapolate_to_rows=1000000), compare's arms, `train` with train.sampler=source and
    train.log_every_steps=2 (metrics-only ray.train.report calls between the checkpoints), then `report`."""
    return shared_run.run


def test_every_linked_figure_is_a_valid_png(reported):
    from PIL import Image

    run = reported
    report = run.read_bytes("report/report.md").decode()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", report)
    assert {"cluster_sizes.png", "costs.png", "loss.png", "hardness.png"} <= set(linked)
    on_disk = [f for f in run.listdir("report") if f.endswith(".png")]
    assert sorted(on_disk) == sorted(set(linked))
    for name in on_disk:
        data = run.read_bytes(f"report/{name}")
        assert data[:8] == PNG_MAGIC, name
        image = Image.open(io.BytesIO(data))
        image.load()
        assert image.size[0] > 100 and image.size[1] > 100, name


def test_report_sections(reported):
    report = reported.read_bytes("report/report.md").decode()
    for heading in ("## Clusters (k=4", "Table 1 analogue", "## Cost: preprocessing vs training", "## Held-out retrieval",
                    "NDCG@10 per cluster", "## Training dynamics"):
        assert heading in report, heading
    assert "Extrapolation (not a measurement) to 1,000,000 pairs" in report
    assert re.search(r"(?<![\w-])clustered-seed0", report)  # the main run's own, not only compare's arms
    assert "compare-random-seed0" in report and "source-seed0" in report


def test_cost_summary_is_consistent_with_costs_json(reported):
    run = reported
    costs, summary = run.read_json("report/costs.json"), run.read_json("report/cost_summary.json")
    pre = sum(costs[s]["worker_s"] for s in ("ingest", "embed", "fit", "assign", "shard"))
    assert summary["preprocess_worker_s"] == pytest.approx(pre)
    assert summary["ratio_per_epoch"] == pytest.approx(pre / summary["train_epoch_worker_s"])
    assert summary["ratio_total"] == pytest.approx(summary["ratio_per_epoch"] / summary["epochs"])
    ext = summary["extrapolation"]
    assert ext["preprocess"]["value"] == pytest.approx(pre * 1_000_000 / summary["rows"])
    # FLOPs: 2 x params x tokens for the embed pass; training is 6 x params x tokens, so more per pair.
    assert summary["flops"]["embed"] > 0 and summary["flops"]["train:clustered-seed0"] > 0


def test_cluster_breakdown_partitions_the_heldout_queries(reported):
    run = reported
    breakdown = run.read_json("eval/by_cluster/k=4.json")
    frozen = run.read_json("eval/frozen.json")
    assert sum(row["queries"] for row in breakdown["clusters"].values()) == frozen["num_queries"]
    clusters = run.read_json("eval/clusters/k=4.json")["cluster"]
    per_query = np.array(frozen["per_query"]["ndcg_at_10"])
    for c, row in breakdown["clusters"].items():
        mask = np.array(clusters) == int(c)
        assert row["queries"] == int(mask.sum())
        assert row["ndcg_at_10"]["frozen"] == pytest.approx(per_query[mask].mean())
    # The held-out passages are assigned exactly as the embed stage would: same encoder, same centroids.
    from clusterscale.modeling.encoder import Encoder
    from clusterscale.stages.kmeans import load_centroids

    cfg = run.read_json("embeddings/_DONE.json")["config"]["embed"]
    held = frozen["per_query"]["pair_id"]
    import pyarrow.dataset as pads

    table = pads.dataset(run.files("heldout"), format="parquet").to_table(columns=["pair_id", "passage"])
    text = dict(zip(table.column("pair_id").to_pylist(), table.column("passage").to_pylist()))
    vectors = Encoder(cfg["model"], pooling=cfg["pooling"], max_length=cfg["max_length"]).encode([text[i] for i in held])
    assert np.argmax(vectors @ load_centroids(run, 4).T, axis=1).tolist() == clusters


def test_source_sampler_run_is_in_the_cost_summary(reported):
    summary = reported.read_json("report/cost_summary.json")
    assert "train:source-seed0" in reported.read_json("report/costs.json")
    assert {"clustered-seed0", "compare-random-seed0", "source-seed0"} <= set(summary["train_runs"])
    assert summary["train_epoch_worker_s"] > 0


def test_exported_model_is_complete_and_its_checkpoints_are_gone(reported):
    import json

    run = reported
    model = "train/clustered-seed0/model"
    assert json.loads(run.read_bytes(f"{model}/sentence_bert_config.json"))["max_seq_length"] == 32  # passage length
    assert run.exists(f"{model}/config_sentence_transformers.json")
    card = run.read_bytes(f"{model}/README.md").decode()
    assert "k=4" in card and "| sampler | clustered" in card and "| steps | 6 x 16 pairs" in card
    assert "| this model |" in card  # `run` evaluated it after the export
    trained = run.listdir("train")
    assert {"clustered-seed0", "compare-random-seed0", "source-seed0"} <= set(trained)
    for name in trained:
        assert run.exists(f"train/{name}/model/model.safetensors") and not run.exists(f"train/{name}/ray")


def test_without_matplotlib_the_report_is_written_without_plots(shared_run, tmp_path, monkeypatch):
    """A node without matplotlib (a bare GPU image: benchmarks/gpu_pipeline.sh) still gets report.md, saying why it
    has no plots; nothing links a figure it did not write."""
    import shutil

    from clusterscale.config import load
    from clusterscale.io.rundir import RunDir
    from clusterscale.stages import report_plots
    from clusterscale.stages.report import write_report

    shutil.copytree(shared_run.run.path(), tmp_path / "run", ignore=shutil.ignore_patterns("*.png"))
    run = RunDir(str(tmp_path / "run"))
    monkeypatch.setattr(report_plots, "available", lambda: False)
    write_report(load(str(tmp_path / "run" / "config.yaml"), []), run)
    report = run.read_bytes("report/report.md").decode()
    assert "matplotlib is not installed" in report and ".png)" not in report
    assert "## Clusters" in report and not run.files("report", suffix=".png")
