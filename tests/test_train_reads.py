"""Reads proportional to use: row-group-aligned batches, a lazy schedule, the row-group reader and its prefetch."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale.train import schedule
from clusterscale.io.layout import read_manifest, row_group_rows_for
from clusterscale.train.data import ShardReader, schedule_block_rows
from tests.train_data import make_sharded_run

SIZES = [70, 33, 16, 100]
B = 16


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_seeded_permutation_is_a_seeded_bijection(n):
    perm = schedule.SeededPermutation(n, [1, 2])
    values = perm(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))
    assert values.tolist() == schedule.SeededPermutation(n, [1, 2])(np.arange(n)).tolist()
    if n >= 7:
        assert values.tolist() != schedule.SeededPermutation(n, [1, 3])(np.arange(n)).tolist()
        assert values.tolist() != list(range(n))


def test_clustered_batches_are_whole_blocks_each_row_once_per_epoch_and_epochs_differ():
    g = 4
    compositions = []
    for epoch in range(2):
        batches = schedule.epoch_global_batches(SIZES, B, "clustered", 0, epoch, block_rows=g)
        assert len(batches) == schedule.batches_per_epoch(SIZES, B)
        for b in batches:
            blocks = b.rows.reshape(-1, g)
            assert (blocks == blocks[:, :1] + np.arange(g)).all() and (blocks[:, 0] % g == 0).all()
        used = [(b.shard, int(r)) for b in batches for r in b.rows]
        assert len(used) == len(set(used)) == sum(s // B * B for s in SIZES)
        assert schedule.unused_pairs(SIZES, B, "clustered", 0, epoch, block_rows=g) == sum(SIZES) - len(used)
        compositions.append({(b.shard, frozenset(b.rows.tolist())) for b in batches})
    assert compositions[0] != compositions[1]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_same_stratum_and_its_slice_is_whole_row_groups(world_size):
    g = 4
    per_rank = [list(schedule.iterate(SIZES, B, "clustered", 0, 30, block_rows=g)) for _ in range(world_size)]
    for step in range(30):
        assert len({r[step].shard for r in per_rank}) == 1
        slices = [per_rank[r][step].rank_rows(r, world_size) for r in range(world_size)]
        assert np.concatenate(slices).tolist() == per_rank[0][step].rows.tolist()
        for s in slices:  # a rank's rows fill exactly len(s) / g row groups
            assert len(set((s // g).tolist())) == len(s) // g


@pytest.mark.parametrize("weighting", schedule.WEIGHTINGS)
def test_resume_anywhere_gives_the_same_next_batches(weighting, monkeypatch):
    monkeypatch.setattr(schedule, "_DRAW_CHUNK", 5)  # resume points across the uniform draws' chunks
    full = list(schedule.iterate(SIZES, B, "clustered", 3, 40, weighting=weighting, block_rows=4))
    for start in (0, 4, 5, 11, 12, 13, 39):
        tail = list(schedule.iterate(SIZES, B, "clustered", 3, 40, start, weighting, block_rows=4))
        assert [(b.step, b.epoch, b.shard, b.rows.tolist()) for b in tail] == \
               [(b.step, b.epoch, b.shard, b.rows.tolist()) for b in full[start:]]


def test_uniform_unused_pairs_counts_rows_never_drawn():
    sizes, g = [400, 48, 36], 4  # the small strata are drawn more often than they hold batches
    batches = schedule.epoch_global_batches(sizes, B, "clustered", 0, 0, "uniform", block_rows=g)
    used = {(b.shard, int(r)) for b in batches for r in b.rows}
    assert schedule.unused_pairs(sizes, B, "clustered", 0, 0, "uniform", block_rows=g) == sum(sizes) - len(used)


@pytest.mark.parametrize("sampler", ["clustered", "random"])
def test_schedule_memory_does_not_grow_with_rows(sampler):
    """A billion rows in 1,000 clusters: the first batches cost kilobytes, not the rows' count."""
    sizes = [10 ** 6] * 1000
    tracemalloc.start()
    stream = schedule.iterate(sizes, 4096, sampler, 0, 10 ** 9 // 4096, 10 ** 5, block_rows=64)
    batches = [next(stream) for _ in range(3)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 << 20 and all(len(b.rows) == 4096 for b in batches)


def test_row_group_rows_divides_the_batch_and_fits_64_ranks():
    assert [row_group_rows_for(g) for g in (16, 32, 64, 96, 1000, 4096, 8192)] == [16, 32, 32, 32, 25, 64, 128]


def _expected(run, manifest, shard, rows):
    files = [pq.read_table(run.path(f)) for f in manifest.clusters[shard].files]
    return pa.concat_tables(files).column("pair_id").take(pa.array(rows)).to_pylist()


@pytest.mark.parametrize("row_group_rows", [None, 4])
def test_reader_returns_the_rows_asked_for(tmp_path, row_group_rows):
    run = make_sharded_run(tmp_path, row_group_rows=row_group_rows)
    manifest = read_manifest(run, "shards/k=4/manifest.json")
    reader = ShardReader(run, manifest)
    rows = np.array([39, 0, 13, 12, 25, 7])
    table = reader.rows(2, rows)
    assert table.column_names == ["pair_id", "query", "passage"]
    assert table.column("pair_id").to_pylist() == _expected(run, manifest, 2, rows)


def test_reader_reads_only_the_row_groups_of_its_rows(tmp_path):
    g = 4
    run = make_sharded_run(tmp_path, row_group_rows=g)
    manifest = read_manifest(run, "shards/k=4/manifest.json")
    reader = ShardReader(run, manifest)
    assert schedule_block_rows(manifest) == g
    sizes = manifest.strata_sizes
    footers = 0
    for shard, n in enumerate(sizes):  # every footer read once, and every row group
        _, read, used = reader.read(shard, np.arange(n))
        assert used < read  # tiny files: their footers weigh more than their rows
        footers += sum(8 + pq.read_metadata(run.path(f)).serialized_size for f in manifest.clusters[shard].files)
    assert reader.footer_bytes_read == footers  # the tail, then exactly the footer
    for gb in schedule.iterate(sizes, B, "clustered", 0, 10, block_rows=g):  # warm footers: data only
        table, read, used = reader.read(gb.shard, gb.rank_rows(1, 2))
        assert table.column("pair_id").to_pylist() == _expected(run, manifest, gb.shard, gb.rank_rows(1, 2))
        assert used <= read <= 1.25 * used  # pre-buffering fetches small holes between chunks in one request
    assert reader.footer_bytes_read == footers


def test_prefetch_yields_each_batch_in_order_and_raises_read_errors(tmp_path):
    run = make_sharded_run(tmp_path, row_group_rows=4)
    manifest = read_manifest(run, "shards/k=4/manifest.json")
    sizes = manifest.strata_sizes
    batches = list(schedule.iterate(sizes, B, "clustered", 0, 8, block_rows=4))
    got = list(ShardReader(run, manifest).prefetch(iter(batches), rank=1, world_size=2))
    assert [r.batch.step for r in got] == list(range(8))
    sync = ShardReader(run, manifest)
    for item in got:
        assert item.table.equals(sync.rows(item.batch.shard, item.batch.rank_rows(1, 2)))
        assert item.bytes_used > 0
    broken = batches[:2] + [schedule.GlobalBatch(2, 0, 0, np.array([10 ** 6] * B))]
    stream = ShardReader(run, manifest).prefetch(iter(broken), rank=0, world_size=2)
    assert next(stream).batch.step == 0
    with pytest.raises(Exception):
        list(stream)


def test_prefetch_stops_when_the_consumer_stops(tmp_path):
    run = make_sharded_run(tmp_path, row_group_rows=4)
    manifest = read_manifest(run, "shards/k=4/manifest.json")
    sizes = manifest.strata_sizes
    consumed = []

    def batches():
        for gb in schedule.iterate(sizes, B, "clustered", 0, 10 ** 6, block_rows=4):
            consumed.append(gb.step)
            yield gb

    stream = ShardReader(run, manifest).prefetch(batches(), rank=0, world_size=1, depth=2)
    next(stream)
    stream.close()
    assert len(consumed) <= 5  # one consumed, two queued, one being read: the thread stopped


def test_prefetch_keeps_several_reads_in_flight_and_says_how_long_a_step_waited(tmp_path):
    """Each read waits on a slow store (a barrier for 4 readers): the reads overlap, results stay in order, and
    the wait a step saw is reported (the first waits for its read, later ones find theirs done)."""
    import threading

    from clusterscale.train.data import READ_THREADS, prefetch

    run = make_sharded_run(tmp_path, row_group_rows=4)
    manifest = read_manifest(run, "shards/k=4/manifest.json")
    reader = ShardReader(run, manifest)
    batches = list(schedule.iterate(manifest.strata_sizes, B, "clustered", 0, 12, block_rows=4))
    together = threading.Barrier(READ_THREADS, timeout=20)  # passes only when READ_THREADS reads run at once
    in_flight, most = [0], [0]
    lock = threading.Lock()

    def slow_read(gb, shard, rows):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        if gb.step < READ_THREADS:
            together.wait()
        with lock:
            in_flight[0] -= 1
        return reader._read(gb, shard, rows)

    got = list(prefetch(slow_read, iter(batches), rank=0, world_size=2, depth=8))
    assert [r.batch.step for r in got] == list(range(12)) and most[0] == READ_THREADS
    sync = ShardReader(run, manifest)
    for item in got:
        assert item.table.equals(sync.rows(item.batch.shard, item.batch.rank_rows(0, 2)))
    assert got[0].wait_s > 0 and all(r.wait_s >= 0 for r in got)


def test_the_progress_line_says_when_steps_waited_for_data():
    from clusterscale.train.metrics import _waited

    assert _waited(0.0, 10.0) == "" and _waited(0.2, 10.0) == ""  # under 5% of the time: nothing said
    assert _waited(3.0, 10.0) == ("; waited 3.0s for data (30%): raise train.prefetch_steps, or read from storage "
                                  "nearer the workers")


def test_shard_writer_writes_whole_row_groups_of_the_batch_slice(tmp_path):
    from clusterscale.io.rundir import RunDir
    from clusterscale.stages.shards import SHARD_COLUMNS, SetLayout, WriteClusterShard

    n, g = 150, 8
    emb = pa.FixedSizeListArray.from_arrays(pa.array(np.ones(n * 2, dtype=np.float32)), 2)
    group = pa.table({"shard": [3] * n, "sub": [0] * n, "pair_id": pa.array(np.arange(n)), "query": ["q"] * n,
                      "passage": ["p"] * n,
                      "source": pa.nulls(n, pa.string()), "cluster": [3] * n, "cos": [1.0] * n, "emb": emb})
    out = WriteClusterShard(str(tmp_path), 4, SetLayout("shards/k=4", "cluster", 0, 5 * g, g, 2), SHARD_COLUMNS)(group)
    files = out.column("files")[0].as_py()
    assert len(files) == 4
    run = RunDir(str(tmp_path))
    for i, rel in enumerate(files):
        md = pq.read_metadata(run.path(rel))
        assert md.num_rows == (5 * g if i < 3 else n - 15 * g)
        assert [md.row_group(r).num_rows for r in range(md.num_row_groups)][:-1] == [g] * (md.num_row_groups - 1)
        assert md.row_group(0).column(1).statistics is None  # no min/max strings: footers stay small
        assert not md.row_group(0).column(1).has_dictionary_page and md.schema.names == SHARD_COLUMNS
