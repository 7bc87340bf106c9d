"""`clusterscale plan`: its formulas on small known cases (against the train schedule's and the stages' own
functions, and against the files a finished run wrote), its errors, its --json keys. No Ray is started except by
the shared_run fixture (made once per session)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from clusterscale import cli, config
from clusterscale.plan import render
from clusterscale.stages import report
from clusterscale.plan.build import PlanRequest, make_plan
from clusterscale.plan.rates import CALIBRATION_FORMAT, line_fit
from clusterscale.plan.shape import (RunShape, assign_files, embed_files, imbalance_factor, lognormal_sizes, run_shape,
                                     shard_files, shard_sizes, train_shape)
from clusterscale.runtime.vectors import EMBEDDINGS_ROW_GROUP_ROWS
from clusterscale.train import schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGE_KEYS = {"wall_s", "gpu_hours", "cpu_hours", "peak_task_mb", "peak_driver_mb", "disk_bytes", "files"}


def shape_of(cfg, sizes: list[int]) -> RunShape:
    sizes = np.asarray(sizes, dtype=np.int64)
    return RunShape(int(sizes.sum()), int(sizes.sum()), 0, len(sizes), 8, sizes, "test")


def test_train_shape_is_the_schedules():
    """Steps and leftover pairs of an epoch are what the train code computes, and what arithmetic says."""
    cfg = config.load(None, ["train.global_batch_size=32", "shard.small_cluster_policy=pool"])
    shards = shard_sizes(cfg, shape_of(cfg, [130, 70, 64, 10, 5]))
    assert sorted(shards.tolist()) == [15, 64, 70, 130]  # 10 and 5 pooled: one shard of 15
    shape = train_shape(cfg, shards)
    assert shape.steps_per_epoch == schedule.batches_per_epoch(shards.tolist(), 32) == 4 + 2 + 2 + 0
    assert shape.unused_pairs_per_epoch == schedule.unused_pairs(shards.tolist(), 32, "clustered", 0) == 2 + 6 + 0 + 15
    assert shape.batches_per_cluster == (0, 2.0, 4)
    merged = shard_sizes(config.load(None, ["train.global_batch_size=32"]), shape_of(cfg, [130, 70, 64, 10, 5]))
    assert sorted(merged.tolist()) == [64, 70, 145]  # merge: the small clusters join a large one


def test_cluster_sizes_at_an_imbalance():
    sizes = lognormal_sizes(1_000_003, 500, 1.5)
    assert sizes.total == 1_000_003 and sizes.items == 500
    assert imbalance_factor(sizes) == pytest.approx(1.5, rel=0.05)
    assert lognormal_sizes(1000, 10, 1.0).tolist() == [100] * 10


def test_files_follow_the_stages_rules():
    """Shard files: sub-groups of shard.max_group_rows, files of batches_per_file global batches; assign: units
    of whole 8,192-row groups up to 32,768 rows per embeddings file."""
    cfg = config.load(None, ["train.global_batch_size=100", "shard.batches_per_file=2", "shard.max_group_rows=1000"])
    # 450 rows: one group, files of 200 rows -> 3; 2,500 rows: 3 groups of ~834 -> 5 files each
    assert shard_files(cfg, np.array([450, 2500])) == 3 + 3 * 5
    assert assign_files([50_000, 8_192, 100]) == 2 + 1 + 1
    cfg = config.load(None, ["data.rows_per_part=1000", "embed.rows_per_unit=400"])
    files = embed_files(cfg, run_shape(cfg, 2500, 4, 8), 2)
    assert files.tolist() == sorted([400, 400, 200, 400, 400, 200, 375])  # 2,375 after 5% held out


def test_line_fit():
    assert line_fit([[100, 12.0], [400, 18.0]]) == pytest.approx((10.0, 0.02))
    assert line_fit([[100, 5.0]]) == (0.0, 0.05)
    assert line_fit([[100, 6.0], [400, 4.0]]) == (4.0, 0.0)  # no growth: start-up only (flagged)


def test_shard_shuffle_grows_with_its_partitions_and_a_run_wall_is_scaled_without_it():
    """shard's shuffle terms are its hash partitions (one per (shard, sub-group) key, up to MIN_PARTITIONS) and its
    input blocks (assign/ row groups) x partitions, at the rate of the path the shuffle takes; a run's measured wall
    scales the calibrated line only after the plan's k terms at the run's own size come off."""
    from clusterscale.plan.rates import Rates, ShuffleRate, StageRate, k_terms_s, merge_run_costs
    from clusterscale.plan.shape import ShuffleWork, shuffle_work

    cfg = config.load(None, ["train.global_batch_size=32", "shard.max_group_rows=100000"])
    work = {k: shuffle_work("shard", cfg, shape_of(cfg, [1000] * k)) for k in (50, 200, 400)}
    blocks = {k: math.ceil(1000 * k / EMBEDDINGS_ROW_GROUP_ROWS) for k in work}
    assert work[50] == ShuffleWork(50, blocks[50]) and work[200] == ShuffleWork(200, blocks[200])
    assert work[400] == ShuffleWork(200, blocks[400])  # MIN_PARTITIONS
    assert shuffle_work("assign", cfg, shape_of(cfg, [1000] * 50)) == ShuffleWork()
    rates = Rates(stages={"shard": StageRate(10.0, 1e-4, "cal")},
                  shuffle={"object store": ShuffleRate(0.01, 0.0), "local files": ShuffleRate(0.002, 0.001)})
    assert k_terms_s(rates, 0.0, ShuffleWork(100, 50), 2) == pytest.approx(0.5)
    assert k_terms_s(rates, 0.0, ShuffleWork(100, 50), 2, shuffle_path="local files") == pytest.approx(2.6)
    # the line says 10 + 1e-4 x 100,000 / 2 = 15 s; measured 30.5 s of which 0.5 s is the shuffle term: scale 2
    merge_run_costs(rates, {"shard": {"wall_s": 30.5}}, {"shard": 100_000.0}, 2, "run", {"shard": 0.5})
    assert rates.stages["shard"].fixed_s == pytest.approx(20.0) and rates.stages["shard"].cpu_s_per_work == \
        pytest.approx(2e-4)


def test_the_planner_takes_the_shuffle_rate_of_the_path_its_shuffle_goes(tmp_path):
    """Below ray.disk_shuffle_min_mib of input the shuffle stays in the object store, from it on it goes through local
    files (runtime/bounded_data.shuffle_for), and the plan adds that path's rate; an older calibration file's one
    rate per row and partition (timed on 8,192-row blocks) stands for both paths, per block x partition."""
    from clusterscale.plan.cluster import this_machine
    from clusterscale.plan.estimate import Models, Planner
    from clusterscale.plan.rates import Rates, ShuffleRate, rates_from_calibration
    from clusterscale.plan.shape import run_shape, shuffle_work

    cfg = config.load(None, ["ray.disk_shuffle_min_mib=64"])
    rates = Rates(bytes_per_row={"pairs": 400.0},
                  shuffle={"object store": ShuffleRate(0.01, 0.0), "local files": ShuffleRate(0.0, 0.001)})
    for rows, path in ((50_000, "object store"), (2_000_000, "local files")):
        shape = run_shape(cfg, rows, 50, 384, None)
        planner = Planner(cfg, shape, this_machine(), rates, Models(0, 0, 0, 0, 0, 0, ""), None)
        assert planner.shuffle_path("shard") == path
        work = shuffle_work("shard", cfg, shape)
        expected = 0.01 * work.partitions if path == "object store" else 0.001 * work.pieces
        assert planner.k_terms("shard", 1) == pytest.approx(expected)
    old = rates_from_calibration({"format": CALIBRATION_FORMAT, "shuffle_cpu_s_per_row_partition": 2e-7}, "old.json")
    assert old.shuffle == {p: ShuffleRate(0.0, 2e-7 * 8192) for p in ("object store", "local files")}


def test_fits_driver_holds_every_actors_sums():
    """fit's driver gathers each k-means actor's float64 (k, d) sums of a Lloyd step at once (stages/kmeans.py): the
    plan counts actors + 1 of them (one actor per GPU, else per node)."""
    from clusterscale.plan.cluster import ClusterSpec
    from clusterscale.plan.estimate import Models, Planner
    from clusterscale.plan.rates import Rates
    from clusterscale.plan.shape import run_shape

    cfg = config.load(None, [])
    shape = run_shape(cfg, 1_000_000, 1000, 768, None)
    for gpus, nodes, actors in ((0, 1, 1), (0, 4, 4), (64, 8, 64)):
        cluster = ClusterSpec(nodes=nodes, cpus_per_node=16, gpus_per_node=gpus // nodes,
                              gpu_type="H100" if gpus else None, node_memory_bytes=64 * 2**30, node_disk_bytes=None,
                              source="test")
        planner = Planner(cfg, shape, cluster, Rates(bytes_per_row={"pairs": 400.0}), Models(0, 0, 0, 0, 0, 0, ""),
                          None)
        assert planner.task_bytes("fit")[1] == (actors + 1) * 1000 * 768 * 8


def test_mines_disk_is_the_sidecar_layouts_formula():
    """plan's disk for mine is train/negatives.mine_disk_bytes: candidates per query, the draw's texts per row (M x
    the epochs, at most candidates / M draws) and the search results until merged; without mined negatives, no
    sidecars."""
    from clusterscale.plan.cluster import this_machine
    from clusterscale.plan.estimate import Models, Planner
    from clusterscale.plan.rates import Rates
    from clusterscale.plan.shape import run_shape
    from clusterscale.io.negatives import mine_disk_bytes

    def disk(*keys: str) -> dict:
        cfg = config.load(None, ["mine.range_max=30", "mine.nprobe=4", *keys])
        shape = run_shape(cfg, 1_000_000, 100, 384, None)
        planner = Planner(cfg, shape, this_machine(), Rates(bytes_per_row={"pairs": 400.0}),
                          Models(0, 0, 0, 0, 0, 0, ""), None)
        return planner.outputs("mine")[0], shape.train_rows, planner.text_bytes

    one, rows, text = disk("train.negatives_per_query=1")
    assert one == mine_disk_bytes(rows, 30, 1, 1, text, 4)
    assert one["negatives/rows"] == pytest.approx(rows * (8 + text + 16))
    assert one["negatives/_search"] == rows * 4 * 30 * 13
    three, _, _ = disk("train.negatives_per_query=2", "train.epochs=3")
    assert three["negatives/rows"] == pytest.approx(rows * (8 + 2 * 3 * (text + 16)))
    capped, _, _ = disk("train.negatives_per_query=10", "train.epochs=50")
    assert capped["negatives/rows"] == pytest.approx(rows * (8 + 10 * 3 * (text + 16)))  # ceil(30 / 10) draws
    assert disk("train.negatives_per_query=0")[0]["negatives/rows"] == 0


def test_dedup_time_is_a_line_in_rows_plus_its_semantic_and_shuffle_terms(tmp_path):
    """dedup: a line in rows (mark, exact, writes), plus rows x cluster rows x d of the semantic pass at its own
    measured rate and rows x (k + 1) partitions of its cluster shuffle; a calibration file without the semantic
    rate (its dedup line was per rows x rows / k) has its dedup line dropped, with a note."""
    from clusterscale.plan.rates import Rates, ShuffleRate, k_terms_s, rates_from_calibration
    from clusterscale.plan.shape import ShuffleWork, semantic_work, shuffle_work, stage_work

    on = config.load(None, ["dedup.exact=true", "dedup.semantic_threshold=0.9"])
    exact_only = config.load(None, ["dedup.exact=true"])
    for k in (50, 200):
        shape = RunShape(600_000, 600_000, 0, k, 384, np.full(k, 600_000 // k), "test")
        assert stage_work("dedup", on, shape) == 600_000
        assert semantic_work("dedup", on, shape) == pytest.approx(600_000 * (600_000 / k) * 384)
        assert shuffle_work("dedup", on, shape) == ShuffleWork(k + 1, math.ceil(600_000 / EMBEDDINGS_ROW_GROUP_ROWS))
        assert semantic_work("dedup", exact_only, shape) == 0 and shuffle_work("dedup", exact_only, shape).pieces == 0
        assert semantic_work("mine", on, shape) == semantic_work("assign", on, shape) == 0
    rates = Rates(semantic_cpu_s_per_row_row_d=1e-11, shuffle={"object store": ShuffleRate(1e-3, 1e-4)})
    assert k_terms_s(rates, 0.0, ShuffleWork(100, 10), 2, semantic=4e11) == pytest.approx((0.1 + 0.1 + 4.0) / 2)
    old = {"format": CALIBRATION_FORMAT, "stages": {s: {"points": [], "fixed_s": 2.0, "cpu_s_per_work": 1e-6}
                                                    for s in ("shard", "dedup")}}
    rates = rates_from_calibration(old, "old.json")
    assert "dedup" not in rates.stages and "shard" in rates.stages
    assert any(n.startswith("dedup: old.json predates") for n in rates.notes)
    rates = rates_from_calibration({**old, "semantic_cpu_s_per_row_row_d": 5e-11}, "new.json")
    assert rates.stages["dedup"].cpu_s_per_work == 1e-6 and rates.semantic_cpu_s_per_row_row_d == 5e-11


def write_calibration(path) -> str:
    stages = {s: {"points": [], "fixed_s": 2.0, "cpu_s_per_work": 1e-6, "cpus": 2, "task_base_mb": 100.0,
                  "driver_base_mb": 200.0} for s in ("ingest", "fit", "assign", "shard")}
    path.write_text(json.dumps({"format": CALIBRATION_FORMAT, "stages": stages, "bytes_per_row": {"pairs": 300.0}}))
    return str(path)


def test_plan_json_keys_and_text(tmp_path, capsys):
    out = tmp_path / "plan.json"
    calibration = write_calibration(tmp_path / "cal.json")
    assert cli.main(["plan", "--rows", "1000000", "--k", "100,400", "--gpus", "16", "--gpu-type", "H100",
                     "--nodes", "2", "--calibration", calibration, "--price-per-gpu-hour", "2.5",
                     "--set", "train.global_batch_size=1024", "train.use_gpu=true", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| assign | cpu |" in text and "steps per epoch" in text
    plan = json.loads(out.read_text())
    assert list(plan)[:3] == ["stages", "preprocess_over_train", "warnings"]
    assert set(plan["stages"]) == {"ingest", "embed", "fit", "assign", "dedup", "shard", "mine", "train", "evaluate"}
    for name, stage in plan["stages"].items():
        assert STAGE_KEYS <= set(stage), name
    assert plan["stages"]["embed"]["runs_on"] == "gpu" and plan["stages"]["assign"]["runs_on"] == "cpu"
    assert plan["stages"]["assign"]["peak_task_mb"] > 100  # formula + the calibrated footprint
    assert plan["preprocess_over_train"] > 0
    assert plan["stages"]["evaluate"]["wall_s"] > 0  # on the GPU: FLOPs at the datasheet MFU
    assert plan["stages"]["shard"]["time_from"].startswith("calibrated")
    assert [(r["k"], r["rows"]) for r in plan["table"]] == [(k, n) for k in (100, 400)
                                                            for n in (250_000, 1_000_000, 4_000_000)]
    # 1M pairs less 5% held out, at k=400 clusters of ~2 batches of 1,024: the mean-cluster warning
    small = make_plan(PlanRequest(None, ["train.global_batch_size=1024"], None, 1_000_000, [400], None, 16, "H100", 2,
                                  None, calibration, None, None))
    assert any("global batches (< 10)" in w for w in small["warnings"])


def test_a_stage_without_a_rate_is_null_and_named(tmp_path):
    """On this machine's CPUs with no rate for embed (the calibration has none, nor a matmul rate), embed's figures
    are null in strict JSON, the stage is named, and the ratio sums the stages that have a rate."""
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--rows", "20000", "--calibration", write_calibration(tmp_path / "cal.json"),
                     "--json", str(out)]) == 0
    plan = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert plan["stages"]["embed"]["wall_s"] is None and plan["stages"]["fit"]["wall_s"] > 0
    assert any("no rate for embed" in n for n in plan["notes"])


@pytest.mark.parametrize("argv, said", [
    (["plan", "--rows", "1000", "--set", "cluster.k=-3"], "cluster.k"),
    (["plan", "--rows", "1000", "--cluster", "cluster_configs/scale-100m.yaml"], "CONFIG argument"),
    (["plan", "--rows", "1000", "--gpus", "8", "--gpu-type", "Z9000"], "Z9000"),
    (["plan", "--rows", "0"], "--rows"),
    (["plan", "no-such-config.yaml", "--rows", "1000"], "does not exist"),
])
def test_plan_user_errors_exit_2(argv, said, capsys):
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert cli.main(argv) == 2
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and "Traceback" not in err


def test_prediction_table():
    prediction = {"stages": {"assign": {"wall_s": 12.0}, "train": {"wall_s": 100.0}, "mine": {"wall_s": 1.0}},
                  "train_shape": {"steps_per_epoch": 50}}
    table = report.prediction_table(prediction, {"assign": {"wall_s": 10.0},
                                                 "train:clustered-seed0": {"wall_s": 25.0, "steps": 10}})
    assert "| assign | 12.0 | 10.0 | +20% |" in table
    assert "| train | 20.0 | 25.0 | -20% |" in table and "mine" not in table


def test_plan_files_equal_a_finished_run(shared_run):
    """The shard, assign and embeddings file counts the plan gives for the shared run's sizes are the files it
    wrote (the formulas are the stages' own rules)."""
    run = shared_run.run
    cfg = config.load(None, [], run_config=config.parse_yaml(run.read_bytes("config.yaml"), "config.yaml"))
    manifest = json.loads(run.read_bytes(f"shards/k={cfg.cluster.k}/manifest.json"))
    sizes = np.array([c["rows"] for c in manifest["clusters"]])
    written = sum(len(c["files"]) for c in manifest["clusters"])
    assert shard_files(cfg, sizes) == written
    embedded = [f for f in run.files("embeddings")]
    costs = run.read_json("report/costs.json")
    shape = run_shape(cfg, costs["ingest"]["rows_in"], cfg.cluster.k, 8)
    rows = costs["embed"]["rows"]
    shape = RunShape(shape.rows_in, rows, shape.heldout_rows, shape.k, 8, shape.cluster_sizes, "test")
    assert embed_files(cfg, shape, costs["embed"]["actors"]).items == len(embedded)
    import pyarrow.parquet as pq
    per_file = [pq.ParquetFile(run.fs.open_input_file(f)).metadata.num_rows for f in embedded]
    assert assign_files(per_file) == len(run.files(f"assign/k={cfg.cluster.k}"))
    # The FLOP arithmetic counts the run's own tokens (a sample of pairs/, capped as the stages cap them), which
    # report's costs count too, not the configured caps.
    from clusterscale.plan.build import models_of
    from clusterscale.stages.costs import mean_tokens

    tokens = mean_tokens(run, cfg)
    models = models_of(cfg, tokens)
    assert models.embed_tokens == tokens["embed"] < cfg.embed.max_length
    assert models.train_tokens == tokens["train_query"] + tokens["train_passage"]
    assert "the mean of" in models.note and models_of(cfg).embed_tokens == cfg.embed.max_length


@pytest.mark.integration
def test_gpu_check_quick_writes_what_plan_reads(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    data = json.loads(out.read_text())
    assert {"minilm", "bert-base"} <= set(data["encoder"]) and data["train_step"]["pairs_per_s"] > 0
    plan = make_plan(PlanRequest(None, [], None, 100_000, [10], None, 8, "H100", 1, None,
                                 write_calibration(tmp_path / "cal.json"), str(out), None))
    assert "datasheet" in plan["stages"]["embed"]["time_from"]  # a CPU --quick file has no MFU: datasheet stays


def test_a_runs_costs_scale_the_calibrated_line_and_keep_its_start_up():
    """One measured size cannot split start-up from per-row time: the calibration's line keeps the split, the run
    scales it (here the run was twice as slow as the line says); a stage without a line is proportional, flagged."""
    from clusterscale.plan.rates import Rates, StageRate, merge_run_costs

    rates = Rates(stages={"shard": StageRate(10.0, 1e-4, "calibrated", 50.0, 20.0)})
    work = 200_000  # the line at 2 CPUs: 10 + 1e-4 x 200k / 2 = 20 s
    merge_run_costs(rates, {"shard": {"wall_s": 40.0}, "assign": {"wall_s": 8.0}}, {"shard": work, "assign": work},
                    2, "measured")
    shard, assign = rates.stages["shard"], rates.stages["assign"]
    assert (shard.fixed_s, shard.cpu_s_per_work) == pytest.approx((20.0, 2e-4))
    assert (shard.task_base_mb, shard.driver_base_mb, shard.source) == (50.0, 20.0, "measured")
    assert shard.fixed_s + shard.cpu_s_per_work * 4 * work / 2 == pytest.approx(100.0)  # 4x the rows: not 160 s
    assert (assign.fixed_s, assign.cpu_s_per_work) == pytest.approx((0.0, 8.0 * 2 / work))
    assert any(note.startswith("assign: one measured size") for note in rates.notes)


def test_dedup_memory_is_at_least_its_shuffle_worker_by_where_the_shuffle_goes(tmp_path):
    """dedup's largest process is a worker of its hash shuffle (one 64 MiB input batch), at the size measured for the
    object-store shuffle below ray.disk_shuffle_min_mib of input and for the shuffle through local files above;
    in proportion below one batch; never below the per-cluster task."""
    from clusterscale.plan.estimate import DEDUP_SHUFFLE_WORKER_MB

    calibration = write_calibration(tmp_path / "cal.json")

    def dedup_mb(rows: int, *keys: str) -> float:
        out = tmp_path / f"plan-{rows}-{len(keys)}.json"
        assert cli.main(["plan", "--rows", str(rows), "--k", "50", "--calibration", calibration, "--json", str(out),
                         "--set", "dedup.exact=true", "dedup.semantic_threshold=0.9", *keys]) == 0
        return json.loads(out.read_text())["stages"]["dedup"]["peak_task_mb"]

    # ~0.9 kB a row (bundled encoder, d = 384, fp16 vectors + text): 150k rows ~130 MB, 600k ~520 MB of input
    assert dedup_mb(150_000) == DEDUP_SHUFFLE_WORKER_MB["object store"]
    assert dedup_mb(600_000) == DEDUP_SHUFFLE_WORKER_MB["local files"]
    assert dedup_mb(600_000, "ray.disk_shuffle=false") == DEDUP_SHUFFLE_WORKER_MB["object store"]
    small = dedup_mb(20_000)
    assert 0 < small < DEDUP_SHUFFLE_WORKER_MB["object store"]
    # a whole cluster of 3M rows per task: the per-cluster task is the larger
    assert dedup_mb(150_000_000, "dedup.max_group_rows=3000000") > DEDUP_SHUFFLE_WORKER_MB["local files"]


def test_shuffle_bytes_are_the_rows_each_stage_moves(tmp_path):
    """shard moves text rows; mine each passage and query once per probed cluster, one fp16 vector and its keys each
    (no text: stages/mine.shuffles); dedup whole assign/ rows (text, vectors, cluster and cosine) once by cluster, and
    once more by key bucket with dedup.exact."""
    calibration, rows = write_calibration(tmp_path / "cal.json"), 200_000

    def moved(*keys: str) -> dict[str, float]:
        out = tmp_path / f"plan-{len(keys)}.json"
        assert cli.main(["plan", "--rows", str(rows), "--k", "50", "--calibration", calibration, "--json", str(out),
                         "--set", "train.negatives_per_query=1", *keys]) == 0
        return {name: s["shuffle_bytes"] for name, s in json.loads(out.read_text())["stages"].items()}

    semantic = moved("dedup.semantic_threshold=0.9")
    both = moved("dedup.semantic_threshold=0.9", "dedup.exact=true")
    cfg = config.load(None, [])
    train_rows = semantic["shard"] / 300  # write_calibration's 300 text bytes a pair; the held-out rows left out
    assert 0.9 * rows < train_rows < rows
    vectors = 2 * 384 * (2 if cfg.embed.side == "both" else 1)  # fp16, the bundled encoder's d
    assert semantic["dedup"] == pytest.approx(train_rows * (300 + vectors + 8))
    assert both["dedup"] == pytest.approx(2 * semantic["dedup"])
    from clusterscale.io.sizing import ROUTED_ROW_BYTES
    assert semantic["mine"] == pytest.approx(train_rows * (1 + cfg.mine.nprobe) * (2 * 384 + ROUTED_ROW_BYTES))
    assert semantic["embed"] == semantic["fit"] == 0


def test_dedup_shuffle_worker_from_the_calibration_when_it_measured_one(tmp_path):
    """`plan --calibrate` measures dedup's shuffle worker (through the object store); plan uses a calibration's
    figures, and says so, instead of the 2-core box's."""
    path = tmp_path / "cal.json"
    data = json.loads(open(write_calibration(path)).read())
    data["dedup_shuffle_worker_mb"] = {"object store": 500.0, "local files": 900.0}
    path.write_text(json.dumps(data))

    def dedup(rows: int) -> dict:
        out = tmp_path / f"plan-{rows}.json"
        assert cli.main(["plan", "--rows", str(rows), "--k", "50", "--calibration", str(path), "--json", str(out),
                         "--set", "dedup.exact=true", "dedup.semantic_threshold=0.9"]) == 0
        return json.loads(out.read_text())["stages"]["dedup"]

    assert dedup(150_000)["peak_task_mb"] == 500.0 and dedup(600_000)["peak_task_mb"] == 900.0
    assert "measured by --calibrate" in dedup(600_000)["memory_from"]


def test_train_has_an_io_term_that_sets_the_pace_when_reads_are_slower_than_steps():
    """A rank's reads from an object store per epoch: REQUESTS_PER_FILE requests per step (twice with mined
    negatives' sidecars) and its bytes, READ_THREADS at once; train's wall is the slower of compute and reads."""
    from clusterscale.plan import estimate
    from clusterscale.plan.cluster import ClusterSpec
    from clusterscale.plan.estimate import Models, Planner
    from clusterscale.plan.rates import Rates
    from clusterscale.plan.shape import run_shape
    from clusterscale.train.data import READ_THREADS

    def planner(*keys: str, flop_params: float = 1e8) -> Planner:
        cfg = config.load(None, ["train.num_workers=8", "train.global_batch_size=4096", "train.use_gpu=true", *keys])
        cluster = ClusterSpec(nodes=1, cpus_per_node=96, gpus_per_node=8, gpu_type="H100",
                              node_memory_bytes=1024 * 2**30, node_disk_bytes=None, source="test")
        return Planner(cfg, run_shape(cfg, 10_000_000, 100, 768, None), cluster,
                       Rates(bytes_per_row={"pairs": 400.0}), Models(flop_params, flop_params, flop_params, flop_params, 64, 128, ""),
                       None)

    plain, mined = planner(), planner("train.negatives_per_query=1")
    steps = plain.train.steps_per_epoch
    step = (estimate.REQUESTS_PER_FILE * estimate.STORE_REQUEST_S
            + 512 * (400 + 8) / estimate.STORE_STREAM_BYTES_S) / READ_THREADS
    assert plain.train_read_s() == pytest.approx(steps * step)
    assert mined.train_read_s() > 2 * plain.train_read_s()  # the sidecar's requests and the drawn texts
    big = plain.stage("train")
    assert big.read_s == pytest.approx(plain.train_read_s()) and big.wall_s > big.read_s  # compute-bound
    assert "bound by its reads" not in big.time_from
    tiny = planner(flop_params=1e3)  # a step's compute shorter than its reads: the reads set the pace
    small = tiny.stage("train")
    assert small.wall_s == pytest.approx(small.read_s) and "bound by its reads" in small.time_from
    assert any("a rank's reads" in w for w in tiny.warnings(tiny.plan()))


def test_this_machine_counts_its_cuda_gpus(monkeypatch):
    """`plan` without --cluster/--gpus on a GPU node plans its GPUs (benchmarks/gpu_pipeline.py's prediction); a GPU
    model without datasheet figures is planned as a CPU node."""
    import torch

    from clusterscale.plan.cluster import this_machine

    assert this_machine().gpus == 0  # this CPU box
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    spec = this_machine()
    assert (spec.gpus, spec.gpu_type, spec.source) == (1, "H200", "this machine")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Some Future Accelerator")
    assert this_machine().gpus == 0


def test_dedup_counts_the_held_out_embedding_it_runs(tmp_path):
    """With its semantic check on, dedup runs embed_heldout first: its wall adds the held-out rows at embed's rate
    (the GPUs' here) and its disk their vectors (embeddings_heldout/); an exact-only dedup does neither."""
    stages = {s: {"points": [], "fixed_s": 2.0, "cpu_s_per_work": 1e-6, "cpus": 2} for s in
              ("ingest", "fit", "assign", "shard", "dedup")}
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"format": CALIBRATION_FORMAT, "stages": stages, "bytes_per_row": {},
                                       "semantic_cpu_s_per_row_row_d": 1e-11}))

    def dedup(*keys: str, fraction: float) -> dict:
        request = PlanRequest(None, [f"data.heldout_fraction={fraction}", "dedup.exact=true", *keys], None,
                              1_000_000, [100], None, 8, "H100", 1, None, str(calibration), None, None)
        return make_plan(request)["stages"]["dedup"]

    small, large = (dedup("dedup.semantic_threshold=0.9", fraction=f) for f in (0.01, 0.3))
    assert "embed_heldout: 10,000 held-out texts" in small["time_from"]
    assert "embed_heldout: 300,000 held-out texts" in large["time_from"] and large["wall_s"] > 0
    assert large["disk_bytes_by_folder"]["embeddings_heldout"] > 20 * small["disk_bytes_by_folder"]["embeddings_heldout"]
    exact = dedup(fraction=0.3)
    assert "embeddings_heldout" not in exact["disk_bytes_by_folder"] and "embed_heldout" not in exact["time_from"]
