"""runtime/bounded_data: stand-in shuffle keys that land one per partition, with a real Ray Data groupby."""
import numpy as np
import pyarrow as pa
import ray

from clusterscale.runtime.bounded_data import bounded_shuffle_maps, one_key_per_partition


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
    with bounded_shuffle_maps(disk=True):
        ds = ray.data.from_arrow(pa.table({"key": stand_ins[keys], "x": np.arange(len(keys))}))
        out = ds.repartition(6).groupby("key", num_partitions=24).map_groups(keys_seen, batch_format="pyarrow")
        rows = out.take_all()
    assert sorted(r["key"] for r in rows) == sorted(stand_ins.tolist())
    assert all(r["rows"] == 50 for r in rows)
