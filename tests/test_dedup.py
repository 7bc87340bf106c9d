"""The dedup stage on a local Ray: a synthetic run with planted duplicates and held-out leaks, checked against a
brute-force one-process reference; then shard builds from the kept rows only."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from clusterscale import cli
from clusterscale.config import load, variant
from clusterscale.errors import UserError
from clusterscale.io.layout import DEDUP, DEDUP_KEPT, DEDUP_REMOVED, assign_dir, manifest_path, shards_dir
from clusterscale.io.rundir import RunDir, StageMissingError
from clusterscale.pipeline import STAGES, execute, pipeline, run_stage
from clusterscale.runtime import dedup_core as core
from clusterscale.runtime.stage_context import StageContext
from clusterscale.runtime.vectors import emb_array, emb_matrix
from clusterscale.stages.dedup import removed_table, run_dedup
from clusterscale.stages.report import dedup_section
from clusterscale.stages.kmeans import load_centroids
from clusterscale.stages.synthetic import SynthSpec

from tests.dedup_reference import brute_force_exact, brute_force_heldout_vectors, brute_force_semantic, unit

ROWS, K, THRESHOLD = 2400, 4, 0.97
PLANTED = 10  # of each kind: exact copies, near copies, exact held-out leaks, semantic held-out leaks


def settings(disk_shuffle: bool = True, **dedup) -> list[str]:
    """disk_shuffle: dedup's and shard's hash shuffles through local files even at this size (min 0 MiB), or else
    through the object store (ray.* keys are no part of a fingerprint), without the file servers' start per shuffle."""
    return ["data.heldout_fraction=0.1", "data.rows_per_part=800", f"cluster.k={K}", "cluster.niter=5",
            "train.global_batch_size=16", "train.num_workers=1", "shard.target_rows_per_file=400",
            f"ray.disk_shuffle={str(disk_shuffle).lower()}", "ray.disk_shuffle_min_mib=0", *[f"dedup.{key}={value}" for key, value in dedup.items()]]


def plant(run: RunDir) -> dict[str, list[int]]:
    """Append planted rows to embeddings/ (one more file; the marker's count and file list follow): exact copies of
    a pair's passage text, near copies of a pair's vector, and copies of held-out passages (text) and vectors."""
    pairs = pads.dataset(run.files("embeddings"), filesystem=run.fs).to_table()
    held = pads.dataset(run.files("heldout"), filesystem=run.fs).to_table()
    rng = np.random.default_rng(0)
    x, hx = emb_matrix(pairs.column("emb")), emb_matrix(held.column("emb"))
    src, hsrc = rng.choice(pairs.num_rows, 2 * PLANTED, replace=False), rng.choice(held.num_rows, 2 * PLANTED,
                                                                                    replace=False)
    near = unit(x[src[PLANTED:]] + 0.05 * rng.standard_normal((PLANTED, x.shape[1])) / np.sqrt(x.shape[1]))
    far = unit(rng.standard_normal((PLANTED, x.shape[1])))  # the exact held-out leaks: text only
    vectors = np.concatenate([x[src[:PLANTED]], near, far, hx[hsrc[PLANTED:]]])
    passages = (pairs.column("passage").take(src[:PLANTED]).to_pylist()
                + [f"planted near copy {i}" for i in range(PLANTED)]
                + [p.upper() + "  " for p in held.column("passage").take(hsrc[:PLANTED]).to_pylist()]
                + [f"planted leak {i}" for i in range(PLANTED)])
    ids = np.arange(4 * PLANTED, dtype=np.int64) + 10_000_000
    n = len(ids)
    table = pa.table({"pair_id": ids, "query": [f"planted query {i}" for i in range(n)], "passage": passages,
                      "source": ["planted"] * n, "emb": emb_array(vectors),
                      "truncated": pa.array(np.zeros(n, bool))})
    run.write_parquet("embeddings/part-99999-00000-00000.parquet", table.cast(pairs.schema))
    done = run.read_json("embeddings/_DONE.json")
    done["stats"]["rows"] += n
    done["files"] = run.listed_files("embeddings")  # the planted file is one of the folder's (else refused as stray)
    run.write_json("embeddings/_DONE.json", done)
    return {name: ids[i * PLANTED:(i + 1) * PLANTED].tolist() for i, name in enumerate(("exact", "near", "leak_text",
                                                                                        "leak_vector"))}


def reference(run: RunDir, rule: str, nprobe: int) -> dict[int, tuple[str, int]]:
    """{removed pair_id: (reason, duplicate_of)} by brute force over every assigned row in one process: held-out
    text leaks, exact copies, held-out vector leaks (all pairs when nprobe = k, else over the held-out vectors
    whose nprobe nearest centroids include the row's cluster), semantic copies; each among the rows kept so far."""
    rows = pads.dataset(run.files(assign_dir(K)), filesystem=run.fs).to_table()
    held = pads.dataset(run.files("heldout"), filesystem=run.fs).to_table()
    ids, cos, cluster = (rows.column(c).to_numpy() for c in ("pair_id", "cos", "cluster"))
    x, hx = emb_matrix(rows.column("emb")).astype(np.float64), emb_matrix(held.column("emb")).astype(np.float64)
    held_ids = held.column("pair_id").to_numpy()
    out = {}
    held_text = {side: {} for side in ("query", "passage")}
    for side, texts in held_text.items():
        for t, pid in zip(held.column(side).to_pylist(), held_ids.tolist()):
            texts.setdefault(core.normalised(t), pid)
    for i, texts in enumerate(zip(rows.column("query").to_pylist(), rows.column("passage").to_pylist())):
        for side, t in zip(("query", "passage"), texts):
            if core.normalised(t) in held_text[side] and ids[i] not in out:
                out[ids[i]] = ("heldout_leak", held_text[side][core.normalised(t)])
    rest = np.array([pid not in out for pid in ids])
    passages = [p for p, r in zip(rows.column("passage").to_pylist(), rest) if r]
    out |= {pid: ("exact", dup) for pid, dup in brute_force_exact(passages, ids[rest], cos[rest], rule, 0).items()}
    rest = np.flatnonzero([pid not in out for pid in ids])
    if nprobe >= K:  # all pairs
        sims = x[rest] @ hx.T
        out |= {ids[i]: ("heldout_leak", int(held_ids[s.argmax()])) for i, s in zip(rest, sims) if s.max() >= THRESHOLD}
    else:
        leaks = brute_force_heldout_vectors(x[rest], cluster[rest], hx, held_ids, load_centroids(run, K), nprobe,
                                            THRESHOLD)
        out |= {ids[rest[i]]: ("heldout_leak", dup) for i, (dup, _) in leaks.items()}
    rest = np.array([pid not in out for pid in ids])
    semantic = brute_force_semantic(x[rest], cluster[rest], ids[rest], cos[rest], rule, 0, THRESHOLD)
    return out | {pid: ("semantic", dup) for pid, (dup, _) in semantic.items()}


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("dedup")
    spec = SynthSpec(rows=ROWS, dim=16, topics=K, seed=3, spread=0.5)
    cfg = load(None, [f"data.path={spec.data_path()}", *settings()])
    run = RunDir(str(root / "run"))
    execute(STAGES["synth"], cfg, run)
    run.write_config(cfg)
    planted = plant(run)
    for verb in ("fit", "assign"):
        run_stage(verb, cfg, run)
    return run, planted, spec


@pytest.mark.parametrize("rule, nprobe, disk_shuffle", [("hard", 1, True), ("random", K, False)])
def test_dedup_equals_brute_force_and_shards_hold_kept_rows(planted_run, rule, nprobe, disk_shuffle):
    """With heldout_nprobe = k the held-out vector check equals the all-pairs one; either shuffle transport."""
    run, planted, spec = planted_run
    cfg = load(None, [f"data.path={spec.data_path()}", *settings(disk_shuffle, exact="true", key="passage",
                                                                 keep=rule, semantic_threshold=THRESHOLD,
                                                                 block_rows=64, heldout_nprobe=nprobe)])
    run_stage("dedup", cfg, run, replace="changed")
    removed = removed_table(run)
    assert run.files(DEDUP_REMOVED) and all(f.endswith(".parquet") for f in run.files(DEDUP_REMOVED))
    got = {pid: (reason, dup) for pid, reason, dup in zip(*(removed.column(c).to_pylist()
                                                             for c in ("pair_id", "reason", "duplicate_of")))}
    assert got == reference(run, rule, nprobe)
    reasons = {name: {p for p, (r, _) in got.items() if r == name} for name in ("exact", "semantic", "heldout_leak")}
    # every planted exact copy (or its original: equal cos, the lower pair_id stays) and nothing else
    assert len(reasons["exact"]) == PLANTED
    assert set(planted["leak_text"]) | set(planted["leak_vector"]) <= reasons["heldout_leak"]
    assert len(reasons["semantic"]) >= PLANTED

    stats = run.done_stats(DEDUP)  # dedup/_DONE.json: the counts, and the clustering's k
    assigned = run.done_stats(assign_dir(K))["rows"]
    assert stats["rows"] + stats["removed"] == assigned == ROWS - run.done_stats("heldout")["rows"] + 4 * PLANTED
    assert stats["removed"] == len(got) and run.done_stats(DEDUP_KEPT)["rows"] == stats["rows"] and stats["k"] == K
    assert len(stats["examples"]) == 3 and sum(stats["similarity_histogram"]["counts"]) > 0
    report = "\n".join(dedup_section(run, K))
    assert f"kept {stats['rows']}, removed {stats['removed']}" in report and report.count("Group of") == 3
    assert " removed | " in report  # the histogram's bins at or above the threshold

    run_stage("shard", cfg, run, replace="changed")
    manifest = run.read_json(manifest_path(K))
    shards = pads.dataset([run.path(f) for c in manifest["clusters"] for f in c["files"]]).to_table()
    assert manifest["stats"]["rows"] == shards.num_rows == stats["rows"]
    assert not set(shards.column("pair_id").to_pylist()) & set(got)
    keys = [core.normalised(p) for p in shards.column("passage").to_pylist()]
    assert len(set(keys)) == len(keys)
    held = pads.dataset(run.files("heldout"), filesystem=run.fs).to_table()
    held_texts = {core.normalised(t) for side in ("query", "passage") for t in held.column(side).to_pylist()}
    assert not held_texts & ({core.normalised(q) for q in shards.column("query").to_pylist()} | set(keys))


@pytest.mark.parametrize("rule", ["easy", "hard", "random"])
def test_clusters_split_into_blocks_equal_brute_force(planted_run, rule):
    """dedup.max_group_rows=64 splits each ~600-row cluster into ~10 blocks, each its own group task, compared
    block x block in Ray tasks: the removed rows (pair_id, reason, duplicate_of) are brute force's for every keep
    rule, as unsplit (the test above), held-out vector leaks included; the kept and removed files are per block."""
    run, _, spec = planted_run
    cfg = load(None, [f"data.path={spec.data_path()}", *settings(False, exact="true", key="passage", keep=rule,
                                                                 semantic_threshold=THRESHOLD, max_group_rows=64)])
    run_stage("dedup", cfg, run, replace="changed")
    removed = removed_table(run)
    got = {pid: (reason, dup) for pid, reason, dup in zip(*(removed.column(c).to_pylist()
                                                             for c in ("pair_id", "reason", "duplicate_of")))}
    assert got == reference(run, rule, 2)
    assert sum(r == "semantic" for r, _ in got.values()) >= PLANTED
    assert sum(r == "heldout_leak" for r, _ in got.values()) >= 2 * PLANTED
    clusters = pads.dataset(run.files(assign_dir(K)), filesystem=run.fs).to_table(columns=["cluster"])
    sizes = np.bincount(clusters.column("cluster").to_numpy())
    assert sizes.min() > 4 * 64  # every cluster in 5+ blocks
    kept_files = [f for f in run.files(DEDUP_KEPT)]
    assert len(kept_files) >= 5 * K and all("-b" in f.rsplit("/", 1)[1] for f in kept_files)  # one or more per block
    assert not run.exists(DEDUP, "_blocks")  # the blocks' working files are gone
    stats = run.done_stats(DEDUP)
    assert stats["rows"] + stats["removed"] == sizes.sum() and len(stats["removed_per_cluster"]) == K
    assert sum(stats["removed_per_cluster"].values()) == stats["removed"] == len(got)


def test_an_interrupted_dedup_keeps_the_clusters_it_finished(planted_run, capsys):
    """Split clusters (dedup.max_group_rows=64, a semantic threshold): after an attempt that recorded some clusters,
    the rerun redoes only the others (their files half written, a temp file left) and writes the same files as the
    uninterrupted run; the recorded clusters' files are untouched and the counts are the same."""
    import json
    import os

    from clusterscale.stages.dedup.stage import UNITS

    run, _, spec = planted_run
    cfg = load(None, [f"data.path={spec.data_path()}", *settings(False, exact="true", key="passage", keep="random",
                                                                 semantic_threshold=THRESHOLD, max_group_rows=64)])
    run_stage("dedup", cfg, run, replace="changed")  # reused when the split test's last rule left it
    stats = run.done_stats(DEDUP)

    def outputs() -> dict[str, bytes]:
        return {f: open(f, "rb").read() for folder in (DEDUP_KEPT, DEDUP_REMOVED) for f in run.files(folder)}

    expected = outputs()
    records = sorted(os.listdir(run.path(UNITS)))
    assert len(records) == K and len(json.loads(open(run.path(UNITS, records[0])).read())["results"]) >= 5
    # As a kill leaves it: no done markers, two clusters unrecorded, one of them with only some of its files.
    for folder in (DEDUP, DEDUP_KEPT):
        os.remove(run.path(folder, "_DONE.json"))
    for name in records[:2]:
        os.remove(run.path(UNITS, name))
    lost = sorted(f for f in expected if f"-{records[0][:-5]}-" in f.rsplit("/", 1)[1])
    for f in lost[::2]:
        os.remove(f)
    open(run.path(DEDUP_KEPT, ".tmp-cut-short"), "wb").write(b"half a file")
    kept = {f: os.stat(f).st_mtime_ns for f in expected if f"-{records[3][:-5]}-" in f.rsplit("/", 1)[1]}
    assert lost and kept
    capsys.readouterr()
    run_stage("dedup", cfg, run)
    assert "resuming: 2 cluster(s) were deduplicated by an earlier attempt" in capsys.readouterr().out
    assert outputs() == expected and not os.path.exists(run.path(DEDUP_KEPT, ".tmp-cut-short"))
    assert all(os.stat(f).st_mtime_ns == t for f, t in kept.items())
    again = run.done_stats(DEDUP)
    for key in ("rows", "removed", "exact", "semantic", "heldout_leak", "removed_per_cluster", "similarity_histogram",
                "examples"):
        assert again[key] == stats[key], key


def test_dedup_off_is_refused_and_not_in_the_default_pipeline(planted_run):
    run, _, spec = planted_run
    cfg = load(None, [f"data.path={spec.data_path()}", *settings()])
    assert "dedup" not in pipeline(cfg)
    assert "dedup" in pipeline(load(None, [f"data.path={spec.data_path()}", *settings(exact="true")]))
    with pytest.raises(UserError, match="Dedup is off"):
        run_dedup(StageContext(cfg, run))


def test_sweep_deduplicates_every_k(planted_run):
    """A sweep with dedup on runs dedup at every k in turn (dedup/ holds the last k's), and each k's shards hold
    that k's kept rows; a finished sweep reruns; shard at a k whose kept rows dedup/ no longer holds is refused.
    The second k is the fixture's (its fit and assign reused); shuffles through the object store (4 dedups)."""
    from clusterscale.experiments import run_sweep

    run, _, spec = planted_run
    cfg = load(None, [f"data.path={spec.data_path()}", *settings(False, exact="true", key="passage",
                                                                 semantic_threshold=0.9)])
    # the earlier tests' dedup/ and shards/k=K/ (other dedup keys: refused, as any output of another config)
    run.remove(DEDUP)
    run.remove(shards_dir(K))
    sweep = run_sweep(cfg, run.uri, [2, K], None, True)
    assigned = run.done_stats(assign_dir(2))["rows"]
    stats = run.done_stats(DEDUP)
    assert stats["k"] == K and stats["rows"] + stats["removed"] == assigned and stats["semantic"] > 0
    assert run.read_json(manifest_path(K))["stats"]["rows"] == stats["rows"] == run.done_stats(DEDUP_KEPT)["rows"]
    assert [p["k"] for p in sweep["points"]] == [2, K] and all(p["dedup_s"] > 0 for p in sweep["points"])
    k2_rows = run.read_json(manifest_path(2))["stats"]["rows"]
    assert k2_rows < assigned  # k=2's shards (of its kept rows) stayed when dedup moved to k=K
    rerun = run_sweep(cfg, run.uri, [2, K], None, True)  # dedup again at each k; the shards are reused
    assert [p["shards"] for p in rerun["points"]] == [p["shards"] for p in sweep["points"]]
    assert run.read_json(manifest_path(2))["stats"]["rows"] == k2_rows and run.done_stats(DEDUP)["k"] == K
    assert f"the last dedup ran at k={K}, not at this report's k=2" in "\n".join(dedup_section(run, 2))
    k2 = variant(cfg, cluster={"k": 2}, train={"global_batch_size": 8})  # another shard config: shards/k=2/ rebuilt
    with pytest.raises(StageMissingError, match=r"dedup/kept holds the output of another config \(changed: "
                                                rf"cluster.k {K} -> 2\).*run `clusterscale dedup`"):
        run_stage("shard", k2, run, replace="changed")


def test_dedup_verb(planted_run, capsys):
    run, _, _ = planted_run
    assert cli.main(["dedup", "--run-dir", run.uri, "--set", "dedup.exact=true", "dedup.key=passage", "--replace"]) == 0
    assert "[dedup]" in capsys.readouterr().out
    assert set(removed_table(run).column("reason").to_pylist()) == {"exact", "heldout_leak"}
    # A threshold below the cosine of unrelated pairs (as with a random encoder) removes every pair as a held-out
    # leak: one paragraph naming the key, not shard's "holds no rows" later.
    assert cli.main(["dedup", "--run-dir", run.uri, "--set", "dedup.semantic_threshold=0.01", "--replace"]) == 2
    err = capsys.readouterr().err
    assert "dedup removed all" in err and "dedup.semantic_threshold=0.01 is below" in err, err
    assert not run.exists(DEDUP, "_DONE.json")


def test_heldout_vectors_of_a_real_run_come_from_the_embed_heldout_stage(shared_run, tmp_path):
    """On a copy of the shared run (a real tiny encoder), dedup's held-out leak check reads the vectors the
    embed_heldout stage wrote with the frozen encoder (its actor pool, not a second encoder inside dedup's tasks):
    one per held-out pair, as the encoder gives them. Another dedup config reuses them."""
    import shutil

    from clusterscale.io.layout import HELDOUT_EMBEDDINGS
    from clusterscale.modeling.encoder import Encoder

    path = tmp_path / "run"
    shutil.copytree(shared_run.run.path(), path)
    run = RunDir(str(path))
    assert cli.main(["dedup", "--run-dir", str(path), "--set", "dedup.semantic_threshold=0.98"]) == 0
    vectors = pads.dataset(run.files(HELDOUT_EMBEDDINGS), filesystem=run.fs).to_table()
    held = run.done_stats("heldout")["rows"]
    assert run.done_stats(HELDOUT_EMBEDDINGS)["rows"] == vectors.num_rows == held == run.done_stats(DEDUP)[
        "heldout_pairs"] > 0
    cfg = load(run.path("config.yaml"), [])
    np.testing.assert_allclose(emb_matrix(vectors.column("emb")),
                               Encoder(cfg.embed.model, max_length=cfg.embed.max_length).encode(
                                   vectors.column("passage").to_pylist()),
                               atol=2e-3)  # stored as float16, as embed stores them
    done_at = run.read_json(f"{HELDOUT_EMBEDDINGS}/_DONE.json")["finished_at"]
    # (not lower: the random tiny BERT puts every text within ~0.97 of another, and a dedup removing every pair stops)
    assert cli.main(["dedup", "--run-dir", str(path), "--set", "dedup.semantic_threshold=0.995", "--replace"]) == 0
    assert run.read_json(f"{HELDOUT_EMBEDDINGS}/_DONE.json")["finished_at"] == done_at
