"""Credentials in URIs are never printed or stored; the run keeps the real URI in memory."""
from __future__ import annotations

import dataclasses

import pytest

from clusterscale import cli, config, pipeline
from clusterscale.stages.ingest import IngestError
from clusterscale.redact import redact_uri

SECRET_URI = "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@bucket/pairs/"
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
        run.record_cost("ingest", {"input": cfg.data.path})
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
