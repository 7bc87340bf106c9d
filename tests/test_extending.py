"""docs/extending.md's worked examples, done as a newcomer would, nothing else changed: a length filter registered
between ingest and embed (its module and its registration; here both in this file), and a batch sampler (its module,
which registers it; here this file). embed reads the filter's output through its wiring, its fingerprint covers the
filter's, and a changed filter is refused like any changed key; the run trains with the new sampler, which the
config, compare's arms, the cost report and `plan` accept, and with labeled hard negatives
(tests/test_labeled_negatives.py tests their rules)."""
from __future__ import annotations

import dataclasses
import json
import posixpath
import sys
from dataclasses import dataclass
from typing import ClassVar, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import ray.cloudpickle

from clusterscale import arm_costs, config, experiments, pipeline
from clusterscale.executor import Estimate, Input, Stage
from clusterscale.io.layout import checked_manifest
from clusterscale.io.rundir import RunDir, StageMissingError, StageResult
from clusterscale.knobs import POSITIVE, Section, knob
from clusterscale.runtime.hashing import SeededPermutation
from clusterscale.runtime.stage_context import StageContext
from clusterscale.train import schedule
from clusterscale.train.samplers import CLUSTERED, Sampler, SetShapes
from clusterscale.train.schedule import GlobalBatch
from clusterscale.train.schedule_config import SAMPLERS
from tests.conftest import make_pairs, tiny_overrides

@dataclass
class LengthFilterConfig(Section):
    """The filter's own config section: `length_filter.min_passage_chars` in YAML and --set."""
    section: ClassVar[str] = "length_filter"
    min_passage_chars: int = knob(150, "Pairs whose passage has fewer characters are rejected.", bounds=POSITIVE)


def run_length_filter(ctx: StageContext) -> StageResult:
    """Keep the pairs whose passage has at least length_filter.min_passage_chars characters in long_pairs/; the others
    go to long_pairs/_rejected-<part>.parquet with their reason (files named `_*` are not data: readers skip them)."""
    kept = rejected = 0
    for path in ctx.source.files(ctx.input("pairs")):
        with ctx.source.fs.open_input_file(path) as f:
            table = pq.read_table(f)
        long = pc.greater_equal(pc.utf8_length(table.column("passage")), ctx.cfg.length_filter.min_passage_chars)
        name = posixpath.basename(path)
        ctx.run.write_parquet(f"long_pairs/{name}", table.filter(long))
        short = table.filter(pc.invert(long))
        ctx.run.write_parquet(f"long_pairs/_rejected-{name}", short.append_column(
            "reason", pa.array(["short_passage"] * short.num_rows, pa.string())))
        kept, rejected = kept + int(pc.sum(long).as_py() or 0), rejected + short.num_rows
    return StageResult({"rows": kept, "rejected": rejected})


def estimate_length_filter(cfg: config.Config, shape) -> Estimate:
    """What `plan` says of it: one part of pairs/ held at a time (~400 bytes of text a pair, twice: read and kept),
    pairs/ written again, and ~20 us of CPU per pair."""
    return Estimate(task_bytes=2 * 400.0 * cfg.data.rows_per_part, disk_bytes={"long_pairs": 400.0 * shape.train_rows},
                    files=-(-shape.train_rows // cfg.data.rows_per_part), cpu_s_per_pair=2e-5)


LENGTH_FILTER = Stage("length_filter", "Drop pairs whose passage is short.", run_length_filter, "long_pairs",
                      inputs=(Input("pairs", "ingest", "Ingested pairs"),), config=LengthFilterConfig, replaces="pairs", shared=True, estimate=estimate_length_filter)


class Sequential(Sampler):
    """The clusters one after another: every full batch of one cluster, then the next cluster's, in a seeded cluster
    order (a new one each epoch). In the real module, `@SAMPLERS.register` above the class is its registration."""
    name = "sequential"
    doc = "the clusters one after another (all of one cluster's batches, then the next's), in a seeded order"
    sets = (CLUSTERED,)  # reads the clustered shards: no set of its own, so no set_strata

    def batches(self, sc, shapes: SetShapes, seed: int, start: int, stop: int,
                num_steps: int) -> Iterator[GlobalBatch]:
        plan = schedule.Schedule(shapes.sizes[0], sc.global_batch_size, CLUSTERED, seed,
                                 block_rows=shapes.block_rows[0])  # each cluster's row order: the clustered one
        if plan.per_epoch == 0:
            raise ValueError("train.sampler=sequential: no cluster holds a full global batch; lower "
                             "train.global_batch_size.")
        epoch = None
        for step in range(start, stop):
            if step // plan.per_epoch != epoch:  # this epoch's cluster order and where each cluster's batches end
                epoch = step // plan.per_epoch
                order = SeededPermutation(len(plan.sizes), [seed, epoch, 0x5E0])(np.arange(len(plan.sizes)))
                ends = np.cumsum(plan.full[order])
            slot = step % plan.per_epoch
            i = int(np.searchsorted(ends, slot, side="right"))
            cluster, index = int(order[i]), slot - int(ends[i] - plan.full[order[i]])
            yield GlobalBatch(step, epoch, cluster, plan.rows(epoch, cluster, 0, index), cluster)


@pytest.fixture
def sequential_registered():
    """The sampler's registration (in its module: `@SAMPLERS.register`), undone after the test. Ray Train's workers
    get the driver's sampler with the job; a class defined in a test module travels by value."""
    SAMPLERS.register(Sequential)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield Sequential
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        SAMPLERS.unregister(Sequential.name)


@pytest.fixture
def registered(monkeypatch):
    """The registration: the stage in pipeline.STAGES right after ingest (one line in the real list)."""
    stages = dict(pipeline.STAGES)
    order = list(stages)
    order.insert(order.index("ingest") + 1, "length_filter")
    stages["length_filter"] = LENGTH_FILTER
    monkeypatch.setattr(pipeline, "STAGES", pipeline.chain({name: stages[name] for name in order}))
    monkeypatch.setattr(pipeline, "STAGE_VERBS", tuple(n for n in order if stages[n].in_run is not None))


def test_a_sampler_registered_in_its_module_is_a_choice_everywhere(sequential_registered):
    """The registration alone makes it a train.sampler value, a compare arm and a cost-report arm (the preprocessing
    it needs: the clustering); an unknown name is refused naming every registered sampler."""
    cfg = config.load(None, ["train.sampler=sequential"])
    assert "sequential" in SAMPLERS.names() and SAMPLERS.names()[0] == "clustered"
    assert experiments.arm_keys("sequential", cfg, {}) == {"sampler": "sequential"}
    assert arm_costs.arm_stages(cfg) == ["ingest", "embed", "fit", "assign", "shard"]
    with pytest.raises(config.ConfigError, match="clustered, random, random_clusters, source, curriculum, sequential"):
        config.load(None, ["train.sampler=sequentail"])


def test_a_stage_and_a_sampler_registered_feed_the_whole_run(registered, sequential_registered, tmp_path, tiny_model,
                                                             ray_local):
    """ingest -> length_filter -> embed -> fit -> assign -> shard -> train with train.sampler=sequential, the pairs
    carrying labeled hard negatives (data.negative_column) that training uses (train.labeled_negatives_per_query=1):
    embed holds exactly the kept pairs, its marker covers the filter, the shards carry `negatives`, the steps take the
    clusters one after another in the sampler's order, every step has one negative slot per row (the rows without one
    masked), and a changed filter refuses the embeddings made from the old one."""
    rows = make_pairs(160).to_pylist()
    for i, row in enumerate(rows):  # another topic's passage as the hard negative; every fifth row none, some two
        row["neg"] = None if i % 5 == 0 else [rows[(i + 7) % len(rows)]["p"]] * (1 + i % 2)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    keys = tiny_overrides(tiny_model, str(tmp_path / "pairs.parquet")) + [
        "data.negative_column=neg", "train.labeled_negatives_per_query=1", "train.steps=3", "train.log_batches=false",
        "data.heldout_fraction=0.05", "train.sampler=sequential"]
    cfg, run = config.load(None, keys), RunDir(str(tmp_path / "run"))
    verbs = pipeline.pipeline(cfg, "ingest", "train")
    assert verbs[:3] == ("ingest", "length_filter", "embed")
    results = pipeline.run_stages(cfg, run, verbs)
    kept = pq.read_table(run.path("long_pairs")).to_pylist()
    assert 0 < len(kept) < results["ingest"].stats["pairs"]
    given = [len(n) for n in pq.read_table(run.files("pairs"), columns=["negatives"]).column("negatives").to_pylist()]
    assert results["ingest"].stats["labeled_negatives"] == sum(given)  # what training can draw, counted by ingest
    assert results["ingest"].stats["without_labeled_negatives"] == given.count(0) > 0
    assert results["length_filter"].stats["rejected"] == results["ingest"].stats["pairs"] - len(kept)
    embedded = set(pq.read_table(run.files("embeddings"), columns=["pair_id"]).column("pair_id").to_pylist())
    assert embedded == {row["pair_id"] for row in kept}  # embed read the filter's output, not pairs/
    assert "via length_filter" in json.dumps(run.done_marker("embeddings").covers, default=str)
    shard = pq.read_table(run.files("shards/k=4")[0])
    assert shard.schema.field("negatives").type == pa.list_(pa.string())
    assert any(shard.column("negatives").to_pylist()) and not all(shard.column("negatives").to_pylist())
    metrics = [json.loads(line) for line in open(run.path("train", "sequential-seed0", "metrics.jsonl"))]
    assert len(metrics) == 3 and all(m["mined_negatives"] == 16 for m in metrics)  # one slot per row of the batch
    manifest = checked_manifest(run, 4, 16)
    drawn = list(Sequential().batches(cfg.train.schedule, SetShapes.of([manifest]), 0, 0, 3, 3))
    assert [m["cluster"] for m in metrics] == [manifest.clusters[b.shard].cluster for b in drawn]
    runs = [c for i, c in enumerate(m["cluster"] for m in metrics) if i == 0 or c != metrics[i - 1]["cluster"]]
    assert len(runs) == len(set(runs))  # each cluster's batches in one run
    assert 0 < sum(m["labeled_negatives_empty"] for m in metrics) < 16 * 3  # rows with one filled theirs
    costs = run.read_json("report/costs.json")  # its cost recorded and counted as preprocessing
    assert costs["length_filter"]["preprocess"] and costs["length_filter"]["rejected"] > 0
    assert pipeline.run_stages(cfg, run, ("embed",))["embed"].stats  # reused as it is
    changed = config.load(None, keys + ["length_filter.min_passage_chars=100"])
    # Made from another filter: refused by key, naming the run that redoes it first (embed --replace alone would embed
    # the pairs the old filter kept under the new config).
    for replace in ("", "always"):
        with pytest.raises(StageMissingError, match=r"long_pairs, which embed reads, was made with other values of "
                                                    r"keys it depends on \(changed: length_filter.min_passage_chars "
                                                    r"150 -> 100\).*`clusterscale run --run-dir"):
            pipeline.run_stages(changed, run, ("embed",), replace=replace)
    assert run.exists("embeddings", "_DONE.json")  # nothing was removed


def test_a_stage_declares_its_own_config_section(registered):
    """Stage.config: the section is a section of the config while the stage is registered (YAML, --set, defaults,
    bounds by key, `clusterscale config`), the stage's fingerprint covers it, and without the registration the key is
    unknown, the built-in fingerprints unchanged."""
    cfg = config.load(None, ["length_filter.min_passage_chars=90"])
    assert cfg.length_filter.min_passage_chars == 90 and config.load(None, []).length_filter.min_passage_chars == 150
    assert cfg.to_dict()["length_filter"] == {"min_passage_chars": 90}
    assert config.from_dict(cfg.to_dict()).length_filter.min_passage_chars == 90  # a run's config.yaml reads back
    with pytest.raises(config.ConfigError, match="length_filter.min_passage_chars"):
        config.load(None, ["length_filter.min_passage_chars=0"])
    with pytest.raises(config.ConfigError, match="allowed keys in length_filter: min_passage_chars"):
        config.load(None, ["length_filter.min_chars=90"])
    assert "length_filter:\n  min_passage_chars: 150" in config.describe()
    stage, run = pipeline.STAGES["length_filter"], RunDir("/tmp/unused")
    assert stage.fingerprint_of(cfg, run) != stage.fingerprint_of(config.load(None, []), run)
    assert stage.fingerprint_of(config.load(None, ["train.steps=7"]), run) == stage.fingerprint_of(
        config.load(None, []), run)


def test_fingerprints_chain_through_the_inputs(registered):
    """The filter declares only its own section; through pairs/ it covers ingest's (data), and embed, reading its
    output, covers both. The built-in stages declare their own sections and cover what they always did."""
    assert pipeline.STAGES["length_filter"].sections == ("data", "length_filter")
    assert set(pipeline.wire(pipeline.STAGES["embed"], config.load(None, []))[0].sections) == {
        "data", "embed", "length_filter"}


def test_built_in_stages_cover_what_they_always_did():
    """pipeline.chain gives every built-in stage the sections it declared by hand before (the old-run test checks the
    fingerprints themselves); mine's equal the ones training checks negatives/ against (io/negatives.MINE_SECTIONS)."""
    from clusterscale.io.negatives import MINE_SECTIONS

    clustering = ("data", "embed", "cluster")
    assert {name: stage.sections for name, stage in pipeline.STAGES.items()} == {
        "synth": ("data",), "ingest": ("data",), "embed": ("data", "embed"), "embed_heldout": ("data", "embed"),
        "fit": clustering, "assign": clustering, "dedup": (*clustering, "dedup"), "shard": (*clustering, "shard"),
        "shard_set": (*clustering, "shard"), "dedup_shards": (*clustering, "shard"), "mine": MINE_SECTIONS,
        "train": (*clustering, "shard", "train"), "evaluate": (), "report": ()}
    assert [name for name, stage in pipeline.STAGES.items() if not stage.marks_done] == ["evaluate", "report"]


def test_a_stage_section_is_unknown_without_its_stage():
    with pytest.raises(config.ConfigError, match="Unknown config section 'length_filter'.*pipeline.STAGES"):
        config.load(None, ["length_filter.min_passage_chars=90"])
    assert "length_filter" not in config.describe() and "length_filter" not in config.load(None, []).to_dict()


def test_plan_lists_a_registered_stage_in_its_place(registered, tmp_path, monkeypatch):
    """`plan` iterates pipeline.STAGES: the length filter has its row after ingest, its memory, disk and time from its
    own Stage.estimate; with --run-dir of a run that ran it, its measured time per pair is scaled to the planned size;
    a stage that declares no estimate has no time without one (the sums and the ratio leave it out, saying so)."""
    from clusterscale.plan.build import PlanRequest, make_plan

    def plan_of(run_dir, rows):
        return make_plan(PlanRequest(None, [], run_dir, rows, [8], None, None, None, None, None, None, None, None))

    plan = plan_of(None, 100_000)
    assert list(plan["stages"])[:3] == ["ingest", "length_filter", "embed"]
    row, cfg = plan["stages"]["length_filter"], config.load(None, [])
    train_rows = 100_000 - round(100_000 * cfg.data.heldout_fraction)
    assert "Stage.estimate" in row["time_from"] and row["wall_s"] > 0
    assert row["disk_bytes_by_folder"] == {"long_pairs": 400.0 * train_rows}
    assert row["peak_task_mb"] >= 800.0 * cfg.data.rows_per_part / 2**20
    run = RunDir(str(tmp_path / "run"))
    run.write_config(cfg)
    run.write_json("report/costs.json", {"ingest": {"rows_in": 1000, "pairs": 950, "wall_s": 1.0},
                                         "length_filter": {"rows": 900, "wall_s": 2.0}})
    row = plan_of(str(tmp_path / "run"), 95_000)["stages"]["length_filter"]
    assert "measured in" in row["time_from"] and 100 < row["wall_s"] < 300  # ~2 s per 950 pairs, at 100x
    stages = dict(pipeline.STAGES)
    stages["length_filter"] = dataclasses.replace(stages["length_filter"], estimate=None)
    monkeypatch.setattr(pipeline, "STAGES", stages)
    plan = plan_of(None, 100_000)
    assert "no estimate" in plan["stages"]["length_filter"]["time_from"]
    assert any("length_filter" in note for note in plan["notes"])


def test_every_compare_arm_counts_a_registered_filter_of_the_pairs(registered):
    """The cost report's per-arm preprocessing: a stage standing in for pairs/ is needed by every arm (they all
    train on its output), in pipeline order."""
    assert arm_costs.arm_stages(config.load(None, [])) == ["ingest", "length_filter", "embed", "fit", "assign", "shard"]
    assert arm_costs.arm_stages(config.load(None, ["train.sampler=random"])) == ["ingest", "length_filter",
                                                                                  "shard:random"]


def test_without_the_registration_every_stage_is_wired_as_before():
    cfg = config.load(None, [])
    for stage in pipeline.STAGES.values():
        assert pipeline.wire(stage, cfg) == (stage, {})
