"""Jobs for real: a Ray cluster on 127.0.0.1 with token auth, started as a user starts one (`ray start --head` without
CPUs, then two worker nodes that `ray start --address` joins to it), `ray job submit` of the pipeline on tiny data
that it reads from, and writes to, an S3 server on loopback (tests/s3_server.py), as the README's cluster run does.

The cluster is this module's own (own ports, own --temp-dir per node); it is stopped by killing the processes that
carry those temp dirs, never with a global `ray stop` (other Ray instances may be running).
"""
from __future__ import annotations

import glob
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml

from clusterscale.io.filesystems import resolve_filesystem
from clusterscale.io.rundir import RunDir
from clusterscale.runtime.nodes import TEST_UNIT_DELAY_ENV
from tests.conftest import RAY_SETTINGS, make_pairs, tiny_overrides
from tests.s3_server import AWS_ENV, s3_server, s3_uri, upload_folder

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_of(temp_dir: str) -> list[int]:
    """pids of the processes started for the head whose --temp-dir is temp_dir (found in their command lines)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if temp_dir in cmdline:
                pids.append(int(entry))
    return pids


def stop_head(temp_dir: str) -> None:
    for sig, wait in ((signal.SIGTERM, 4.0), (signal.SIGKILL, 5.0)):  # a test head's state is not kept
        pids = processes_of(temp_dir)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while processes_of(temp_dir) and time.time() < deadline:
            time.sleep(0.1)


@pytest.fixture(scope="module")
def s3_endpoint():
    with s3_server() as endpoint:
        yield endpoint


WORKER_NODES, CPUS_PER_WORKER = 2, 2
EMBED_UNIT_DELAY_S = 0.4  # per embed unit on these nodes (runtime.nodes.TEST_UNIT_DELAY_ENV); see ray_head
NODE_PORTS = ["--node-manager-port", "--object-manager-port", "--metrics-export-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port"]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory, s3_endpoint):
    """A Ray cluster on loopback with token auth: a head that offers no CPU (the job's driver runs there, its work on
    the worker nodes) and WORKER_NODES worker nodes, each its own raylet; yields the job API address and the client
    env. The nodes' environment holds the S3 credentials (a cluster's workers take them from their nodes)."""
    token_file = tmp_path_factory.mktemp("secret") / "auth_token"
    token_file.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    token_file.chmod(0o600)
    temp_dir = tempfile.mkdtemp(prefix="csjob-", dir="/tmp")  # short: Ray's socket paths are length-limited
    # Not RAY_ADDRESS (nothing else may find this head), not PYTHONPATH (the job ships its code itself).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    # The suite's Ray settings (conftest: a short controller poll, no preemption watcher, idle workers kept) hold on
    # these nodes too; their raylets and workers inherit them from the nodes' environment.
    env.update({k: os.environ[k] for k in RAY_SETTINGS if k in os.environ})
    # The job's driver takes a stage lock on the S3 run for each of ~10 stages and reads it back after the settle time
    # (2 s by default, README "Locks"): a short one on loopback.
    env.update(AWS_ENV, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", CLUSTERSCALE_LOCK_SETTLE_S="0.5")
    # Tiny embed units take milliseconds: a unit is encoded before the tokeniser has the next, so the encoder next to
    # the tokeniser (Ray Data prefers the actor beside a block) could take every unit and the stage run on one node
    # (seen once in CI). A short wait per unit (the test hook) keeps the first actor busy, so the other gets units.
    delay_file = tmp_path_factory.mktemp("hook") / "unit_delay.json"
    delay_file.write_text(json.dumps({"embed": EMBED_UNIT_DELAY_S}))
    env[TEST_UNIT_DELAY_ENV] = str(delay_file)
    dashboard_port, gcs_port = free_port(), free_port()

    def ports(flags: list[str]) -> list[str]:
        return [f"{flag}={free_port()}" for flag in flags]

    head = [RAY, "start", "--head", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
            "--include-dashboard=true", "--num-cpus=0", f"--temp-dir={temp_dir}", "--disable-usage-stats",
            f"--port={gcs_port}", f"--dashboard-port={dashboard_port}", *ports(NODE_PORTS)]
    workers = [[RAY, "start", f"--address=127.0.0.1:{gcs_port}", "--node-ip-address=127.0.0.1",
                f"--num-cpus={CPUS_PER_WORKER}", f"--temp-dir={temp_dir}-w{i}", "--disable-usage-stats",
                *ports(NODE_PORTS)] for i in range(WORKER_NODES)]
    try:
        for start in (head, *workers):
            subprocess.run(start, env=env, check=True, timeout=240, capture_output=True, text=True)
        yield {"address": f"http://127.0.0.1:{dashboard_port}", "env": env, "temp_dir": temp_dir,
               "units": Path(f"{delay_file}.units")}
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"ray start failed:\n{exc.stdout}\n{exc.stderr}")
    finally:
        stop_head(temp_dir)  # the worker nodes' temp dirs start with the head's
    assert not processes_of(temp_dir)
    for folder in (temp_dir, *[f"{temp_dir}-w{i}" for i in range(WORKER_NODES)]):
        shutil.rmtree(folder, ignore_errors=True)


def job(ray_head, *args: str, env: dict | None = None, timeout: int = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, "job", *args[:1], "--address", ray_head["address"], *args[1:]],
                          env=env or ray_head["env"], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def config_file(path: Path, overrides: list[str]) -> str:
    """The same keys as --set overrides, written as a pipeline YAML."""
    raw: dict = {}
    for text in overrides:
        key, value = text.split("=", 1)
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_submitted_pipeline_reads_and_writes_s3_and_fills_the_run_dir(ray_head, s3_endpoint, tiny_model, tmp_path):
    """The README's cluster run: the job ships its code, joins the cluster it was submitted to, spreads its stages
    over the worker nodes, reads its pairs and its encoder and student (a cluster without hub access) from an object
    store and writes its run there."""
    fs, _ = resolve_filesystem(s3_uri(s3_endpoint, "data-bucket"))
    fs.create_dir("data-bucket/pairs")
    sink = io.BytesIO()
    pq.write_table(make_pairs(240), sink)
    with fs.open_output_stream("data-bucket/pairs/part-0.parquet") as out:
        out.write(sink.getvalue())
    model = upload_folder(tiny_model, s3_uri(s3_endpoint, "model-bucket/tiny-bert"))
    config = config_file(tmp_path / "tiny.yaml", tiny_overrides(model, s3_uri(s3_endpoint, "data-bucket/pairs")))
    run_uri = s3_uri(s3_endpoint, "run-bucket/runs/tiny")
    submission = f"cs-{uuid.uuid4().hex[:8]}"
    result = job(ray_head, "submit", "--submission-id", submission, "--working-dir", str(REPO), "--",
                 "python", "jobs/run_pipeline.py", config, "--run-dir", run_uri,
                 "--set", "train.steps=4", "train.log_batches=false", "embed.num_actors=2",
                 "train.num_workers=2")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"run directory: {run_uri}" in result.stdout
    assert "ray: joined" in result.stdout  # the job used the cluster it was submitted to
    status = subprocess.run(
        [sys.executable, "-c", "import sys; from ray.job_submission import JobSubmissionClient as C; "
                               "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)", ray_head["address"], submission],
        env=ray_head["env"], capture_output=True, text=True, timeout=120)
    assert status.stdout.strip() == "SUCCEEDED", status.stderr[-2000:]

    run = RunDir(run_uri)
    assert run.root == "run-bucket/runs/tiny" and isinstance(run.fs, pafs.S3FileSystem)
    for stage in ("pairs", "heldout", "embeddings", "kmeans/k=4", "assign/k=4", "shards/k=4",
                  "train/clustered-seed0"):
        assert run.exists(stage, "_DONE.json"), stage
    ingested = run.done_stats("pairs")
    assert ingested["rows_in"] == 240 and ingested["quarantine"] == 0
    embed_units = [line.split()[1] for line in ray_head["units"].read_text().splitlines() if line.startswith("embed ")]
    assert len(set(embed_units)) == WORKER_NODES, embed_units  # the hook reached the actors on both nodes
    for stage in ("embeddings", "train/clustered-seed0"):  # the job used both worker nodes
        assert run.done_stats(stage)["num_nodes"] == WORKER_NODES, (stage, run.done_stats(stage)["nodes"])
    manifest = run.read_json("shards/k=4/manifest.json")
    sharded = pads.dataset([run.path(f) for c in manifest["clusters"] for f in c["files"]], filesystem=run.fs,
                           format="parquet").to_table(columns=["pair_id"]).column("pair_id").to_pylist()
    assert len(sharded) == len(set(sharded)) == ingested["pairs"]
    assert run.read_json("train/clustered-seed0/_DONE.json")["stats"]["steps"] == 4
    assert run.exists("train/clustered-seed0/model/model.safetensors")
    assert run.read_json("eval/clustered-seed0.json")["metrics"]["ndcg_at_10"] >= 0
    assert run.exists("report/report.md") and "clustered-seed0" in run.read_bytes("report/report.md").decode()
    # Nothing was written to a local disk under a name that looks like the run: not where the tests run, not in
    # the job's working directory (unpacked under the head's temp dir).
    assert not os.path.exists("run-bucket") and not (REPO / "run-bucket").exists()
    assert not glob.glob(os.path.join(ray_head["temp_dir"], "**", "run-bucket"), recursive=True)


def test_bad_config_fails_the_job_with_the_key_named(ray_head, tmp_path):
    result = job(ray_head, "submit", "--working-dir", str(REPO), "--", "python", "jobs/preprocess.py",
                 "--run-dir", str(tmp_path / "run"), "--set", "cluster.k=0")
    assert result.returncode != 0
    assert "cluster.k must be greater than 0" in result.stdout + result.stderr


def test_job_api_refuses_a_wrong_token(ray_head):
    wrong = {**ray_head["env"], "RAY_AUTH_TOKEN": "not-the-token"}
    result = job(ray_head, "list", env=wrong, timeout=120)
    assert result.returncode != 0
    assert result.stdout.count("submission_id") == 0
