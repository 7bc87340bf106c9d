"""Control characters in a config value or a command-line path (issue 55): refused at config load, naming the key
and showing the value escaped, before anything is written."""
from __future__ import annotations

import os

import pytest

from clusterscale import cli, config
from clusterscale.config import ConfigError


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Every refusal here comes before Ray starts: a value let through fails fast instead of running ingest."""
    from clusterscale.runtime import session

    def started(ray_cfg):
        raise AssertionError("Ray was started: the value was not refused")

    monkeypatch.setattr(session, "init_ray", started)


def _refused(capsys, argv: list[str]) -> str:
    """cli.main(argv) exits 2 with one `error:` paragraph and no traceback; returns that paragraph."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("value, name, shown", [
    ("/data/pairs\nb.parquet", "a newline", r"'/data/pairs\nb.parquet'"),  # YAML would make it 'pairs b.parquet'
    ("/data/pairs\r\nb.parquet", "a carriage return", r"'/data/pairs\r\nb.parquet'"),  # a Windows line end
    ("/data/\x1bpairs", "the control character '\\x1b'", r"'/data/\x1bpairs'"),
])
def test_cli_refuses_a_control_character_in_a_set_path(tmp_path, capsys, value, name, shown):
    err = _refused(capsys, ["ingest", "--run-dir", str(tmp_path / "run"), "--set", f"data.path={value}"])
    assert err.startswith(f"error: --set data.path holds {name}: {shown}. ") and "on one line" in err
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_cli_refuses_a_control_character_in_a_config_file_and_in_run_dir(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text('data:\n  path: "/data/pairs\\0.parquet"\nembed:\n  model: "bge\\tsmall"\n')
    err = _refused(capsys, ["ingest", str(path), "--run-dir", str(tmp_path / "run")])
    assert r"data.path holds a NUL character: '/data/pairs\x00.parquet'." in err
    err = _refused(capsys, ["ingest", "--run-dir", str(tmp_path / "run\n")])
    assert err.startswith("error: --run-dir holds a newline: ") and "run\\n'" in err
    assert [p.name for p in tmp_path.iterdir()] == ["c.yaml"]


def test_a_control_character_in_a_uri_never_shows_its_secret(tmp_path, capsys):
    """The value is escaped before it is redacted: a newline inside the secret cannot stop the redaction."""
    uri = "s3://AKIAQX:S3KRETQ\nTAILQ@bucket/x.parquet?session_token=T0KENQ\nMOREQ"
    err = _refused(capsys, ["ingest", "--run-dir", str(tmp_path / "run"), "--set", f"data.path={uri}"])
    assert "--set data.path holds a newline: 's3://***@bucket/x.parquet?session_token=***" in err
    assert not any(s in err for s in ("AKIAQX", "S3KRETQ", "TAILQ", "T0KENQ", "MOREQ")), err
    assert list(tmp_path.iterdir()) == []


def test_config_load_names_the_key_of_any_string_value():
    with pytest.raises(ConfigError, match=r"--set data.query_column holds a tab: 'qu\\tery'"):
        config.load(None, ["data.query_column=qu\tery"])
    with pytest.raises(ConfigError, match=r"^train.name holds a newline: 'a\\nb'"):
        config.from_dict({"train": {"name": "a\nb"}})
    # a trailing newline YAML drops anyway (a value from `$(cat file)`-like pastes) is no mistake
    assert config.load(None, ["data.path=/data/x.parquet\n"]).data.path == "/data/x.parquet"


@pytest.mark.parametrize("argv, shown", [
    (["sweep", "--k", "4,8,4"], r"--k lists 4 more than once \('4,8,4'\): give each value once"),
    (["sweep", "--k", "4", "--limit", "100,100"], r"--limit lists 100 more than once"),
    (["compare", "--arms", "clustered,random,clustered"], r"--arms lists clustered more than once"),
])
def test_a_list_option_with_a_value_twice_is_refused(tmp_path, capsys, argv, shown):
    """`sweep --k 4,4` ran one point and counted two in its report: a list option names the repeated value."""
    import re

    err = _refused(capsys, [argv[0], "--run-dir", str(tmp_path / "run"), *argv[1:]])
    assert re.search(shown, err), err


@pytest.mark.parametrize("verb", ["evaluate", "compare"])
def test_mteb_local_folder_that_is_not_there_is_refused_before_ray(tmp_path, capsys, verb):
    """`evaluate --mteb local:FOLDER` with a mistyped folder: said before Ray starts (it took ~15 s to an error), as
    a path that is not there (it said the folder "lacks corpus.jsonl")."""
    (tmp_path / "a-file.jsonl").write_text("{}\n")
    err = _refused(capsys, [verb, "--run-dir", str(tmp_path / "run"), "--mteb", f"local:{tmp_path}/sts-tsak"])
    assert f"--mteb local:{tmp_path}/sts-tsak: {tmp_path}/sts-tsak is not a folder here (no such path)" in err, err
    err = _refused(capsys, [verb, "--run-dir", str(tmp_path / "run"), "--mteb", f"local:{tmp_path}/a-file.jsonl"])
    assert "is not a folder here (a file)" in err, err


@pytest.mark.parametrize("arm, shown", [
    ("x:train.global_batch_size=48", r"--arm x: train.global_batch_size=48 differs from the run's 32, but it sets "
                                     r"the shards' batches"),
    ("x:train.init=/no/such/model", r"train.init=/no/such/model: The folder /no/such/model does not exist"),
    # compare names and seeds every arm's runs itself: these were dropped, and x was clustered reported twice
    ("x:train.name=foo", r"--arm x: train.name is compare's own"),
    ("x:train.sampler=random", r"Arms random and x train the same config"),
])
def test_a_compare_arm_that_cannot_train_is_refused_before_any_arm_trains(tmp_path, capsys, arm, shown):
    """An arm refused by its own training was found only after the arms before it had trained (~30 s here, hours on
    a cluster): every arm's batch size and student are checked first."""
    import re

    err = _refused(capsys, ["compare", "--run-dir", str(tmp_path / "run"), "--arms", "random,x", "--arm", arm])
    assert re.search(shown, err), err


def test_inspect_of_a_run_directory_that_is_not_there_says_so(tmp_path, capsys):
    """It said to run `clusterscale shard` first, for a mistyped path."""
    err = _refused(capsys, ["inspect", str(tmp_path / "nope"), "--k", "4"])
    assert f"{tmp_path / 'nope'}: no such run directory" in err, err


@pytest.mark.parametrize("verb, said", [("evaluate", "Held-out pairs not found in"),
                                        ("train", "Shards for k=8 not found in"),
                                        ("mine", "Embeddings not found in")])
def test_a_verb_whose_input_is_missing_says_so_before_ray_starts(tmp_path, capsys, verb, said):
    """Its first stage's inputs come from earlier commands: said in a second, not after Ray's start (~5 s)."""
    err = _refused(capsys, [verb, "--run-dir", str(tmp_path / "run"), "--set", "train.negatives_per_query=1"])
    assert said in err and "first" in err, err


def test_evaluate_of_a_stopped_training_names_the_resume(tmp_path, capsys):
    """`evaluate` after `train --set train.stop_after_steps=N` said to run `clusterscale train` (which would start
    afresh): it names `train --resume`. The held-out pairs are there; the model's folder holds only the attempt."""
    from clusterscale.io.rundir import RunDir

    run = RunDir(str(tmp_path / "run"))
    run.write_json("heldout/_DONE.json", {"fingerprint": "x", "finished_at": "", "stats": {}, "config": {}})
    run.write_json("train/clustered-seed0/_ATTEMPT.json", {"fingerprint": "x"})
    err = _refused(capsys, ["evaluate", "--run-dir", run.uri])
    assert "Trained model not found in" in err and "`clusterscale train --resume` continues it" in err, err


def test_training_with_mined_negatives_that_were_not_mined_is_refused_before_ray(tmp_path, capsys):
    """The train stage's precheck (Stage.precheck), run before Ray starts when train is the command's first stage."""
    from clusterscale.io.rundir import RunDir

    run = RunDir(str(tmp_path / "run"))
    run.write_json("shards/k=8/_DONE.json", {"fingerprint": "x", "finished_at": "", "stats": {}, "config": {}})
    err = _refused(capsys, ["train", "--run-dir", run.uri, "--set", "train.negatives_per_query=1"])
    assert "train.negatives_per_query=1 needs mined negatives in" in err and "run `clusterscale mine`" in err, err


def test_train_resume_with_no_attempt_to_continue_is_refused_before_ray(tmp_path, capsys):
    """`train --resume` where no training started: said by the precheck before Ray starts (it was after Ray's start)."""
    from clusterscale.io.rundir import RunDir

    run = RunDir(str(tmp_path / "run"))
    run.write_json("shards/k=8/_DONE.json", {"fingerprint": "x", "finished_at": "", "stats": {}, "config": {}})
    err = _refused(capsys, ["train", "--run-dir", run.uri, "--resume"])
    assert "--resume: no earlier run of train/clustered-seed0" in err and "start without --resume" in err, err
    assert not os.path.exists(tmp_path / "run" / "train"), "refused before anything was written"
