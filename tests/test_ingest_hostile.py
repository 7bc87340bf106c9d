"""Ingest on hostile input, round 2 (issue 31): symlink loops and files reached twice, repeated column names,
ragged CSV rows keeping their numbers, a mislabelled binary file, run directories inside the data folder and
an oversized config; round 3 (issue 55): deeply nested JSON, a byte-order mark, control characters, an input
file replaced after ingest; round 4: compressed and suffix-less files of a folder, a JSON file whose first object
lacks a mapped key, an empty --run-dir, paths and column names holding YAML's ` #` and `*`, every pair held out.
User faults exit 2 with one paragraph; every row is read once and kept or quarantined."""
from __future__ import annotations

import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import cli
from clusterscale.io import input_files
from clusterscale.io.rundir import RunDir
from clusterscale.stages.ingest import ROW_BITS, IngestError
from test_ingest_inputs import KINDS, _ingest

ROW_MASK = (1 << ROW_BITS) - 1


def _cli_ingest(capsys, run_dir, data_path, *extra) -> tuple[int, str, str]:
    code = cli.main(["ingest", "--run-dir", str(run_dir), "--set", f"data.path={data_path}", "data.query_column=q",
                     "data.passage_column=p", "data.heldout_fraction=0.3", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def _user_fault(code: int, err: str) -> None:
    """Exit 2 with one `error:` paragraph and no traceback."""
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def _ragged_csv(rows: int) -> tuple[bytes, set[int]]:
    """A CSV whose row i holds "q{i}" (good) or a wrong number of cells starting with "r{i}" (ragged)."""
    ragged = {i for i in range(rows) if i % 7 in (0, 3)} | {rows - 1}
    lines = [f"r{i},too,many,cells" if i in ragged else f"q{i},p{i},x" for i in range(rows)]
    return ("q,p,extra\n" + "\n".join(lines) + "\n").encode(), ragged


def _row_numbers_hold(rows: list[dict], file_index: int, ragged: set[int], total: int) -> None:
    """Each row's pair_id (and a quarantined row's input_row) is its row in the file, and says what it holds."""
    assert sorted(r["pair_id"] for r in rows) == [(file_index << ROW_BITS) | i for i in range(total)]
    for r in rows:
        row = r["pair_id"] & ROW_MASK
        assert r["query"].startswith(f"r{row},") if row in ragged else r["query"] == f"q{row}"
        if "input_row" in r:
            assert r["input_row"] == row and (row in ragged) == r["reason"].startswith("csv_cells")


def _table_rows(run: RunDir) -> list[dict]:
    return [r for kind in KINDS for f in run.files(kind) for r in pq.read_table(f).to_pylist()]


def test_cli_reads_each_file_once_skips_run_dirs_and_keeps_csv_row_numbers(tmp_path, ray_local, capsys):
    """One data folder holding a symlink loop, two more names of one file, a linked folder, another run
    directory and a ragged CSV: every file is read once, the run directory not at all."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"q": [f"a{i}" for i in range(100)], "p": ["text"] * 100}), data / "a.parquet")
    os.symlink("../data", data / "self")  # a loop
    os.symlink("../a.parquet", data / "sub" / "again.parquet")  # a second name of a.parquet
    os.link(data / "a.parquet", data / "hard.parquet")  # a third one
    os.symlink(data / "sub", data / "sub_link")  # a second name of a folder
    csv_bytes, ragged = _ragged_csv(60)
    (data / "b.csv").write_bytes(csv_bytes)
    old = RunDir(str(data / "old_run"))  # an earlier run's outputs are not input pairs
    old.write_text("config.yaml", "data: {}\n")
    old.write_parquet("pairs/part-00000-00000-00000.parquet", pa.table({"q": ["old"], "p": ["old"]}))
    old.mark_done("pairs", "f", {})

    run = RunDir(str(tmp_path / "run"))
    code, out, err = _cli_ingest(capsys, run.uri, data)
    assert code == 0, err
    assert "2 input file(s)" in out and "4 folder(s) or file(s) reached again under another name" in out
    assert f"run directory(ies) inside data.path skipped (their files are a run's outputs, not input pairs): " \
           f"{data / 'old_run'}" in out
    stats = run.done_stats("pairs")
    assert stats["links_skipped"] == 4 and stats["run_dirs_skipped"] == [str(data / "old_run")]
    rows = _table_rows(run)
    assert stats["rows_in"] == 160 == len(rows) == stats["pairs"] + stats["heldout"] + stats["quarantine"]
    assert stats["quarantine"] == len(ragged)
    assert f"[ingest] warning: {len(ragged)} of 160 rows ({len(ragged) / 160:.0%}) were quarantined" in out
    assert "The first: csv_cells:4_of_3, the row reads r0,too,many,cells." in out  # what to look at
    _row_numbers_hold([r for r in rows if r["pair_id"] >> ROW_BITS == 1], 1, ragged, 60)  # b.csv sorts after a.parquet
    assert sorted(r["query"] for r in rows if r["pair_id"] >> ROW_BITS == 0) == sorted(f"a{i}" for i in range(100))


def test_ragged_csv_rows_keep_their_numbers_across_parser_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(input_files, "CSV_BLOCK_BYTES", 256)  # ~20 rows a block: ragged rows in many blocks
    csv_bytes, ragged = _ragged_csv(400)
    (tmp_path / "pairs.csv").write_bytes(csv_bytes)
    tables, counts = _ingest(tmp_path, tmp_path / "pairs.csv")
    assert counts[0]["rows_in"] == 400 and len(tables["quarantine"]) == len(ragged)
    _row_numbers_hold([r for kind in KINDS for r in tables[kind]], 0, ragged, 400)


REPEATED = {  # the case: the last "q" holds ids, and was read as the query
    "pairs.parquet": lambda path: pq.write_table(pa.Table.from_arrays(
        [pa.array(["what", "why"]), pa.array(["this", "that"]), pa.array(["1", "2"])], names=["q", "p", "q"]), path),
    "pairs.csv": lambda path: path.write_text("q,p,q\nwhat,this,1\nwhy,that,2\n"),
    "pairs.jsonl": lambda path: path.write_text('{"q": "what", "p": "this", "q": 1}\n'),
}


@pytest.mark.parametrize("name", sorted(REPEATED))
def test_repeated_column_name_is_an_error_naming_it_and_its_places(tmp_path, name):
    REPEATED[name](tmp_path / name)
    with pytest.raises(IngestError) as err:
        _ingest(tmp_path, tmp_path / name)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / name}: the column name(s) 'q' (columns 1, 3) appear more than once")
    assert "Rename the repeated columns" in message and "map data.query_column to a column" in message


def test_repeated_key_in_a_later_json_line_quarantines_that_line(tmp_path):
    lines = ['{"q": "what", "p": "this", "meta": 1, "meta": 2}', '{"q": "why", "p": "that", "q": 17}',
             '{"q": "how", "p": "so"}']
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    tables, counts = _ingest(tmp_path, tmp_path / "pairs.jsonl")  # an unmapped key twice is harmless
    assert counts[0]["rows_in"] == 3 and len(tables["pairs"]) + len(tables["heldout"]) == 2
    assert [(r["reason"], r["query"], r["input_row"]) for r in tables["quarantine"]] == [
        ("repeated_key:q", lines[1], 1)]


def test_cli_repeated_column_exits_2(tmp_path, ray_local, capsys):
    REPEATED["pairs.parquet"](tmp_path / "pairs.parquet")
    code, _, err = _cli_ingest(capsys, tmp_path / "run", tmp_path / "pairs.parquet")
    _user_fault(code, err)
    assert "'q' (columns 1, 3) appear more than once" in err and str(tmp_path / "pairs.parquet") in err


def test_cli_parquet_named_csv_says_it_is_not_csv(tmp_path, ray_local, capsys):
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"q": ["what"], "p": ["this"]}), data / "pairs.csv")
    (data / "z.jsonl").write_text('{"q": "why", "p": "that"}\n')
    code, _, err = _cli_ingest(capsys, tmp_path / "run", data)
    _user_fault(code, err)
    assert (f"{data / 'pairs.csv'}: cannot be read as csv (this is not CSV (it looks like Parquet: it starts with "
            f"b'PAR1'); rename it to .parquet or set data.format=parquet)") in err

    (tmp_path / "nul.jsonl").write_bytes('{"q": "a", "p": "b"}\n'.encode("utf-16-le"))
    tables, counts = _ingest(tmp_path / "lenient", data, "data.bad_files=quarantine")
    assert [c["rows_in"] for c in counts] == [0, 1] and counts[0]["bad_file"].startswith("this is not CSV")
    with pytest.raises(IngestError, match="this is not JSONL text: it holds NUL bytes .* UTF-16/32"):
        _ingest(tmp_path / "utf16", tmp_path / "nul.jsonl")
    (tmp_path / "one_nul.jsonl").write_bytes(b'{"q": "a\x00", "p": "b"}\n{"q": "c", "p": "d"}\n')
    tables, counts = _ingest(tmp_path / "stray", tmp_path / "one_nul.jsonl")  # a stray NUL is its text's (a space)
    assert counts[0]["rows_in"] == 2 and sorted(r["query"] for k in KINDS for r in tables[k]) == ["a", "c"]


def test_cli_run_dir_inside_the_data_folder_is_refused_before_writing(tmp_path, ray_local, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "pairs.jsonl").write_text('{"q": "why", "p": "that"}\n')
    for run_dir, data_path in ((data / "runs" / "r1", data), (data / "r2", f"{data}/*.jsonl")):
        code, _, err = _cli_ingest(capsys, run_dir, data_path)
        _user_fault(code, err)
        assert f"--run-dir {run_dir} is inside data.path {data_path}" in err and "outside that folder" in err
    assert sorted(os.listdir(data)) == ["pairs.jsonl"]  # no config.yaml, no lock left in the data folder
    code, _, err = _cli_ingest(capsys, tmp_path / "r3", tmp_path / "r3" / "pairs")  # the input ingest would delete
    _user_fault(code, err)
    assert "is inside the folders ingest replaces in --run-dir" in err and not (tmp_path / "r3").exists()


def test_cli_oversized_config_file_is_refused_unparsed(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    path.write_text("eval:\n  mteb_tasks:\n" + "  - x\n" * 300_000)  # 1.8 MB
    assert cli.main(["ingest", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: Config file {path} is larger than 1,048,576 bytes (1 MiB)") and "Traceback" not in err
    assert not (tmp_path / "run").exists()


# Round 3 (issue 55): deep JSON, a byte-order mark, control characters, an input file replaced after ingest.

def _deep(levels: int, closed: bool = True) -> str:
    return "[" * levels + ("]" * levels if closed else "")


def _objects(levels: int) -> str:
    return '{"q": "deep", "p": ' + '{"a": ' * levels + "1" + "}" * levels + "}"


def _conserved_stats(run: RunDir) -> dict:
    stats = run.done_stats("pairs")
    assert stats["rows_in"] == stats["pairs"] + stats["heldout"] + stats["quarantine"] == len(_table_rows(run))
    return stats


def test_cli_deeply_nested_json_is_quarantined_and_the_rest_ingested(tmp_path, ray_local, capsys):
    """100,000 `[` or 5,000 objects deep: in a JSON line (the file's first, so the file starts with `[`), as an
    element of a JSON array, and as a whole file of one line; each is one quarantined row."""
    data = tmp_path / "data"
    data.mkdir()
    good = [json.dumps({"q": f"query {i}", "p": f"passage {i}"}) for i in range(6)]
    (data / "a.jsonl").write_text("\n".join([_deep(100_000), *good[:3], _objects(5_000), *good[3:]]) + "\n")
    (data / "b.json").write_text("[" + ", ".join([good[0], _deep(100_000), _objects(5_000), good[1]]) + "]")
    (data / "c.jsonl").write_text(_deep(100_000))
    run = RunDir(str(tmp_path / "run"))
    code, out, err = _cli_ingest(capsys, run.uri, data)
    assert code == 0 and "Traceback" not in out + err, err
    stats = _conserved_stats(run)
    assert stats["rows_in"] == 8 + 4 + 1 and stats["reasons"] == {"json_too_deep": 5}
    deep = sorted((r["input_file"].rsplit("/", 1)[1], r["input_row"]) for r in _table_rows(run) if "reason" in r)
    assert deep == [("a.jsonl", 0), ("a.jsonl", 4), ("b.json", 1), ("b.json", 2), ("c.jsonl", 0)]


def test_json_nesting_cap_is_a_function_of_the_record(tmp_path):
    from clusterscale.io.json_input import MAX_JSON_DEPTH, json_array_items, too_deep

    at_cap = '{"q": "a", "p": "b", "x": ' + _deep(MAX_JSON_DEPTH - 1) + "}"
    assert not too_deep(at_cap) and too_deep("[" + at_cap + "]")
    assert not too_deep('{"q": "' + "[" * 500 + '", "p": "\\"{{{"}')  # brackets inside strings do not nest
    text = "[" + ", ".join(['{"q": 1}', _deep(3_000), '"]]"', _objects(2_000), "7"]) + "]"
    whole = list(json_array_items(io.StringIO(text)))
    assert [raw for _, raw in whole] == ['{"q": 1}', _deep(3_000), '"]]"', _objects(2_000), "7"]
    for chunk_chars in (1, 7, 1000):  # an element found by its brackets may span chunks too
        assert [raw for _, raw in json_array_items(io.StringIO(text), chunk_chars=chunk_chars)] == \
            [raw for _, raw in whole]
    (tmp_path / "open.jsonl").write_text(_deep(100_000, closed=False))  # one line, never closed: a bad array
    with pytest.raises(IngestError, match="open.jsonl: cannot be read as jsonl .*not closed before the end"):
        _ingest(tmp_path, tmp_path / "open.jsonl")


def test_a_json_file_is_one_array_unless_its_first_line_is_a_whole_value_with_more_lines(tmp_path):
    rows = [{"q": "a", "p": "b"}, {"q": "c", "p": "d"}]
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a_pretty.jsonl").write_text(json.dumps(rows, indent=2))  # arrays, whatever the suffix
    (folder / "b_one_line.json").write_text(json.dumps(rows) + "\n\n")
    (folder / "c_lines.jsonl").write_text("[1, 2]\n\n" + "\n".join(map(json.dumps, rows)) + "\n")  # JSON lines
    tables, counts = _ingest(tmp_path, folder)
    assert [c["rows_in"] for c in counts] == [2, 2, 4]
    assert [(r["reason"], r["input_row"]) for r in tables["quarantine"]] == [("not_an_object", 0), ("blank_line", 1)]


def test_byte_order_mark_starts_json_lines_arrays_and_csv(tmp_path):
    bom = b"\xef\xbb\xbf"
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(bom + b'{"q": "a0", "p": "x"}\n{"q": "a1", "p": "x"}\n')
    (folder / "b.json").write_bytes(bom + b' [{"q": "b0", "p": "x"}, {"q": "b1", "p": "x"}]')
    (folder / "c.csv").write_bytes(bom + b"q,p\nc0,x\nc1,x\n")
    tables, counts = _ingest(tmp_path, folder)
    assert [c["rows_in"] for c in counts] == [2, 2, 2] and tables["quarantine"] == []
    assert sorted(r["query"] for k in KINDS for r in tables[k]) == ["a0", "a1", "b0", "b1", "c0", "c1"]


def test_control_characters_are_spaces_in_every_format(tmp_path):
    """NUL and the other C0/C1 controls but tab, LF, CR: a space in CSV, JSON (raw or escaped) and Parquet alike;
    a text of nothing else is empty (quarantined `empty` in every format)."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.csv").write_bytes(b"q,p\na\x00b\x1bc,t\tu\n\x00\xc2\x85,x\n")
    (folder / "b.jsonl").write_bytes(b'{"q": "a\x00b\x1bc", "p": "t\tu"}\n{"q": "\x00\xc2\x85", "p": "x"}\n')
    (folder / "c.jsonl").write_bytes(b'{"q": "a\\u0000b\\u001bc", "p": "t\\tu"}\n{"q": "\\u0000\\u0085", "p": "x"}\n')
    (folder / "d.json").write_bytes(b'[{"q": "a\x00b\x1bc", "p": "t\tu"}, {"q": "\x00\xc2\x85", "p": "x"}]')
    pq.write_table(pa.table({"q": ["a\x00b\x1bc", "\x00\x85"], "p": ["t\tu", "x"]}), folder / "e.parquet")
    tables, counts = _ingest(tmp_path, folder)
    assert [c["rows_in"] for c in counts] == [2] * 5
    assert sorted((r["query"], r["passage"]) for r in tables["pairs"] + tables["heldout"]) == [("a b c", "t\tu")] * 5
    assert [(r["reason"], r["input_row"]) for r in tables["quarantine"]] == [("query_empty", 1)] * 5


def test_cli_input_file_replaced_after_ingest_refuses_reuse_naming_it(tmp_path, ray_local, capsys):
    data = tmp_path / "data"
    data.mkdir()
    path = data / "pairs.jsonl"

    def write(rows: int, mtime: int) -> None:
        path.write_text("".join(json.dumps({"q": f"q{i}", "p": f"p{i}"}) + "\n" for i in range(rows)))
        os.utime(path, (mtime, mtime))

    write(50, 1_700_000_000)
    run = RunDir(str(tmp_path / "run"))
    assert _cli_ingest(capsys, run.uri, data)[0] == 0
    code, out, _ = _cli_ingest(capsys, run.uri, data)
    assert code == 0 and "[pairs] reused" in out  # nothing changed

    write(100, 1_700_000_100)  # the same name, new rows
    code, out, err = _cli_ingest(capsys, run.uri, data)
    _user_fault(code, err)
    assert "reused" not in out and f"{path} changed (" in err and "bytes, modified 2023-11-14T22:13:20.000Z ->" in err
    assert "--replace" in err and _conserved_stats(run)["rows_in"] == 50
    code, _, err = _cli_ingest(capsys, run.uri, data, "--replace")
    assert code == 0 and _conserved_stats(run)["rows_in"] == 100, err

    (data / "more.jsonl").write_text('{"q": "new", "p": "row"}\n')  # a file added is a change too
    code, _, err = _cli_ingest(capsys, run.uri, data)
    _user_fault(code, err)
    assert f"{data / 'more.jsonl'} was added" in err

    data.rename(tmp_path / "moved")  # a data.path that can no longer be listed: pairs/ is the only copy, reused
    code, out, err = _cli_ingest(capsys, run.uri, data)
    assert code == 0 and "cannot be listed now" in out and "[pairs] reused" in out, err
    (tmp_path / "moved").rename(data)

    marker = run.read_json("pairs/_DONE.json")  # a marker from before inputs were recorded: reused as it was
    del marker["stats"]["inputs"]
    run.write_json("pairs/_DONE.json", marker)
    code, out, err = _cli_ingest(capsys, run.uri, data)
    assert code == 0 and "[pairs] reused" in out, err


def test_a_folder_s_compressed_files_are_read_and_a_file_of_unknown_format_is_named(tmp_path, ray_local, capsys):
    """Round 4: a folder of compressed JSON lines and CSV is read whole (its README skipped and named); a part file
    without a suffix stops ingest with its name (dropping it would lose its rows without a word), and is read as
    the data.format that is set."""
    import bz2
    import gzip

    def lines(start: int) -> bytes:
        return "".join(json.dumps({"q": f"q{i}", "p": f"p{i}"}) + "\n" for i in range(start, start + 10)).encode()

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl.gz").write_bytes(gzip.compress(lines(0)))
    (data / "b.json.gz").write_bytes(gzip.compress(lines(10)))
    with pa.CompressedOutputStream(str(data / "c.ndjson.zst"), "zstd") as out:
        out.write(lines(20))
    (data / "d.csv.bz2").write_bytes(bz2.compress(("q,p\n" + "".join(f"q{i},p{i}\n" for i in range(30, 40))).encode()))
    (data / "README.md").write_text("# my pairs\n")
    run = RunDir(str(tmp_path / "run"))
    code, out, err = _cli_ingest(capsys, run.uri, data)
    assert code == 0, err
    assert "4 input file(s)" in out and "README.md" in out
    assert "1 documentation or config file(s) beside the data skipped" in out
    stats = run.done_stats("pairs")
    assert stats["rows_in"] == 40 == stats["pairs"] + stats["heldout"] and stats["docs_skipped"] == 1
    assert sorted(r["query"] for r in _table_rows(run)) == sorted(f"q{i}" for i in range(40))
    # A run made by a clusterscale that skipped b.json.gz: its rerun names the file it reads now, not "added".
    from clusterscale.io.input_identity import INPUT_LISTING, listing_digest
    listing = pq.read_table(run.path("pairs", INPUT_LISTING))
    older = listing.filter(pa.array([not p.endswith("b.json.gz") for p in listing.column("path").to_pylist()]))
    pq.write_table(older, run.path("pairs", INPUT_LISTING))
    marker = run.read_json("pairs/_DONE.json")
    marker["stats"]["inputs"] |= {"digest": listing_digest(older), "files": older.num_rows}
    run.write_json("pairs/_DONE.json", marker)
    code, _, err = _cli_ingest(capsys, run.uri, data)
    _user_fault(code, err)
    assert f"{data / 'b.json.gz'} is read now but was not then, though it was there" in err

    parts = tmp_path / "parts"  # a Hadoop-style output: one part without a suffix
    parts.mkdir()
    for name, start in (("part-00000.parquet", 0), ("part-00001", 10)):
        pq.write_table(pa.table({"q": [f"q{i}" for i in range(start, start + 10)], "p": ["text"] * 10}), parts / name)
    (parts / "LICENSE").write_text("CC-BY\n")
    (parts / "SHA256SUMS").write_text("0 part-00000.parquet\n")  # checksums beside the data: skipped, named
    code, _, err = _cli_ingest(capsys, tmp_path / "run2", parts)
    _user_fault(code, err)
    assert "1 file(s) of no format ingest reads by their name: 'part-00001'" in err
    assert "read as data.format when it is set" in err and f"'{parts}/*.parquet'" in err
    assert not (tmp_path / "run2" / "pairs").exists()
    code, out, err = _cli_ingest(capsys, tmp_path / "run2", parts, "data.format=parquet")
    assert code == 0, err
    assert RunDir(str(tmp_path / "run2")).done_stats("pairs")["rows_in"] == 20
    assert "2 documentation or config file(s) beside the data skipped" in out
    (parts / "more.xlsx").write_bytes(b"PK\x03\x04")  # another format: named whatever data.format says
    code, _, err = _cli_ingest(capsys, tmp_path / "run4", parts, "data.format=parquet")
    _user_fault(code, err)
    assert "'more.xlsx'" in err and "Convert files of another format" in err

    (tmp_path / "semi.csv").write_text("q;p\nquery;passage\n")  # a CSV separated by semicolons: said so
    code, _, err = _cli_ingest(capsys, tmp_path / "run3", tmp_path / "semi.csv")
    _user_fault(code, err)
    assert "is one column holding a semicolon: the file is semicolon-separated" in err


def test_a_json_file_whose_first_object_lacks_the_query_quarantines_that_row(tmp_path, ray_local, capsys):
    """Round 4: JSON objects need not share their keys: the first object without the query is that row's fault
    (quarantined), not a wrong mapping; a key that no object holds still is, named as such."""
    data = tmp_path / "first.jsonl"
    data.write_text(json.dumps({"p": "orphan"}) + "\n" + "".join(
        json.dumps({"q": f"q{i}", "p": f"p{i}"}) + "\n" for i in range(30)))
    run = RunDir(str(tmp_path / "run"))
    code, _, err = _cli_ingest(capsys, run.uri, data)
    assert code == 0, err
    stats = run.done_stats("pairs")
    assert stats["rows_in"] == 31 and stats["quarantine"] == 1 and stats["pairs"] + stats["heldout"] == 30
    code, _, err = _cli_ingest(capsys, tmp_path / "run2", data, "data.query_column=question")
    _user_fault(code, err)
    assert "data.query_column='question' not found in any of its objects" in err and "'p', 'q'" in err


def test_cli_text_keys_are_taken_as_typed_and_an_empty_run_dir_is_a_user_fault(tmp_path, ray_local, capsys,
                                                                                 monkeypatch):
    """Round 4: `--set data.path=...` holding ` #` (YAML's comment) or starting with `*` (YAML's alias) is the path
    typed, a column named `yes` or `123` is that name; an empty --run-dir (an unset $RUN) and a run whose every
    pair is held out are one paragraph each, exit 2."""
    data = tmp_path / "run #2"
    data.mkdir()
    pq.write_table(pa.table({"yes": [f"q{i}" for i in range(20)], "123": ["text"] * 20}), data / "a.parquet")
    code, _, err = _cli_ingest(capsys, tmp_path / "run", data / "a.parquet", "data.query_column=yes",
                               "data.passage_column=123")
    assert code == 0, err
    assert RunDir(str(tmp_path / "run")).done_stats("pairs")["rows_in"] == 20
    monkeypatch.chdir(data)  # a glob starting with *, relative to the working directory
    code, _, err = _cli_ingest(capsys, tmp_path / "run_glob", "*.parquet", "data.query_column=yes",
                               "data.passage_column=123")
    assert code == 0, err

    code, out, err = _cli_ingest(capsys, "", data)
    _user_fault(code, err)
    assert "--run-dir is empty" in err

    code, _, err = _cli_ingest(capsys, tmp_path / "run_all_held", data, "data.query_column=yes",
                               "data.passage_column=123", "data.heldout_fraction=0.9999999")
    _user_fault(code, err)
    assert "Every valid pair" in err and "was held out" in err and "Lower data.heldout_fraction" in err
    # None held out although asked for (few distinct queries, or a tiny fraction): ingested, with a warning that
    # names the fraction, the distinct queries and the keys to set.
    code, out, err = _cli_ingest(capsys, tmp_path / "run_none_held", data, "data.query_column=yes",
                                 "data.passage_column=123", "data.heldout_fraction=0.000001")
    assert code == 0, err
    assert "data.heldout_fraction=1e-06 held out none of the 20 pairs" in out and "20 distinct queries" in out, out
    from clusterscale.io.rundir import StageMissingError
    from clusterscale.stages.eval_set import heldout_queries

    with pytest.raises(StageMissingError, match="held out no query of this data") as missing:
        heldout_queries(RunDir(str(tmp_path / "run_none_held")), 10)
    assert "data.heldout_fraction=1e-06" in str(missing.value)


def test_cli_a_text_column_that_barely_varies_is_warned_of_naming_it(tmp_path, ray_local, capsys):
    """A passage column holding one text (a label, a source or a constant picked by mistake) is ingested, with a
    warning naming the key to check; the query column, distinct per row, is not warned of."""
    from clusterscale.stages.ingest import few_distinct_warnings

    pq.write_table(pa.table({"q": [f"question {i} about topic {i % 7}" for i in range(300)], "p": ["label"] * 300}),
                   tmp_path / "pairs.parquet")
    code, out, _ = _cli_ingest(capsys, tmp_path / "run", tmp_path / "pairs.parquet")
    assert code == 0
    warned = [line for line in out.splitlines() if line.startswith("[ingest] warning:")]
    assert len(warned) == 1 and "only 1 distinct passage text(s) (data.passage_column=p)" in warned[0], out
    stats = RunDir(str(tmp_path / "run")).done_stats("pairs")
    assert stats["distinct_sample"] == {"rows": stats["pairs"], "query": stats["pairs"], "passage": 1}
    # The rule: at most 1% of the sample distinct, and fewer than a global batch.
    cfg = cli.config_mod.load(None, ["data.query_column=q", "data.passage_column=p"])
    assert few_distinct_warnings({"rows": 10_000, "query": 10_000, "passage": 100}, 4096, cfg.data)
    assert not few_distinct_warnings({"rows": 10_000, "query": 10_000, "passage": 100}, 64, cfg.data)
    assert not few_distinct_warnings({"rows": 10_000, "query": 10_000, "passage": 101}, 4096, cfg.data)
    assert not few_distinct_warnings({"rows": 1, "query": 1, "passage": 1}, 16, cfg.data)
