"""The typed records between stages (io/records.py): done markers and shard manifests round-trip, carry a
version, and files written before they were versioned still read (a run made by older code is reused)."""
from __future__ import annotations

from clusterscale import config as config_mod
from clusterscale.io.records import DONE_MARKER_VERSION, MANIFEST_VERSION, DoneMarker, ShardEntry, ShardManifest
from clusterscale.io.rundir import RunDir

# A done marker and two manifests exactly as the code before the records wrote them (no `version`).
OLD_MARKER = {"fingerprint": "ab12", "finished_at": "2026-11-30T10:00:00Z", "stats": {"rows": 10},
              "config": {"cluster": {"k": 4}}, "covers": {"data": {"path": "/p"}, "cluster": {"k": 4}}}
OLD_CLUSTERED = {"k": 2, "fingerprint": "cd34", "global_batch_size": 16, "row_group_rows": 16, "rows_per_file": 32,
                 "small_cluster_policy": "merge", "seed": 0, "max_group_rows": 1000, "keep_emb": False,
                 "original_counts": [40, 3], "moved": {"1": 0}, "empty_clusters": [],
                 "clusters": [{"cluster": 0, "name": "0", "rows": 43, "files": ["shards/k=2/cluster=0/part-00000-00000"
                                                                                ".parquet"], "file_rows": [43],
                               "members": [0, 1], "mean_intra_cosine": 0.5, "mean_cos_to_centroid": 0.7,
                               "samples": ["q"], "groups": 1}],
                 "stats": {"rows": 43, "overall_mean_cosine": 0.2}}
OLD_SET = {"k": 2, "sampler": "random", "fingerprint": "ef56", "clustered_fingerprint": "cd34",
           "global_batch_size": 16, "row_group_rows": 16, "rows_per_file": 32, "seed": 0,
           "clusters": [{"cluster": 0, "name": "random", "rows": 43, "files": ["a.parquet", "b.parquet"],
                         "file_rows": [32, 11], "groups": 2, "samples": []}], "stats": {"rows": 43}}


def test_old_files_read_as_version_0_with_the_same_values():
    marker = DoneMarker.from_json(OLD_MARKER)
    assert (marker.version, marker.fingerprint, marker.stats, marker.covers) == (0, "ab12", {"rows": 10},
                                                                                   OLD_MARKER["covers"])
    for old in (OLD_CLUSTERED, OLD_SET):
        manifest = ShardManifest.from_json(old)
        assert manifest.version == 0 and manifest.to_json() == old | {"version": 0}
    clustered, sampled = ShardManifest.from_json(OLD_CLUSTERED), ShardManifest.from_json(OLD_SET)
    assert clustered.clusters[0].members == [0, 1] and clustered.moved == {"1": 0} and clustered.sampler is None
    assert sampled.strata_sizes == [43] and sampled.files == ["a.parquet", "b.parquet"]
    assert sampled.clusters[0].members is None and sampled.small_cluster_policy is None
    # A manifest from before row groups and per-file rows were recorded: whole-file row groups.
    oldest = ShardManifest.from_json({k: v for k, v in OLD_SET.items() if k not in ("row_group_rows", "rows_per_file")}
                                     | {"clusters": [{"cluster": 0, "name": "0", "rows": 5, "files": ["a"]}]})
    assert oldest.row_group_rows == 1 and oldest.clusters[0].file_rows is None


def test_new_records_round_trip_with_their_version():
    entry = ShardEntry(cluster=1, name="pool", rows=3, files=["f"], file_rows=[3], groups=1, samples=["s"])
    manifest = ShardManifest(k=4, fingerprint="x", global_batch_size=8, clusters=[entry], stats={"rows": 3},
                             sampler="source", clustered_fingerprint="y")
    data = manifest.to_json()
    assert data["version"] == MANIFEST_VERSION and "small_cluster_policy" not in data and "members" not in \
        data["clusters"][0]
    assert ShardManifest.from_json(data) == manifest


def test_a_marker_written_by_old_code_is_reused(tmp_path):
    """RunDir reads an unversioned marker: same fingerprint = done, and its stats come back."""
    run, cfg = RunDir(str(tmp_path / "run")), config_mod.load(None, [])
    fingerprint = cfg.fingerprint(("data",))
    run.write_json("pairs/_DONE.json", OLD_MARKER | {"fingerprint": str(fingerprint)})
    assert run.is_done("pairs", fingerprint) and run.done_stats("pairs") == {"rows": 10}
    run.mark_done("embeddings", fingerprint, {"rows": 1})
    assert run.read_json("embeddings/_DONE.json")["version"] == DONE_MARKER_VERSION
