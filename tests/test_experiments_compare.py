"""`clusterscale compare` on tiny data: every arm trained on the same shards, evaluated, summarised with spread."""
from __future__ import annotations

import json

import numpy as np
import pytest

from clusterscale import cli
from tests.conftest import SHARED_EASY_STEPS, SHARED_MINED_ARM, SHARED_SAMPLERS, SHARED_SEEDS, tiny_overrides

SAMPLERS, SEEDS, MINED = SHARED_SAMPLERS, SHARED_SEEDS, SHARED_MINED_ARM
ARMS = SAMPLERS + (MINED,)
STEPS = 6  # the shared run's train.steps: compare ran without --set, on the finished run's config


@pytest.fixture(scope="module")
def compared(shared_run):
    """conftest's shared run: `run`, then `compare --samplers clustered,random,random+mined --seeds 2` on it (then
    more verbs)."""
    return shared_run.run


def runs(run, arm: str) -> list[str]:
    """The arm's training per seed, as compare.json names them."""
    return run.read_json("report/compare.json")["arms"][arm]["runs"]


def test_the_runs_own_training_is_the_clustered_arms_seed0_and_the_rest_train_under_compares_names(compared):
    """`run` trained clustered seed 0 with the very config of compare's clustered arm: compare reused it (and its
    evaluation) instead of training it again as compare-clustered-seed0."""
    run = compared
    assert runs(run, "clustered") == ["clustered-seed0", "compare-clustered-seed1"]
    assert not run.exists("train/compare-clustered-seed0") and not run.exists("eval/compare-clustered-seed0.json")
    assert "train:compare-clustered-seed0" not in run.read_json("report/costs.json")
    for arm in ARMS[1:]:
        assert runs(run, arm) == [f"compare-{arm}-seed{s}" for s in range(SEEDS)]


def test_an_arm_reuses_only_a_finished_training_with_its_exact_config(tmp_path):
    from clusterscale import config as config_mod
    from clusterscale.config import variant
    from clusterscale.experiments import _the_runs_own_when_same
    from clusterscale.io.rundir import RunDir
    from clusterscale.pipeline import STAGES

    run, cfg = RunDir(str(tmp_path / "run")), config_mod.load(None, ["train.steps=5"])
    arm = variant(cfg, train={"seed": 0, "name": "compare-clustered-seed0"})
    assert _the_runs_own_when_same(cfg, run, arm, {}) is arm  # nothing trained yet
    run.mark_done("train/clustered-seed0", STAGES["train"].fingerprint_of(cfg, run), {"steps": 5})
    assert _the_runs_own_when_same(cfg, run, arm, {}).train_name() == "clustered-seed0"
    assert _the_runs_own_when_same(cfg, run, arm, {"replace": "changed"}) is arm  # --replace: trained anew
    other = variant(arm, train={"steps": 4})
    assert _the_runs_own_when_same(cfg, run, other, {}) is other  # another config: its own training
    seed1 = variant(arm, train={"seed": 1, "name": "compare-clustered-seed1"})
    assert _the_runs_own_when_same(cfg, run, seed1, {}) is seed1


def test_every_arm_trained_for_the_same_steps_on_the_same_shards(compared):
    run = compared
    manifest_fp = run.read_json("shards/k=4/manifest.json")["fingerprint"]
    for arm in ARMS:
        for seed, name in enumerate(runs(run, arm)):
            done = run.read_json(f"train/{name}/_DONE.json")
            assert done["stats"]["steps"] == STEPS and done["stats"]["sampler"] == arm.removesuffix("+mined")
            assert done["config"]["train"]["seed"] == seed
            lines = run.read_bytes(f"train/{name}/metrics.jsonl").decode().splitlines()
            assert len(lines) == STEPS
            assert run.exists(f"eval/{name}.json")
    assert run.read_json("shards/k=4/manifest.json")["fingerprint"] == manifest_fp
    # Different seeds give different batch schedules, so different losses.
    first, second = ([json.loads(x)["loss"] for x in run.read_bytes(f"train/{name}/metrics.jsonl").decode().splitlines()]
                     for name in runs(run, "clustered"))
    assert first != second


def test_compare_json_mean_and_spread_match_the_eval_files(compared):
    run = compared
    summary = run.read_json("report/compare.json")
    assert list(summary["arms"]) == list(ARMS)
    for sampler, arm in summary["arms"].items():
        values = [run.read_json(f"eval/{name}.json")["metrics"]["ndcg_at_10"] for name in runs(run, sampler)]
        stats = arm["metrics"]["ndcg_at_10"]
        assert stats["values"] == pytest.approx(values)
        assert stats["mean"] == pytest.approx(np.mean(values))
        assert stats["std"] == pytest.approx(np.std(values, ddof=1))
        assert stats["min"] == pytest.approx(min(values)) and stats["max"] == pytest.approx(max(values))
    paired = summary["paired_vs_random"]["clustered"]
    diffs = [run.read_json(f"eval/{c}.json")["metrics"]["ndcg_at_10"] - run.read_json(f"eval/{r}.json")["metrics"]["ndcg_at_10"]
             for c, r in zip(runs(run, "clustered"), runs(run, "random"))]
    assert paired["mean"] == pytest.approx(np.mean(diffs))
    from scipy import stats as st

    half = st.t.ppf(0.975, SEEDS - 1) * np.std(diffs, ddof=1) / np.sqrt(SEEDS)
    both = summary["paired"]["clustered - random"]
    assert both["ndcg_at_10"]["ci95"] == pytest.approx([np.mean(diffs) - half, np.mean(diffs) + half])
    assert set(both) == {"ndcg_at_10", "mrr_at_10"}
    assert summary["frozen"] == run.read_json("eval/frozen.json")["metrics"]


def test_costs_and_report_cover_every_arm(compared):
    run = compared
    costs = run.read_json("report/costs.json")
    for sampler in ARMS:
        for name in runs(run, sampler):
            # The run's own training (reused by compare) was evaluated by `run`, in the record "evaluate".
            assert f"train:{name}" in costs and (f"evaluate:{name}" in costs or name == "clustered-seed0")
    assert "evaluate" in costs and "clustered-seed0" in run.read_json("report/cost_summary.json")["train_runs"]
    report = run.read_bytes("report/report.md").decode()
    assert "## Compare: samplers over seeds" in report and "± " in report
    assert "clustered - random, paired by seed: NDCG@10" in report and "95% interval" in report
    assert run.exists("report/paired.png")
    assert "![compare](compare.png)" in report and run.exists("report/compare.png")
    # The per-cluster breakdown includes every arm, not only the last one evaluated (and the run's own model,
    # which `run` evaluated before the compare).
    breakdown = run.read_json("eval/by_cluster/k=4.json")
    models = {m for row in breakdown["clusters"].values() for m in row["ndcg_at_10"]}
    assert models == {"frozen", "clustered-seed0"} | {name for s in ARMS for name in runs(run, s)}
    assert len(models) == 2 + len(ARMS) * SEEDS - 1  # clustered seed 0 is the run's own


def test_the_mined_arm_mines_once_for_every_seed_after_its_easy_first_phase(compared):
    run = compared
    mined_at = run.read_json("negatives/_DONE.json")["finished_at"]
    for seed in range(SEEDS):
        name = f"compare-{MINED}-seed{seed}"
        assert run.read_json(f"train/{name}/_DONE.json")["finished_at"] > mined_at  # mined before, not per seed
        steps = [json.loads(x) for x in run.read_bytes(f"train/{name}/metrics.jsonl").decode().splitlines()]
        assert [s["mined_negatives"] > 0 for s in steps] == [s["step"] >= SHARED_EASY_STEPS for s in steps]
    costs = run.read_json("report/costs.json")
    assert [k for k in costs if k.startswith("mine")] == ["mine"]
    summary = run.read_json("report/compare.json")
    assert summary["arms"][MINED]["train_keys"] == {"sampler": "random", "negatives_per_query": 1,
                                                    "negatives_curriculum_steps": SHARED_EASY_STEPS}


def test_each_arm_costs_its_own_preprocessing_and_the_gain_per_hour_follows(compared):
    """Per arm: the stages its method needs, summed from the run's cost records (shared stages once in the total),
    its training cost per seed, and the paired NDCG@10 gain over random per extra preprocessing worker-hour."""
    run = compared
    summary, costs = run.read_json("report/compare.json"), run.read_json("report/costs.json")
    arms = summary["arms"]
    assert arms["random"]["preprocess"]["stages"] == ["ingest", "shard:random"]
    assert arms["clustered"]["preprocess"]["stages"] == ["ingest", "embed", "fit", "assign", "shard"]
    assert arms[MINED]["preprocess"]["stages"] == ["ingest", "embed", "fit", "assign", "shard", "shard:random", "mine"]
    for name, arm in arms.items():
        pre = arm["preprocess"]
        assert pre["worker_s"] == pytest.approx(sum(costs[k]["worker_s"] for k in pre["stages"]))
        assert pre["wall_s"] == pytest.approx(sum(costs[k]["wall_s"] for k in pre["stages"]))
        assert pre["cpu_s"] == pytest.approx(pre["worker_s"]) and pre["gpu_s"] == 0 and not pre["unrecorded"]
        extra = [k for k in pre["stages"] if k not in arms["random"]["preprocess"]["stages"]]
        assert pre["extra"]["stages"] == extra
        per_seed = [costs[f"train:{run_name}"]["worker_s"] for run_name in runs(run, name)]
        assert arm["train"]["worker_s_per_seed"] == pytest.approx(np.mean(per_seed))
    assert arms["random"]["gain_per_preprocess_hour"] is None  # no extra preprocessing over itself
    diff = summary["paired"][f"{MINED} - random"]["ndcg_at_10"]["mean"]
    hours = arms[MINED]["preprocess"]["extra"]["worker_s"] / 3600
    assert arms[MINED]["gain_per_preprocess_hour"]["ndcg_at_10"] == pytest.approx(diff / hours)
    total = summary["preprocess_total"]
    assert total["stages"] == arms[MINED]["preprocess"]["stages"]  # every stage any arm needs, once
    assert total["worker_s"] == pytest.approx(sum(costs[k]["worker_s"] for k in total["stages"]))
    report = run.read_bytes("report/report.md").decode()
    assert "gain per extra preprocessing hour" in report and run.exists("report/compare_cost.png")
    assert f"| {MINED} | " in report.split("Quality against cost")[1]


def test_study_table_prints_the_cost_table_from_compare_json(compared, capsys):
    from tests.test_benchmarks_code import load

    assert load("study_table").main([compared.path()]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.split("NDCG@10 gain per extra preprocessing hour |")[1].splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == list(ARMS)  # the data rows: after the header, "|-" rule
    summary = compared.read_json("report/compare.json")
    gain = summary["arms"][MINED]["gain_per_preprocess_hour"]["ndcg_at_10"]
    assert rows[-1].endswith(f"| {gain:+.4f} |") and "Preprocessing of the whole compare, each stage once" in out


def test_unknown_sampler_fails_before_any_work(tmp_path, tiny_model, ray_local, capsys):
    rc = cli.main(["compare", "--run-dir", str(tmp_path / "run"), "--samplers", "clustered,nonsense", "--seeds", "1",
                   "--set", *tiny_overrides(tiny_model, str(tmp_path / "none.parquet"))])
    assert rc == 2
    assert "train.sampler" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_named_and_custom_arms_resolve_to_train_keys():
    from clusterscale import config as config_mod
    from clusterscale.config import ConfigError
    from clusterscale.experiments import arm_keys, parse_arm

    cfg = config_mod.load(None, ["train.steps=5"])
    assert arm_keys("random", cfg, {}) == {"sampler": "random"}
    assert arm_keys("clp", cfg, {}) == {"sampler": "clustered", "negatives_per_query": 1, "loss": "clp"}
    assert arm_keys("recluster", cfg, {})["recluster_every"] == 3  # two segments: 3 + 2 steps
    name, keys = parse_arm("hard:train.negatives_per_query=4,train.sampler=random")
    assert (name, keys) == ("hard", {"negatives_per_query": 4, "sampler": "random"})
    with pytest.raises(ConfigError, match="only train"):
        parse_arm("bad:cluster.k=4")
    with pytest.raises(ConfigError, match="train.recluster_every"):
        arm_keys("recluster", config_mod.load(None, ["train.steps=null"]), {})


def test_compare_scores_every_arm_and_seed_on_an_mteb_task(shared_run, tmp_path, monkeypatch):
    """`compare --mteb local:FOLDER` on a copy of the shared run (every arm trained and evaluated: reused): the
    frozen encoder and each arm's seeds scored on the task, each arm's spread and its seed-paired difference to
    random per task, and the report's MTEB table."""
    import shutil

    from clusterscale.io.rundir import RunDir
    from tests.conftest import make_pairs

    monkeypatch.setenv("MTEB_CACHE", str(tmp_path / "mteb-cache"))
    task = tmp_path / "toy"
    (task / "qrels").mkdir(parents=True)
    rows = make_pairs(30, seed=5).to_pylist()
    (task / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "text": r["p"]}) + "\n"
                                               for i, r in enumerate(rows)))
    (task / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": r["q"]}) + "\n"
                                                for i, r in enumerate(rows[:15])))
    (task / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n"
                                                                                      for i in range(15)))
    shutil.copytree(shared_run.run.path(), tmp_path / "run")
    assert cli.main(["compare", "--run-dir", str(tmp_path / "run"), "--samplers", "clustered,random",
                     "--seeds", str(SEEDS), "--mteb", f"local:{task}"]) == 0
    run = RunDir(str(tmp_path / "run"))
    mteb = run.read_json("report/compare.json")["mteb"]
    assert mteb["tasks"] == ["LocalToy"] and 0 <= mteb["frozen"]["LocalToy"]["ndcg_at_10"] <= 1
    names = ["frozen", "clustered-seed0", "compare-clustered-seed1", "compare-random-seed0", "compare-random-seed1"]
    scores = {n: run.read_json(f"eval/mteb/{n}.json")["tasks"]["LocalToy"]["main_score"] for n in names}
    for arm in ("clustered", "random"):
        spread = mteb["arms"][arm]["LocalToy"]["main_score"]
        assert spread["mean"] == pytest.approx(np.mean([v for n, v in scores.items() if arm in n]))
    paired = mteb["paired"]["clustered - random"]["LocalToy"]["main_score"]
    assert paired["n"] == SEEDS and paired["mean"] == pytest.approx(
        np.mean([scores["clustered-seed0"] - scores["compare-random-seed0"],
                 scores["compare-clustered-seed1"] - scores["compare-random-seed1"]]))
    assert "### MTEB main score per arm" in run.read_bytes("report/report.md").decode()
