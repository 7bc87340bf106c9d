"""Object stores for real: the run directory, locks, listings and model folders on an S3 server on loopback.

The server is moto's (`moto[server]`, tests/s3_server.py), started on 127.0.0.1 by the test. Credentials and the
endpoint come the way a user passes them: AWS_* environment variables, or query parameters of the URI. A whole
tiny pipeline that reads its pairs and model from, and writes its run to, such a server runs as a submitted
job in tests/test_jobs.py (a cluster's workers take the credentials from their nodes' environment).
"""
from __future__ import annotations

import json
import os

import pytest

from clusterscale import run_protocol
from clusterscale.io.filesystems import resolve_filesystem
from clusterscale.io.rundir import RunDir, local_copy
from tests.s3_server import s3_server, s3_uri


@pytest.fixture(scope="module")
def s3_endpoint():
    """host:port of a fresh S3 server on loopback, with test credentials in the environment."""
    with s3_server() as endpoint:
        yield endpoint


def test_uri_query_and_environment_reach_the_same_store(s3_endpoint, monkeypatch):
    fs, root = resolve_filesystem(s3_uri(s3_endpoint, "env-bucket/a"))
    fs.create_dir("env-bucket")
    with fs.open_output_stream(f"{root}/x.txt") as out:
        out.write(b"hello")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{s3_endpoint}")
    fs2, root2 = resolve_filesystem("s3://env-bucket/a")
    assert root2 == root and fs2.get_file_info(f"{root2}/x.txt").size == 5


def test_credentials_in_the_uri_query_are_used(s3_endpoint):
    # pyarrow's from_uri refuses these parameters; the README says a URI may carry them
    uri = (s3_uri(s3_endpoint, "cred-bucket/a") + "&access_key=AKIAQUERY&secret_key=s3cr%2Fet+x&session_token=T0K")
    fs, root = resolve_filesystem(uri)
    options = fs.__reduce__()[1][0]
    assert (options["access_key"], options["secret_key"], options["session_token"]) == ("AKIAQUERY", "s3cr/et+x", "T0K")
    assert options["endpoint_override"] == s3_endpoint and options["allow_bucket_creation"]
    run = RunDir(uri)
    run.write_json("x.json", {"rows": 3})
    assert run.read_json("x.json") == {"rows": 3} and root == "cred-bucket/a"
    keyed, _ = resolve_filesystem(s3_uri(s3_endpoint, "cred-bucket/a").replace("s3://", "s3://AKIAUSER:pw@")
                                  + "&session_token=T0K")
    assert keyed.__reduce__()[1][0]["access_key"] == "AKIAUSER" and keyed.__reduce__()[1][0]["session_token"] == "T0K"


def test_globs_in_a_uri_keep_its_query(s3_endpoint):
    from clusterscale.config import DataConfig
    from clusterscale.io.input_files import IngestError
    from clusterscale.stages.ingest import list_input_files

    fs, _ = resolve_filesystem(s3_uri(s3_endpoint, "glob-bucket"))
    fs.create_dir("glob-bucket/in")
    for name in ("a.parquet", "b.parquet", "notes.txt"):
        with fs.open_output_stream(f"glob-bucket/in/{name}") as out:
            out.write(b"x")
    _, files = list_input_files(DataConfig(path=s3_uri(s3_endpoint, "glob-bucket/in/*.parquet")))
    assert files == ["glob-bucket/in/a.parquet", "glob-bucket/in/b.parquet"]
    # The folder: a file of no data format is named (not dropped without a word), with the glob that skips it.
    with pytest.raises(IngestError, match="holds 1 file.s. of no format ingest reads by their name: 'notes.txt'") as e:
        list_input_files(DataConfig(path=s3_uri(s3_endpoint, "glob-bucket/in")))
    assert f"'{s3_uri(s3_endpoint, 'glob-bucket/in/*.parquet')}'" in str(e.value)


def test_listing_skips_run_dirs_and_refuses_a_run_dir_inside_the_data(s3_endpoint):
    from clusterscale.config import DataConfig
    from clusterscale.io.input_files import IngestError, find_input_files, refuse_run_dir_in_data

    fs, _ = resolve_filesystem(s3_uri(s3_endpoint, "walk-bucket"))
    fs.create_dir("walk-bucket/in")
    for name in ("a.parquet", "old_run/config.yaml", "old_run/pairs/_DONE.json", "old_run/pairs/part-0.parquet",
                 "config_only/config.yaml", "config_only/b.parquet"):
        with fs.open_output_stream(f"walk-bucket/in/{name}") as out:
            out.write(b"x")
    data = DataConfig(path=s3_uri(s3_endpoint, "walk-bucket/in"))
    walk = find_input_files(data).walk
    assert walk.files == ["walk-bucket/in/a.parquet", "walk-bucket/in/config_only/b.parquet"]
    assert walk.run_dirs_skipped == ["walk-bucket/in/old_run"] and walk.links_skipped == 0
    assert walk.docs_skipped == ["walk-bucket/in/config_only/config.yaml"]  # a config beside data: named, not read
    with pytest.raises(IngestError, match="is inside data.path"):
        refuse_run_dir_in_data(data, s3_uri(s3_endpoint, "walk-bucket/in/runs/r1"))
    refuse_run_dir_in_data(data, s3_uri(s3_endpoint, "walk-bucket/runs/r1"))  # a sibling is fine


def test_run_dir_atomic_files_and_child_uris(s3_endpoint):
    run = RunDir(s3_uri(s3_endpoint, "rundir-bucket/runs/r1"))
    assert not run.is_local and run.root == "rundir-bucket/runs/r1"
    run.write_json("a/b.json", {"x": 1})
    assert run.read_json("a/b.json") == {"x": 1}
    assert run.listdir("a") == ["b.json"]  # no temporary names left behind
    child = RunDir(run.child_uri("a"))
    assert child.read_json("b.json") == {"x": 1}
    run.remove("a")
    assert not run.exists("a/b.json")


def test_stage_lock_is_a_lease_on_object_stores(s3_endpoint, monkeypatch):
    import time

    monkeypatch.setattr(run_protocol, "LOCK_SETTLE_S", 0.1)
    run = RunDir(s3_uri(s3_endpoint, "lock-bucket/runs/r1"))
    with run_protocol.lock(run, "train/x"):
        assert run.read_json("locks/train/x.json")["pid"] == os.getpid()
        with pytest.raises(run_protocol.StageLockedError, match=f"pid {os.getpid()} on host"):
            with run_protocol.lock(run, "train/x"):
                pass
    assert not run.exists("locks/train/x.json")
    # A lease of another host that was not renewed in time is taken over.
    run.write_json("locks/train/x.json", {"id": "gone", "host": "elsewhere", "pid": 7, "since": "2026-01-01T00:00:00Z",
                                          "expires": time.time() - 1})
    with run_protocol.lock(run, "train/x"):
        assert run.read_json("locks/train/x.json")["host"] != "elsewhere"


def test_lock_settle_time_comes_from_the_environment(monkeypatch):
    from clusterscale.errors import UserError

    monkeypatch.delenv(run_protocol.LOCK_SETTLE_ENV, raising=False)
    assert run_protocol.lock_settle_s() == run_protocol.LOCK_SETTLE_S
    monkeypatch.setenv(run_protocol.LOCK_SETTLE_ENV, "0.25")
    assert run_protocol.lock_settle_s() == 0.25
    for bad in ("soon", "-1", "nan", "1e9"):
        monkeypatch.setenv(run_protocol.LOCK_SETTLE_ENV, bad)
        with pytest.raises(UserError, match=f"CLUSTERSCALE_LOCK_SETTLE_S='{bad}' is not a number of seconds"):
            run_protocol.lock_settle_s()


def test_local_copy_downloads_a_folder(s3_endpoint, tmp_path):
    run = RunDir(s3_uri(s3_endpoint, "copy-bucket/m"))
    run.write_text("config.json", "{}")
    run.write_text("1_Pooling/config.json", '{"pooling_mode_mean_tokens": true}')
    local = local_copy(run.uri)
    assert sorted(os.listdir(local)) == ["1_Pooling", "config.json"]
    assert json.load(open(os.path.join(local, "1_Pooling", "config.json")))["pooling_mode_mean_tokens"]
    assert local_copy(str(tmp_path)) == str(tmp_path)  # local folders are used in place


def test_an_ambiguous_userinfo_is_refused_before_the_store_is_used(s3_endpoint, capsys):
    """Issue 55: the secret's tail was taken as the bucket, and writing config.yaml into it was a traceback."""
    import pyarrow.fs as pafs

    from clusterscale import cli

    uri = s3_uri(s3_endpoint, "USERQ:TOPSECRET@LEAKEDPART/x@hostbucket/x")
    assert cli.main(["ingest", "--run-dir", uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --run-dir s3://***@hostbucket/x?endpoint_override=") and err.count("\n") == 1
    assert "it is ambiguous" in err and "Traceback" not in err
    assert not any(fragment in err for fragment in ("USERQ", "TOPSECRET", "LEAKEDPART")), err
    fs, _ = resolve_filesystem(s3_uri(s3_endpoint, "any"))
    buckets = {info.path for info in fs.get_file_info(pafs.FileSelector("/"))}
    assert not buckets & {"leakedpart", "LEAKEDPART", "hostbucket"}, buckets


def test_byte_ranges_of_a_jsonl_file_on_the_store_read_its_lines_once(s3_endpoint):
    """Ranged reads (read_at) on an object store: the ranges of a JSON lines file give its records once each, in
    order, and their counts its lines, as on local disk (tests/test_text_ranges.py)."""
    from clusterscale.config import DataConfig
    from clusterscale.io.input_files import iter_records
    from clusterscale.io.text_ranges import byte_ranges, count_rows
    from clusterscale.stages.ingest import list_input_files

    fs, _ = resolve_filesystem(s3_uri(s3_endpoint, "range-bucket"))
    fs.create_dir("range-bucket")
    lines = [json.dumps({"q": f"query {i}", "p": "passage " + "é" * (i % 40)}, ensure_ascii=False) for i in range(300)]
    with fs.open_output_stream("range-bucket/pairs.jsonl") as out:
        out.write(("\n".join(lines) + "\n").encode())
    data = DataConfig(path=s3_uri(s3_endpoint, "range-bucket/pairs.jsonl"), query_column="q", passage_column="p")
    fs, files = list_input_files(data)
    size = fs.get_file_info(files[0]).size

    def records(byte_range=None):
        return [r for batch in iter_records(fs, files[0], "jsonl", ["q", "p"], data, byte_range=byte_range)
                for r in batch]

    ranges = byte_ranges(size, size // 7)
    assert [r for byte_range in ranges for r in records(byte_range)] == records() and len(records()) == 300
    assert sum(count_rows(fs, files[0], r, "jsonl", False) for r in ranges) == 300
