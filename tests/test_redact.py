"""Credentials in URIs are never printed or stored; the run keeps the real URI in memory."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterscale import cli, config, pipeline, run_protocol
from clusterscale.stages.ingest import IngestError
from clusterscale.redact import redact_uri, redacted_output, uri_problem

ROOT = Path(__file__).resolve().parents[1]

SECRET_URI = "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI%2FK7MDENG%2FbPxRfiCYEXAMPLEKEY@bucket/pairs/"
QUERY_URI = "s3://bucket/pairs?region=eu-west-1&access_key=AKIA1&secret_key=s3cr/et&session_token=tok3n"


@pytest.mark.parametrize("text, expected", [
    (SECRET_URI, "s3://***@bucket/pairs/"),
    (QUERY_URI, "s3://bucket/pairs?region=eu-west-1&access_key=***&secret_key=***&session_token=***"),
    (f"cannot read {SECRET_URI}: denied", "cannot read s3://***@bucket/pairs/: denied"),
    ("gs://bucket/team/jane@example.com/x.parquet", "gs://bucket/team/jane@example.com/x.parquet"),
    ("s3://bucket/run?endpoint_override=localhost:9000", "s3://bucket/run?endpoint_override=localhost:9000"),
    ("/data/pairs.parquet", "/data/pairs.parquet"),
])
def test_redact_uri(text, expected):
    assert redact_uri(text) == expected


def test_credentials_do_not_change_the_fingerprint():
    a = config.load(None, [f"data.path={SECRET_URI}"])
    b = config.load(None, ["data.path=s3://OTHERKEY:other@bucket/pairs/"])
    c = config.load(None, ["data.path=s3://OTHERKEY:other@bucket/other/"])
    assert a.fingerprint(("data",)) == b.fingerprint(("data",)) != c.fingerprint(("data",))


def test_cli_never_prints_or_stores_credentials(tmp_path, monkeypatch, capsys):
    import clusterscale.runtime.session

    seen = {}

    def ingest(call):
        cfg, run = call.cfg, call.run
        seen["path"] = cfg.data.path
        run.mark_done("pairs", cfg.fingerprint(("data",)), {"rows_in": 0, "input": cfg.data.path},
                      {"data": dataclasses.asdict(cfg.data)})
        run_protocol.record_cost(run, "ingest", {"input": cfg.data.path})
        raise IngestError(f"No input files found at data.path {cfg.data.path!r}.")

    monkeypatch.setattr(clusterscale.runtime.session, "init_ray", lambda ray_cfg: None)
    monkeypatch.setitem(pipeline.STAGES, "ingest", dataclasses.replace(pipeline.STAGES["ingest"], run=ingest))
    run_dir = tmp_path / "run"
    assert cli.main(["ingest", "--run-dir", str(run_dir), "--set", f"data.path={SECRET_URI}"]) == 2
    assert seen["path"] == SECRET_URI  # the run itself uses the real URI
    out = capsys.readouterr()
    stored = {p.name: p.read_text() for p in run_dir.rglob("*") if p.is_file()}
    assert {"config.yaml", "_DONE.json", "costs.json"} <= set(stored)
    for text in [out.out, out.err, *stored.values()]:
        assert "wJalrXUtnFEMI" not in text and "AKIAIOSFODNN7EXAMPLE" not in text
    assert "s3://***@bucket/pairs/" in out.err and "s3://***@bucket/pairs/" in stored["config.yaml"]
    assert config.load(run_dir / "config.yaml").data.path == "s3://***@bucket/pairs/"


# Each secret holds S3KRET (or T0KEN) and a fragment past the character that broke the old pattern.
SECRETS = ("S3KRET", "T0KEN", "AKIAEXAMPLE", "pAss", "ret99", "zzS3", "s3cr/")
MALFORMED = {
    "space": "s3://AKIAEXAMPLE:S3KRET pAss@bucket/x.parquet",
    "at": "s3://AKIAEXAMPLE:S3KRET@ret99@bucket/x.parquet",
    "bad percent": "s3://AKIAEXAMPLE:%zzS3KRET@bucket/x.parquet",
    "slash": "s3://AKIAEXAMPLE:s3cr/S3KRET@bucket/x.parquet",
    "query": "s3://bucket/x.parquet?secret_key=S3KRET pAss&session_token=T0KEN",
}


@pytest.mark.parametrize("text, expected", [
    *[(uri, "s3://***@bucket/x.parquet") for name, uri in MALFORMED.items() if name != "query"],
    (MALFORMED["query"], "s3://bucket/x.parquet?secret_key=***&session_token=***"),
    ("s3://AKIA:p@ss/w@rd@bucket/x", "s3://***@bucket/x"),  # '@' and '/' together
    ("s3://:S3KRET@bucket/x", "s3://***@bucket/x"),  # a password without a user
    ("s3://S3KRET@ret99@bucket/x", "s3://***@bucket/x"),  # a user without a password, holding '@'
    ("s3://AKIA:S3KRET?#x@bucket/x", "s3://***@bucket/x"),
    ("Cannot parse URI: 's3://AKIA:S3KRET pAss@bucket/x' due to a syntax error",
     "Cannot parse URI: 's3://***@bucket/x' due to a syntax error"),
    ("S3://AKIA:S3KRET@bucket/x", "S3://***@bucket/x"),
    ("gs://bucket/x?X-Goog-Signature=ab12&X-Amz-Credential=AKIA%2F2026&sig=x&account_key=y&Password=z",
     "gs://bucket/x?X-Goog-Signature=***&X-Amz-Credential=***&sig=***&account_key=***&Password=***"),
    ("s3://b/x?session_token='T0KEN pAss'", "s3://b/x?session_token=***"),  # quotes and spaces: to the end
    ("s3://b/x?region=eu-west-1&secret_key=", "s3://b/x?region=eu-west-1&secret_key=***"),
    ("hdfs://namenode:8020/data/x.parquet", "hdfs://namenode:8020/data/x.parquet"),  # host:port is not userinfo
    # a message quoting a redacted URI keeps its text; a secret that merely starts with *** does not
    ("s3://b/x?session_token=***: unreachable (set ?endpoint_override=H&scheme=http)",
     "s3://b/x?session_token=***: unreachable (set ?endpoint_override=H&scheme=http)"),
    ("s3://b/x?secret_key=***S3KRET&x=1", "s3://b/x?secret_key=***&x=1"),
    ("s3://AKIA:S3KRET@bucket/a\ns3://bucket/b", "s3://***@bucket/a\ns3://bucket/b"),  # per line
])
def test_redact_uri_malformed(text, expected):
    assert redact_uri(text) == expected
    assert redact_uri(expected) == expected  # redacting twice changes nothing


def test_bounded_repr_redacts_before_it_cuts():
    from clusterscale.errors import bounded_repr

    long_secret = "s3://AKIAEXAMPLE:S3KRET" + "x" * 80 + "@bucket/x.parquet"
    assert bounded_repr(long_secret) == "'s3://***@bucket/x.parquet'"


@pytest.mark.parametrize("uri, problem", [
    (MALFORMED["space"], "a character a URI cannot hold"), (MALFORMED["at"], "more than one '@'"),
    (MALFORMED["bad percent"], "a character a URI cannot hold"), (MALFORMED["slash"], "not host[:port]"),
    (MALFORMED["query"], "a character a URI cannot hold"),
    ("s3://AKIA:wJal%2FS3KRET@bucket/x?region=r", None), ("s3://b/in/*.parquet", None),
    ("hdfs://nn:8020/x", None), ("s3://[::1]:9000/b/x", None), ("/local path/x y", None), ("s3://***@b/x", None),
    # userinfo and a later '@' (issue 55): the parser's host is the secret's tail, redact_uri hides up to the last '@'
    ("s3://user:S3KRET@ret99/x@bucket/x", "it is ambiguous"), ("s3://AKIA:p@ss/w0rd@bucket/x", "it is ambiguous"),
    ("s3://AKIA:123/S3KRET@bucket/x", "it is ambiguous"),  # a secret starting with digits, holding a '/'
    ("s3://AKIA:S3KRET@bucket/team/jane@example.com/x", "write an '@' of the path as %40"),
    ("hdfs://nn:8020/a/jane@corp/x", "it is ambiguous"),  # redact_uri would show hdfs://***@corp/x
    ("s3://AKIA:S3KRET@bucket/team/jane%40example.com/x", None), ("s3://AKIA@bucket/team/jane@example.com/x", None),
    ("gs://bucket/team/jane@example.com/x.parquet", None),  # an '@' in a path without userinfo
])
def test_uri_problem(uri, problem):
    found = uri_problem(uri)
    assert (found is None) if problem is None else (problem in found and "S3KRET" not in found)


def test_redacted_output_covers_prints_log_handlers_and_restores(capsys):
    import logging
    import sys

    handler = logging.StreamHandler(sys.stderr)  # made before, as Ray's are: it keeps the stream it was given
    logger = logging.getLogger("clusterscale.test_redact")
    logger.addHandler(handler)
    try:
        with redacted_output():
            print(f"(ingest pid=1) reading {SECRET_URI}")
            print(QUERY_URI, file=sys.stderr)
            logger.warning("cannot open %s", MALFORMED["space"])
            with redacted_output():  # nested: one layer
                print(MALFORMED["at"])
        print("after")
    finally:
        logger.removeHandler(handler)
    assert handler.stream is sys.stderr
    out, err = capsys.readouterr()
    assert out == "(ingest pid=1) reading s3://***@bucket/pairs/\ns3://***@bucket/x.parquet\nafter\n"
    assert "secret_key=***&session_token=***" in err and "cannot open s3://***@bucket/x.parquet" in err
    assert not any(s in out + err for s in ("wJalrXUtnFEMI", "tok3n", *SECRETS))


def run_cli_script(script: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """`script` in a fresh Python (the real entry point: stdout, stderr, excepthook), from tmp_path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


# The real CLI, several commands in one process (each a fresh process costs seconds of imports). Ray is
# never started: the URIs fail before it, and ingest's listing fails before any Ray work.
USER_FAULTS_SCRIPT = """
import sys
from clusterscale import cli
from clusterscale.runtime import session
session.init_ray = lambda ray_cfg: None
for argv in [line.split("\\t") for line in sys.argv[1:]]:
    print("rc=%d" % cli.main(argv), flush=True)
"""


@pytest.mark.integration
def test_cli_secrets_in_malformed_uris_are_never_printed_or_stored(tmp_path):
    unreachable = "endpoint_override=127.0.0.1:1&scheme=http"
    commands = [*(["ingest", "--run-dir", str(tmp_path / f"run{i}"), "--set", f"data.path={uri}"]
                  for i, uri in enumerate(MALFORMED.values())),
                *(["ingest", "--run-dir", uri] for uri in MALFORMED.values()),
                # well-formed, with credentials, at an endpoint that refuses connections: as --run-dir ...
                ["ingest", "--run-dir", f"s3://bucket/run?access_key=AKIAEXAMPLE&secret_key=S3KRET%2FpAss&"
                                        f"session_token=T0KEN&{unreachable}"],
                # ... and as data.path (RUN/config.yaml is written first, then ingest cannot list the input)
                ["ingest", "--run-dir", str(tmp_path / "run-made"), "--set",
                 f"data.path=s3://AKIAEXAMPLE:S3KRET%40ret99@bucket/x.parquet?session_token=T0KEN&{unreachable}"]]
    done = run_cli_script(USER_FAULTS_SCRIPT, tmp_path, *("\t".join(c) for c in commands))
    output = done.stdout + done.stderr
    statuses = [line for line in done.stdout.splitlines() if line.startswith("rc=")]
    assert done.returncode == 0 and statuses == ["rc=2"] * len(commands), output
    errors = done.stderr.splitlines()
    assert len(errors) == len(commands) and all(e.startswith("error: ") for e in errors), output
    assert "Traceback" not in output
    assert all("s3://***@bucket/x.parquet is not a valid URI" in e and "Percent-encode" in e for e in errors[:4])
    assert "data.path s3://bucket/x.parquet?secret_key=***&session_token=*** is not a valid URI" in errors[4]
    assert all("not a valid URI" in e for e in errors[5:10])
    for e in errors[10:]:
        assert "the object store cannot be used" in e and "Failed to connect to 127.0.0.1:1" in e
        assert "endpoint_override=HOST:PORT" in e and "AWS_ENDPOINT_URL_S3" in e
    assert errors[10].startswith("error: s3://bucket/run?access_key=***&secret_key=***&session_token=***&")
    assert errors[11].startswith("error: s3://***@bucket/x.parquet?session_token=***&endpoint_override")
    stored = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in stored] == ["config.yaml"]  # only the last command got as far as writing
    assert "data.path" not in stored[0].read_text() or "s3://***@bucket" in stored[0].read_text()
    for text in [output, *(p.read_text() for p in stored)]:
        assert not any(s in text for s in SECRETS), text


BUG_SCRIPT = """
import logging, sys, threading
logging.basicConfig()  # a handler made before the command, on the real stderr
from clusterscale import cli, pipeline
from clusterscale.runtime import session
session.init_ray = lambda ray_cfg: None
uri = sys.argv[1]

def bug(*args, **kwargs):
    print("(ingest pid=7) worker output naming", uri, file=sys.stderr)  # as Ray forwards a worker's output
    logging.getLogger("ray.data").warning("reading %s", uri)
    thread = threading.Thread(target=lambda: 1 / 0 if uri else None, name="renewer")
    thread.start()
    thread.join()
    raise RuntimeError("a bug while reading " + uri)

pipeline.run_stages = bug
sys.exit(cli.main(["ingest", "--run-dir", sys.argv[2], "--set", "data.path=" + uri]))
"""


@pytest.mark.integration
def test_cli_bug_traceback_and_forwarded_output_are_redacted(tmp_path):
    uri = "s3://AKIAEXAMPLE:S3KRET%2FpAss@bucket/x.parquet?session_token=T0KEN"
    done = run_cli_script(BUG_SCRIPT, tmp_path, uri, str(tmp_path / "run"))
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert "Traceback" in err and "RuntimeError: a bug while reading s3://***@bucket/x.parquet?session_token=***" \
        in err
    assert "worker output naming s3://***@bucket" in err and "reading s3://***@bucket" in err
    assert "Exception in thread renewer" in err and "ZeroDivisionError" in err
    assert not any(s in done.stdout + err for s in SECRETS), err


@pytest.mark.parametrize("uri, expected", [
    ("s3://b/x?request_timeout=1&secret_key=S3KRET&endpoint_override=127.0.0.1:1",
     "its query parameter 'request_timeout' is not one this filesystem takes (an s3:// URI takes region, scheme"),
    ("s3://b/x?access_key=AKIAEXAMPLE&endpoint_override=127.0.0.1:1", "give access_key and secret_key together"),
    ("nosuchfs://AKIAEXAMPLE:S3KRET@b/x", "nosuchfs://***@b/x cannot be opened: Unrecognized filesystem type"),
    (MALFORMED["at"], "s3://***@bucket/x.parquet is not a valid URI: more than one '@'"),
])
def test_resolve_filesystem_refusals_are_user_errors_without_the_secret(uri, expected):
    import traceback

    from clusterscale.io.filesystems import UriError, resolve_filesystem

    with pytest.raises(UriError) as refused:
        resolve_filesystem(uri)
    assert expected in str(refused.value)
    printed = "".join(traceback.format_exception(refused.value))  # pyarrow's error (quoting the URI) not chained
    assert not any(s in printed for s in SECRETS), printed


# Issue 55: a URI whose userinfo is ambiguous used the secret's tail as the bucket (`bucket 'LEAKEDPART'` in the
# region lookup's error; a traceback against a reachable store). Each fragment is unique to one part of the URI.
AMBIGUOUS = {"tail as bucket": "s3://USERQ:TOPSECRET@LEAKEDPART/x@hostbucket/x",
             "p@ss/word": "s3://USERQ:PQZ@SSQ/WORDQ@hostbucket/x?endpoint_override=127.0.0.1:1&scheme=http",
             "digits and '/'": "s3://USERQ:4242/TAILQ@hostbucket/x"}
AMBIGUOUS_FRAGMENTS = ("USERQ", "TOPSECRET", "LEAKEDPART", "PQZ", "SSQ", "WORDQ", "4242", "TAILQ")


@pytest.mark.parametrize("uri", AMBIGUOUS.values(), ids=AMBIGUOUS.keys())
@pytest.mark.parametrize("where", ["--run-dir", "--set data.path", "--set train.init", "embed.model in a file",
                                   "plan --run-dir"])
def test_cli_refuses_an_ambiguous_userinfo_before_any_work(tmp_path, capsys, monkeypatch, uri, where):
    import clusterscale.runtime.session

    monkeypatch.setattr(clusterscale.runtime.session, "init_ray", None)  # a URI let through fails fast
    run_dir, config_file = tmp_path / "run", tmp_path / "config" / "c.yaml"
    config_file.parent.mkdir()
    config_file.write_text(yaml.safe_dump({"embed": {"model": uri}}))
    argv = {"--run-dir": ["ingest", "--run-dir", uri],
            "--set data.path": ["ingest", "--run-dir", str(run_dir), "--set", f"data.path={uri}"],
            "--set train.init": ["train", "--run-dir", str(run_dir), "--set", f"train.init={uri}"],
            "embed.model in a file": ["embed", str(config_file), "--run-dir", str(run_dir)],
            "plan --run-dir": ["plan", "--run-dir", uri, "--rows", "1000"]}[where]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    named = "--run-dir" if "--run-dir" in where else where.split(" in ")[0]
    assert f"error: {named} {redact_uri(uri)} is not a valid URI: it is ambiguous" in err
    assert "s3://***@hostbucket/x" in err and "Percent-encode" in err and "AWS_SECRET_ACCESS_KEY" in err
    assert not any(fragment in err for fragment in AMBIGUOUS_FRAGMENTS), err
    assert [p.name for p in tmp_path.iterdir()] == ["config"]  # no run directory, nothing written


def test_resolve_filesystem_refuses_an_ambiguous_userinfo_offline(monkeypatch):
    """Any other URI (a model folder, a costs run) reaches pyarrow through resolve_filesystem: refused there
    before from_uri, which would look the secret's tail up as a bucket."""
    from types import SimpleNamespace

    from clusterscale.io import filesystems
    from clusterscale.io.filesystems import UriError, resolve_filesystem

    def no_network(uri):
        raise AssertionError("from_uri was called")

    monkeypatch.setattr(filesystems, "pafs", SimpleNamespace(FileSystem=SimpleNamespace(from_uri=no_network)))
    with pytest.raises(UriError) as refused:
        resolve_filesystem(AMBIGUOUS["tail as bucket"])
    assert "s3://***@hostbucket/x is not a valid URI: it is ambiguous" in str(refused.value)
    assert not any(fragment in str(refused.value) for fragment in AMBIGUOUS_FRAGMENTS)
