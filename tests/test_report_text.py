"""The report's text never prints a figure it cannot stand behind: refused or flagged extrapolations, tiny
samples marked, MTEB folded into the held-out table, no 'No evaluation yet' above a sweep's NDCG (no Ray)."""
from __future__ import annotations

import pytest

from clusterscale import config

from clusterscale.stages import report
from clusterscale.stages.costs import extrapolate, summarize
from clusterscale.io.rundir import RunDir


def test_negative_slope_is_refused_not_printed_as_zero():
    ext = extrapolate([(1000, 50.0), (4000, 40.0)], 100_000_000)
    assert ext["value"] is None and ext["warning"].startswith("refused: the fitted per-row cost")
    text = "\n".join(report.extrapolation_text({"target_rows": 100_000_000, "preprocess": ext,
                                                "train_epoch": extrapolate([(1000, 5.0), (4000, 20.0)], 1e8),
                                                "ratio_per_epoch": None}))
    assert "preprocessing not extrapolated" in text and "ratio n/a per epoch" in text
    assert "~0 worker-s" not in text and "ratio ~0" not in text
    assert "**Unreliable preprocessing extrapolation**: refused" in text


def test_start_up_dominated_fit_is_flagged_and_a_clean_fit_is_not():
    dominated = extrapolate([(1000, 30.0), (2000, 31.0)], 1e6)  # a=29 s, b x 2000 rows = 2 s
    assert dominated["value"] == pytest.approx(29.0 + 0.001 * 1e6)
    assert dominated["warning"].startswith("start-up dominated: the fixed cost a=29 s")
    clean = extrapolate([(1000, 11.0), (4000, 41.0)], 1e6)  # a=1 s, b=0.01 s/row
    assert clean["value"] == pytest.approx(1.0 + 0.01 * 1e6) and "warning" not in clean
    single = extrapolate([(1000, 10.0)], 1e6)
    assert single["value"] == pytest.approx(10_000.0) and "upper bound" in single["warning"]


def _eval(run: RunDir, name: str, scores: list[float]) -> None:
    run.write_json(f"eval/{name}.json", {"name": name, "metrics": {"ndcg_at_10": sum(scores) / len(scores)},
                                         "num_queries": len(scores),
                                         "per_query": {"pair_id": list(range(len(scores))), "ndcg_at_10": scores}})


def test_eval_table_marks_tiny_samples_and_folds_in_mteb(tmp_path):
    run = RunDir(str(tmp_path))
    assert report.eval_table(run) is None
    _eval(run, "frozen", [1.0, 0.0, 0.5])
    _eval(run, "clustered-seed0", [1.0, 1.0, 0.5])
    run.write_json("eval/mteb/clustered-seed0.json", {"model_name": "clustered-seed0", "mteb_version": "2",
                                                      "tasks": {"A": {"ndcg_at_10": 0.4}, "B": {"ndcg_at_10": 0.6}}})
    table = report.eval_table(run)
    frozen, trained = (line for line in table.splitlines() if line.startswith(("| frozen", "| clustered")))
    assert frozen.startswith("| frozen | 3 * | 0.5000 | 0.2887 |")  # s.e. = std(ddof=1) / sqrt(3)
    assert trained.endswith("| 0.5000 (2) |")  # MTEB mean NDCG@10 over its 2 tasks
    assert "fewer than 30 held-out queries" in table


def test_per_cluster_ndcg_from_one_query_is_marked():
    table = report.by_cluster_table({"clusters": {"0": {"queries": 1, "ndcg_at_10": {"frozen": 1.0}},
                                                  "1": {"queries": 40, "ndcg_at_10": {"frozen": 0.5}}}})
    assert "| 0 | 1 * | 1.0000 |" in table and "| 1 | 40 | 0.5000 |" in table
    assert "tiny sample" in table


def test_compare_with_one_seed_is_marked():
    stats = {"mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5, "values": [0.5]}
    table = report.compare_table({"arms": {"clustered": {"seeds": [0], "metrics": {"ndcg_at_10": stats,
                                                                                   "mrr_at_10": stats}}}})
    assert "| clustered | 1 * |" in table and "fewer than 3 seeds" in table


def test_sweep_report_does_not_claim_no_evaluation(tmp_path):
    run = RunDir(str(tmp_path))
    run.write_json("report/sweep.json", {"description": "k in [2]", "points": [
        {"rows": 100, "k": 2, "shards": 2, "min_rows": 40, "max_rows": 60, "mean_intra_cosine": 0.3,
         "min_intra_cosine": 0.2, "max_intra_cosine": 0.4, "fit_s": 1.0, "assign_s": 1.0, "shard_s": 1.0,
         "ndcg_at_10": 0.7, "frozen_ndcg_at_10": 0.6}]})
    text = open(report.write_report(config.load(None, []), run)).read()
    assert "No evaluation yet" not in text and "| 100 | 2 | 2 |" in text
    assert "sweep.png" in text


def _cost_text(tmp_path, stages: tuple[str, ...]) -> str:
    """The cost section's text of a run whose costs.json holds only `stages` (2 worker-s each, 600 pairs)."""
    cfg = config.load(None, ["cluster.k=4"])
    costs = {s: {"worker_s": 2.0, "wall_s": 2.0, "pairs": 600, "rows": 600, "preprocess": True} for s in stages}
    return "\n".join(report.cost_summary_text(summarize(cfg, RunDir(str(tmp_path)), costs)))


def test_cost_title_and_extrapolation_name_only_the_stages_that_ran(tmp_path):
    only_ingest = _cost_text(tmp_path, ("ingest",))
    assert only_ingest.startswith("Preprocessing (ingest; cost keys ingest) on 600 pairs: **2.0 worker-s** (so far: ")
    assert "embed" not in only_ingest.split("\n")[0] and "fit" not in only_ingest and "k=4" not in only_ingest
    assert "Extrapolation" not in only_ingest and "No extrapolation: it needs at least the embed stage" in only_ingest

    embedded = _cost_text(tmp_path, ("ingest", "embed"))
    assert embedded.startswith("Preprocessing (ingest + embed; cost keys ingest, embed) on 600 pairs")
    assert ("Extrapolation (not a measurement) to 100,000,000 pairs of ingest + embed, proportional to rows from "
            "the measured points (600 rows, 4.0 s): preprocessing so far (ingest + embed) ~6.67e+05 worker-s") in embedded

    complete = _cost_text(tmp_path, ("ingest", "embed", "fit", "assign", "shard"))
    assert complete.startswith("Preprocessing (ingest + embed + fit + assign + shard at k=4; cost keys ingest, embed, "
                               "fit, assign, shard) on 600 pairs: **10.0 worker-s**.")
    assert "pairs of ingest + embed + fit + assign + shard, " in complete and ": preprocessing ~1.67e+06" in complete
