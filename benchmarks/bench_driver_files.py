"""The driver's per-file work on an S3 server (moto, in its own process on loopback): the training start's check
that every shard file a manifest lists exists, and reading Parquet footers, before / after issue 27.

    python benchmarks/bench_driver_files.py [--files 25000 --footer-files 2000] [--json OUT]

It writes --files one-row Parquet shard files under shards/k=1000/cluster=<c>/ (1,000 clusters), then times
  - check before: one get_file_info (run.exists) per listed file, as io/layout._check_set did;
  - check after:  io/layout.missing_files, one recursive listing of the files' common folder;
  - footers before / after: --footer-files footers read one by one / with RunDir.footers (32 threads).
Run it alone on a quiet box (record `uptime`): moto answers every request in Python.
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import socket
import sys
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from clusterscale.io.layout import missing_files  # noqa: E402
from clusterscale.io.rundir import RunDir  # noqa: E402

BUCKET = "bench"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}


def serve(port: int, keys: list[str]) -> None:
    """moto's S3 in this (child) process, so its request handling does not share the client's GIL; the shard
    files are put into its store directly (55 PUT/s over HTTP here would take 8 min for 25k files)."""
    import logging

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    backend.create_bucket(BUCKET, "us-east-1")
    for i, key in enumerate(keys):
        backend.put_object(BUCKET, key, tiny_parquet(i))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    while True:
        time.sleep(3600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_parquet(i: int) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"pair_id": [i]}), sink)
    return sink.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=25_000)
    parser.add_argument("--footer-files", type=int, default=2_000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.update(AWS_ENV)
    port = free_port()
    rel = [f"shards/k=1000/cluster={i % 1000}/part-{i:05d}-00000.parquet" for i in range(args.files)]
    started = time.perf_counter()
    server = multiprocessing.Process(target=serve, args=(port, [f"run/{f}" for f in rel]), daemon=True)
    server.start()
    run = RunDir(f"s3://{BUCKET}/run?endpoint_override=127.0.0.1:{port}&scheme=http")
    while True:  # the server answers once its store holds every file
        try:
            if run.fs.get_file_info(run.path(rel[-1])).type == pafs.FileType.File:
                break
        except OSError:
            pass
        time.sleep(0.5)
    write_s = time.perf_counter() - started

    started = time.perf_counter()
    before_missing = [f for f in rel if not run.exists(f)]
    check_before_s = time.perf_counter() - started
    started = time.perf_counter()
    after_missing = missing_files(run, rel)
    check_after_s = time.perf_counter() - started
    assert before_missing == after_missing == []

    paths = [run.path(f) for f in rel[:args.footer_files]]
    started = time.perf_counter()
    serial = []
    for p in paths:
        with run.fs.open_input_file(p) as f:
            serial.append(pq.ParquetFile(f).metadata.num_rows)
    footers_before_s = time.perf_counter() - started
    started = time.perf_counter()
    threaded = [m.num_rows for m in run.footers(paths)]
    footers_after_s = time.perf_counter() - started
    assert serial == threaded
    result = {"files": args.files, "write_s": round(write_s, 1), "check_before_s": round(check_before_s, 2),
              "check_after_s": round(check_after_s, 2), "footer_files": len(paths),
              "footers_before_s": round(footers_before_s, 2), "footers_after_s": round(footers_after_s, 2),
              "load": os.getloadavg()[0], "cpus": os.cpu_count()}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    server.terminate()


if __name__ == "__main__":
    main()
