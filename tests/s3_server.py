"""Test helper: an S3 server on loopback (moto's `moto[server]`), with test credentials in the environment.

test_object_store reads and writes it from this process; test_jobs' Ray head gets the same credentials in its
environment (as a cluster's nodes have them) and its submitted pipeline reads its pairs and model from, and writes
its run to, this server."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """host:port of a fresh S3 server on loopback; AWS_ENV is in os.environ while it runs."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    saved = {k: os.environ.get(k) for k in AWS_ENV}
    os.environ.update(AWS_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_uri(endpoint: str, path: str) -> str:
    """An s3:// URI that carries its endpoint: what a user writes for MinIO, Ceph or an S3 on loopback."""
    return f"s3://{path}?endpoint_override={endpoint}&scheme=http&allow_bucket_creation=true"


def upload_folder(local: str, uri: str) -> str:
    """Copy a local folder (a model) to the object store under uri; returns the folder's URI."""
    from clusterscale.io.rundir import RunDir

    target = RunDir(uri)
    for root, _, names in os.walk(local):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), local)
            with open(os.path.join(root, name), "rb") as f:
                target.write_bytes(rel, f.read())
    return target.uri
