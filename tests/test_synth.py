"""`clusterscale synth`: rows as a pure function of (seed, row), the ingest/embed contract, and later stages on it."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from clusterscale import cli
from clusterscale.stages.ingest import PAIR_SCHEMA, is_heldout
from clusterscale.stages.synthetic import BLOCK_ROWS, SynthSpec, synth_part, synth_rows
from clusterscale.runtime.vectors import emb_matrix


def test_rows_do_not_depend_on_how_the_range_is_split():
    spec = SynthSpec(rows=3 * BLOCK_ROWS, dim=8, topics=5, seed=3)
    whole = synth_rows(spec, 0, spec.rows)
    cuts = [0, 17, BLOCK_ROWS + 5, 2 * BLOCK_ROWS, spec.rows]
    pieces = pa.concat_tables([synth_rows(spec, a, b) for a, b in zip(cuts, cuts[1:])])
    assert whole.equals(pieces)
    assert whole.column("pair_id").to_pylist() == list(range(spec.rows))
    assert not synth_rows(SynthSpec(rows=spec.rows, dim=8, topics=5, seed=4), 0, 50).equals(whole.slice(0, 50))


def test_texts_are_distinct_and_topical_and_vectors_cluster_by_topic():
    spec = SynthSpec(rows=2000, dim=32, topics=4, seed=0)
    table = synth_rows(spec, 0, spec.rows)
    queries, passages = table.column("query").to_pylist(), table.column("passage").to_pylist()
    assert len(set(queries)) == len(set(passages)) == spec.rows
    topics = table.column("source").to_pylist()
    vocab = {t: set() for t in set(topics)}
    for t, p in zip(topics, passages):
        vocab[t] |= set(p.split()[:-1])
    shared = set.intersection(*vocab.values())
    assert len(shared) < 5 and all(len(v) > 20 for v in vocab.values())
    for q, p in zip(queries[:50], passages[:50]):
        assert set(q.split()[:-1]) <= set(p.split())  # the query's words come from its passage
    x = emb_matrix(table.column("emb"))
    assert np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-2)
    labels = np.array(topics)
    same = np.mean([x[labels == t].mean(0) @ x[labels == t].mean(0) for t in vocab])
    assert same > 0.5 > float(x.mean(0) @ x.mean(0))  # tight within a topic, spread across topics


def test_part_splits_like_ingest_and_embeddings_hold_the_pairs(tmp_path):
    spec = SynthSpec(rows=500, dim=8, topics=3)
    counts = synth_part(str(tmp_path), vars(spec), 2, 100, 400, heldout_fraction=0.2)
    pairs = pads.dataset(str(tmp_path / "pairs")).to_table()
    held = pads.dataset(str(tmp_path / "heldout")).to_table()
    emb = pads.dataset(str(tmp_path / "embeddings")).to_table()
    assert os.listdir(tmp_path / "pairs") == ["part-00002-00000.parquet"]
    assert os.listdir(tmp_path / "embeddings") == ["part-00002-00000-00000.parquet"]
    assert pairs.schema == held.select(PAIR_SCHEMA.names).schema == PAIR_SCHEMA
    assert held.column_names == [*PAIR_SCHEMA.names, "emb"]  # held-out vectors, for dedup's leak check
    assert counts == {"rows": 300, "pairs": pairs.num_rows, "heldout": held.num_rows} and held.num_rows > 0
    assert sorted(pairs.column("pair_id").to_pylist() + held.column("pair_id").to_pylist()) == list(range(100, 400))
    assert all(is_heldout(q, 0.2) for q in held.column("query").to_pylist())
    assert not any(is_heldout(q, 0.2) for q in pairs.column("query").to_pylist())
    assert emb.column_names == ["pair_id", "query", "passage", "source", "emb", "truncated"]
    assert emb.select(PAIR_SCHEMA.names).equals(pairs)


def test_query_vectors_sit_near_their_passages_and_leave_emb_unchanged(tmp_path):
    spec = SynthSpec(rows=600, dim=32, topics=3)
    synth_part(str(tmp_path / "p"), vars(spec), 0, 0, 600, heldout_fraction=0.1)
    synth_part(str(tmp_path / "b"), vars(spec), 0, 0, 600, heldout_fraction=0.1, query_vectors=True)
    plain = pads.dataset(str(tmp_path / "p" / "embeddings")).to_table()
    both = pads.dataset(str(tmp_path / "b" / "embeddings")).to_table()
    assert both.column_names == ["pair_id", "query", "passage", "source", "emb", "truncated", "emb_query",
                                 "truncated_query"]  # embed.side=both's columns
    assert both.select(plain.column_names).equals(plain)
    p, q = emb_matrix(both.column("emb")), emb_matrix(both.column("emb_query"))
    assert np.allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-2)
    scores = q @ p.T
    assert (scores.argmax(axis=1) == np.arange(len(q))).mean() > 0.95  # its own passage is the nearest


def test_mine_frozen_refuses_a_synth_run_without_query_vectors(tmp_path):
    from clusterscale.config import ConfigError, load
    from clusterscale.stages.mine import resolve_encoder
    from clusterscale.io.rundir import RunDir

    run = RunDir(str(tmp_path))
    run.mark_done("embeddings", "fp", {"rows": 1}, {"synth": vars(SynthSpec(rows=1))})
    with pytest.raises(ConfigError, match="embed.side=both"):
        resolve_encoder(load(None, []), run)
    assert resolve_encoder(load(None, ["embed.side=both"]), run) is None


def test_boilerplate_rows_are_near_duplicates_of_one_another_and_leave_the_rest_unchanged():
    """synth --boilerplate 0.25: about a quarter of the rows within cosine 0.99 of one another (every pair), the
    other rows' vectors and every text as without it; the fraction rides in data.path (and back)."""
    plain, spec = SynthSpec(rows=1500, dim=64, topics=4, seed=2), SynthSpec(rows=1500, dim=64, topics=4, seed=2,
                                                                           boilerplate=0.25)
    assert SynthSpec.from_data_path(spec.data_path()) == spec and "boilerplate" not in plain.data_path()
    a, b = synth_rows(plain, 0, plain.rows), synth_rows(spec, 0, spec.rows)
    xa, xb = emb_matrix(a.column("emb")), emb_matrix(b.column("emb"))
    changed = np.flatnonzero((xa != xb).any(axis=1))
    assert abs(len(changed) / spec.rows - 0.25) < 0.04 and a.drop(["emb"]).equals(b.drop(["emb"]))
    sims = xb[changed].astype(np.float64) @ xb[changed].T.astype(np.float64)
    assert sims.min() >= 0.99
    args = cli.build_parser().parse_args(["synth", "--run-dir", "r", "--rows", "10", "--boilerplate", "0.3"])
    assert args.boilerplate == 0.3
    with pytest.raises(Exception, match="synth --boilerplate must be a fraction"):
        SynthSpec(rows=10, boilerplate=1.5).check()


def test_synth_refuses_bad_sizes(tmp_path, capsys):
    assert cli.main(["synth", "--run-dir", str(tmp_path / "run"), "--rows", "0"]) == 2
    assert "synth --rows must be a positive integer, got 0" in capsys.readouterr().err


def _files(root) -> dict[str, bytes]:
    """The data files of pairs/, heldout/ and embeddings/ by relative path."""
    out = {}
    for folder in ("pairs", "heldout", "embeddings"):
        for d, _, names in os.walk(os.path.join(root, folder)):
            out |= {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                    for f in names if f.endswith(".parquet")}
    return out


def test_synth_run_feeds_fit_assign_shard_train_evaluate(tmp_path, tiny_model, ray_local, capsys):
    from clusterscale.config import load
    from clusterscale.io.rundir import RunDir
    from clusterscale.pipeline import STAGES, execute

    run_dir = str(tmp_path / "run")
    sets = [f"embed.model={tiny_model}", "embed.max_length=32", "data.rows_per_part=300", "cluster.k=4",
            "cluster.niter=10", f"train.init={tiny_model}", "train.global_batch_size=16", "train.steps=4",
            "train.query_max_length=16", "train.passage_max_length=32", "train.warmup_steps=1",
            "eval.num_distractors=50", "eval.max_queries=20", "train.num_workers=1"]
    assert cli.main(["synth", "--run-dir", run_dir, "--rows", "900", "--dim", "16", "--topics", "4",
                     "--heldout-fraction", "0.1", "--seed", "7", "--set", *sets]) == 0
    for verb in ("fit", "assign", "shard", "train", "evaluate"):
        assert cli.main([verb, "--run-dir", run_dir]) == 0, verb
    out = capsys.readouterr().out
    run = RunDir(run_dir)
    pairs, held = run.done_stats("pairs"), run.done_stats("heldout")
    assert pairs["pairs"] + held["rows"] == 900 and held["rows"] > 0
    assert run.read_json("shards/k=4/manifest.json")["stats"]["rows"] == pairs["pairs"]
    assert "NDCG@10 per cluster skipped" in out
    assert {"frozen.json", "clustered-seed0.json"} <= set(os.listdir(os.path.join(run_dir, "eval")))

    # The same seed gives the same bytes whether the parts run one at a time or two at once (the synth command
    # above ran as many at once as the session's Ray has CPUs: 2), and the same rows whatever the part size.
    from clusterscale.runtime.resources import ClusterResources

    assert ClusterResources.current().cpus >= 2
    for name, in_flight, rows_per_part in (("one", 1, 300), ("whole", 1, 900)):
        spec = SynthSpec(rows=900, dim=16, topics=4, seed=7)
        cfg = load(None, [f"data.path={spec.data_path()}", "data.heldout_fraction=0.1",
                          f"data.rows_per_part={rows_per_part}", f"embed.model={tiny_model}", "embed.max_length=32"])
        execute(STAGES["synth"], cfg, RunDir(str(tmp_path / name)), max_tasks_in_flight=in_flight)
    original = _files(run_dir)
    assert len(original) == 9 and original == _files(tmp_path / "one")
    for folder in ("pairs", "heldout", "embeddings"):
        assert pads.dataset(str(tmp_path / "whole" / folder)).to_table().equals(
            pads.dataset(os.path.join(run_dir, folder)).to_table()), folder
