"""Mined negatives travel with the rows (no Ray): sidecar pieces aligned to a shard file, read with its row
groups; the draw of M per row is seeded, never the row's own pair, and topped up from the padding pool."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale.io.layout import NEGATIVES
from clusterscale.io.records import ShardEntry, ShardManifest
from clusterscale.io.rundir import RunDir
from clusterscale.stages import mine_rows
from clusterscale.train import negatives as neg
from clusterscale.train.data import ShardReader

FILE = "shards/k=1/cluster=0/part-00000-00000.parquet"
ROWS, GROUP_ROWS = 22, 4


def _candidates(pid: int) -> list[int]:
    """Row pid's candidates, best first: none for multiples of 5, else 1..3 other pair_ids."""
    return [] if pid % 5 == 0 else [(pid + 1 + 5 * j) % ROWS + 100 for j in range(1 + pid % 3)]


@pytest.fixture
def shard_run(tmp_path, monkeypatch) -> tuple[RunDir, ShardManifest]:
    """One shuffled shard file of 22 rows in row groups of 4, its sidecar pieces (2 groups per piece), a pool."""
    monkeypatch.setattr(neg, "SIDECAR_PIECE_ROWS", 2 * GROUP_ROWS)
    run = RunDir(str(tmp_path / "run"))
    ids = np.random.default_rng(0).permutation(np.arange(100, 100 + ROWS))
    shard = pa.table({"pair_id": ids, "query": [f"q{i}" for i in ids], "passage": [f"p{i}" for i in ids]})
    run.write_parquet(FILE, shard, row_group_size=GROUP_ROWS)
    manifest = ShardManifest(k=1, fingerprint="test", global_batch_size=GROUP_ROWS, stats={},
                             clusters=[ShardEntry(cluster=0, name="0", rows=ROWS, files=[FILE], file_rows=[ROWS])],
                             rows_per_file=ROWS, row_group_rows=GROUP_ROWS)
    found = [(int(a), slot, c) for a in ids for slot, c in enumerate(_candidates(int(a) - 100))]
    found = pa.table({"anchor": [f[0] for f in found], "slot": [f[1] for f in found], "cand": [f[2] for f in found],
                      "neg_passage": [f"p{f[2]}" for f in found], "neg_query": [f"q{f[2]}" for f in found]})
    units = mine_rows.piece_units(manifest)
    assert len(units) == 3  # 6 row groups, 2 per piece
    for unit in units:  # the groups arrive shuffled and mixed; each piece keeps only its rows
        mine_rows._write(run, unit, found.take(pa.array(np.random.default_rng(1).permutation(len(found)))))
    run.write_parquet(neg.PADDING_PATH, shard.slice(0, 6))
    run.mark_done(NEGATIVES, "test", {})
    return run, manifest


def test_sidecar_pieces_keep_the_shard_rows_and_row_groups(shard_run):
    run, manifest = shard_run
    shard = pq.ParquetFile(run.path(FILE))
    for piece in range(3):
        side = pq.ParquetFile(run.path(neg.sidecar_path(FILE, piece)))
        groups = range(2 * piece, min(2 * piece + 2, shard.metadata.num_row_groups))
        assert [side.metadata.row_group(g).num_rows for g in range(side.metadata.num_row_groups)] == \
            [shard.metadata.row_group(g).num_rows for g in groups]
        table = side.read()
        assert table.column("pair_id").equals(shard.read_row_groups(list(groups)).column("pair_id"))
        for pid, cands, texts in zip(*(table.column(c).to_pylist() for c in ("pair_id", "neg_pair_ids",
                                                                             "neg_passages"))):
            assert cands == _candidates(pid - 100) and texts == [f"p{c}" for c in cands]  # best first


def test_reader_reads_a_rows_negatives_with_it_and_only_its_pieces(shard_run):
    run, manifest = shard_run
    sidecars = neg.NegativeSidecars(run, manifest)
    reader = ShardReader(run, manifest, sidecars=sidecars)
    table = reader.rows(0, np.array([9, 8, 1]))  # row groups 2 and 0: pieces 1 and 0, not piece 2
    for pid, cands, queries in zip(*(table.column(c).to_pylist() for c in ("pair_id", "neg_pair_ids",
                                                                           "neg_queries"))):
        assert cands == _candidates(pid - 100) and queries == [f"q{c}" for c in cands]
    whole = sum(run.fs.get_file_info(run.path(neg.sidecar_path(FILE, p))).size for p in range(3))
    assert 0 < sidecars.bytes_read < whole
    everything = ShardReader(run, manifest, sidecars=neg.NegativeSidecars(run, manifest)).rows(-1, np.arange(ROWS))
    assert everything.column("neg_pair_ids").to_pylist() == [_candidates(p - 100) for p in
                                                             everything.column("pair_id").to_pylist()]


def test_misaligned_or_missing_sidecar_says_rerun_mine(shard_run):
    run, manifest = shard_run
    run.write_parquet(neg.sidecar_path(FILE, 1), pq.read_table(run.path(neg.sidecar_path(FILE, 0))),
                      row_group_size=GROUP_ROWS)
    with pytest.raises(neg.NegativesError, match="not aligned.*clusterscale mine --replace"):
        ShardReader(run, manifest, sidecars=neg.NegativeSidecars(run, manifest)).rows(0, np.array([9]))
    run.remove(neg.sidecar_path(FILE, 2))
    with pytest.raises(neg.NegativesError, match="missing.*clusterscale mine --replace"):
        ShardReader(run, manifest, sidecars=neg.NegativeSidecars(run, manifest)).rows(0, np.array([20]))


def test_draw_is_seeded_never_the_pair_and_padded_from_the_pool(shard_run):
    run, manifest = shard_run
    table = ShardReader(run, manifest, sidecars=neg.NegativeSidecars(run, manifest)).rows(0, np.arange(ROWS))
    negatives = neg.MinedNegatives(run, per_query=2, seed=3)
    passages, queries, padded = negatives.for_rows(table, step=5)
    assert (passages, queries, padded) == negatives.for_rows(table, step=5)
    assert negatives.for_rows(table, step=6)[0] != passages
    part = negatives.for_rows(table.slice(3, 5), step=5)  # a row's draw does not depend on the rows beside it
    assert part[:2] == (passages[6:16], queries[6:16])
    assert len(passages) == len(queries) == 2 * ROWS
    expected_padding = sum(max(0, 2 - len(_candidates(p - 100))) for p in table.column("pair_id").to_pylist())
    assert padded == expected_padding > 0
    for i, pid in enumerate(table.column("pair_id").to_pylist()):
        drawn = passages[2 * i:2 * i + 2]
        assert f"p{pid}" not in drawn and all(q == "q" + p[1:] for p, q in zip(drawn, queries[2 * i:2 * i + 2]))
        cands = _candidates(pid - 100)
        mined = [int(p[1:]) for p in drawn[:min(2, len(cands))]]  # the row's own candidates first, then padding
        assert all(c in cands for c in mined) and mined == sorted(mined, key=cands.index)  # best first
