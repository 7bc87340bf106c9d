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
    with pytest.raises(IngestError, match="No valid pairs .* The first: query_empty, data.query_column='q' holds \\."):
        _ingest(tmp_path, path)
    path = tmp_path / "objects.jsonl"  # a passage column of objects without a "text": the error shows what it holds
    path.write_text("".join(json.dumps({"q": f"q{i}", "p": {"title": "t", "body": "x" * 300}}) + "\n"
                            for i in range(3)))
    with pytest.raises(IngestError, match=r"The first: passage_not_string:dict, data.passage_column='p' holds "
                                          r'\{"title": "t", "body": "x{176}\.\.\.\.$'):
        _ingest(tmp_path / "objects", path)


def _kinds_by_id(run) -> dict[int, tuple[str, str]]:
    """pair_id -> (output folder, query text) over pairs/, heldout/ and quarantine/."""
    out = {}
    for kind in ("pairs", "heldout", "quarantine"):
        table = _table(run, kind)
        queries = table.column("query").to_pylist() if "query" in table.column_names else []
        out |= {pid: (kind, q) for pid, q in zip(table.column("pair_id").to_pylist(), queries)}
    return out


def test_big_parquet_file_is_split_into_row_group_units_with_the_same_ids(tmp_path, ray_local):

    from clusterscale.stages.ingest import IngestUnit, file_units, ingest_unit, list_input_files

    path = tmp_path / "big.parquet"
    queries = [f"query {i}" if i % 97 else "" for i in range(1000)]  # some quarantined rows too
    pq.write_table(pa.table({"q": queries, "p": [f"passage {i}" for i in range(1000)]}), path, row_group_size=100)
    cfg = config.load(None, [f"data.path={path}", "data.query_column=q", "data.passage_column=p",
                             "data.heldout_fraction=0.2", "data.rows_per_part=250"])
    fs, files = list_input_files(cfg.data)
    units = file_units(fs, 0, files[0], cfg.data)
    assert [(u.row_start, u.rows, len(u.row_groups)) for u in units] == [(0, 300, 3), (300, 300, 3), (600, 300, 3),
                                                                        (900, 100, 1)]
    whole = RunDir(str(tmp_path / "whole"))
    ingest_unit(whole.uri, fs, IngestUnit(0, files[0]), cfg.data)  # today's one task per file
    run, stats = _ingest(tmp_path, path, "data.rows_per_part=250")
    assert stats["rows_in"] == 1000 and stats["input_files"] == 1 and stats["quarantine"] == 11
    assert _kinds_by_id(run) == _kinds_by_id(whole) and len(_kinds_by_id(run)) == 1000
    assert {name.split("-")[2] for name in map(lambda f: f.rsplit("/", 1)[1], run.files("pairs"))} == \
        {"00000", "00001", "00002", "00003"}  # four units wrote parts

    limited, stats = _ingest(tmp_path / "limited", path, "data.rows_per_part=250", "data.limit=550")
    assert stats["rows_in"] == 550 and set(_kinds_by_id(limited)) == set(range(550))


def test_limit_over_text_and_parquet_files_reads_the_first_rows_in_file_order(tmp_path, ray_local):
    folder = tmp_path / "in"
    folder.mkdir()

    def rows(name: str, n: int) -> dict:
        return {"q": [f"{name} q{j}" for j in range(n)], "p": [f"{name} p{j}" for j in range(n)]}

    (folder / "a.jsonl").write_text("".join(json.dumps({"q": q, "p": p}) + "\n" for q, p in zip(*rows("a", 10).values())))
    pq.write_table(pa.table(rows("b", 30)), folder / "b.parquet", row_group_size=10)
    (folder / "c.jsonl").write_text("".join(json.dumps({"q": q, "p": p}) + "\n" for q, p in zip(*rows("c", 10).values())))
    pq.write_table(pa.table(rows("d", 10)), folder / "d.parquet")
    # 2 CPUs: a.jsonl and c.jsonl are read at once, each with the most rows it could be allowed; c.jsonl
    # reads 10, is allowed 5 once a and b are counted, and is re-read with 5.
    run, stats = _ingest(tmp_path, folder, "data.rows_per_part=10", "data.limit=45")
    assert stats["rows_in"] == 45 and stats["input_files"] == 3
    expected = {(0 << 40) + j: f"a q{j}" for j in range(10)} | {(1 << 40) + j: f"b q{j}" for j in range(30)} \
        | {(2 << 40) + j: f"c q{j}" for j in range(5)}
    assert {pid: q for pid, (_, q) in _kinds_by_id(run).items()} == expected
    # the JSON lines files in byte ranges (counted in waves until the limit): the same rows
    run, stats = _ingest(tmp_path / "ranges", folder, "data.rows_per_part=10", "data.limit=45", "data.range_bytes=80")
    assert stats["rows_in"] == 45 and {pid: q for pid, (_, q) in _kinds_by_id(run).items()} == expected


def test_limit_rules_rerun_units_read_too_far_or_cut_short():
    from clusterscale.stages.ingest import IngestUnit, _Accepted, speculative_batch

    units = [IngestUnit(0, "a.parquet", rows=10), IngestUnit(1, "b.jsonl"), IngestUnit(2, "c.parquet", rows=10)]
    assert speculative_batch(units, 25, width=1) == [(units[0], 25), (units[1], 15)]
    assert speculative_batch(units, 25, width=2) == [(units[0], 25), (units[1], 15), (units[2], 15)]
    assert speculative_batch(units, None, width=1) == [(u, None) for u in units]

    class Run:  # records what _Accepted deletes
        removed: list[str] = []

        def remove(self, name):
            self.removed.append(name)

    reruns = []

    def rerun(unit, budget):
        reruns.append((unit.file_index, budget))
        return {"rows_in": budget, "written": [f"rerun-{unit.file_index}"]}

    accepted = _Accepted(Run(), limit=25)
    accepted.add(units[0], 25, {"rows_in": 0, "written": [], "bad_file": "broken"}, rerun)  # 0 rows, not 10
    accepted.add(units[1], 15, {"rows_in": 15, "written": ["b"]}, rerun)  # cut at 15 while 25 are allowed
    assert reruns == [(1, 25)] and Run.removed == ["b"] and accepted.full()
    accepted.add(units[2], 15, {"rows_in": 10, "written": ["c"]}, rerun)  # past the limit: dropped
    assert Run.removed == ["b", "c"] and [u.file_index for u, _ in accepted.results] == [0, 1]

    accepted = _Accepted(Run(), limit=12)
    accepted.add(units[1], 12, {"rows_in": 5, "written": ["b"]}, rerun)
    accepted.add(IngestUnit(3, "d.jsonl"), 12, {"rows_in": 12, "written": ["d"]}, rerun)  # 7 allowed
    assert reruns[-1] == (3, 7) and Run.removed[-1] == "d" and accepted.rows_in == 12


def test_an_interrupted_ingest_keeps_its_finished_units(tmp_path, ray_local, capsys):
    """A rerun after an attempt that finished some units (their markers written after their parts) runs only the
    others, into the same names: the same files as one uninterrupted ingest, the kept ones untouched. Changed input
    files start the attempt over."""
    import os

    from clusterscale.stages.ingest import UNITS_DIR

    folder = tmp_path / "in"
    folder.mkdir()
    queries = [f"query {i}" if i % 41 else "" for i in range(600)]  # a few quarantined rows
    pq.write_table(pa.table({"q": queries, "p": [f"passage {i}" for i in range(600)]}), folder / "a.parquet",
                   row_group_size=100)
    (folder / "b.jsonl").write_text("".join(json.dumps({"q": f"b {i}", "p": f"bp {i}"}) + "\n" for i in range(50)))
    extra = ["data.rows_per_part=200"]
    reference, stats = _ingest(tmp_path / "reference", folder, *extra)
    run, _ = _ingest(tmp_path, folder, *extra)

    def data_files(r):
        return {f: open(r.path(f), "rb").read() for kind in ("pairs", "heldout", "quarantine")
                for f in r.listdir(kind) if f.endswith(".parquet") and not f.startswith("_")
                for f in [f"{kind}/{f}"]}

    expected = data_files(reference)
    assert data_files(run) == expected and stats["rows_in"] == 650
    # As a kill leaves it: no done markers; two units lost their markers (one of them its parts too), a temp file.
    for kind in ("pairs", "heldout", "quarantine"):
        os.remove(run.path(f"{kind}/_DONE.json"))
    markers = sorted(run.listdir(UNITS_DIR))
    assert len(markers) == 4  # three row-group units of a.parquet, one of b.jsonl
    for name in markers[1:3]:
        written = json.loads(open(run.path(f"{UNITS_DIR}/{name}")).read())["written"]
        os.remove(run.path(f"{UNITS_DIR}/{name}"))
        if name == markers[1]:
            for f in written[:-1]:
                os.remove(run.path(f))
    open(run.path("pairs/.tmp-cut-short"), "wb").write(b"half a part")
    kept = {f: os.stat(run.path(f)).st_mtime_ns for f in expected if os.path.exists(run.path(f))}
    capsys.readouterr()
    _, again = _ingest(tmp_path, folder, *extra)
    assert "resuming: 2 of 4 work units" in capsys.readouterr().out
    assert data_files(run) == expected and not os.path.exists(run.path("pairs/.tmp-cut-short"))
    assert {k: again[k] for k in ("rows_in", "pairs", "heldout", "quarantine", "reasons")} == \
        {k: stats[k] for k in ("rows_in", "pairs", "heldout", "quarantine", "reasons")}
    unit_a0 = markers[0].replace(".json", "")
    assert all(os.stat(run.path(f)).st_mtime_ns == t for f, t in kept.items() if unit_a0 in f)

    # Interrupted again, then the input changes: nothing of the attempt is kept.
    os.remove(run.path("pairs/_DONE.json"))
    (folder / "b.jsonl").write_text("".join(json.dumps({"q": f"b {i}", "p": f"bp {i}"}) + "\n" for i in range(60)))
    _, changed = _ingest(tmp_path, folder, *extra)
    assert "input files changed since the interrupted attempt" in capsys.readouterr().out
    assert changed["rows_in"] == 660
