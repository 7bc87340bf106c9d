"""benchmarks/bench_scale_train.py's figures from a run's records: read amplification and the rank's peak."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
SPEC = importlib.util.spec_from_file_location("bench_scale_train", os.path.join(BENCH, "bench_scale_train.py"))
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_read_amplification_sums_over_steps(tmp_path):
    # a first step that reads every shard (random sampler before shard sets), then steps that read what they use
    records = [{"step": 0, "bytes_read": 10_000, "bytes_used": 500},
               {"step": 1, "bytes_read": 0, "bytes_used": 500},
               {"step": 2, "bytes_read": 0, "bytes_used": 1_000}]
    (tmp_path / "train" / "t").mkdir(parents=True)
    (tmp_path / "train" / "t" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    read_back = bench.metrics_records(str(tmp_path), "t")
    assert read_back == records
    assert bench.read_amplification(read_back) == pytest.approx(5.0)
    assert bench.read_amplification([{"step": 0, "loss": 1.0}]) is None  # records without byte counts
    assert bench.metrics_records(str(tmp_path), "missing") == []


def test_rank_peak_is_the_largest_train_worker():
    summary = {"worker_peaks_by_title_mb": {"ray::RayTrainWorker": 512.5, "ray::TrainController": 900.0,
                                            "ray::RayTrainWorker._execute": 530.0}}
    assert bench.rank_peak_mb(summary) == 530.0
    assert bench.rank_peak_mb({"worker_peaks_by_title_mb": {"ray::IDLE": 100.0}}) is None


def test_arm_entry_growth_and_errors():
    runs = [{"rank_peak_uss_mb": 400.0, "train_read_amplification": 1.1, "bytes_read_per_step": 10, "steps": 4,
             "seconds": 9.0},
            {"rank_peak_uss_mb": 460.0, "train_read_amplification": 1.2, "bytes_read_per_step": 12, "steps": 4,
             "seconds": 9.5, "error": "boom"}]
    entry = bench.arm_entry([10, 40], runs)
    assert entry["growth"] == 1.15 and entry["train_read_amplification"] == [1.1, 1.2]
    assert entry["error"] == [None, "boom"]


def test_read_amplification_without_footers_takes_the_footer_bytes_out():
    records = [{"step": 0, "bytes_read": 3_000, "bytes_used": 1_000, "footer_bytes_read": 1_500},
               {"step": 1, "bytes_read": 1_500, "bytes_used": 1_000, "footer_bytes_read": 500}]
    assert bench.read_amplification(records) == pytest.approx(2.25)
    assert bench.read_amplification(records, minus_bytes=2_000) == pytest.approx(1.25)
