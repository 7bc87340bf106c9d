"""User faults end as one `error:` paragraph and exit 2: also behind Ray's wrappers, and for a full or read-only disk."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import yaml
from ray.exceptions import ActorDiedError, OutOfDiskError, RayTaskError, UserCodeException
from ray.train import WorkerGroupError

from clusterscale import cli
from clusterscale.config import ConfigError
from clusterscale.errors import object_store_error, storage_error, user_message
from clusterscale.io.rundir import RunDir


def ray_task_error(cause: Exception, traceback_text: str) -> RayTaskError:
    """What ray.get raises for `cause` in a task: a subclass of both, whose message is the remote traceback."""
    return RayTaskError("task", traceback_text, cause, proctitle="ray::task", pid=1, ip="127.0.0.1") \
        .as_instanceof_cause()


TRACEBACK = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
             "clusterscale.stages.ingest.IngestError: data.query_column 'q' not found.\nColumns found: a, b.\n\n"
             "The above exception was the direct cause of the following exception:\n\n"
             "ray.exceptions.UserCodeException: UDF failed to process a data block.")


@pytest.mark.parametrize("wrapped", [
    lambda: ray_task_error(ConfigError("data.query_column 'q' not found.\nColumns found: a, b."), "tb"),
    lambda: WorkerGroupError("[Rank 0 Error Snippet]: ...", {0: ConfigError("data.query_column 'q' not found.\n"
                                                                            "Columns found: a, b.")}),
    # Ray Data UDFs and actors that die in __init__ keep the original only as traceback text
    lambda: ray_task_error(UserCodeException("UDF failed to process a data block."), TRACEBACK),
    lambda: ActorDiedError(RayTaskError("A.__init__", TRACEBACK, ValueError("x"), "ray::A", 1, "127.0.0.1")),
])
def test_user_error_behind_ray_wrappers_is_its_own_message(wrapped):
    assert user_message(wrapped()) == "data.query_column 'q' not found.\nColumns found: a, b."


@pytest.mark.parametrize("code, advice", [(errno.ENOSPC, "free space on that disk"),
                                          (errno.EROFS, "choose a writable --run-dir"),
                                          (errno.EACCES, "choose a writable --run-dir")])
def test_storage_faults_name_the_path_also_inside_ray(code, advice):
    # pyarrow's form: the path sits in the message, filename is empty
    raw = OSError(code, f"Failed to open local file '/runs/a/pairs/part-0.parquet'. Detail: [errno {code}] x")
    for exc in (raw, ray_task_error(raw, "tb"), WorkerGroupError("snippet", {1: raw}),
                ray_task_error(UserCodeException("UDF failed"), f"OSError: [Errno {code}] Failed to open local "
                                                                 f"file '/runs/a/pairs/part-0.parquet'. Detail: x")):
        message = user_message(exc)
        assert message and "/runs/a/pairs/part-0.parquet" in message and advice in message, message
    assert user_message(OSError(errno.ENOSPC, "No space left on device", "/runs/b/x")).startswith(
        "No space left on device (/runs/b/x): free space")
    assert "free space on it" in user_message(ray_task_error(OutOfDiskError("object store full"), "tb"))
    assert user_message(RuntimeError("a bug")) is None and user_message(OSError(errno.EIO, "io")) is None
    assert "(the path was not reported; most likely under --run-dir)" in user_message(
        OSError(errno.ENOSPC, "No space left on device"))


@pytest.fixture
def no_ray(monkeypatch):
    import clusterscale.runtime.session

    monkeypatch.setattr(clusterscale.runtime.session, "init_ray", lambda ray_cfg: None)


@pytest.mark.parametrize("code, advice", [(errno.ENOSPC, "free space on that disk"),
                                          (errno.EROFS, "choose a writable --run-dir"),
                                          (errno.EACCES, "choose a writable --run-dir")])
def test_cli_full_or_read_only_run_dir_is_one_paragraph(tmp_path, monkeypatch, capsys, no_ray, code, advice):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o555)  # as root chmod stops nothing, so the write itself fails below

    def failing_write(self, rel, data):
        raise OSError(code, f"Failed to open local file '{self.path(rel)}'. Detail: [errno {code}] refused")

    monkeypatch.setattr(RunDir, "write_bytes", failing_write)
    assert cli.main(["ingest", "--run-dir", str(run_dir), "--set", "data.path=/nowhere.parquet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert f"{run_dir}/config.yaml" in err and advice in err


def fake_shards(run_dir, config_text: str | None) -> None:
    """A run with a finished shards/k=2/ (one cluster) and, when given, this config.yaml."""
    run = RunDir(str(run_dir))
    run.write_json("shards/k=2/manifest.json", {
        "k": 2, "stats": {"rows": 3, "overall_mean_cosine": 0.5}, "small_cluster_policy": "merge", "moved": {},
        "clusters": [{"name": 0, "rows": 3, "members": [0], "mean_intra_cosine": 0.6,
                      "mean_cos_to_centroid": 0.7, "samples": ["a query"]}]})
    run.mark_done("shards/k=2", "f", {})
    if config_text is not None:
        run.write_text("config.yaml", config_text)


def test_inspect_json_into_a_missing_folder(tmp_path, capsys):
    fake_shards(tmp_path / "run", None)
    target = tmp_path / "missing" / "table.json"
    assert cli.main(["inspect", str(tmp_path / "run"), "--k", "2", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"the folder {tmp_path / 'missing'} does not exist" in err and "Traceback" not in err
    target.parent.mkdir()
    assert cli.main(["inspect", str(tmp_path / "run"), "--k", "2", "--json", str(target)]) == 0
    assert json.loads(target.read_text())["rows"] == 3


@pytest.mark.parametrize("config_text", ["train: {lr: 0.1}\n", "cluster:\n", "cluster: {k: true}\n", "- 1\n"])
def test_inspect_a_config_yaml_without_cluster_k(tmp_path, capsys, config_text):
    fake_shards(tmp_path / "run", config_text)
    assert cli.main(["inspect", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "config.yaml has no integer cluster.k" in err and "pass --k K" in err
    fake_shards(tmp_path / "run", yaml.safe_dump({"cluster": {"k": 2}}))
    assert cli.main(["inspect", str(tmp_path / "run")]) == 0



def test_job_prints_one_paragraph_for_a_ray_wrapped_fault_and_redacts_tracebacks(tmp_path, monkeypatch, capsys,
                                                                                   no_ray):
    import clusterscale.runtime.session

    monkeypatch.setattr(clusterscale.runtime.session, "check_run_dir_shared", lambda *args: None)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "jobs"))
    from _job import run_job

    def user_fault(cfg, run, args):
        raise WorkerGroupError("[Rank 0 Error Snippet]: ...", {0: ConfigError("train.lr is too high: lower it.")})

    assert run_job("test", user_fault, ["--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == f"error: train.lr is too high: lower it.\nrun directory: {tmp_path / 'r'}\n"

    def bug(cfg, run, args):
        raise RuntimeError("cannot reach s3://KEY:SECRET@bucket/x?session_token=TOKEN")

    assert run_job("test", bug, ["--run-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "s3://***@bucket/x?session_token=***" in err
    assert "SECRET" not in err and "TOKEN" not in err


class FullDisk:
    """A run directory's filesystem whose writes fail as a full disk does, naming no path (as a bare OSError)."""

    def __init__(self, fs):
        self.fs = fs

    def open_output_stream(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.fs, name)


def test_a_full_disk_is_named_by_the_file_being_written(tmp_path, monkeypatch, capsys):
    fake_shards(tmp_path / "run", yaml.safe_dump({"cluster": {"k": 2}}))
    opened = RunDir.__init__

    def on_full_disk(self, uri):
        opened(self, uri)
        self.fs = FullDisk(self.fs)

    monkeypatch.setattr(RunDir, "__init__", on_full_disk)
    assert cli.main(["inspect", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: No space left on device (writing {tmp_path}/run/shards/k=2/inspect.json): free space on "
                   f"that disk (or choose a --run-dir on one with room) and rerun; completed stages are kept.\n")
    # pyarrow's own text, when it has more than the bare strerror, is kept after the path
    found = user_message(storage_error(OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28]"),
                                       "/runs/a/x.parquet"))
    assert found.startswith("No space left on device (writing /runs/a/x.parquet; Error writing bytes to file.")


@pytest.mark.parametrize("below", ["", "/sub/run"])
def test_run_dir_that_is_a_file(tmp_path, capsys, below):
    (tmp_path / "notes.txt").write_text("mine")
    assert cli.main(["ingest", "--run-dir", f"{tmp_path}/notes.txt{below}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --run-dir {tmp_path}/notes.txt{below}") and err.count("\n") == 1
    assert f"{tmp_path}/notes.txt exists and is not a folder" in err and "Traceback" not in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


AWS_ERROR = ("When getting information for key 'run/config.yaml' in bucket 'bucket': AWS Error NETWORK_CONNECTION "
             "during HeadObject operation: curlCode: 7, Could not connect to server")


def test_object_store_errors_are_one_paragraph_also_inside_ray():
    for exc in (OSError(AWS_ERROR), ray_task_error(OSError(AWS_ERROR), "tb"),
                ray_task_error(UserCodeException("UDF failed"), f"Traceback ...\nOSError: {AWS_ERROR}\n")):
        message = user_message(exc)
        assert message.startswith("the object store cannot be used: When getting information for key"), message
        assert "?endpoint_override=HOST:PORT" in message and "?region=NAME" in message
    named = user_message(object_store_error(OSError(AWS_ERROR), "s3://KEY:S3KRET@bucket/run?session_token=T0K"))
    assert named.startswith("s3://***@bucket/run?session_token=***: the object store cannot be used")
    assert user_message(OSError("When reading: something else")) is None
