"""docs/extending.md's worked example, done as a newcomer would: a length filter registered between ingest and embed
(its module and its registration; here both in this file), and nothing else changed. embed reads the filter's output
through its wiring, its fingerprint covers the filter's, and a changed filter is refused like any changed key. The
run goes on to train with labeled hard negatives (tests/test_labeled_negatives.py tests their rules)."""
from __future__ import annotations

import json
import posixpath

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from clusterscale import config, pipeline
from clusterscale.executor import Input, Stage
from clusterscale.io.rundir import ConfigMismatchError, RunDir, StageResult
from clusterscale.runtime.stage_context import StageContext
from tests.conftest import make_pairs, tiny_overrides

MIN_CHARS = {"passage": 150}  # the filter's setting (a config key would be a knob in a section of its own)


def run_length_filter(ctx: StageContext) -> StageResult:
    """Keep the pairs whose passage has at least MIN_CHARS characters in long_pairs/; the others go to
    long_pairs/_rejected-<part>.parquet with their reason (files named `_*` are not data: readers skip them)."""
    kept = rejected = 0
    for path in ctx.source.files(ctx.input("pairs")):
        with ctx.source.fs.open_input_file(path) as f:
            table = pq.read_table(f)
        long = pc.greater_equal(pc.utf8_length(table.column("passage")), MIN_CHARS["passage"])
        name = posixpath.basename(path)
        ctx.run.write_parquet(f"long_pairs/{name}", table.filter(long))
        short = table.filter(pc.invert(long))
        ctx.run.write_parquet(f"long_pairs/_rejected-{name}", short.append_column(
            "reason", pa.array(["short_passage"] * short.num_rows, pa.string())))
        kept, rejected = kept + int(pc.sum(long).as_py() or 0), rejected + short.num_rows
    return StageResult({"rows": kept, "rejected": rejected})


LENGTH_FILTER = Stage("length_filter", "Drop pairs whose passage is short.", run_length_filter, "long_pairs",
                      inputs=(Input("pairs", "ingest", "Ingested pairs"),), sections=("data",),
                      extra=lambda cfg, run: {"min_passage_chars": MIN_CHARS["passage"]}, replaces="pairs",
                      shared=True)


@pytest.fixture
def registered(monkeypatch):
    """The registration: the stage in pipeline.STAGES right after ingest (one line in the real list)."""
    stages = dict(pipeline.STAGES)
    order = list(stages)
    order.insert(order.index("ingest") + 1, "length_filter")
    stages["length_filter"] = LENGTH_FILTER
    monkeypatch.setattr(pipeline, "STAGES", {name: stages[name] for name in order})
    monkeypatch.setattr(pipeline, "STAGE_VERBS", tuple(n for n in order if stages[n].in_run is not None))


def test_a_stage_registered_between_ingest_and_embed_feeds_the_whole_run(registered, tmp_path, tiny_model,
                                                                         ray_local):
    """ingest -> length_filter -> embed -> fit -> assign -> shard -> train, the pairs carrying labeled hard negatives
    (data.negative_column) that training uses (train.labeled_negatives_per_query=1): embed holds exactly the kept
    pairs, its marker covers the filter, the shards carry `negatives`, every step has one negative slot per row (the
    rows without one masked), and a changed filter refuses the embeddings made from the old one."""
    rows = make_pairs(160).to_pylist()
    for i, row in enumerate(rows):  # another topic's passage as the hard negative; every fifth row none, some two
        row["neg"] = None if i % 5 == 0 else [rows[(i + 7) % len(rows)]["p"]] * (1 + i % 2)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    keys = tiny_overrides(tiny_model, str(tmp_path / "pairs.parquet")) + [
        "data.negative_column=neg", "train.labeled_negatives_per_query=1", "train.steps=3", "train.log_batches=false",
        "data.heldout_fraction=0.05"]
    cfg, run = config.load(None, keys), RunDir(str(tmp_path / "run"))
    verbs = pipeline.pipeline(cfg, "ingest", "train")
    assert verbs[:3] == ("ingest", "length_filter", "embed")
    results = pipeline.run_stages(cfg, run, verbs)
    kept = pq.read_table(run.path("long_pairs")).to_pylist()
    assert 0 < len(kept) < results["ingest"].stats["pairs"]
    assert results["length_filter"].stats["rejected"] == results["ingest"].stats["pairs"] - len(kept)
    embedded = set(pq.read_table(run.files("embeddings"), columns=["pair_id"]).column("pair_id").to_pylist())
    assert embedded == {row["pair_id"] for row in kept}  # embed read the filter's output, not pairs/
    assert "via length_filter" in json.dumps(run.done_marker("embeddings").covers, default=str)
    shard = pq.read_table(run.files("shards/k=4")[0])
    assert shard.schema.field("negatives").type == pa.list_(pa.string())
    assert any(shard.column("negatives").to_pylist()) and not all(shard.column("negatives").to_pylist())
    metrics = [json.loads(line) for line in open(run.path("train", "clustered-seed0", "metrics.jsonl"))]
    assert len(metrics) == 3 and all(m["mined_negatives"] == 16 for m in metrics)  # one slot per row of the batch
    assert 0 < sum(m["labeled_negatives_empty"] for m in metrics) < 16 * 3  # rows with one filled theirs
    costs = run.read_json("report/costs.json")  # its cost recorded and counted as preprocessing
    assert costs["length_filter"]["preprocess"] and costs["length_filter"]["rejected"] > 0
    assert pipeline.run_stages(cfg, run, ("embed",))["embed"].stats  # reused as it is
    MIN_CHARS["passage"] = 100
    try:
        with pytest.raises(ConfigMismatchError):
            pipeline.run_stages(cfg, run, ("embed",))  # made from another filter: refused, --replace to redo
    finally:
        MIN_CHARS["passage"] = 150


def test_without_the_registration_every_stage_is_wired_as_before():
    cfg = config.load(None, [])
    for stage in pipeline.STAGES.values():
        assert pipeline.wire(stage, cfg) == (stage, {})
