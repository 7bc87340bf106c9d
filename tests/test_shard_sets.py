"""Shard sets of the random, random_clusters and source samplers (stages/shard_sets.py) on local Ray: their
strata, their row groups, reuse through the executor, and a rank reading only the row groups of its rows."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import config as config_mod
from clusterscale.io.layout import read_manifest, row_group_rows_for, shard_set_dir, shard_set_manifest
from clusterscale.io.rundir import StageMissingError
from clusterscale.pipeline import STAGES, execute
from clusterscale.train import schedule
from clusterscale.train.data import ShardReader, schedule_block_rows
from tests.train_data import make_sharded_run

K, B = 2, 16  # make_sharded_run: 2 clusters of 80 rows, 4 sources of 40


def _cfg(sampler: str):
    return config_mod.load(None, [f"cluster.k={K}", f"train.global_batch_size={B}", f"train.sampler={sampler}",
                                  "shard.max_group_rows=30", "shard.target_rows_per_file=16"])


@pytest.fixture(scope="module")
def sets(tmp_path_factory, ray_local):
    run = make_sharded_run(tmp_path_factory.mktemp("sets") / "run", k=K, row_group_rows=4)
    manifests = {}
    for sampler in ("random", "random_clusters", "source"):
        execute(STAGES["shard_set"], _cfg(sampler), run)
        manifests[sampler] = shard_set_manifest(run, K, B, sampler)
    return run, manifests


def _rows(run, entry) -> pa.Table:
    return pa.concat_tables([pq.read_table(run.path(f)) for f in entry.files])


def _clustered_ids(run) -> list[set]:
    manifest = read_manifest(run, f"shards/k={K}/manifest.json")
    return [set(_rows(run, c).column("pair_id").to_pylist()) for c in manifest.clusters]


def test_random_clusters_keep_the_sizes_not_the_members(sets):
    run, manifests = sets
    clusters = _clustered_ids(run)
    strata = [set(_rows(run, c).column("pair_id").to_pylist()) for c in manifests["random_clusters"].clusters]
    assert [len(s) for s in strata] == [len(c) for c in clusters] == [80, 80]
    assert set().union(*strata) == set().union(*clusters) and not strata[0] & strata[1]
    assert strata[0] != clusters[0] and strata[0] != clusters[1]


def test_random_is_one_shuffled_stratum_of_every_row(sets):
    run, manifests = sets
    (entry,) = manifests["random"].clusters
    ids = _rows(run, entry).column("pair_id").to_pylist()
    assert sorted(ids) == sorted(set().union(*_clustered_ids(run))) and entry.rows == 160
    assert ids != sorted(ids) and entry.groups == 10  # groups of 16 rows: max_group_rows=30 cut to row groups


def test_source_strata_follow_the_source_column(sets):
    run, manifests = sets
    entries = manifests["source"].clusters
    assert [c.name for c in entries] == ["astronomy", "cooking", "finance", "football"]
    for entry in entries:
        assert set(_rows(run, entry).column("source").to_pylist()) == {entry.name} and entry.rows == 40


def test_set_files_are_row_groups_of_the_batch_slice_and_listed_in_the_manifest(sets):
    run, manifests = sets
    for manifest in manifests.values():
        g = row_group_rows_for(B)
        assert manifest.row_group_rows == g and schedule_block_rows(manifest) == g
        for entry in manifest.clusters:
            for rel, rows in zip(entry.files, entry.file_rows):
                md = pq.read_metadata(run.path(rel))
                assert md.num_rows == rows <= 16
                assert {md.row_group(i).num_rows for i in range(md.num_row_groups - 1)} <= {g}
        assert len(manifest.files) == manifest.stats["files"]


def test_a_rank_reads_only_the_row_groups_of_its_rows(sets):
    """A global batch of 16 rows is one row group here: once the footers are cached (the first pass), a step
    reads that group and nothing else (source's strata are split by a hash of pair_id, like large clusters:
    a sub-group's last file ends on a partial row group, and a batch across it reads two)."""
    run, manifests = sets
    for sampler, manifest in manifests.items():
        reader = ShardReader(run, manifest)
        batches = list(schedule.iterate(manifest.strata_sizes, B, sampler, 0, 8,
                                        block_rows=schedule_block_rows(manifest)))
        for _ in range(2):
            reader.bytes_read = reader.bytes_used = 0
            for gb in batches:
                assert reader.rows(gb.shard, gb.rank_rows(0, 1)).column("pair_id").num_chunks == 1
        assert 0 < reader.bytes_read <= (1.25 if sampler == "source" else 1.02) * reader.bytes_used, sampler


def test_a_set_is_reused_and_its_absence_is_explained(sets, tmp_path):
    run, manifests = sets
    assert execute(STAGES["shard_set"], _cfg("random"), run).stats == run.done_stats(shard_set_dir(K, "random"))
    bare = make_sharded_run(tmp_path / "bare", k=K, row_group_rows=4)
    with pytest.raises(StageMissingError, match="sampler=random_clusters are not in .*`clusterscale train` writes"):
        shard_set_manifest(bare, K, B, "random_clusters")
