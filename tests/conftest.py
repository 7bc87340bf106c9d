"""Shared fixtures: a local Ray, a tiny random BERT saved like a hub model, tiny topical pair data, and one
finished tiny run (trained, compared, reported) that the end-to-end tests read."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
# Ray Train's controller polls its workers every 2 s by default, so each of the suite's ~25 training runs waits up
# to that long at every state change (start, each report, the end); a short poll only trades idle waiting for a
# little controller CPU. Set before the session's Ray starts: its workers (the controller too) inherit it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# Ray Train starts a PreemptionWatcher actor per run to follow node drains (a spot reclaim notice); no test drains
# a node (test_multinode kills nodes outright), and the actor's process start costs each run ~1.5-2 s here.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# The idle workers a raylet keeps (runtime/session.init_ray sets it for the CLI's local Ray): the same for the Ray
# nodes the tests start themselves (test_multinode's cluster, test_jobs' head), whose raylets inherit it.
os.environ.setdefault("RAY_num_workers_soft_limit", "8")
# runtime.nodes.TEST_UNIT_DELAY_ENV for the session's Ray: a test that writes this file ({stage: seconds}) slows that
# stage's units in the workers (which inherit the variable) until it removes the file; absent, a unit pays one open.
os.environ.setdefault("CLUSTERSCALE_TEST_UNIT_DELAY", str(Path(__file__).resolve().parent.parent / ".pytest_cache"
                                                          / f"unit-delay-{os.getpid()}.json"))
RAY_SETTINGS = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER",
                "RAY_num_workers_soft_limit")

TOPICS = {
    "astronomy": "star galaxy planet orbit telescope comet nebula moon solar cosmic asteroid eclipse",
    "cooking": "recipe oven flour butter sauce garlic simmer bake pepper onion salad roast",
    "finance": "stock bond interest market price inflation bank loan dividend budget tax credit",
    "football": "goal striker referee league match penalty keeper stadium coach season pass tackle",
}


def make_pairs(n: int, seed: int = 0) -> pa.Table:
    """n (query, passage, source) rows; each topic has its own vocabulary, so clusters exist."""
    rng = np.random.default_rng(seed)
    names = sorted(TOPICS)
    queries, passages, sources = [], [], []
    for i in range(n):
        topic = names[i % len(names)]
        words = TOPICS[topic].split()
        passage = " ".join(rng.choice(words, size=int(rng.integers(12, 30))))
        query = " ".join(rng.choice(passage.split(), size=4)) + f" {i}"
        queries.append(query)
        passages.append(f"{passage} item {i}")
        sources.append(topic)
    return pa.table({"q": queries, "p": passages, "src": sources})


# The unit tier (`pytest -m unit`: seconds, for the edit-test loop): every test that uses none of these fixtures
# (directly or through a fixture of its own module) and is not marked integration. A unit test that starts Ray or a
# CLI subprocess fails (unit_guard), so the tier stays Ray-free whatever a new test does.
HEAVY_FIXTURES = {"ray_local", "shared_run", "tiny_model", "multinode", "ray_head", "s3_endpoint"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not HEAVY_FIXTURES & set(item.fixturenames) and not item.get_closest_marker("integration") \
                and not item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def unit_guard(request, monkeypatch):
    """A unit test may not start Ray or a process of its own: it is marked integration instead."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import subprocess

    def refused(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} is in the unit tier (it uses none of conftest.HEAVY_FIXTURES) "
                             f"but starts Ray or a subprocess: mark it @pytest.mark.integration")

    import ray

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.setattr(subprocess, "Popen", refused)
    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refused))
    yield


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from clusterscale.config import RayConfig
    from clusterscale.runtime.session import init_ray

    if not ray.is_initialized():
        init_ray(RayConfig(num_cpus=2, include_dashboard=False))  # the CLI's own local start
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A randomly initialised 2-layer BERT (hidden 32) with the bundled uncased vocab, mean pooling."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from clusterscale.modeling.encoder import resolve_model_path, save_sentence_transformers_dir

    out = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("bundled"))
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=128))
    save_sentence_transformers_dir(model, tokenizer, str(out), pooling="mean", max_length=64)
    return str(out)


@pytest.fixture
def pairs_parquet(tmp_path) -> str:
    path = tmp_path / "pairs.parquet"
    pq.write_table(make_pairs(320), path)
    return str(path)


def tiny_overrides(model: str, data_path: str) -> list[str]:
    """A full pipeline in well under a minute: tiny BERT as encoder and student, k=4, 2 embed actors and ONE training
    worker (a Ray Train fit here costs ~11 s with one rank, ~14 s with two: a test that needs ranks or DDP sets
    train.num_workers=2)."""
    return [f"data.path={data_path}", "data.query_column=q", "data.passage_column=p", "data.source_column=src",
            "data.heldout_fraction=0.1", f"embed.model={model}", "embed.max_length=32", "embed.batch_size=32",
            "cluster.k=4", "cluster.niter=10", f"train.init={model}", "train.global_batch_size=16",
            "train.steps=6", "train.query_max_length=16", "train.passage_max_length=32", "train.log_batches=true",
            "train.warmup_steps=2", "train.lr=1e-3", "train.final_lr=1e-4", "eval.num_distractors=100",
            "train.num_workers=1"]


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


# Rows the ingest must quarantine (not drop): an empty query, a null passage, a whitespace-only query.
BAD_ROWS = [{"q": "", "p": "text", "src": "x"}, {"q": "query", "p": None, "src": "x"},
            {"q": "  \t ", "p": "passage", "src": "x"}]
SHARED_SAMPLERS, SHARED_SEEDS = ("clustered", "random"), 2
# Exact copies of the first pairs, planted in the shared data: test_dedup_compare's dedup arm (on a copy of the
# shared run) must find and remove them. Their pair_ids are their own (row numbers), so every row is still one row.
SHARED_PLANTED_COPIES = 40
# compare's arm with mined negatives (random batches + 1 mined negative per query from step 2 on, the easy-first
# phase: an --arm over the named arm's keys): one mining pass serves both seeds.
SHARED_MINED_ARM, SHARED_EASY_STEPS = "random+mined", 2


@dataclass(frozen=True)
class SharedRun:
    """The finished run, the number of input rows, and what the fixture saw between its commands."""
    run: object  # clusterscale.io.rundir.RunDir: <base>/runs/x
    base: Path  # the working directory of the commands, holding data/pairs.parquet
    rows_in: int
    embedded_at: str  # embeddings/_DONE.json's finished_at after `run`
    trained: dict  # train/clustered-seed0/_DONE.json after `run`
    evaluate_cost: dict  # report/costs.json's "evaluate" before the last `evaluate` (everything cached by then)


def shard_ids(run, folder: str) -> list[int]:
    """pair_ids of folder's Parquet files, not of the shard sets in its subfolders (shards/k=<k>/random/)."""
    import pyarrow.dataset as pads

    sets = ("/random/", "/random_clusters/", "/source/", "/dedup/")
    files = [f for f in run.files(folder) if not any(s in f[len(run.path(folder)):] for s in sets)]
    if not files:
        return []
    return pads.dataset(files, format="parquet").to_table(columns=["pair_id"]).column("pair_id").to_pylist()


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, tiny_model, ray_local) -> SharedRun:
    """One tiny run that test_pipeline_e2e, test_quickstart_relative, test_experiments_compare and test_report all
    read (each trained its own before: ~5 min of the suite). It is made as a newcomer types the quick start:
    relative --run-dir, data.path and model folder from the run's parent folder, then verbs on the finished run
    without --set (they start from its config.yaml):
      run (clustered, 6 steps, rank batch logs; 300 pairs + 40 planted copies + 3 bad rows)
      -> compare clustered,random,random+mined x 2 seeds (clustered seed 0 is the run's own training, reused)
      -> train with the source sampler -> report -> evaluate again (every result cached).
    Tests only read it (a refused or reused rerun writes nothing); a test that adds work runs on a copy."""
    from clusterscale import cli
    from clusterscale.io.rundir import RunDir

    base = tmp_path_factory.mktemp("shared")
    pairs = make_pairs(300).to_pylist()
    rows = pairs + pairs[:SHARED_PLANTED_COPIES] + BAD_ROWS
    (base / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), base / "data" / "pairs.parquet")
    cwd = os.getcwd()
    os.chdir(base)
    try:
        # The run's own training on 2 DDP ranks (test_pipeline_e2e reads both ranks' batch logs); the arms and the
        # source run after it on one (train.num_workers changes no output: the run's training is still compare's
        # clustered seed 0).
        overrides = tiny_overrides(os.path.relpath(tiny_model), "data/pairs.parquet") + [
            "eval.extrapolate_to_rows=1000000", "train.num_workers=2"]
        assert cli.main(["run", "--run-dir", "runs/x", "--set", *overrides]) == 0
        run = RunDir(str(base / "runs" / "x"))
        embedded_at = run.read_json("embeddings/_DONE.json")["finished_at"]
        trained = run.read_json("train/clustered-seed0/_DONE.json")
        assert cli.main(["compare", "--run-dir", "runs/x", "--samplers", ",".join(SHARED_SAMPLERS + (SHARED_MINED_ARM,)),
                         "--arm", f"{SHARED_MINED_ARM}:train.negatives_curriculum_steps={SHARED_EASY_STEPS}",
                         "--seeds", str(SHARED_SEEDS), "--set", "train.num_workers=1"]) == 0
        # data.source_column=src: the source sampler's run must reach the cost summary too.
        # log_every_steps=2: metrics-only ray.train.report calls between the checkpoints.
        assert cli.main(["train", "--run-dir", "runs/x", "--set", "train.sampler=source",
                         "train.log_every_steps=2", "train.num_workers=1"]) == 0
        assert cli.main(["report", "--run-dir", "runs/x"]) == 0
        evaluate_cost = run.read_json("report/costs.json")["evaluate"]
        assert cli.main(["evaluate", "--run-dir", "runs/x"]) == 0
    finally:
        os.chdir(cwd)
    return SharedRun(run, base, len(rows), embedded_at, trained, evaluate_cost)
