"""Ingest on hostile and unusual input: bad records, unreadable files, HF save_to_disk folders, JSON
arrays, hidden files, and the held-out split by query. Every test checks that rows are conserved."""
from __future__ import annotations

import gzip
import io
import json
import unicodedata

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from clusterscale import cli, config
from clusterscale.stages.ingest import IngestError, IngestUnit, heldout_key, ingest_unit, list_input_files
from clusterscale.io.json_input import json_array_items
from clusterscale.io.rundir import RunDir

KINDS = ("pairs", "heldout", "quarantine")


def _ingest(tmp_path, data_path, *extra) -> tuple[dict, list[dict]]:
    """Every input file as one unit through ingest_unit (the Ray task's body, run here without Ray)."""
    cfg = config.load(None, [f"data.path={data_path}", "data.query_column=q", "data.passage_column=p",
                             "data.heldout_fraction=0.3", *extra])
    run = RunDir(str(tmp_path / "run"))
    fs, files = list_input_files(cfg.data)
    counts = [ingest_unit(run.uri, fs, IngestUnit(i, f), cfg.data) for i, f in enumerate(files)]
    return _conserved(run, counts), counts


def _conserved(run: RunDir, counts: list[dict]) -> dict:
    """The output rows per folder, after checking rows_in (+ the pairs of records' further passages) == pairs +
    heldout + quarantine, ids unique."""
    tables = {k: pads.dataset(run.files(k), format="parquet").to_table().to_pylist() if run.files(k) else []
              for k in KINDS}
    rows_in = sum(c["rows_in"] + c.get("extra_positives", 0) for c in counts)
    assert rows_in == sum(len(rows) for rows in tables.values())
    for kind in KINDS:
        assert sum(c[kind] for c in counts) == len(tables[kind])
    ids = [r["pair_id"] for rows in tables.values() for r in rows]
    assert len(ids) == len(set(ids))
    return tables


def _by_reason(quarantine: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in quarantine:
        out.setdefault(row["reason"], []).append(row)
    return out


def test_jsonl_lone_surrogate_and_invalid_utf8_are_quarantined_with_raw_text(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps({"q": f"query {i}", "p": f"passage {i}"}).encode() for i in range(20)]
    lines += [b'{"q": "bad \\ud800 half", "p": "fine"}', b'{"q": "caf\xe9", "p": "latin-1 byte"}',
              b'{"q": "ok", "p": "tail \\udcff"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    tables, _ = _ingest(tmp_path, path)
    assert len(tables["pairs"]) + len(tables["heldout"]) == 20
    bad = _by_reason(tables["quarantine"])
    assert set(bad) == {"query_lone_surrogate", "invalid_utf8", "passage_lone_surrogate"}
    assert bad["query_lone_surrogate"][0]["query"] == "bad \\ud800 half"  # kept, escaped, not U+FFFD
    assert bad["query_lone_surrogate"][0]["passage"] == "fine"
    assert bad["invalid_utf8"][0]["query"] == '{"q": "caf\\xe9", "p": "latin-1 byte"}'
    assert bad["passage_lone_surrogate"][0]["passage"] == "tail \\udcff"
    assert all("\ufffd" not in (r["query"] or "") for r in tables["quarantine"])


def test_csv_ragged_rows_invalid_utf8_and_null_words(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_bytes(b"q,p,extra\nq0,p0,x\nthree,cells,x,too many\nNA,null,x\nNaN,N/A,x\n"
                     b"one cell\ncaf\xe9,p5,x\n,p6,x\n\"quoted, comma\",p7,x\n")
    tables, counts = _ingest(tmp_path, path)
    kept = {r["query"]: r["passage"] for r in tables["pairs"] + tables["heldout"]}
    assert kept == {"q0": "p0", "NA": "null", "NaN": "N/A", "quoted, comma": "p7"}  # the words are text
    bad = _by_reason(tables["quarantine"])
    assert [r["query"] for r in bad["csv_cells:4_of_3"]] == ["three,cells,x,too many"]
    assert [r["query"] for r in bad["csv_cells:1_of_3"]] == ["one cell"]
    assert [r["query"] for r in bad["query_invalid_utf8"]] == ["caf\\xe9"]
    assert [r["passage"] for r in bad["query_null"]] == ["p6"]
    assert counts[0]["rows_in"] == 8


def test_tsv_cells_are_never_quoted_and_a_tab_separated_csv_is_named(tmp_path):
    """TSV: a header line, a cell ends at a tab or line break and a quote is text (an unmatched quote at a cell's start
    swallows no row), .tsv.gz, ragged rows quarantined in their place; a .csv that is tab-separated (or a .tsv that is
    comma-separated) is refused with the fix."""
    import gzip

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.tsv").write_text('q\tp\nq0\tp0\nq1\t"Hello," he said\nq2\t"unbalanced start\nq3\tp3 "x"\nq4\tNA\n')
    with gzip.open(data / "b.tsv.gz", "wt") as f:
        f.write("q\tp\nq5\tp5\nthree\tcells\there\nq6\tp6\n")
    tables, counts = _ingest(tmp_path, str(data))
    kept = {r["query"]: r["passage"] for r in tables["pairs"] + tables["heldout"]}
    assert kept == {"q0": "p0", "q1": '"Hello," he said', "q2": '"unbalanced start', "q3": 'p3 "x"', "q4": "NA",
                    "q5": "p5", "q6": "p6"}
    assert [(r["query"], r["reason"], r["input_row"]) for r in tables["quarantine"]] == [
        ("three\tcells\there", "csv_cells:3_of_2", 1)]
    (tmp_path / "tabs.csv").write_text("q\tp\nquery\tpassage\n")
    with pytest.raises(IngestError, match=r"is one column holding a tab: the file is tab-separated, and CSV input is "
                                          r"read comma-separated\. Name it \.tsv \(or set data\.format=tsv\)"):
        _ingest(tmp_path / "x", str(tmp_path / "tabs.csv"))
    tables, _ = _ingest(tmp_path / "y", str(tmp_path / "tabs.csv"), "data.format=tsv")
    assert [(r["query"], r["passage"]) for r in tables["pairs"] + tables["heldout"]] == [("query", "passage")]
    (tmp_path / "commas.tsv").write_text("q,p\nquery,passage\n")
    with pytest.raises(IngestError, match=r"holding a comma: .* TSV input is read tab-separated\. Name it \.csv"):
        _ingest(tmp_path / "z", str(tmp_path / "commas.tsv"))
    with pytest.raises(IngestError, match=r"TSV input is read tab-separated\. Set data\.format=csv\.$"):
        _ingest(tmp_path / "w", str(tmp_path / "commas.tsv"), "data.format=tsv")  # renaming would not help


def test_files_without_a_header_line_take_data_column_names(tmp_path):
    """MS MARCO's triples.train.small.tsv: query, positive, negative per line and no header. Without
    data.column_names its first line is taken for the header: the error says how to name the columns."""
    from clusterscale.plan.build import count_input_rows

    data = tmp_path / "data"
    data.mkdir()
    (data / "triples.tsv").write_text("what is a star\ta ball of gas\ta planet\nragged line\nbake bread\tmix flour\t\n")
    (data / "pairs.csv").write_text('q one,"p, one",n1\nq two,p two,n2\n')
    named = ["data.column_names=[query,positive,negative]", "data.query_column=query",
             "data.passage_column=positive", "data.negative_column=negative"]
    tables, _ = _ingest(tmp_path, str(data), *named)
    kept = sorted((r["query"], r["passage"], r["negatives"]) for r in tables["pairs"] + tables["heldout"])
    assert kept == [("bake bread", "mix flour", []), ("q one", "p, one", ["n1"]), ("q two", "p two", ["n2"]),
                    ("what is a star", "a ball of gas", ["a planet"])]
    # Every row keeps its number: the ragged one is the file's second line (input_row + 1 without a header line).
    assert [(r["query"], r["input_row"], r["pair_id"] & ((1 << 40) - 1)) for r in tables["quarantine"]] == [
        ("ragged line", 1, 1)]
    cfg = config.load(None, [f"data.path={data}", *named])
    assert count_input_rows(cfg)[0] == 5  # no line is a header
    with pytest.raises(IngestError, match=r"Columns found: 'what is a star', 'a ball of gas', 'a planet'\..* If "
                                          r"the file has no header line, name its columns in order with data\."):
        _ingest(tmp_path / "x", str(data / "triples.tsv"))
    with pytest.raises(config.ConfigError, match=r"data\.column_names must list distinct, non-empty column names"):
        config.load(None, ["data.column_names=[a,a]"])


@pytest.mark.parametrize("layout, expected", [
    ({"anchor": "a", "positive": "b", "negative": "c"},  # sentence-transformers' triplets
     "data.query_column=anchor data.passage_column=positive data.negative_column=negative"),
    ({"query": "a", "pos": ["b"], "neg": ["c", "d"], "prompt": "e"},  # FlagEmbedding
     "data.query_column=query data.passage_column=pos data.negative_column=neg"),
    ({"query": "a", "positive": "b", **{f"negative_{i}": f"n{i}" for i in range(1, 12)}},  # triplet-50's columns
     "data.query_column=query data.passage_column=positive data.negative_column='negative_*'"),
    ({"Question": "a", "Answer": "b", "id": 1}, "data.query_column=Question data.passage_column=Answer"),
])
def test_missing_columns_name_the_mapping_the_files_names_fit(tmp_path, layout, expected):
    """A file of a known layout read with the default column names: the message proposes the --set that fits its
    names, and that --set reads it. A file of other names gets the generic example."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({**layout, "row": row}) + "\n" for row in range(2)))
    defaults = ["data.query_column=query", "data.passage_column=passage"]
    with pytest.raises(IngestError, match=r"This file's names fit: --set ") as raised:
        _ingest(tmp_path / "a", str(path), *defaults)
    hint = str(raised.value).split("--set ", 1)[1].split(" (data.negative_column")[0].rstrip(".")
    wanted = {k: v for k, v in (w.split("=", 1) for w in expected.split())}
    assert {k: v for k, v in (w.split("=", 1) for w in hint.split())} == {
        k: v for k, v in wanted.items() if k != "data.query_column" or v != "query"}
    settings = [f"{k}={v.strip(chr(39))}" for k, v in wanted.items()]
    tables, _ = _ingest(tmp_path / "b", str(path), *settings)
    assert len(tables["pairs"]) + len(tables["heldout"]) >= 2 and not tables["quarantine"]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": 1, "title": "t", "body": "b"}) + "\n")
    with pytest.raises(IngestError, match=r"Columns found: 'id', 'title', 'body'\. Set the data\.\*_column keys to "
                                          r"match \(e\.g\. --set data\.query_column=question"):
        _ingest(tmp_path / "c", str(other), *defaults)


@pytest.mark.unit
def test_the_column_hint_never_proposes_a_column_another_key_reads_or_a_broader_glob():
    from clusterscale.io.input_files import mapping_hint

    data = config.load(None, []).data
    # neg_scores is no negative: the glob neg_* would take it, so the numbered columns are named
    assert "data.negative_column=neg_0,neg_1 " in mapping_hint(["anchor", "positive", "neg_0", "neg_1", "neg_scores"],
                                                               data)
    source = config.load(None, ["data.source_column=answer"]).data  # answer is the source: the passage is text
    assert "--set data.query_column=question data.passage_column=text." in mapping_hint(
        ["question", "answer", "text"], source)
    assert mapping_hint(["anchor", "x"], data) == (
        "This file's names fit --set data.query_column=anchor; no column's name says which is data.passage_column: "
        "set it to one of the columns found.")
    missing_negatives = config.load(None, ["data.negative_column=negatives"]).data
    assert mapping_hint(["query", "passage", "neg"], missing_negatives) == (
        "This file's names fit: --set data.negative_column=neg.")


def _parquet_bytes(rows: int, row_group_size: int) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"q": [f"query {i}" for i in range(rows)], "p": [f"passage {i}" for i in range(rows)]}),
                   sink, row_group_size=row_group_size, compression="none")
    return sink.getvalue()


def _corrupt_late_row_group(data: bytes) -> bytes:
    """The last row group's pages overwritten: the file opens and yields rows, then fails."""
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    start = meta.row_group(meta.num_row_groups - 1).column(0).data_page_offset
    return data[:start] + b"\xff" * 64 + data[start + 64:]


BAD_FILES = {
    "empty.parquet": b"",
    "truncated.parquet": _parquet_bytes(100, 50)[:300],
    "late_corrupt.parquet": _corrupt_late_row_group(_parquet_bytes(40_000, 10_000)),
    "empty.csv": b"",
    "truncated.jsonl.gz": gzip.compress(b'{"q": "a", "p": "b"}\n' * 2000)[:-10],
    "broken_array.json": b'[{"q": "a", "p": "b"}, {"q": ',
    "empty.arrow": b"",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_unreadable_file_is_an_error_naming_it_or_quarantined_whole(tmp_path, name):
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"q": ["a", "b"], "p": ["c", "d"]}), folder / "a_good.parquet")
    (folder / name).write_bytes(BAD_FILES[name])
    with pytest.raises(IngestError) as err:
        _ingest(tmp_path / "strict", folder, "data.rows_per_part=1000")
    assert str(folder / name) in str(err.value) and "data.bad_files=quarantine" in str(err.value)

    tables, counts = _ingest(tmp_path / "lenient", folder, "data.rows_per_part=1000", "data.bad_files=quarantine")
    assert counts[0]["rows_in"] == 2 and "bad_file" not in counts[0]
    assert counts[1]["rows_in"] == 0 and counts[1]["bad_file"]
    # the rows a bad file yielded before it failed (late_corrupt: 16,384, in 16 parts) left with it
    assert len(tables["pairs"]) + len(tables["heldout"]) == 2


def test_glob_and_folder_skip_hidden_files(tmp_path):
    folder = tmp_path / "in"
    (folder / "_temporary").mkdir(parents=True)
    for name in ("a.jsonl", "_SUCCESS.jsonl", ".b.jsonl.crc.jsonl", "_temporary/c.jsonl"):
        (folder / name).write_text('{"q": "x", "p": "y"}\n')
    for data_path in (folder, f"{folder}/*.jsonl", f"{folder}/*jsonl"):  # fnmatch: * crosses folders
        _, files = list_input_files(config.load(None, [f"data.path={data_path}"]).data)
        assert files == [str(folder / "a.jsonl")]


def _hf_save_to_disk(folder, table: pa.Table) -> None:
    """What datasets' Dataset.save_to_disk writes (built by hand: datasets is not a dependency)."""
    folder.mkdir(parents=True)
    with pa.ipc.new_stream(folder / "data-00000-of-00001.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=7):
            writer.write_batch(batch)
    (folder / "dataset_info.json").write_text(json.dumps(
        {"citation": "", "description": "", "features": {c: {"dtype": "string", "_type": "Value"}
                                                           for c in table.column_names}}, indent=2))
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": "abc", "_format_columns": None,
         "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train"}, indent=2))
    # a map() cache next to the data: not part of the saved dataset
    with pa.ipc.new_stream(folder / "cache-0123.arrow", table.schema) as writer:
        writer.write_table(table)


def test_hf_save_to_disk_folder_reads_its_arrow_data_only(tmp_path):
    table = pa.table({"q": [f"question {i}" for i in range(30)], "p": [f"answer {i}" for i in range(30)]})
    _hf_save_to_disk(tmp_path / "ds", table)
    tables, counts = _ingest(tmp_path, tmp_path / "ds")
    assert [c["rows_in"] for c in counts] == [30] and not tables["quarantine"]
    assert sorted(r["query"] for r in tables["pairs"] + tables["heldout"]) == sorted(table.column("q").to_pylist())


def test_hf_dataset_dict_folder_names_its_splits(tmp_path):
    table = pa.table({"q": ["a"], "p": ["b"]})
    for split in ("train", "test"):
        _hf_save_to_disk(tmp_path / "dd" / split, table)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(IngestError, match=r"DatasetDict folder with the splits 'train', 'test'.*dd/train"):
        _ingest(tmp_path, tmp_path / "dd")


def test_bare_arrow_file_in_file_format(tmp_path):
    table = pa.table({"q": [f"q{i}" for i in range(20)], "p": [f"p{i}" for i in range(20)]})
    with pa.ipc.new_file(tmp_path / "pairs.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=6)
    tables, counts = _ingest(tmp_path, tmp_path / "pairs.arrow")
    assert counts[0]["rows_in"] == 20 and len(tables["pairs"]) + len(tables["heldout"]) == 20


def test_json_file_holding_an_array(tmp_path):
    rows = [{"q": f"query {i}", "p": f"passage {i}"} for i in range(25)]
    (tmp_path / "pairs.json").write_text(json.dumps(rows[:10] + [7, None] + rows[10:], indent=2))
    tables, counts = _ingest(tmp_path, tmp_path / "pairs.json")
    assert counts[0]["rows_in"] == 27 and len(tables["pairs"]) + len(tables["heldout"]) == 25
    assert sorted((r["reason"], r["query"]) for r in tables["quarantine"]) == [("not_an_object", "7"),
                                                                               ("not_an_object", "null")]


def test_json_array_parser_is_independent_of_chunk_size():
    text = '[ {"q": "a", "p": [1, 2]}, 12345, "str\\u00e9", null , {"x": {"y": 1.5e3}} ]\n'
    whole = list(json_array_items(io.StringIO(text)))
    assert [v for v, _ in whole] == [{"q": "a", "p": [1, 2]}, 12345, "str\u00e9", None, {"x": {"y": 1500.0}}]
    for chunk_chars in range(1, 12):
        assert list(json_array_items(io.StringIO(text), chunk_chars=chunk_chars)) == whole


def test_heldout_split_keeps_each_query_on_one_side(tmp_path):
    """Variants of one query (case, spacing, NFD) and duplicate pairs across files all land on one side,
    so no training pair is identical to a held-out pair."""
    folder = tmp_path / "in"
    folder.mkdir()
    rows = []
    for i in range(120):
        base = f"Which café is number {i}"
        variants = [base, f"  which   CAFÉ is number {i} ", unicodedata.normalize("NFD", base.upper())]
        rows += [{"q": v, "p": f"passage {i}-{j}"} for j, v in enumerate(variants)] + [{"q": base, "p": "same"}]
    for name in ("a.jsonl", "b.jsonl"):  # every pair twice, in two files
        (folder / name).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tables, _ = _ingest(tmp_path, folder)
    side: dict[str, set[str]] = {}
    for kind in ("pairs", "heldout"):
        for r in tables[kind]:
            side.setdefault(heldout_key(r["query"]), set()).add(kind)
    assert len(side) == 120 and all(len(s) == 1 for s in side.values())
    assert 10 < sum(s == {"heldout"} for s in side.values()) < 60  # about heldout_fraction=0.3 of the queries
    train = {(r["query"], r["passage"]) for r in tables["pairs"]}
    assert not train & {(r["query"], r["passage"]) for r in tables["heldout"]}


def test_cli_bad_file_exits_2_naming_it_then_quarantine_lists_it(tmp_path, ray_local, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"q": [f"q{i}" for i in range(30)], "p": [f"p{i}" for i in range(30)]}),
                   folder / "good.parquet")
    (folder / "zero.parquet").write_bytes(b"")
    common = ["--set", f"data.path={folder}", "data.query_column=q", "data.passage_column=p"]
    assert cli.main(["ingest", "--run-dir", str(tmp_path / "strict"), *common]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(folder / "zero.parquet") in err and "data.bad_files=quarantine" in err

    run = RunDir(str(tmp_path / "lenient"))
    assert cli.main(["ingest", "--run-dir", run.uri, *common, "data.bad_files=quarantine"]) == 0
    stats = run.done_stats("pairs")
    assert stats["rows_in"] == 30 == stats["pairs"] + stats["heldout"] + stats["quarantine"]
    assert [b["path"] for b in run.read_json("quarantine/bad_files.json")] == [str(folder / "zero.parquet")]
    assert stats["bad_files"][0]["error"].startswith("ArrowInvalid: Parquet file size is 0 bytes")


def test_bad_late_row_group_drops_every_unit_of_its_file(tmp_path, ray_local):
    from clusterscale.pipeline import run_stage

    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"q": ["a", "b"], "p": ["c", "d"]}), folder / "a_good.parquet")
    (folder / "late_corrupt.parquet").write_bytes(_corrupt_late_row_group(_parquet_bytes(4_000, 1_000)))
    cfg = config.load(None, [f"data.path={folder}", "data.query_column=q", "data.passage_column=p",
                             "data.rows_per_part=1000", "data.bad_files=quarantine"])
    run = RunDir(str(tmp_path / "run"))
    stats = run_stage("ingest", cfg, run).stats  # four units of the corrupt file: three read fine, the last one fails
    assert stats["rows_in"] == 2 and [b["path"] for b in stats["bad_files"]] == [str(folder / "late_corrupt.parquet")]
    assert sum(pq.read_metadata(f).num_rows for k in KINDS for f in run.files(k)) == 2


@pytest.mark.unit
def test_ingest_names_big_files_one_task_reads_whole(capsys):
    from clusterscale.io.input_walk import InputWalk
    from clusterscale.stages.ingest import WHOLE_FILE_WARN_BYTES, IngestUnit, _print_whole_files

    files = ["/d/big.jsonl", "/d/big.parquet", "/d/small.tsv", "/d/huge.csv.gz", "/d/array.json", "/d/cut.tsv"]
    walk = InputWalk(files=files, stamps={"/d/big.jsonl": (3 * 2**30, 0), "/d/big.parquet": (5 * 2**30, 0),
                                          "/d/small.tsv": (WHOLE_FILE_WARN_BYTES - 1, 0),
                                          "/d/huge.csv.gz": (WHOLE_FILE_WARN_BYTES, 0),
                                          "/d/array.json": (2 * 2**30, 0), "/d/cut.tsv": (2 * 2**30, 0)})
    units = [IngestUnit(0, "/d/big.jsonl", 0, byte_range=(0, 2**30)),
             IngestUnit(0, "/d/big.jsonl", 1, byte_range=(2**30, 3 * 2**30)), IngestUnit(1, "/d/big.parquet"),
             IngestUnit(2, "/d/small.tsv"), IngestUnit(3, "/d/huge.csv.gz"), IngestUnit(4, "/d/array.json"),
             IngestUnit(5, "/d/cut.tsv", 0, byte_range=(0, 2 * 2**30))]
    _print_whole_files(walk, config.load(None, []).data, units)
    said = capsys.readouterr().out
    assert said.startswith("[ingest] 2 big file(s) each read whole by one task (CSV, compressed, JSON array and "
                           "Arrow files are; Parquet is split by row groups, uncompressed JSON lines and TSV by byte "
                           "ranges of data.range_bytes): /d/huge.csv.gz (1.0 GiB), /d/array.json (2.0 GiB). Split "
                           "them"), said
    _print_whole_files(InputWalk(files=["/d/small.tsv"], stamps={}), config.load(None, []).data, [])
    assert capsys.readouterr().out == ""


@pytest.mark.unit
def test_negative_columns_no_key_names_are_noted_by_ingest_and_plan(tmp_path):
    from clusterscale.io.input_files import unused_negatives
    from clusterscale.plan.build import input_warnings

    data = config.load(None, ["data.passage_column=positive", "data.query_column=anchor"]).data
    assert unused_negatives(["anchor", "positive", "negative"], data).startswith(
        "the input has a column 'negative' that looks like labeled hard negatives")
    numbered = unused_negatives(["anchor", "positive"] + [f"negative_{i}" for i in range(1, 4)], data)
    assert "columns 'negative_*' that look like" in numbered and "--set data.negative_column='negative_*'" in numbered
    assert unused_negatives(["anchor", "positive", "score"], data) is None
    mapped = config.load(None, ["data.passage_column=positive", "data.query_column=anchor",
                                "data.negative_column=negative"]).data
    assert unused_negatives(["anchor", "positive", "negative"], mapped) is None
    assert unused_negatives(["anchor", "negative"], config.load(None, ["data.passage_column=negative",
                                                                       "data.query_column=anchor"]).data) is None
    path = tmp_path / "triplets.parquet"
    pq.write_table(pa.table({"anchor": ["a"], "positive": ["p"], "hard_negatives": [["n"]]}), path)
    cfg = config.load(None, [f"data.path={path}", "data.passage_column=positive", "data.query_column=anchor"])
    assert input_warnings(cfg)[0].startswith("the input has a column 'hard_negatives' that looks like")
    tsv = tmp_path / "triples.tsv"
    tsv.write_text("q\tp\tneg\nquery\tpassage\tnegative\n")
    cfg = config.load(None, [f"data.path={tsv}", "data.passage_column=p", "data.query_column=q"])
    assert "'neg'" in input_warnings(cfg)[0]
