"""Mined negatives travel with the rows (no Ray): the draw of M per row and epoch is seeded, uniform over the row's
candidates and independent of the rows beside it; sidecar pieces aligned to a shard file hold only the drawn texts,
read with the shard's row groups one draw at a time; short rows are topped up from the padding pool."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale.io.layout import NEGATIVES
from clusterscale.io.records import ShardEntry, ShardManifest
from clusterscale.io.rundir import RunDir
from clusterscale.runtime.hashing import hash_unit, splitmix64
from clusterscale.stages import mine_rows
from clusterscale.io import negatives as sidecar_format
from clusterscale.train import negatives as neg
from clusterscale.train.data import ShardReader

FILE = "shards/k=1/cluster=0/part-00000-00000.parquet"
ROWS, GROUP_ROWS = 22, 4
DRAW = neg.Draw(per_query=2, seed=3, draws=2)


def _candidates(pid: int) -> list[int]:
    """Row pid's candidates, best first: none for multiples of 5, else 1..4 other pair_ids."""
    return [] if pid % 5 == 0 else [(pid + 1 + 5 * j) % ROWS + 100 for j in range(1 + pid % 4)]


def _parts(ids) -> pa.Table:
    """negatives/part-*.parquet's columns for the rows `ids`."""
    return pa.table({"pair_id": pa.array(ids, pa.int64()),
                     "neg_pair_ids": pa.array([_candidates(int(p) - 100) for p in ids], pa.list_(pa.int64()))})


def _reference_draw(pid: int, d: int, draw: neg.Draw) -> list[int]:
    """The draw's definition, row by row: the M candidates of smallest key, in their (best-first) order."""
    cands = _candidates(pid - 100)
    keys = [hash_unit((splitmix64(np.array([pid ^ draw.seed], np.int64)) ^ np.array([c], np.uint64)).view(np.int64),
                      mine_rows.DRAW_SALT + d)[0] for c in cands]
    chosen = sorted(np.argsort(keys, kind="stable")[:draw.per_query].tolist())
    return [cands[i] for i in chosen]


@pytest.fixture
def shard_run(tmp_path, monkeypatch) -> tuple[RunDir, ShardManifest]:
    """One shuffled shard file of 22 rows in row groups of 4, its sidecar pieces of DRAW (2 groups per piece), a
    padding pool."""
    monkeypatch.setattr(sidecar_format, "SIDECAR_PIECE_ROWS", 2 * GROUP_ROWS)
    run = RunDir(str(tmp_path / "run"))
    ids = np.random.default_rng(0).permutation(np.arange(100, 100 + ROWS))
    shard = pa.table({"pair_id": ids, "query": [f"q{i}" for i in ids], "passage": [f"p{i}" for i in ids]})
    run.write_parquet(FILE, shard, row_group_size=GROUP_ROWS)
    manifest = ShardManifest(k=1, fingerprint="test", global_batch_size=GROUP_ROWS, stats={},
                             clusters=[ShardEntry(cluster=0, name="0", rows=ROWS, files=[FILE], file_rows=[ROWS])],
                             rows_per_file=ROWS, row_group_rows=GROUP_ROWS)
    found = mine_rows.draw_candidates(_parts(ids), DRAW)
    found = found.append_column("neg_passage", pa.array([f"p{c}" for c in found.column("cand").to_pylist()])) \
        .append_column("neg_query", pa.array([f"q{c}" for c in found.column("cand").to_pylist()]))
    units = mine_rows.piece_units(manifest)
    assert len(units) == 3  # 6 row groups, 2 per piece
    for unit in units:  # the groups arrive shuffled and mixed; each piece keeps only its rows
        mine_rows._write(run, unit, found.take(pa.array(np.random.default_rng(1).permutation(len(found)))), DRAW)
    run.write_parquet(neg.PADDING_PATH, shard.slice(0, 6))
    run.mark_done(NEGATIVES, "test", {})
    return run, manifest


def test_draw_is_a_seeded_uniform_choice_of_each_rows_candidates_whatever_the_rows_beside_it():
    ids = np.arange(100, 100 + ROWS)
    drawn = mine_rows.draw_candidates(_parts(ids), DRAW).to_pylist()
    by = {}
    for r in drawn:
        by.setdefault((r["anchor"], r["draw"]), []).append(r)
    for pid in ids.tolist():
        cands = _candidates(pid - 100)
        for d in range(DRAW.draws):
            rows = by.get((pid, d), [])
            assert [r["cand"] for r in rows] == _reference_draw(pid, d, DRAW)
            assert len(rows) == min(2, len(cands)) and [r["slot"] for r in rows] == sorted(r["slot"] for r in rows)
            assert all(cands[r["slot"]] == r["cand"] for r in rows)  # slot: the candidate's rank, best first
    assert any(by[(p, 0)] != by[(p, 1)] for p in ids.tolist() if len(_candidates(p - 100)) > 2)  # draws differ
    alone = mine_rows.draw_candidates(_parts(ids[7:9][::-1]), DRAW).to_pylist()
    assert sorted(map(str, alone)) == sorted(str(r) for r in drawn if r["anchor"] in (107, 108))
    other_seed = mine_rows.draw_candidates(_parts(ids), neg.Draw(2, 4, 2)).to_pylist()
    assert other_seed != drawn
    # Uniform: over many rows of 4 candidates, each slot is drawn about M / 4 of the time.
    many = pa.table({"pair_id": pa.array(np.arange(4000), pa.int64()),
                     "neg_pair_ids": pa.array([[10_000 + 4 * i + j for j in range(4)] for i in range(4000)],
                                              pa.list_(pa.int64()))})
    slots = mine_rows.draw_candidates(many, neg.Draw(1, 0, 1)).column("slot").to_numpy()
    assert len(slots) == 4000 and np.allclose(np.bincount(slots, minlength=4) / 4000, 0.25, atol=0.03)


def test_training_draw_follows_the_epochs_and_stops_at_the_candidates():
    from clusterscale.config import load

    manifest = ShardManifest(k=1, fingerprint="t", global_batch_size=4, stats={},
                             clusters=[ShardEntry(cluster=0, name="0", rows=40, files=[FILE], file_rows=[40])],
                             rows_per_file=40, row_group_rows=4)
    one = load(None, ["train.global_batch_size=4", "train.negatives_per_query=2", "train.steps=null"])
    assert neg.training_draw(one, manifest) == neg.Draw(2, one.train.schedule.seed, 1)
    three = load(None, ["train.global_batch_size=4", "train.negatives_per_query=2", "train.steps=25"])
    assert neg.training_draw(three, manifest).draws == 3  # 10 batches per epoch, 25 steps
    many = load(None, ["train.global_batch_size=4", "train.negatives_per_query=2", "train.epochs=50",
                       "train.steps=null", "mine.range_max=7"])
    assert neg.training_draw(many, manifest).draws == 4  # ceil(7 / 2): every candidate has had its turn


def test_sidecar_pieces_keep_the_shard_rows_and_row_groups_and_hold_only_the_drawn_texts(shard_run):
    run, manifest = shard_run
    shard = pq.ParquetFile(run.path(FILE))
    for piece in range(3):
        side = pq.ParquetFile(run.path(neg.sidecar_path(FILE, piece, DRAW)))
        groups = range(2 * piece, min(2 * piece + 2, shard.metadata.num_row_groups))
        assert [side.metadata.row_group(g).num_rows for g in range(side.metadata.num_row_groups)] == \
            [shard.metadata.row_group(g).num_rows for g in groups]
        table = side.read()
        assert table.column("pair_id").equals(shard.read_row_groups(list(groups)).column("pair_id"))
        for d in range(DRAW.draws):
            for pid, cands, texts in zip(*(table.column(c).to_pylist()
                                           for c in ("pair_id", f"neg_pair_ids_{d}", f"neg_passages_{d}"))):
                assert cands == _reference_draw(pid, d, DRAW) and texts == [f"p{c}" for c in cands]


def test_reader_reads_one_draw_of_a_rows_negatives_with_it_and_only_its_pieces(shard_run):
    run, manifest = shard_run
    sidecars = neg.NegativeSidecars(run, manifest, DRAW, ids=True)
    reader = ShardReader(run, manifest, sidecars=sidecars)
    table = reader.rows(0, np.array([9, 8, 1]))  # row groups 2 and 0: pieces 1 and 0, not piece 2; epoch 0
    for pid, cands, queries in zip(*(table.column(c).to_pylist() for c in ("pair_id", "neg_pair_ids",
                                                                           "neg_queries"))):
        assert cands == _reference_draw(pid, 0, DRAW) and queries == [f"q{c}" for c in cands]
    whole = sum(run.fs.get_file_info(run.path(neg.sidecar_path(FILE, p, DRAW))).size for p in range(3))
    assert 0 < sidecars.bytes_read < whole / 2  # one draw's columns of two pieces
    rows = pq.read_table(run.path(FILE)).slice(0, 8)
    for epoch in (1, 2, 3):  # epoch e trains with draw e % draws
        got = sidecars.attach(rows, FILE, [0, 1], epoch)
        assert got.column("neg_pair_ids").to_pylist() == [_reference_draw(p, epoch % 2, DRAW)
                                                           for p in rows.column("pair_id").to_pylist()]


def test_misaligned_or_missing_sidecar_says_rerun_mine(shard_run):
    run, manifest = shard_run
    run.write_parquet(neg.sidecar_path(FILE, 1, DRAW), pq.read_table(run.path(neg.sidecar_path(FILE, 0, DRAW))),
                      row_group_size=GROUP_ROWS)
    with pytest.raises(neg.NegativesError, match="not aligned.*clusterscale mine --replace"):
        ShardReader(run, manifest, sidecars=neg.NegativeSidecars(run, manifest, DRAW, ids=True)).rows(0, np.array([9]))
    run.remove(neg.sidecar_path(FILE, 2, DRAW))
    with pytest.raises(neg.NegativesError, match="missing.*clusterscale mine --replace"):
        ShardReader(run, manifest, sidecars=neg.NegativeSidecars(run, manifest, DRAW, ids=True)).rows(0, np.array([20]))


def test_negatives_are_the_draw_never_the_pair_and_padded_from_the_pool(shard_run):
    run, manifest = shard_run
    table = ShardReader(run, manifest, sidecars=neg.NegativeSidecars(run, manifest, DRAW, ids=True)).rows(0, np.arange(ROWS))
    negatives = neg.MinedNegatives(run, per_query=2, seed=3)
    passages, queries, padded = negatives.for_rows(table, step=5)
    assert (passages, queries, padded) == negatives.for_rows(table, step=5)
    part = negatives.for_rows(table.slice(3, 5), step=5)  # a row's negatives do not depend on the rows beside it
    assert part[:2] == (passages[6:16], queries[6:16])
    assert len(passages) == len(queries) == 2 * ROWS
    expected_padding = sum(max(0, 2 - len(_candidates(p - 100))) for p in table.column("pair_id").to_pylist())
    assert padded == expected_padding > 0
    for i, pid in enumerate(table.column("pair_id").to_pylist()):
        drawn = passages[2 * i:2 * i + 2]
        assert f"p{pid}" not in drawn and all(q == "q" + p[1:] for p, q in zip(drawn, queries[2 * i:2 * i + 2]))
        mined = [int(p[1:]) for p in drawn[:min(2, len(_candidates(pid - 100)))]]  # the draw first, then padding
        assert mined == _reference_draw(pid, 0, DRAW)
