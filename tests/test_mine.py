"""`clusterscale mine`: hard negatives equal brute-force search, never a positive or its duplicate, resumable."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import cli
from clusterscale import config as config_mod
from clusterscale.config import ConfigError, MineConfig
from clusterscale.stages.mine_search import filter_candidates
from clusterscale.io.negatives import candidate_files, load_negatives
from clusterscale.io.layout import read_manifest
from clusterscale.io.rundir import RunDir
from tests.conftest import make_pairs, tiny_overrides


def brute_force(q, p, own_rows, pk, qk, mc: MineConfig) -> list[list[int]]:
    """The rule written out per query with a full sort (the reference for the faiss pass)."""
    out = []
    for i in range(len(q)):
        scores = p @ q[i]
        order = np.argsort(-scores, kind="stable")[:mc.range_max]
        pos = float(p[own_rows[i]] @ q[i])
        kept = []
        for rank, j in enumerate(order):
            if rank < mc.range_min or qk[j] == qk[own_rows[i]] or pk[j] == pk[own_rows[i]]:
                continue
            if mc.margin is not None and scores[j] > mc.margin * pos:
                continue
            kept.append(int(j))
        out.append(kept)
    return out


def test_filter_matches_per_query_rule():
    rng = np.random.default_rng(0)
    n, d = 60, 8
    p = rng.normal(size=(n, d)).astype(np.float32)
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    q = p + 0.3 * rng.normal(size=p.shape).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    pk, qk = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64) + 1000
    pk[5] = pk[4]           # row 5 duplicates row 4's passage text
    qk[11] = qk[10]         # rows 10 and 11 share a query: each one's passage is the other's positive
    for mc in (MineConfig(range_min=0, range_max=10, margin=None), MineConfig(range_min=2, range_max=15, margin=0.95)):
        scores = q @ p.T
        rows = np.argsort(-scores, axis=1, kind="stable")[:, :mc.range_max]
        top = np.take_along_axis(scores, rows, 1)
        own = np.arange(n)
        pos = (q * p).sum(1)
        keep, drops = filter_candidates(top, rows, own, pos, pk, qk, mc)
        kept, kept_scores = [r[m] for r, m in zip(rows, keep)], [t[m] for t, m in zip(top, keep)]
        assert [k.tolist() for k in kept] == brute_force(q, p, own, pk, qk, mc)
        assert all(np.all(np.diff(s) <= 1e-6) for s in kept_scores)  # best first
        assert 5 not in kept[4] and 4 not in kept[5] and 11 not in kept[10] and 10 not in kept[11]
        assert drops["positive"] > 0
        assert drops["duplicate"] >= 1


def test_mine_config_errors():
    with pytest.raises(ConfigError, match="mine.range_min"):
        config_mod.load(None, ["mine.range_min=5", "mine.range_max=5"])
    with pytest.raises(ConfigError, match="mine.margin"):
        config_mod.load(None, ["mine.margin=0"])
    with pytest.raises(ConfigError, match="mine.index"):
        config_mod.load(None, ["mine.index=hnsw"])
    with pytest.raises(ConfigError, match="mine.nprobe"):
        config_mod.load(None, ["mine.nprobe=0"])


@pytest.fixture(scope="module")
def mined_run(tmp_path_factory, tiny_model, ray_local):
    base = tmp_path_factory.mktemp("mine")
    table = make_pairs(160, seed=3).to_pylist()
    for i in range(0, 60, 3):
        table[i + 1]["p"] = table[i]["p"]   # duplicate passages (different pairs)
        table[i + 2]["q"] = table[i]["q"]   # queries with two positives
    pq.write_table(pa.Table.from_pylist(table), base / "pairs.parquet")
    run_dir = base / "run"
    # ray.disk_shuffle=false: shard's and mine's hash shuffles through the object store (ray.* keys are no part of a
    # stage's fingerprint), as at this size with the default ray.disk_shuffle_min_mib; mine's runs through local
    # files (first and resumed, split groups) are test_mine_clusters' stage test.
    overrides = tiny_overrides(tiny_model, str(base / "pairs.parquet")) + ["mine.range_max=12", "mine.margin=null",
                                                                           "data.rows_per_part=50",
                                                                           "ray.disk_shuffle=false"]
    assert cli.main(["ingest", "--run-dir", str(run_dir), "--set", *overrides]) == 0
    for verb in ("embed", "fit", "assign", "shard", "mine"):  # k = 4 = mine.nprobe: the search covers every passage
        assert cli.main([verb, "--run-dir", str(run_dir), "--set", *overrides]) == 0
    return run_dir, overrides


def _embedded(run: RunDir) -> pa.Table:
    table = pa.concat_tables([pq.read_table(f) for f in run.files("embeddings")])
    return table.take(pa.array(np.argsort(table.column("pair_id").to_numpy(), kind="stable")))


def test_mine_equals_brute_force_and_skips_positives(mined_run, tiny_model):
    from clusterscale.runtime.vectors import emb_matrix
    from clusterscale.modeling.encoder import Encoder
    from clusterscale.runtime.hashing import text_hashes

    run_dir, overrides = mined_run
    run = RunDir(str(run_dir))
    cfg = config_mod.load(None, overrides)
    table = _embedded(run)
    ids = table.column("pair_id").to_numpy()
    p = emb_matrix(table.column("emb"))
    q = Encoder(tiny_model, max_length=cfg.embed.max_length).encode(table.column("query").to_pylist())
    pk, qk = text_hashes(table.column("passage").to_pylist()), text_hashes(table.column("query").to_pylist())
    expected = brute_force(q, p, np.arange(len(ids)), pk, qk, cfg.mine)
    pair_ids, negatives = load_negatives(run)
    assert pair_ids.tolist() == ids.tolist()  # every training query mined exactly once
    mined = pa.concat_tables([pq.read_table(f) for f in candidate_files(run)])
    mined_scores = dict(zip(mined.column("pair_id").to_pylist(), mined.column("neg_scores").to_pylist()))
    texts = dict(zip(ids.tolist(), zip(table.column("query").to_pylist(), table.column("passage").to_pylist())))
    exact = 0
    for i, negs in enumerate(negatives):
        query, passage = texts[int(ids[i])]
        assert all(texts[int(n)][0] != query and texts[int(n)][1] != passage for n in negs)
        # Same scores in the same order as the full sort (equal vectors may swap ids, never scores) ...
        ref = np.sort(p[expected[i]] @ q[i])[::-1]
        got = np.asarray(mined_scores[int(ids[i])])
        assert abs(len(got) - len(ref)) <= 1  # a cut at range_max may split a group of tied scores
        assert np.allclose(got[:min(len(got), len(ref))], ref[:min(len(got), len(ref))], atol=1e-4)
        # ... and the same ids wherever no two candidates tie.
        if len(ref) < 2 or np.min(-np.diff(ref)) > 1e-3:
            exact += negs.tolist() == ids[expected[i]].tolist()
        else:
            exact += 1
    assert exact >= len(ids) - 3
    stats = run.done_stats("negatives")
    assert stats["rows"] == len(ids) and stats["dropped_duplicate"] >= 1 and stats["dropped_positive"] >= 1


def test_mine_resumes_and_refuses_other_config(mined_run, capsys):
    """A lost negatives file: the rerun (whole) writes the same negatives, passing no deprecated Ray argument."""
    import warnings

    from ray.util.annotations import RayDeprecationWarning

    run_dir, overrides = mined_run
    run = RunDir(str(run_dir))
    before = load_negatives(run)
    first = sorted(run.listdir("negatives"))
    victim = next(f for f in first if f.startswith("part-"))
    run.remove("negatives", victim)
    run.remove("negatives", "_DONE.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["mine", "--run-dir", str(run_dir), "--set", *overrides]) == 0
    assert not [w for w in caught if issubclass(w.category, RayDeprecationWarning)], [str(w.message) for w in caught]
    after = load_negatives(run)
    assert before[0].tolist() == after[0].tolist()
    assert all(a.tolist() == b.tolist() for a, b in zip(before[1], after[1]))
    capsys.readouterr()
    assert cli.main(["mine", "--run-dir", str(run_dir), "--set", *overrides, "mine.range_max=20"]) != 0
    assert "negatives" in capsys.readouterr().err


def test_mine_with_another_encoder_routes_by_the_frozen_clusters(mined_run, tiny_model, tmp_path):
    """A re-embedding (any model folder) is joined to assign/ by pair_id; every query mined once, by the rule.
    On a copy of the mined run, so the other tests keep its frozen negatives without mining them again."""
    import shutil

    run_dir, overrides = shutil.copytree(mined_run[0], tmp_path / "run"), mined_run[1]
    run = RunDir(str(run_dir))
    extra = [f"mine.encoder={tiny_model}", "mine.nprobe=2"]
    assert cli.main(["mine", "--run-dir", str(run_dir), "--set", *overrides, *extra, "--replace"]) == 0
    table = _embedded(run)
    texts = dict(zip(table.column("pair_id").to_pylist(), zip(table.column("query").to_pylist(),
                                                              table.column("passage").to_pylist())))
    pair_ids, negatives = load_negatives(run)
    assert pair_ids.tolist() == sorted(texts) and sum(len(n) for n in negatives) > len(texts)
    for pid, negs in zip(pair_ids.tolist(), negatives):
        assert all(texts[int(n)][0] != texts[pid][0] and texts[int(n)][1] != texts[pid][1] for n in negs)
    assert run.done_stats("negatives")["encoder"] == tiny_model


def test_redo_raises_no_ray_deprecation_and_done_stages_say_reused(mined_run, capsys):
    """Our map_batches calls in embed pass no deprecated `ray_remote_args` (mine's: the resume test above); a
    finished stage says reused."""
    import warnings

    from ray.util.annotations import RayDeprecationWarning

    run_dir, overrides = mined_run
    run = RunDir(str(run_dir))
    n_pairs = run.done_stats("pairs")["pairs"]
    # one lost output file: the stage redoes that unit
    run.remove("embeddings", next(f for f in run.listdir("embeddings") if f.startswith("part-")))
    run.remove("embeddings", "_DONE.json")
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["embed", "--run-dir", str(run_dir), "--set", *overrides]) == 0
    assert not [w for w in caught if issubclass(w.category, RayDeprecationWarning)], [str(w.message) for w in caught]
    assert run.done_stats("embeddings")["rows"] == n_pairs
    capsys.readouterr()
    assert cli.main(["embed", "--run-dir", str(run_dir), "--set", *overrides]) == 0
    finished_at = run.read_json("embeddings/_DONE.json")["finished_at"]
    assert f"[embeddings] reused (done at {finished_at})" in capsys.readouterr().out


# --- training with mined negatives (+ CLP) and with re-clustering, on the mined run ------------------------------
def _jsonl(run: RunDir, rel: str) -> list[dict]:
    import json

    return [json.loads(line) for line in run.read_bytes(rel).decode().splitlines() if line]


@pytest.fixture(scope="module")
def sharded_mined_run(mined_run):
    run_dir, overrides = mined_run
    for verb in ("fit", "assign", "shard"):
        assert cli.main([verb, "--run-dir", str(run_dir), "--set", *overrides]) == 0
    return run_dir, overrides


@pytest.fixture(scope="module")
def clp_recluster_run(sharded_mined_run):
    """One training that both tests below read (one Ray Train run each before): 2 mined negatives per query with
    the CLP loss, 4 steps re-clustered after 2 (two segments, the second on re-embedded, re-sharded pairs)."""
    run_dir, overrides = sharded_mined_run
    # The sidecars training writes (the segment's) shuffle through the object store too (mined_run's overrides).
    extra = ["train.negatives_per_query=2", "train.loss=clp", "train.recluster_every=2", "train.steps=4",
             "train.name=recl", "train.num_workers=2"]  # both ranks' batch logs are read below
    assert cli.main(["train", "--run-dir", str(run_dir), "--set", *overrides, *extra]) == 0
    return RunDir(str(run_dir))


def _draw(run: RunDir, prefix: str):
    """The draw whose sidecars training wrote into the run (negatives/rows/<draw key>/)."""
    from clusterscale.io.negatives import SIDECAR_DIR, Draw

    keys = [k for k in run.listdir(SIDECAR_DIR) if k.startswith(prefix)]
    assert len(keys) == 1, keys
    return Draw(**run.read_json(f"{SIDECAR_DIR}/{keys[0]}/shards/k=4/_SHARDS.json")["draw"])


def test_train_with_mined_negatives_and_clp(clp_recluster_run):
    from clusterscale.train.data import ShardReader
    from clusterscale.train.negatives import MinedNegatives, NegativeSidecars

    run = clp_recluster_run
    metrics = _jsonl(run, "train/recl/metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics:  # both segments: the re-clustered shards carry the mined negatives too
        assert m["mined_negatives"] == 16 * 2
        assert 0.0 <= m["clp_penalty"] <= 2.0 and np.isfinite(m["loss"])
    assert run.exists("train/recl/model/model.safetensors")
    manifest = read_manifest(run, "shards/k=4/manifest.json")
    pair_ids, candidates = load_negatives(run)
    expected = dict(zip(pair_ids.tolist(), (c.tolist() for c in candidates)))
    # Every shard row carries its draw of 2 of them (best first, 1 draw: 4 steps are under one epoch).
    reader = ShardReader(run, manifest, sidecars=NegativeSidecars(run, manifest, _draw(run, "m2-"), ids=True))
    rows = pa.concat_tables([reader.rows(s, np.arange(c.rows)) for s, c in enumerate(manifest.clusters)])
    texts = dict(zip(rows.column("pair_id").to_pylist(), rows.column("passage").to_pylist()))
    assert sorted(texts) == sorted(expected)
    for pid, cands, passages in zip(*(rows.column(c).to_pylist() for c in ("pair_id", "neg_pair_ids", "neg_passages"))):
        assert len(cands) == min(2, len(expected[pid])) and passages == [texts[c] for c in cands]
        assert cands == [c for c in expected[pid] if c in cands]  # the row's candidates, best first
    # The negatives are a pure function of (seed, step, pair_id) and never the pair itself.
    negatives = MinedNegatives(run, 2, seed=0)
    first, again = negatives.for_rows(rows.slice(0, 8), 5), negatives.for_rows(rows.slice(0, 8), 5)
    assert first == again and len(first[0]) == len(first[1]) == 16
    own = rows.column("passage").to_pylist()[:8]
    assert all(p != own[i // 2] for i, p in enumerate(first[0]))


def test_mined_negatives_ride_the_shard_sets_of_the_curriculum_after_the_easy_first_phase(sharded_mined_run):
    """The curriculum reads the clustered shards and shards/k=4/random/ (another sampler's set): the sidecars follow
    both sets' files; with train.negatives_curriculum_steps=2 the first two steps use in-batch negatives alone."""
    from clusterscale.io.negatives import sidecar_marker

    run_dir, overrides = sharded_mined_run
    run = RunDir(str(run_dir))
    extra = ["train.negatives_per_query=1", "train.sampler=curriculum", "train.curriculum_start=0.5",
             "train.negatives_curriculum_steps=2", "train.steps=4", "train.name=curr"]
    assert cli.main(["train", "--run-dir", str(run_dir), "--set", *overrides, *extra]) == 0
    metrics = _jsonl(run, "train/curr/metrics.jsonl")
    assert [m["mined_negatives"] for m in metrics] == [0, 0, 16, 16]
    assert {m["cluster"] is None for m in metrics} == {True, False}  # batches from both sets
    draw = _draw(run, "m1-")
    assert run.exists(sidecar_marker("shards/k=4", draw)) and run.exists(sidecar_marker("shards/k=4/random", draw))


def test_train_needs_mined_negatives_of_this_config(sharded_mined_run, capsys):
    run_dir, overrides = sharded_mined_run
    capsys.readouterr()
    rc = cli.main(["train", "--run-dir", str(run_dir), "--set", *overrides, "train.negatives_per_query=1",
                   "train.name=other", "mine.range_max=7"])
    assert rc != 0 and "negatives" in capsys.readouterr().err


def test_recluster_during_training(clp_recluster_run):
    from clusterscale.io.layout import load_manifest
    from clusterscale.io.negatives import sidecar_path

    run = clp_recluster_run
    metrics = _jsonl(run, "train/recl/metrics.jsonl")
    assert [(m["step"], m["segment"]) for m in metrics] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    child = RunDir(run.child_uri("train/recl/recluster/seg-1"))
    manifest = load_manifest(child, 4)
    cluster_of = {}
    for c in manifest.clusters:
        for f in c.files:
            for pid in pq.read_table(child.path(f), columns=["pair_id"]).column(0).to_pylist():
                cluster_of[pid] = c.cluster
    batches = [_jsonl(run, f"train/recl/batches/rank-{r}.jsonl") for r in (0, 1)]
    for b0, b1 in zip(*batches):
        if b0["step"] >= 2:  # segment 1 batches come from one cluster of the re-clustered shards
            assert len({cluster_of[p] for p in b0["pair_ids"] + b1["pair_ids"]}) == 1
    assert sorted(cluster_of) == sorted(load_negatives(run)[0].tolist())  # every training pair re-sharded
    draw = _draw(run, "m2-")
    assert all(child.exists(sidecar_path(f, 0, draw)) for c in manifest.clusters for f in c.files)  # negatives too
    costs = run.read_json("report/costs.json")
    assert {"recluster:recl:seg-1:embed", "recluster:recl:seg-1:shard"} <= set(costs)
    assert run.done_stats("train/recl")["segments"] == 2
