"""The benchmarks call the library's internals: a refactor that breaks them must fail here, not months later."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_kmeans_ray_fit_runs_and_equals_the_core(ray_local):
    """bench_kmeans's Ray arm on 2 actors gives the in-process core's centroids bit for bit."""
    bench = load("bench_kmeans")
    x, _ = bench.clustered_unit_vectors(600, 16, 8, seed=0)
    centroids, seconds = bench.ray_fit(x, 8, 3, 0, 2, 2)
    core, _ = bench.fit_spherical_kmeans(x, 8, 3, 0)
    assert seconds > 0 and np.array_equal(centroids, core)


def test_study_table_prints_the_runs_own_figures(tmp_path, capsys):
    """study_table.py turns a compare run's report/compare.json (here the recorded scratch study) into RESULTS.md's
    tables: every arm and every paired difference, with its interval and wins; a missing summary is a clear error."""
    import shutil

    table = load("study_table")
    (tmp_path / "report").mkdir()
    recorded = os.path.join(BENCH, "results", "study", "scratch_random_clusters", "compare.json")
    shutil.copy(recorded, tmp_path / "report")
    assert table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| clustered | 0.2750 ± 0.0046 (0.2704..0.2795) | 0.2399 ± 0.0040 | 1.77 | 0.231 |" in out
    assert "| clustered - random_clusters | -0.0168 [-0.0218, -0.0118] | -0.0147 [-0.0169, -0.0125] | 0/3, 0/3 |" in out
    assert "predates the per-arm costs" in out  # the cost table needs a compare.json of issue 30 (test_experiments_compare)
    assert table.main([str(tmp_path / "missing")]) == 2
    assert "report/compare.json not found" in capsys.readouterr().err


def test_results_page_cites_files_that_exist_and_results_hold_only_small_data():
    """Every benchmarks/results/ path RESULTS.md cites (outside `git show` spans) exists; results/ holds no file over
    1 MB, no script and no tarball."""
    import re

    text = re.sub(r"`git show [^`]*`", "", open(os.path.join(BENCH, "RESULTS.md")).read())
    cited = set(re.findall(r"results/[\w./-]*[\w/]", text))
    assert cited and not [p for p in cited if not os.path.exists(os.path.join(BENCH, p))]
    for folder, _, names in os.walk(os.path.join(BENCH, "results")):
        for name in names:
            assert not name.endswith((".py", ".sh", ".tar", ".gz", ".tgz", ".zip")), os.path.join(folder, name)
            assert os.path.getsize(os.path.join(folder, name)) <= 1 << 20, os.path.join(folder, name)


def test_study_state_carries_finished_arms_and_checks_the_preprocessing(tmp_path, monkeypatch):
    """study_state.py (the MiniLM study over several machines) saves a finished arm's records and held-out result
    without its weights, leaves an arm stopped midway out, restores into a new run dir, and `verify` passes on the
    same preprocessing and fails, naming the folder, when the shards differ; with the study's arms it lets a seed
    trained wholly on another preprocessing stand and refuses one that would mix two. save-preprocessing carries
    what the next arms read (not the embeddings or the sidecars), and a restore of it verifies."""
    import json
    import tarfile
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    state = load("study_state")
    old, new = tmp_path / "old", tmp_path / "new"
    for rel, rows in {"pairs/part-0.parquet": 5, "heldout/part-0.parquet": 2, "shards/k=2/cluster=0/p-0.parquet": 3,
                      "shards/k=2/random/p-0.parquet": 3, "negatives/part-00000.parquet": 3,
                      "negatives/rows/shards/k=2/cluster=0/p-0/piece-0.parquet": 3,
                      "embeddings/part-0.parquet": 5}.items():
        (old / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"pair_id": list(range(rows)), "text": ["t"] * rows}), old / rel)
    seed0 = "compare-random-seed0"
    for rel, text in {f"train/{seed0}/_DONE.json": "{}", f"train/{seed0}/metrics.jsonl": "{}\n",
                      f"train/{seed0}/model/model.safetensors": "w", f"train/{seed0}/ray/ckpt": "c",
                      f"eval/{seed0}.json": "{}", "eval/frozen.json": "{}",
                      "report/costs.json": json.dumps({f"train:{seed0}": {"wall_s": 1}}),
                      "train/compare-clustered-seed0/metrics.jsonl": "{}\n", "config.yaml": "x: 1\n",
                      **{f"{d}/_DONE.json": "{}" for d in ("pairs", "heldout", "embeddings", "shards/k=2",
                                                           "shards/k=2/random", "negatives")}}.items():
        (old / rel).parent.mkdir(parents=True, exist_ok=True)
        (old / rel).write_text(text)
    state.save(old, tmp_path / "s.tar.gz")
    state.save_preprocessing(old, tmp_path / "pre.tar.gz")
    with tarfile.open(tmp_path / "pre.tar.gz") as tar:
        carried = set(tar.getnames())
    assert {"pairs/part-0.parquet", "shards/k=2/cluster=0/p-0.parquet", "negatives/part-00000.parquet",
            "embeddings/_DONE.json", "config.yaml"} <= carried
    assert not carried & {"embeddings/part-0.parquet", "shards/k=2/random/p-0.parquet", "shards/k=2/random/_DONE.json",
                          "negatives/rows/shards/k=2/cluster=0/p-0/piece-0.parquet"}
    state.restore_preprocessing(tmp_path / "pre.tar.gz", new)  # the next machine reuses this preprocessing
    state.restore(tmp_path / "s.tar.gz", new)
    assert (new / f"train/{seed0}/_DONE.json").exists() and (new / f"eval/{seed0}.json").exists()
    assert json.loads((new / "report/costs.json").read_text()) == {f"train:{seed0}": {"wall_s": 1}}
    assert not (new / f"train/{seed0}/model").exists() and not (new / f"train/{seed0}/ray").exists()
    assert not (new / "train/compare-clustered-seed0").exists()
    state.verify(tmp_path / "s.tar.gz", new)
    with pytest.raises(SystemExit, match=f"already holds {seed0}"):
        state.restore(tmp_path / "s.tar.gz", new)
    with pytest.raises(SystemExit, match="already holds a preprocessing"):
        state.restore_preprocessing(tmp_path / "pre.tar.gz", new)

    # Another CPU's preprocessing: the shards differ.
    pq.write_table(pa.table({"pair_id": [0, 2, 1], "text": ["t"] * 3}), new / "shards/k=2/cluster=0/p-0.parquet")
    with pytest.raises(SystemExit, match=r"shards \(shards/k=\*/cluster=\*\)"):
        state.verify(tmp_path / "s.tar.gz", new)
    study = [SimpleNamespace(train_name=lambda a=a: a) for a in
             (seed0, "compare-clustered-seed0", "compare-random-seed1", "compare-clustered-seed1")]
    monkeypatch.setattr(state, "_compare_arms", lambda run_dir, argv: (study, None))
    with pytest.raises(SystemExit, match="would mix two preprocessings"):  # clustered seed 0 would train here
        state.verify(tmp_path / "s.tar.gz", new, ["--seeds", "2"])
    (new / "train/compare-clustered-seed0").mkdir(parents=True)  # seed 0 finished on the old box: it stands
    (new / "train/compare-clustered-seed0/_DONE.json").write_text("{}")
    (new / "train/compare-clustered-seed0/metrics.jsonl").write_text("{}\n")
    (new / "eval/compare-clustered-seed0.json").write_text("{}")
    state.save(new, tmp_path / "s2.tar.gz")  # each arm keeps the digests of the preprocessing it trained on
    saved = state._state(tmp_path / "s2.tar.gz")["arm_digests"]
    assert saved[seed0]["shards"] != saved["compare-clustered-seed0"]["shards"]
    with pytest.raises(SystemExit, match="would mix two preprocessings"):  # one seed, two preprocessings
        state.verify(tmp_path / "s2.tar.gz", new, ["--seeds", "2"])
    study[1:2] = []
    state.verify(tmp_path / "s.tar.gz", new, ["--seeds", "2"])  # seed 0 done elsewhere, seed 1 trains here


def test_bench_matryoshka_measures_agreement_and_runs_its_cores():
    """The Matryoshka benchmark's NMI (1 for the same clusters under other names, ~0 for unrelated ones), its
    mined-candidate recall, and its compute cores at a small size (the truncated width is the faster one)."""
    import sys

    sys.path.insert(0, BENCH)
    bench = load("bench_matryoshka")
    a = np.random.default_rng(0).integers(8, size=5000)
    assert bench.nmi(a, (a + 3) % 8) == pytest.approx(1.0)
    assert bench.nmi(a, np.random.default_rng(1).integers(8, size=5000)) < 0.01
    assert bench.recall({1: [2, 3], 4: [5, 6], 7: []}, {1: [3, 9], 4: [5, 6]}) == 0.75
    rows = bench.cores(64, [16], 30_000)
    assert [r["dims"] for r in rows] == [64, 16] and rows[0]["fit_vs_full"] == 1.0
    assert set(rows[1]) >= {"fit_s", "dedup_semantic_s", "mine_search_s", "mine_search_vs_full"}


def test_bench_packing_times_both_ways_with_the_modes_it_names(tiny_model):
    """bench_packing's training step and encoder core, padded then packed, at a tiny size: each entry ran in the
    mode it says, and a packed step computes fewer tokens than a padded one."""
    import sys

    import torch

    sys.path.insert(0, BENCH)
    bench = load("bench_packing")
    from tests.conftest import make_pairs

    pairs = make_pairs(32)
    queries, passages = pairs.column("q").to_pylist(), pairs.column("p").to_pylist()
    threads = torch.get_num_threads()
    try:
        step = bench.train_steps(tiny_model, queries, passages, 32, steps=1, batch=8)
        core = bench.encoder_core(tiny_model, passages, 32)
    finally:
        torch.set_num_threads(threads)
    assert step["padded"]["batching"] == "padded" and step["packed"]["batching"].startswith("packed")
    assert len(step["packed"]["step_s"]) == 2 and step["packed"]["tokens_per_step"] < step["padded"]["tokens_per_step"]
    assert core["packed"]["batching"].startswith("packed") and core["packed_over_padded"] > 0
