"""A passage column of lists (FlagEmbedding's {"query", "pos": [...], "neg": [...]} format, a Parquet list<string>):
each text of the list is a positive of the query, so a pair of its own. The first keeps the record's pair_id, the
others get ids of their own in the same file's range; every pair of a query falls on one side of the held-out split;
a list with no text, or with an element that is not text, quarantines the record whole; the counts still add up
(rows in + extra_positives = pairs + held out + quarantined)."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import cli, config
from clusterscale.io.rundir import RunDir
from clusterscale.stages.ingest import (EXTRA_POSITIVE_BIT, MAX_POSITIVES, ROW_BITS, _route_record, extra_positive_id,
                                        normalise_passages)
from test_ingest_inputs import _ingest


@pytest.mark.unit
def test_a_passage_is_a_text_or_a_list_of_texts():
    assert normalise_passages(" a\u0000b ") == (["a b"], None)
    assert normalise_passages(["x", None, "", "  ", "y"]) == (["x", "y"], None)
    assert normalise_passages(pa.array([["u", "v"]])[0].values.to_numpy(zero_copy_only=False)) == (["u", "v"], None)
    assert normalise_passages(np.array(["w"], dtype=object)) == (["w"], None)
    assert normalise_passages(np.str_("a text")) == (["a text"], None)  # a NumPy text is one text, not a list
    for value, reason in (([], "empty"), ([None, " "], "empty"), ([1], "not_string:int"), (["ok", 2.5],
                          "not_string:float"), ({"title": "t"}, "not_string:dict"), ([b"\xff"], "invalid_utf8"),
                          (None, "null"), (["t"] * (MAX_POSITIVES + 1), "too_many_texts")):
        assert normalise_passages(value) == ([], reason), value
    assert len(normalise_passages([f"t{i}" for i in range(MAX_POSITIVES)])[0]) == MAX_POSITIVES


@pytest.mark.unit
def test_a_passage_object_with_a_text_is_its_title_and_text():
    """DPR's ctxs, Tevatron's passages, a BEIR corpus record: {"title", "text", ...} is "title text", the text alone
    without a title; an object without a text string stays a rejected dict. The labeled negatives read the same."""
    assert normalise_passages({"title": "T", "text": "body", "score": 3}) == (["T body"], None)
    assert normalise_passages([{"title": "", "text": "a"}, {"text": " b "}, {"title": None, "text": "c"}]) == (
        ["a", "b", "c"], None)
    for value in ({"text": None, "title": "T"}, [{"title": "T"}], {"text": 5}):
        assert normalise_passages(value) == ([], "not_string:dict"), value
    data = config.load(None, ["data.heldout_fraction=0", "data.negative_column=hard", "data.passage_column=pos"]).data
    routed = _route_record({"query": "q", "pos": [{"title": "A", "text": "a"}],
                            "hard": [{"title": "N", "text": "n", "passage_id": "7"}, "plain"]}, 1, data)
    assert routed == [("pairs", {"pair_id": 1, "query": "q", "passage": "A a", "source": None,
                                 "negatives": ["N n", "plain"]})]
    routed = _route_record({"query": "q", "pos": "p", "hard": {"title": "N", "text": "n"}}, 2, data)
    assert routed[0][1]["negatives"] == ["N n"]
    assert _route_record({"query": "q", "pos": "p", "hard": [{"id": 1}]}, 3, data)[0][1]["reason"] == \
        "negative_not_string:dict"


def test_dpr_json_array_and_a_parquet_list_of_structs(tmp_path):
    """DPR's training file (a JSON array; question, positive_ctxs, hard_negative_ctxs of {"title", "text", ...}) and
    the same as Parquet list<struct> columns read as they are: one pair per positive, negatives as "title text"."""
    records = [{"question": f"who made thing {i}", "answers": [f"maker {i}"],
                "positive_ctxs": [{"title": f"Thing {i}", "text": f"made by maker {i}", "passage_id": str(i)}] * (
                    1 + i % 2),
                "hard_negative_ctxs": [{"title": "", "text": f"thing {i + 1} by maker {i + 1}", "passage_id": "x"}]}
               for i in range(6)]
    (tmp_path / "dpr.json").write_text(json.dumps(records, indent=1))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "dpr.parquet")
    mapping = ["data.query_column=question", "data.passage_column=positive_ctxs",
               "data.negative_column=hard_negative_ctxs", "data.heldout_fraction=0"]
    for name in ("dpr.json", "dpr.parquet"):
        tables, counts = _ingest(tmp_path / name.replace(".", "_"), str(tmp_path / name), *mapping)
        pairs = sorted((r["query"], r["passage"], tuple(r["negatives"])) for r in tables["pairs"])
        assert len(pairs) == 9 and not tables["quarantine"], name  # 3 records with two positives
        assert pairs[0] == ("who made thing 0", "Thing 0 made by maker 0", ("thing 1 by maker 1",)), name


@pytest.mark.unit
def test_further_passages_get_ids_of_their_own_in_their_files_range():
    data = config.load(None, ["data.heldout_fraction=0", "data.max_text_chars=10"]).data
    base = (7 << ROW_BITS) | 12
    routed = _route_record({"query": "q", "passage": ["p0", "p1", "p2"]}, base, data)
    assert [(kind, row["passage"]) for kind, row in routed] == [("pairs", "p0"), ("pairs", "p1"), ("pairs", "p2")]
    ids = [row["pair_id"] for _, row in routed]
    assert ids[0] == base and ids[1:] == [extra_positive_id(base, 1), extra_positive_id(base, 2)]
    assert all(i >> ROW_BITS == 7 for i in ids)  # the file index stays in the high bits
    # No id of a further passage is the id of any row of any file (no row reaches the bit), nor another's.
    rows = [0, 1, 255, 256, (1 << (ROW_BITS - 9)) - 1]
    extra = {extra_positive_id((f << ROW_BITS) | r, i) for f in (0, 1, 5) for r in rows
             for i in (1, 2, MAX_POSITIVES - 1)}
    assert len(extra) == 3 * len(rows) * 3 and all(e & EXTRA_POSITIVE_BIT for e in extra)
    # One over-long text quarantines the record whole, its list kept as JSON.
    [(kind, row)] = _route_record({"query": "q", "passage": ["ok", "z" * 11]}, base, data)
    assert kind == "quarantine" and row["reason"] == "over_long_passage" and json.loads(row["passage"]) == ["ok",
                                                                                                           "z" * 11]


def _bge_records(n: int) -> list[dict]:
    """FlagEmbedding's training format: every 3rd query with two positives, every 10th record's list broken."""
    records = []
    for i in range(n):
        pos = [f"passage {i} a"] + ([f"passage {i} b"] if i % 3 == 0 else [])
        if i % 10 == 9:
            pos = [] if i % 20 == 9 else [f"passage {i} a", 7]
        records.append({"q": f"query {i}", "p": pos, "neg": [f"negative {i}"]})
    return records


@pytest.mark.unit
def test_jsonl_and_parquet_lists_give_one_pair_per_text(tmp_path):
    records = _bge_records(60)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    good = [r for r in records if all(isinstance(t, str) for t in r["p"]) and r["p"]]
    pq.write_table(pa.Table.from_pylist(good, schema=pa.schema([("q", pa.string()), ("p", pa.list_(pa.string())),
                                                                 ("neg", pa.list_(pa.string()))])), data / "b.parquet")
    tables, counts = _ingest(tmp_path, str(data), "data.negative_column=neg")  # checks the counts add up
    pairs = tables["pairs"] + tables["heldout"]
    expected = [(r["q"], t) for r in good for t in r["p"]]
    assert sorted((p["query"], p["passage"]) for p in pairs) == sorted(expected * 2)  # both files
    assert sum(c.get("extra_positives", 0) for c in counts) == 2 * sum(len(r["p"]) - 1 for r in good)
    assert all(p["negatives"] == [p["query"].replace("query", "negative")] for p in pairs)  # each pair its row's
    held = {p["query"] for p in tables["heldout"]}
    assert held and not held & {p["query"] for p in tables["pairs"]}  # a query's pairs fall on one side
    reasons = {r["input_row"]: r["reason"] for r in tables["quarantine"]}
    assert reasons == {i: "passage_empty" if i % 20 == 9 else "passage_not_string:int" for i in range(9, 60, 10)}
    for p in pairs:  # the first text of a record has its row's id, a further one the extra id of its row
        row = p["pair_id"] & ((1 << (ROW_BITS - 1)) - 1)
        first = not p["pair_id"] & EXTRA_POSITIVE_BIT
        source = records if p["pair_id"] >> ROW_BITS == 0 else good  # a.jsonl, b.parquet
        assert p["passage"].endswith(" a") == first and p["query"] == source[row if first else row >> 8]["q"]


def test_the_cli_ingests_flagembedding_jsonl_and_says_how_many_pairs_the_lists_added(tmp_path, ray_local, capsys):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"query": f"q{i}", "pos": [f"p{i}", f"p{i} again"], "neg": [f"n{i}"]}) + "\n"
                            for i in range(40)))
    code = cli.main(["ingest", "--run-dir", str(tmp_path / "run"), "--set", f"data.path={path}",
                     "data.query_column=query", "data.passage_column=pos", "data.negative_column=neg",
                     "data.heldout_fraction=0.2"])
    out = capsys.readouterr().out
    assert code == 0, out
    stats = RunDir(str(tmp_path / "run")).done_stats("pairs")
    assert stats["rows_in"] == 40 and stats["extra_positives"] == 40
    assert stats["pairs"] + stats["heldout"] == 80 and stats["quarantine"] == 0
    assert stats["labeled_negatives"] == stats["pairs"]  # every pair carries its record's negative
    assert "rows in 40 (+40 pairs from the records' further passages): pairs" in out
    assert "note:" not in out
    # The same file with its negatives left unmapped: ingest says they are not read, and what to set.
    code = cli.main(["ingest", "--run-dir", str(tmp_path / "unmapped"), "--set", f"data.path={path}",
                     "data.query_column=query", "data.passage_column=pos", "data.heldout_fraction=0.2"])
    out = capsys.readouterr().out
    assert code == 0 and "[ingest] note: the input has a column 'neg' that looks like labeled hard negatives, but " \
        "data.negative_column is unset: they are not read, and training draws none. To train with them: --set " \
        "data.negative_column=neg train.labeled_negatives_per_query=1 (or more)." in out, out
