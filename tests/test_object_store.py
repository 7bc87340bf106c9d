"""Object stores for real: a tiny pipeline reads its pairs from, and writes its run to, an S3 server on loopback.

The server is moto's (`moto[server]`), started on 127.0.0.1 by the test. Credentials and the endpoint
come the way a user passes them: AWS_* environment variables, or query parameters of the URI.
"""
from __future__ import annotations

import io
import json
import os

import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from clusterscale import cli
from clusterscale.io.filesystems import resolve_filesystem
from clusterscale.io.rundir import RunDir, local_copy
from tests.conftest import make_pairs, tiny_overrides

AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """host:port of a fresh S3 server on loopback, with test credentials in the environment."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    saved = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"{host}:{port}"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ray_with_aws_env(s3_endpoint):
    """Local Ray whose workers inherit the credentials (they are read when Ray starts its workers)."""
    import ray

    from clusterscale.config import RayConfig
    from clusterscale.runtime.session import init_ray

    was_running = ray.is_initialized()
    ray.shutdown()
    init_ray(RayConfig(num_cpus=2, include_dashboard=False))  # started the way the CLI starts it (loopback)
    yield ray
    ray.shutdown()
    if was_running:  # leave the session's Ray as the other modules expect it
        init_ray(RayConfig(num_cpus=2, include_dashboard=False))


def s3_uri(endpoint: str, path: str) -> str:
    """An s3:// URI that carries its endpoint: what a user writes for MinIO, Ceph or an S3 on loopback."""
    return f"s3://{path}?endpoint_override={endpoint}&scheme=http&allow_bucket_creation=true"


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
    from clusterscale.stages.ingest import list_input_files

    fs, _ = resolve_filesystem(s3_uri(s3_endpoint, "glob-bucket"))
    fs.create_dir("glob-bucket/in")
    for name in ("a.parquet", "b.parquet", "notes.txt"):
        with fs.open_output_stream(f"glob-bucket/in/{name}") as out:
            out.write(b"x")
    _, files = list_input_files(DataConfig(path=s3_uri(s3_endpoint, "glob-bucket/in/*.parquet")))
    assert files == ["glob-bucket/in/a.parquet", "glob-bucket/in/b.parquet"]
    _, files = list_input_files(DataConfig(path=s3_uri(s3_endpoint, "glob-bucket/in")))
    assert files == ["glob-bucket/in/a.parquet", "glob-bucket/in/b.parquet"]


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

    from clusterscale.io import rundir

    monkeypatch.setattr(rundir, "LOCK_SETTLE_S", 0.1)
    run = RunDir(s3_uri(s3_endpoint, "lock-bucket/runs/r1"))
    with run.lock("train/x"):
        assert run.read_json("locks/train/x.json")["pid"] == os.getpid()
        with pytest.raises(rundir.StageLockedError, match=f"pid {os.getpid()} on host"):
            with run.lock("train/x"):
                pass
    assert not run.exists("locks/train/x.json")
    # A lease of another host that was not renewed in time is taken over.
    run.write_json("locks/train/x.json", {"id": "gone", "host": "elsewhere", "pid": 7, "since": "2026-01-01T00:00:00Z",
                                          "expires": time.time() - 1})
    with run.lock("train/x"):
        assert run.read_json("locks/train/x.json")["host"] != "elsewhere"


def test_local_copy_downloads_a_folder(s3_endpoint, tmp_path):
    run = RunDir(s3_uri(s3_endpoint, "copy-bucket/m"))
    run.write_text("config.json", "{}")
    run.write_text("1_Pooling/config.json", '{"pooling_mode_mean_tokens": true}')
    local = local_copy(run.uri)
    assert sorted(os.listdir(local)) == ["1_Pooling", "config.json"]
    assert json.load(open(os.path.join(local, "1_Pooling", "config.json")))["pooling_mode_mean_tokens"]
    assert local_copy(str(tmp_path)) == str(tmp_path)  # local folders are used in place


def test_tiny_pipeline_reads_from_and_writes_to_s3(s3_endpoint, tiny_model, ray_with_aws_env):
    fs, _ = resolve_filesystem(s3_uri(s3_endpoint, "data-bucket"))
    fs.create_dir("data-bucket/pairs")
    sink = io.BytesIO()
    pq.write_table(make_pairs(240), sink)
    with fs.open_output_stream("data-bucket/pairs/part-0.parquet") as out:
        out.write(sink.getvalue())
    data_uri = s3_uri(s3_endpoint, "data-bucket/pairs")
    run_uri = s3_uri(s3_endpoint, "run-bucket/runs/tiny")
    # The encoder and the student come from the object store too (a cluster without hub access).
    model_run = RunDir(s3_uri(s3_endpoint, "model-bucket/tiny-bert"))
    for root, _, names in os.walk(tiny_model):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), tiny_model)
            model_run.write_bytes(rel, open(os.path.join(root, name), "rb").read())
    overrides = tiny_overrides(model_run.uri, data_uri) + ["train.log_batches=false"]
    assert cli.main(["run", "--run-dir", run_uri, "--set", *overrides]) == 0

    run = RunDir(run_uri)
    assert run.root == "run-bucket/runs/tiny"
    for stage in ("pairs", "heldout", "embeddings", "kmeans/k=4", "assign/k=4", "shards/k=4",
                  "train/clustered-seed0"):
        assert run.exists(stage, "_DONE.json"), stage
    ingested = run.done_stats("pairs")
    assert ingested["rows_in"] == 240 and ingested["quarantine"] == 0
    manifest = run.read_json("shards/k=4/manifest.json")
    sharded = pads.dataset([run.path(f) for c in manifest["clusters"] for f in c["files"]], filesystem=run.fs,
                           format="parquet").to_table(columns=["pair_id"]).column("pair_id").to_pylist()
    assert len(sharded) == len(set(sharded)) == ingested["pairs"]
    assert run.exists("train/clustered-seed0/model/model.safetensors")
    assert run.read_json("eval/clustered-seed0.json")["metrics"]["ndcg_at_10"] >= 0
    assert "clustered-seed0" in run.read_bytes("report/report.md").decode()
    # Nothing was written to the local disk under a name that looks like the run.
    assert not os.path.exists("run-bucket")
    assert isinstance(run.fs, pafs.S3FileSystem)
