"""The trainer's metrics processor: the all-reduce of a step's figures on 2 gloo ranks equals one process;
the records, printed lines and collapse verdict of a few steps."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch

from clusterscale.config import TrainConfig
from clusterscale.io.rundir import RunDir
from clusterscale.train.metrics import (JsonlLog, MetricsProcessor, StepFigures, StepResult, model_flops_utilization,
                                        peak_flops, read_jsonl_lines,
                                        reduce_step_figures)
from clusterscale.train.schedule import GlobalBatch
from clusterscale.train.step import contrastive_backward
from tests.test_train_grad import N, _model, _settings, _texts, spawn_two_ranks


def _reduce_worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    queries, passages = _texts()
    mine = slice(rank * N // world, (rank + 1) * N // world)
    model, tokenizer = _model(path, dropout=False)
    loss, stats = contrastive_backward(DistributedDataParallel(model), tokenizer, queries[mine], passages[mine],
                                       _settings(), torch.device("cpu"))
    figures = reduce_step_figures(loss, stats, world)
    if rank == 0:
        torch.save({"loss": figures.loss, **figures.values()}, os.path.join(out_dir, "reduced.pt"))
    dist.destroy_process_group()


def test_two_rank_figures_equal_one_process(tiny_model, tmp_path):
    reduced = spawn_two_ranks(_reduce_worker, tiny_model, tmp_path, ["reduced"])["reduced"]
    model, tokenizer = _model(tiny_model, dropout=False)
    queries, passages = _texts()
    loss, stats = contrastive_backward(model, tokenizer, queries, passages, _settings(), torch.device("cpu"))
    assert reduced["loss"] == pytest.approx(float(loss), rel=1e-5)
    # means over every query and sums of counts; neg_cos_mean averages the ranks' means (masks differ slightly)
    for key in ("pos_cos", "neg_cos_max"):
        assert reduced[key] == pytest.approx(float(stats[key]), rel=1e-5), key
    assert reduced["neg_cos_mean"] == pytest.approx(float(stats["neg_cos_mean"]), abs=2e-3)
    assert reduced["masked_false_negatives"] == float(stats["masked_false_negatives"]) > 0
    assert reduced["mined_negatives"] == 0 and "negatives_padded" not in reduced


def test_one_process_figures_keep_the_optional_ones_that_exist():
    stats = {"pos_cos": 0.5, "neg_cos_mean": 0.1, "neg_cos_max": 0.3, "masked_false_negatives": 1, "tokens": 40,
             "moe_aux_loss": 0.25, "clp_skipped": 2}
    figures = reduce_step_figures(torch.tensor(2.0), stats, world=1)
    assert figures.loss == 2.0
    assert figures.means == {"pos_cos": 0.5, "neg_cos_mean": pytest.approx(0.1), "neg_cos_max": pytest.approx(0.3),
                             "moe_aux_loss": 0.25}
    assert figures.sums == {"masked_false_negatives": 1, "tokens": 40, "clp_skipped": 2}


def _result(step: int, loss: float, neg_cos: float) -> StepResult:
    figures = StepFigures(loss, {"pos_cos": 0.5, "neg_cos_mean": neg_cos, "neg_cos_max": 0.99},
                          {"masked_false_negatives": 0.0, "tokens": 64.0})
    batch = GlobalBatch(step, 0, 1, np.arange(4), 1)
    return StepResult(batch, (7, "cluster-7"), figures, 1e-3, 0.5, 2e9, 0.5, [step * 10, step * 10 + 1])


def test_records_printed_lines_and_collapse(tmp_path, capsys):
    run = RunDir(str(tmp_path))
    tc = TrainConfig.of(global_batch_size=4, log_every_steps=2, warmup_steps=0, log_batches=True)
    processor = MetricsProcessor(run, "t", tc, rank=0, world=2, peak=8e9, resume_step=None, num_steps=6,
                                 stop_step=6, segment=0)
    verdicts = []
    for step in range(6):  # chance loss with every text in one direction: collapsed after 3 intervals of 2 steps
        result = _result(step, math.log(4), 0.95)
        processor.log(result)
        verdicts.append(processor.check(result))
    assert verdicts[:5] == [None] * 5 and "looks collapsed at step 6" in verdicts[5]
    records = [json.loads(line) for line in run.read_bytes("train/t/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records] == list(range(6))  # flushed at the last logging step
    assert list(records[0]) == ["step", "epoch", "cluster", "cluster_name", "loss", "lr", "grad_norm", "pos_cos",
                                "neg_cos_mean", "neg_cos_max", "masked_false_negatives", "tokens", "pairs_per_s",
                                "step_s", "tflops_per_s", "mfu"]
    assert records[0]["tokens"] == 64 and isinstance(records[0]["tokens"], int)
    assert records[0]["mfu"] == pytest.approx(2e9 / 0.5 / (2 * 8e9)) and records[0]["pairs_per_s"] == 8.0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train] step")]
    assert len(lines) == 3 and lines[0].startswith("[train] step 2/6 epoch 0 loss 1.3863 lr 1.00e-03 neg_cos 0.950 ")
    assert lines[0].endswith("pairs/s MFU 25.0%")
    assert run.read_json("train/t/collapse.json")["step"] == 6
    batches = run.read_bytes("train/t/batches/rank-0.jsonl").decode().splitlines()
    assert json.loads(batches[2]) == {"step": 2, "epoch": 0, "shard": 1, "group": 1, "pair_ids": [20, 21]}
    assert processor.report(6)["loss"] == pytest.approx(math.log(4)) and processor.report(6)["step"] == 6


def test_a_step_without_an_in_batch_negative_is_said_once(tmp_path, capsys):
    """Every off-diagonal candidate of a global batch of 4 masked (4 x 3 = 12): one warning naming the step and the
    text columns, not one per step; a step with one candidate left says nothing."""
    tc = TrainConfig.of(global_batch_size=4, log_every_steps=10, warmup_steps=0)
    processor = MetricsProcessor(RunDir(str(tmp_path)), "t", tc, rank=0, world=1, peak=None, resume_step=None,
                                 num_steps=4, stop_step=4, segment=0)
    for step, masked in enumerate((11.0, 12.0, 12.0, 0.0)):
        result = _result(step, 0.0, 0.1)
        result.figures.sums["masked_false_negatives"] = masked
        processor.log(result)
    said = [line for line in capsys.readouterr().out.splitlines() if "every in-batch negative" in line]
    assert len(said) == 1 and said[0].startswith("[train] warning: step 2: ") and "data.passage_column" in said[0]


def test_mfu_formula_and_an_impossible_one_is_unknown(tmp_path, capsys):
    """MFU = achieved FLOP/s / (peak per worker x workers); a step that beats its peak proves the peak wrong."""
    assert model_flops_utilization(4e9, 4e9, 2) == pytest.approx(0.5)
    assert model_flops_utilization(4e9, 2e9, 2) == pytest.approx(1.0)
    assert model_flops_utilization(5e9, 2e9, 2) is None and model_flops_utilization(1e9, None, 2) is None
    tc = TrainConfig.of(global_batch_size=4, log_every_steps=1, warmup_steps=0)
    processor = MetricsProcessor(RunDir(str(tmp_path)), "t", tc, rank=0, world=2, peak=1e9, resume_step=None,
                                 num_steps=1, stop_step=1, segment=0)
    processor.log(_result(0, 1.0, 0.1))  # 2e9 FLOP in 0.5 s on 2 workers of 1e9 FLOP/s: 200%, impossible
    assert processor.metrics.pending == [] and "MFU unknown" in capsys.readouterr().out
    assert json.loads(RunDir(str(tmp_path)).read_bytes("train/t/metrics.jsonl"))["mfu"] is None


def test_cpu_peak_is_not_below_what_a_training_sized_matmul_reaches():
    """The CPU peak (what MFU divides by) must not read below the rate of the matmuls a step runs, else MFU > 100%
    (121.7% was printed). A BERT-base feed-forward matmul on 512 tokens, with this process's threads."""
    peak = peak_flops(torch.device("cpu"))
    a, b = torch.randn(512, 768), torch.randn(768, 3072)
    a @ b
    started, repeats = time.perf_counter(), 8
    for _ in range(repeats):
        a @ b
    reached = repeats * 2 * 512 * 768 * 3072 / (time.perf_counter() - started)
    assert peak >= reached, (peak, reached)
    assert peak_flops(torch.device("cpu")) == peak  # measured once per process


@pytest.mark.parametrize("appendable", [True, False])
def test_jsonl_log_appends_and_a_resume_cuts_the_steps_after_the_checkpoint(tmp_path, monkeypatch, appendable):
    """Each flush writes only its new records (never the whole file); an object store (no append) gets parts.
    A resumed attempt drops what the failed one logged after the checkpoint, then continues appending."""
    run = RunDir(str(tmp_path))
    run.is_local = appendable  # the object-store path, on a local folder
    log = JsonlLog(run, "train/t/metrics.jsonl", None)
    written = []
    monkeypatch.setattr(run, "write_bytes",
                        lambda rel, data: (written.append(len(data)), RunDir.write_bytes(run, rel, data)))
    for step in range(7):
        log.append({"step": step})
        if step % 2:
            log.flush()
    log.flush()
    assert [json.loads(x)["step"] for x in read_jsonl_lines(run, "train/t/metrics.jsonl")] == list(range(7))
    if appendable:
        assert not written and run.exists("train/t/metrics.jsonl")
    else:
        assert len(written) == 4 and max(written) <= 2 * len('{"step": 0}\n')
    resumed = JsonlLog(run, "train/t/metrics.jsonl", 3)  # checkpoint at step 3: steps 3..6 are logged again
    for step in range(3, 5):
        resumed.append({"step": step, "again": True})
    resumed.flush()
    records = [json.loads(x) for x in read_jsonl_lines(run, "train/t/metrics.jsonl")]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4] and all(r.get("again") for r in records[3:])
