"""The embed stage on local Ray: exact output, side=both, and kills (driver, actor) followed by reruns."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from clusterscale import cli
from clusterscale import config as config_mod
from clusterscale.runtime.vectors import emb_matrix
from clusterscale.modeling.encoder import Encoder
from clusterscale.pipeline import run_stage
from clusterscale.runtime import interrupt
from clusterscale.io.rundir import RunDir
from tests.conftest import make_pairs
from tests.test_embed import save_nan_model

REPO = Path(__file__).resolve().parents[1]


def overrides(data: str, model: str = "bundled", *extra: str) -> list[str]:
    """600 pairs in 3 pairs/ parts, 12 units of 50 rows: enough units in flight to kill something mid-run."""
    return [f"data.path={data}", "data.query_column=q", "data.passage_column=p", "data.heldout_fraction=0",
            "data.rows_per_part=200", f"embed.model={model}", "embed.max_length=32", "embed.rows_per_unit=50",
            *extra]


def read_embeddings(run: RunDir, column: str = "emb") -> dict[int, np.ndarray]:
    table = pads.dataset(run.files("embeddings"), format="parquet").to_table(columns=["pair_id", column])
    ids = table.column("pair_id").to_pylist()
    assert len(ids) == len(set(ids)), "a pair_id appears twice"
    return dict(zip(ids, emb_matrix(table.column(column))))


def pair_ids(run: RunDir) -> list[int]:
    return sorted(pads.dataset(run.files("pairs"), format="parquet").to_table().column("pair_id").to_pylist())


@pytest.fixture(scope="module")
def ingested(tmp_path_factory, ray_local) -> tuple[str, Path]:
    base = tmp_path_factory.mktemp("embed")
    pq.write_table(make_pairs(600), base / "pairs.parquet")
    data = str(base / "pairs.parquet")
    run_stage("ingest", config_mod.load(None, overrides(data)), RunDir(str(base / "ingested")))
    return data, base / "ingested"


def fresh_copy(ingested, tmp_path: Path) -> RunDir:
    _, src = ingested
    shutil.copytree(src, tmp_path / "run")
    return RunDir(str(tmp_path / "run"))


@pytest.fixture(scope="module")
def expected(ingested) -> dict[int, np.ndarray]:
    """The encoder core's vectors (no Ray) by pair_id: what every run, interrupted or not, must reproduce."""
    table = pads.dataset(RunDir(str(ingested[1])).files("pairs"), format="parquet").to_table()
    vectors = Encoder("bundled", max_length=32, device="cpu").encode(table.column("passage").to_pylist())
    return dict(zip(table.column("pair_id").to_pylist(), vectors))


def assert_equals_the_encoder(got: dict[int, np.ndarray], expected: dict[int, np.ndarray], run: RunDir) -> None:
    """Every pair once, each vector the encoder core's (fp16 storage)."""
    assert sorted(got) == sorted(expected) == pair_ids(run)
    assert min(float(got[i] @ expected[i]) for i in got) >= 0.999
    assert max(np.abs(got[i] - expected[i]).max() for i in got) <= 1e-3


def test_side_both_truncation_and_the_later_stages(ingested, tiny_model, tmp_path):
    """embed.side=both at max_length 12: both columns are the encoder's vectors, the truncated passages are counted,
    and fit, assign and shard run on the result."""
    run = fresh_copy(ingested, tmp_path)
    args = ["--run-dir", run.uri, "--set", *overrides(ingested[0], tiny_model, "embed.side=both", "embed.max_length=12",
                                                     "cluster.k=4", "train.global_batch_size=8")]
    for verb in ("embed", "fit", "assign", "shard"):
        assert cli.main([verb, *args]) == 0
    schema = pq.read_schema(run.files("embeddings")[0])
    assert str(schema.field("emb").type) == "fixed_size_list<element: halffloat>[32]"
    for name in ("emb_query", "truncated", "truncated_query", "pair_id", "query", "passage", "source"):
        assert name in schema.names
    table = pads.dataset(run.files("embeddings"), format="parquet").to_table()
    encoder = Encoder(tiny_model, max_length=12, device="cpu")
    for column, text in (("emb", "passage"), ("emb_query", "query")):
        expected = encoder.encode(table.column(text).to_pylist()[:50])
        assert (emb_matrix(table.column(column))[:50] * expected).sum(axis=1).min() >= 0.999
    passages = pads.dataset(run.files("pairs"), format="parquet").to_table().column("passage").to_pylist()
    truncated = sum(len(ids) > 12 for ids in encoder.tokenizer(passages)["input_ids"])
    assert 0 < run.done_stats("embeddings")["truncated"] == truncated  # of the clustered side, the passage
    assert run.read_json("shards/k=4/manifest.json")["stats"]["rows"] == 600


def _start_driver(run: RunDir, data: str, address: str, stdout, stderr) -> subprocess.Popen:
    """`clusterscale embed` as its own process on this test's Ray; returns once it has written a unit more than
    the run dir held when it started (so it is mid-run: 12 units of the bundled encoder take seconds)."""
    before = len(run.files("embeddings"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": address}
    cmd = [sys.executable, "-m", "clusterscale.cli", "embed", "--run-dir", run.uri, "--set", *overrides(data)]
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
    deadline = time.time() + 300
    while len(run.files("embeddings")) <= before and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    return proc


def test_sigkill_then_sigint_of_the_driver_then_rerun(ingested, expected, tmp_path, ray_local):
    """SIGKILL of the driver mid-embed keeps its finished units; a second driver skips them and is stopped by
    Ctrl-C (one line, exit 130, no traceback; finished units and no lock left); the rerun resumes and every
    vector is the encoder's."""
    run = fresh_copy(ingested, tmp_path)
    address = ray_local.get_runtime_context().gcs_address
    log = tmp_path / "driver.log"
    with open(log, "wb") as out:
        proc = _start_driver(run, ingested[0], address, out, subprocess.STDOUT)
        assert proc.poll() is None, f"the driver ended before it could be killed:\n{log.read_text()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: at least one unit is complete, the marker is not written
        proc.wait()
    killed = {f: os.stat(f).st_mtime_ns for f in run.files("embeddings")}
    assert 1 <= len(killed) < 12 and not run.exists("embeddings/_DONE.json"), log.read_text()[-3000:]

    out, err = tmp_path / "driver.out", tmp_path / "driver.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = _start_driver(run, ingested[0], address, stdout, stderr)
        assert proc.poll() is None, f"the driver ended before Ctrl-C:\n{err.read_text()[-3000:]}"
        os.kill(proc.pid, signal.SIGINT)
        status = proc.wait(timeout=120)
    log = err.read_text()
    assert status == 130, log[-3000:]
    assert log.count(interrupt.MESSAGE) == 1 and log.rstrip().endswith(interrupt.MESSAGE) and "Traceback" not in log
    survivors = run.files("embeddings")
    assert len(killed) < len(survivors) < 12 and not run.exists("embeddings/_DONE.json")
    assert not run.files("locks", suffix=".json")
    assert {f: os.stat(f).st_mtime_ns for f in killed} == killed  # the killed driver's units were skipped, not redone

    stats = run_stage("embed", config_mod.load(None, overrides(ingested[0])), run).stats
    assert stats["units_skipped"] >= len(survivors) and stats["rows"] == 600
    assert_equals_the_encoder(read_embeddings(run), expected, run)  # every pair_id once


def _embed_unit_processes() -> list[int]:
    """Pids of actor processes of this test's Ray (descendants of this process) running a unit right now.

    Read from /proc (Linux): Ray names a Ray Data actor process `ray::MapWorker(MapBatches(EncodeTokens))`."""
    parent, cmdline = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
                cmdline[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, ValueError, IndexError):
                pass
    me, found = os.getpid(), []
    for pid, cmd in cmdline.items():
        if "MapBatches(EncodeTokens)" not in cmd:
            continue
        ancestor = pid
        while ancestor > 1 and ancestor != me:
            ancestor = parent.get(ancestor, 1)
        if ancestor == me:
            found.append(pid)
    return found


def test_killed_actor_is_retried_without_duplicates(ingested, expected, tmp_path):
    """A whole embed with one encoder actor SIGKILLed mid-unit: the unit is retried, the stage counts every unit and
    row once, and the output (schema, ids, vectors) is the encoder core's."""
    run = fresh_copy(ingested, tmp_path)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(run_stage("embed", config_mod.load(None, overrides(ingested[0])),
                                                                               run).stats))
    worker.start()
    killed, deadline = None, time.time() + 300
    while killed is None and worker.is_alive() and time.time() < deadline:
        busy = _embed_unit_processes()
        if busy and run.files("embeddings"):
            killed = busy[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    worker.join(timeout=300)
    assert killed is not None and result, "the stage should finish after an actor was killed mid-unit"
    assert result["units"] == 12 and result["units_skipped"] == 0 and result["rows"] == 600
    assert result["rows_per_s"] > 0 and result["worker_s"] > 0
    assert str(pq.read_schema(run.files("embeddings")[0]).field("emb").type) == "fixed_size_list<element: halffloat>[384]"
    assert_equals_the_encoder(read_embeddings(run), expected, run)


def test_nan_model_and_missing_weights_stop_with_a_message(ingested, tiny_model, tmp_path, capsys):
    run = fresh_copy(ingested, tmp_path)
    nan_model = save_nan_model(tiny_model, str(tmp_path / "nan"))
    assert cli.main(["embed", "--run-dir", run.uri, "--set", *overrides(ingested[0], nan_model)]) == 2
    err = capsys.readouterr().err
    assert "NaN/inf vectors" in err and "pair_ids [" in err and not run.exists("embeddings/_DONE.json")
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert cli.main(["embed", "--run-dir", run.uri, "--set", *overrides(ingested[0], str(empty))]) == 2
    assert "No safetensors weights" in capsys.readouterr().err


def test_report_of_an_ingest_only_run_names_only_ingest(ingested, tmp_path, capsys):
    run = fresh_copy(ingested, tmp_path)
    assert cli.main(["report", "--run-dir", run.uri, "--set", *overrides(ingested[0])]) == 0
    report = run.read_bytes("report/report.md").decode()
    title = next(line for line in report.splitlines() if line.startswith("Preprocessing ("))
    assert title.startswith("Preprocessing (ingest; cost keys ingest) on 600 pairs: ") and "so far" in title
    assert "embed" not in title and "fit" not in report.split("## Cost")[1].split("|")[0]
    assert "Extrapolation" not in report and "No extrapolation: it needs at least the embed stage" in report
