"""runtime/bounded_data: stand-in shuffle keys that land one per partition, with a real Ray Data groupby."""
import numpy as np
import pyarrow as pa
import ray

import pyarrow.parquet as pq

from clusterscale.config import RayConfig
from clusterscale.io.rundir import RunDir
from clusterscale.runtime.bounded_data import (SHUFFLE_MAP_BATCH_BYTES, ShuffleSettings, bounded_shuffle_maps,
                                               one_key_per_partition, shuffle_for)


def test_stand_ins_are_distinct_and_land_one_per_partition():
    from ray.data._internal.arrow_ops.transform_pyarrow import hash_partition

    for keys, parts in ((6, None), (24, None), (187, None), (300, 100)):
        stand_ins = one_key_per_partition(keys, parts)
        assert len(set(stand_ins.tolist())) == keys
        parts = parts or keys
        split = hash_partition(pa.table({"k": stand_ins}), hash_cols=["k"], num_partitions=parts)
        for p, table in split.items():  # the keys whose stand-ins landed in partition p: exactly i % parts == p
            landed = np.flatnonzero(np.isin(stand_ins, table.column("k").to_numpy()))
            assert landed.tolist() == list(range(p, keys, parts))


def test_groupby_on_stand_ins_through_the_disk_shuffle(ray_local):
    """Every group arrives whole in one call, as with the plain keys, through Ray Data's disk-based shuffle."""
    def keys_seen(group: pa.Table) -> pa.Table:  # nested: pickled by value (Ray workers cannot import tests/)
        return pa.table({"key": [int(group.column("key")[0].as_py())], "rows": [group.num_rows]})

    keys = np.repeat(np.arange(24), 50)
    stand_ins = one_key_per_partition(24)
    with bounded_shuffle_maps(ShuffleSettings(disk=True)):
        ds = ray.data.from_arrow(pa.table({"key": stand_ins[keys], "x": np.arange(len(keys))}))
        out = ds.repartition(6).groupby("key", num_partitions=24).map_groups(keys_seen, batch_format="pyarrow")
        rows = out.take_all()
    assert sorted(r["key"] for r in rows) == sorted(stand_ins.tolist())
    assert all(r["rows"] == 50 for r in rows)


def test_small_shuffles_stay_in_the_object_store_with_an_aggregator_per_batch(tmp_path):
    """ray.disk_shuffle sends a shuffle through local files from ray.disk_shuffle_min_mib of rows on (estimated from
    the first file's bytes per row): 1,000 rows of 1 KiB are ~1 MiB. Below, in the object store, one aggregator
    actor per 64 MiB batch of rows, not Ray Data's one per cluster CPU, in the DataContext that the datasets made
    inside copy."""
    rows = [np.random.default_rng(i).bytes(1024) for i in range(1000)]
    pq.write_table(pa.table({"x": rows}), tmp_path / "part.parquet", compression="zstd")
    run, files = RunDir(str(tmp_path)), [str(tmp_path / "part.parquet")]
    per_row = pq.read_metadata(files[0]).row_group(0).total_byte_size / 1000
    assert per_row > 1000  # uncompressed bytes: the rows as they sit in memory, not the zstd file
    at = int(2**20 / per_row)  # the rows that make 1 MiB
    assert shuffle_for(RayConfig(disk_shuffle_min_mib=1), run, files, at + 1) == ShuffleSettings(disk=True)
    assert shuffle_for(RayConfig(disk_shuffle_min_mib=1), run, files, at - 1) == ShuffleSettings(False, 1)
    assert shuffle_for(RayConfig(disk_shuffle_min_mib=0), run, [], 0).disk  # 0: every shuffle, no footer read
    default = shuffle_for(RayConfig(), run, files, 10**5)  # the default 256 MiB: ~100 MiB stays in memory
    assert default == ShuffleSettings(False, 2)
    huge = shuffle_for(RayConfig(disk_shuffle=False, disk_shuffle_min_mib=0), run, files, 10**9)
    assert not huge.disk and huge.aggregators == -(-10**9 * per_row // SHUFFLE_MAP_BATCH_BYTES)
    ctx = ray.data.DataContext.get_current()
    before = ctx.max_hash_shuffle_aggregators
    for settings, inside in ((default, 2), (huge, 128)):  # Ray Data's own cap of 128 holds
        with bounded_shuffle_maps(settings):
            now = ray.data.DataContext.get_current()
            assert now.max_hash_shuffle_aggregators == inside and not now.use_disk_based_hash_shuffle
        assert ctx.max_hash_shuffle_aggregators == before


def test_rows_unlike_the_files_are_sized_by_their_own_bytes(tmp_path):
    """mine shuffles routed vectors without their texts, then search results: shuffle_for takes their bytes per row
    instead of a file's, and reads no footer (files may be empty)."""
    run = RunDir(str(tmp_path))
    mib = 2**20
    assert shuffle_for(RayConfig(disk_shuffle_min_mib=1), run, [], 1000, row_bytes=mib / 1000 + 1).disk
    assert shuffle_for(RayConfig(disk_shuffle_min_mib=1), run, [], 1000, row_bytes=mib / 1000 - 1) == \
        ShuffleSettings(False, 1)


def test_mines_shuffles_are_sized_by_what_they_move(tmp_path, monkeypatch):
    """200k pairs at d = 64 with nprobe 4 route ~1M copies of 168 bytes (168 MB, under the default 256 MiB: the
    object store), while assign/'s rows with their texts would have sent them through local files; the search results
    are 0.8M rows of 30 candidates (334 MB: local files), at 100k half that."""
    from clusterscale.config import load
    from clusterscale.stages import mine

    cfg = load(None, ["embed.side=both"])
    monkeypatch.setattr(mine, "vector_layout", lambda *args: (64, 2))
    route, merge = mine.shuffles(cfg, RunDir(str(tmp_path)), RunDir(str(tmp_path)), None, 200_000)
    assert route == ShuffleSettings(False, 3) and merge.disk
    route, merge = mine.shuffles(cfg, RunDir(str(tmp_path)), RunDir(str(tmp_path)), None, 100_000)
    assert not route.disk and not merge.disk
    route, _ = mine.shuffles(cfg, RunDir(str(tmp_path)), RunDir(str(tmp_path)), None, 400_000)
    assert route.disk  # 2M copies: 336 MB
