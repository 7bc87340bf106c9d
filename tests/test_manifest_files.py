"""Per-file work on the driver: the training start's check that every shard file exists is one listing, and
Parquet footers are read in parallel, in order. Counted on tiny local files (no Ray)."""
from __future__ import annotations

import pyarrow as pa
import pytest

from clusterscale.io.layout import missing_files
from clusterscale.io.rundir import RunDir

FILES = 300


@pytest.fixture(scope="module")
def shard_files(tmp_path_factory) -> tuple[RunDir, list[str]]:
    """FILES one-row Parquet files under shards/k=4/cluster=<c>/ (relative paths, as a manifest lists them)."""
    run = RunDir(str(tmp_path_factory.mktemp("files") / "run"))
    rel = [f"shards/k=4/cluster={i % 7}/part-{i:05d}-00000.parquet" for i in range(FILES)]
    for i, f in enumerate(rel):
        run.write_parquet(f, pa.table({"pair_id": [i] * (1 + i % 3)}))
    run.write_json("shards/k=4/manifest.json", {})  # beside the files: listed, never mistaken for one
    return run, rel


def test_the_file_check_is_one_listing_not_a_request_per_file(shard_files, monkeypatch):
    run, rel = shard_files
    calls = {"exists": 0, "files": 0}
    exists, files = RunDir.exists, RunDir.files

    def counting_exists(self, *parts):
        calls["exists"] += 1
        return exists(self, *parts)

    def counting_files(self, *parts, **kwargs):
        calls["files"] += 1
        return files(self, *parts, **kwargs)

    monkeypatch.setattr(RunDir, "exists", counting_exists)
    monkeypatch.setattr(RunDir, "files", counting_files)
    assert missing_files(run, rel) == []
    assert calls == {"exists": 1, "files": 1}  # run.files: is the folder there, then one recursive listing
    gone = rel[123]
    run.remove(gone)
    try:
        assert missing_files(run, [*rel, "shards/k=4/cluster=0/never-written.parquet"]) == [
            gone, "shards/k=4/cluster=0/never-written.parquet"]
    finally:
        run.write_parquet(gone, pa.table({"pair_id": [123]}))


def test_footers_are_read_in_parallel_and_returned_in_order(shard_files):
    run, rel = shard_files
    footers = run.footers([run.path(f) for f in rel])
    assert [m.num_rows for m in footers] == [1 + i % 3 for i in range(FILES)]
    assert run.footers([]) == [] and run.footers([run.path(rel[2])])[0].num_rows == 3
