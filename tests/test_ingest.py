"""Ingest: formats, schema errors, quarantine with reasons, stable pair_ids, the held-out split."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from clusterscale import config
from clusterscale.pipeline import run_stage
from clusterscale.stages.ingest import IngestError, is_heldout, normalise_text
from clusterscale.io.rundir import RunDir


def _ingest(tmp_path, data_path, *extra):
    cfg = config.load(None, [f"data.path={data_path}", "data.query_column=q", "data.passage_column=p",
                             "data.heldout_fraction=0.2", *extra])
    run = RunDir(str(tmp_path / "run"))
    return run, run_stage("ingest", cfg, run).stats


def _table(run, folder):
    files = run.files(folder)
    return pads.dataset(files, format="parquet").to_table() if files else pa.table({"pair_id": pa.array([], pa.int64())})


def test_normalise_text():
    assert normalise_text("  cafe\u0301\x00 ok\x1b ") == ("caf\u00e9  ok", None)
    assert normalise_text(None) == (None, "null")
    assert normalise_text(" \t") == (None, "empty")
    assert normalise_text(3) == (None, "not_string:int")
    assert normalise_text(b"caf\xc3\xa9") == ("caf\u00e9", None)
    assert normalise_text(b"\xff abc") == (None, "invalid_utf8")  # never silently U+FFFD
    assert normalise_text("half \ud800") == (None, "lone_surrogate")


def test_jsonl_bad_rows_are_quarantined_with_reasons(tmp_path, ray_local):
    lines = [json.dumps({"q": f"query {i}", "p": f"passage {i}"}) for i in range(50)]
    lines += ["{not json", json.dumps({"q": 7, "p": "x"}), json.dumps({"q": "q", "p": ""}), "[1, 2]",
              json.dumps({"q": "q", "p": "p" * 200})]
    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    run, stats = _ingest(tmp_path, path, "data.max_text_chars=100")
    assert stats["rows_in"] == 55 and stats["quarantine"] == 5
    assert stats["pairs"] + stats["heldout"] == 50
    q = _table(run, "quarantine").to_pylist()
    reasons = {r["reason"] for r in q}
    assert reasons == {"invalid_json", "query_not_string:int", "passage_empty", "not_an_object", "over_long_passage"}
    assert any(r["query"] == "{not json" for r in q)  # the raw line is kept
    ids = _table(run, "pairs").column("pair_id").to_pylist() + _table(run, "heldout").column("pair_id").to_pylist()
    assert sorted(ids + [r["pair_id"] for r in q]) == list(range(55))


def test_wrong_column_lists_columns_found(tmp_path, ray_local):
    path = tmp_path / "pairs.csv"
    path.write_text("question,answer\nwhat,that\n")
    with pytest.raises(IngestError) as err:
        _ingest(tmp_path, path)
    assert "data.query_column='q'" in str(err.value) and "'question', 'answer'" in str(err.value)


def test_folder_of_files_limit_and_stable_ids(tmp_path, ray_local):
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"q": [f"q{i}-{j}" for j in range(10)], "p": [f"p{i}-{j}" for j in range(10)]}),
                       folder / f"part-{i}.parquet")
    run, stats = _ingest(tmp_path, folder, "data.limit=25")
    assert stats["rows_in"] == 25 and stats["input_files"] == 3
    rows = _table(run, "pairs").to_pylist() + _table(run, "heldout").to_pylist()
    by_id = {r["pair_id"]: r["query"] for r in rows}
    assert by_id[(1 << 40) + 3] == "q1-3" and by_id[(2 << 40) + 4] == "q2-4" and (2 << 40) + 5 not in by_id
    held = set(_table(run, "heldout").column("pair_id").to_pylist())
    assert held == {pid for pid, query in by_id.items() if is_heldout(query, 0.2)}


def test_heldout_split_is_a_fixed_fraction_of_queries():
    held = [is_heldout(f"query number {i}", 0.05) for i in range(100_000)]
    assert 0.045 < np.mean(held) < 0.055
    assert is_heldout("Query  Number 7", 0.05) == held[7]  # case and spacing do not move a query


def test_all_rows_bad_is_a_clear_error(tmp_path, ray_local):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"q": ["", None], "p": ["x", "y"]}), path)
    with pytest.raises(IngestError, match="No valid pairs"):
        _ingest(tmp_path, path)
