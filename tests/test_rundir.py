"""The run-directory layer without Ray: absolute paths, starting from RUN/config.yaml, refusals that name the
changed keys, --replace, and stage locks. Stages are stand-ins run by the real executor."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from clusterscale import cli, pipeline
from clusterscale import config as config_mod
from clusterscale.runtime import session
from clusterscale.experiments import run_compare
from clusterscale.io.layout import kmeans_dir, shards_dir
from clusterscale.io.rundir import RunDir, StageResult
from clusterscale.run_protocol import StageLockedError, lock, replace
from tests.test_jobs_local import run_job

BASE = ["data.path=/data/pairs.parquet", "cluster.k=4", "cluster.niter=10", "train.steps=3"]


def fake_stage(calls: list, verb: str = "fit") -> pipeline.Stage:
    """The stage `verb` without inputs, with a stand-in run function that writes rows; the executor does the rest."""
    def write_rows(call):
        call.run.write_json(f"{pipeline.STAGES[verb].output_of(call.cfg)}/rows.json", list(range(10)))
        calls.append(call.cfg)
        return StageResult({"rows": 10})
    return dataclasses.replace(pipeline.STAGES[verb], run=write_rows, inputs=(), after_done=None)


@pytest.fixture
def no_ray(monkeypatch):
    calls: list = []
    monkeypatch.setattr(session, "init_ray", lambda ray_config: None)
    monkeypatch.setitem(pipeline.STAGES, "fit", fake_stage(calls))
    return calls


@pytest.fixture
def existing_run(tmp_path) -> RunDir:
    run, cfg = RunDir(str(tmp_path / "run")), config_mod.load(None, BASE)
    run.write_config(cfg)
    run.mark_done("pairs", cfg.fingerprint(("data",)), {"rows_in": 10, "quarantine": 0, "heldout": 1})
    return run


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "enc").mkdir(parents=True)
    cfg = config_mod.load(None, ["data.path=data/*.jsonl", "embed.model=models/enc", "train.init=models/enc",
                                 "mine.encoder=frozen", "train.tokenizer=org/not-here"])
    assert cfg.data.path == str(tmp_path / "data" / "*.jsonl")
    assert cfg.embed.model == cfg.train.student.init == str(tmp_path / "models" / "enc")
    assert (cfg.mine.encoder, cfg.train.student.tokenizer) == ("frozen", "org/not-here")  # keywords and hub ids stay
    assert RunDir("runs/x").uri == str(tmp_path / "runs" / "x")
    assert RunDir(f"file://{tmp_path}/runs/y").uri == f"file://{tmp_path}/runs/y"  # URIs stay as given


def test_inspect_json_path_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "load_manifest", lambda run, k: {})
    monkeypatch.setattr(cli, "cluster_table", lambda manifest: [{"cluster": 0}])
    monkeypatch.setattr(cli, "format_cluster_table", lambda table: "table")
    cli.inspect_run(str(tmp_path), 4, "out/../table.json")
    assert json.loads((tmp_path / "table.json").read_text()) == [{"cluster": 0}]


def test_mteb_local_folder_is_absolute(existing_run, monkeypatch, tmp_path):
    seen = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(session, "init_ray", lambda ray_config: None)
    monkeypatch.setitem(pipeline.STAGES, "evaluate", dataclasses.replace(
        pipeline.STAGES["evaluate"], run=lambda call: StageResult({}, {"results": {}}), inputs=()))
    monkeypatch.setattr(cli, "run_mteb", lambda cfg, run, specs: seen.extend(specs))
    (tmp_path / "tasks" / "mine").mkdir(parents=True)  # a local task must be a folder (checked before Ray)
    assert cli.main(["evaluate", "--run-dir", existing_run.uri, "--mteb", "local:tasks/mine,SciFact"]) == 0
    assert seen == [f"local:{tmp_path}/tasks/mine", "SciFact"]


def test_stage_verb_starts_from_the_runs_config(existing_run, no_ray):
    before = existing_run.read_bytes("config.yaml")
    assert cli.main(["fit", "--run-dir", existing_run.uri, "--set", "cluster.k=3"]) == 0
    cfg = no_ray[0]
    assert (cfg.data.path, cfg.cluster.k, cfg.train.schedule.steps) == ("/data/pairs.parquet", 3, 3)
    assert existing_run.read_bytes("config.yaml") == before  # never rewritten behind the user's back
    assert existing_run.exists(kmeans_dir(3), "_DONE.json")


def test_config_file_must_agree_with_the_run(existing_run, no_ray, tmp_path, capsys):
    agreeing = tmp_path / "agreeing.yaml"
    agreeing.write_text(yaml.safe_dump({"cluster": {"k": 4, "num_workers": 2}, "embed": {"batch_size": 8}}))
    assert cli.main(["fit", str(agreeing), "--run-dir", existing_run.uri]) == 0
    assert no_ray[0].cluster.num_workers == 2 and no_ray[0].data.path == "/data/pairs.parquet"
    differing = tmp_path / "differing.yaml"
    differing.write_text(yaml.safe_dump({"cluster": {"niter": 5}, "data": {"path": "builtin:docstrings"}}))
    assert cli.main(["fit", str(differing), "--run-dir", existing_run.uri]) == 2
    err = capsys.readouterr().err
    assert "cluster.niter (run: 10" in err and "data.path (run: '/data/pairs.parquet'" in err
    assert len(no_ray) == 1


def test_a_first_attempt_that_completed_nothing_can_be_corrected(tmp_path, no_ray):
    run = RunDir(str(tmp_path / "run"))
    run.write_config(config_mod.load(None, [*BASE, "data.query_column=typo"]))
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(yaml.safe_dump({"data": {"path": "/data/pairs.parquet", "query_column": "q"}}))
    assert cli.main(["fit", str(fixed), "--run-dir", run.uri]) == 0
    assert yaml.safe_load(run.read_bytes("config.yaml"))["data"]["query_column"] == "q"


def test_refusal_names_changed_keys_and_replace_goes_on(existing_run, no_ray, capsys):
    run = existing_run
    assert cli.main(["fit", "--run-dir", run.uri]) == 0
    old = config_mod.load(None, BASE)
    # Outputs made from kmeans/k=4 (shards of k=4, a model trained on them) and one that was not (k=8).
    for folder, cfg in ((shards_dir(4), old), ("train/clustered-seed0", old),
                        (shards_dir(8), config_mod.load(None, [*BASE, "cluster.k=8"]))):
        run.mark_done(folder, cfg.fingerprint(("data", "embed", "cluster", "shard")), {})
    run.write_json("eval/clustered-seed0.json", {"name": "clustered-seed0"})
    argv = ["fit", "--run-dir", run.uri, "--set", "cluster.niter=5"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "cluster.niter 10 -> 5" in err
    assert f"clusterscale fit --run-dir {run.uri} --set cluster.niter=5 --replace" in err
    assert "fingerprint" not in err and len(no_ray) == 1
    assert cli.main([*argv, "--replace"]) == 0
    assert len(no_ray) == 2 and run.read_json(f"{kmeans_dir(4)}/rows.json") == list(range(10))
    assert run.read_json(f"{kmeans_dir(4)}/_DONE.json")["covers"]["cluster"]["niter"] == 5
    assert not run.exists(shards_dir(4)) and not run.exists("train/clustered-seed0")
    assert not run.exists("eval/clustered-seed0.json") and run.exists(shards_dir(8), "_DONE.json")
    assert yaml.safe_load(run.read_bytes("config.yaml"))["cluster"]["niter"] == 5  # --replace records it


def test_second_holder_is_refused_with_the_holder_named(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    refused: list[Exception] = []

    def second():
        try:
            with lock(run, "train/x"):
                pass
        except StageLockedError as exc:
            refused.append(exc)

    with lock(run, "train/x"):
        worker = threading.Thread(target=second)
        worker.start()
        worker.join()
    assert len(refused) == 1
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in str(refused[0])
    assert not run.exists("locks/train/x.json")  # released
    with lock(run, "train/x"):
        pass


@pytest.mark.integration
def test_cli_refuses_a_stage_locked_by_another_process(existing_run, no_ray, capsys):
    run = existing_run
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from clusterscale.io.rundir import RunDir; from clusterscale.run_protocol import lock\n"
        f"with lock(RunDir({run.uri!r}), 'kmeans/k=4'):\n"
        "    print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli.main(["fit", "--run-dir", run.uri]) == 2
        err = capsys.readouterr().err
        assert f"pid {holder.pid} on host {socket.gethostname()}" in err and "Wait for it to finish" in err
        assert no_ray == [] and not run.exists(kmeans_dir(4))
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its lock (dead pid, this host) is stale and taken over.
    assert run.exists("locks/kmeans/k=4.json")
    assert cli.main(["fit", "--run-dir", run.uri]) == 0
    assert run.read_json(f"{kmeans_dir(4)}/rows.json") == list(range(10)) and len(no_ray) == 1


def test_expired_lease_of_another_host_is_taken_over(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    lease = {"id": "other", "host": "elsewhere", "pid": 1, "since": "2026-01-01T00:00:00Z"}
    run.write_json("locks/embeddings.json", lease | {"expires": time.time() + 600})
    with pytest.raises(StageLockedError, match="pid 1 on host elsewhere, since 2026-01-01T00:00:00Z"):
        with lock(run, "embeddings"):
            pass
    run.write_json("locks/embeddings.json", lease | {"expires": time.time() - 1})
    with lock(run, "embeddings"):
        assert run.read_json("locks/embeddings.json")["pid"] == os.getpid()


def test_arm_names_never_replace_the_main_training(tmp_path):
    from clusterscale.config import ConfigError
    from clusterscale.experiments import arm_name

    assert arm_name("compare", "clustered", 0) != config_mod.load(None, BASE).train_name()
    cfg = config_mod.load(None, [*BASE, "train.name=compare-random-seed0"])
    with pytest.raises(ConfigError, match="also the name of an experiment arm"):
        run_compare(cfg, RunDir(str(tmp_path / "run")), ["random"], 1)


def test_job_with_relative_run_dir_refuses_then_replaces(existing_run, no_ray, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(existing_run.root.rsplit("/", 1)[0])
    monkeypatch.setattr(session, "check_run_dir_shared", lambda *args: None)
    monkeypatch.setitem(pipeline.STAGES, "train", fake_stage(no_ray, "train"))
    assert run_job(monkeypatch, "train", "--run-dir", "run") == 0
    assert no_ray[0].data.path == "/data/pairs.parquet" and existing_run.exists("train/clustered-seed0/_DONE.json")
    assert run_job(monkeypatch, "train", "--run-dir", "run", "--set", "cluster.niter=3") == 2
    err = capsys.readouterr().err
    assert "cluster.niter 10 -> 3" in err and "jobs/train.py --run-dir run --set cluster.niter=3 --replace" in err
    assert run_job(monkeypatch, "train", "--run-dir", "run", "--set", "cluster.niter=3", "--replace") == 0
    assert existing_run.read_json("train/clustered-seed0/_DONE.json")["covers"]["cluster"]["niter"] == 3


def test_replace_removes_what_was_made_from_the_folder_not_its_inputs(tmp_path):
    """fit's and assign's markers cover the same config values; assign --replace removes the shards made from
    assign/ (finished after it) and keeps kmeans/, its input (finished before it)."""
    from clusterscale import config as config_mod

    run = RunDir(str(tmp_path / "run"))
    cfg = config_mod.load(None, ["cluster.k=4"])
    for folder, sections, at in (("kmeans/k=4", ("data", "embed", "cluster"), "2026-12-05T10:00:00Z"),
                                 ("assign/k=4", ("data", "embed", "cluster"), "2026-12-05T10:00:05Z"),
                                 ("shards/k=4", ("data", "embed", "cluster", "shard"), "2026-12-05T10:00:09Z")):
        run.write_json(f"{folder}/part.json", {})
        run.mark_done(folder, cfg.fingerprint(sections), {})
        run.write_json(f"{folder}/_DONE.json", run.read_json(f"{folder}/_DONE.json") | {"finished_at": at})
    assert replace(run, "assign/k=4") == ["shards/k=4", "assign/k=4"]
    assert run.exists("kmeans/k=4", "_DONE.json") and not run.exists("shards/k=4")
