"""Labeled hard negatives (data.negative_column -> `negatives`, train.labeled_negatives_per_query): ingest keeps them
normalised or quarantines the row with a reason, the step masks a row's empty slots for every query, and training on
shards without them is refused by name; negatives spread over several columns (sentence-transformers' negative_1 ...
negative_n) are named by a comma list or a glob. A whole run that carries them to training: tests/test_extending.py."""
from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import config
from clusterscale.io.input_files import negative_columns
from clusterscale.stages.ingest import IngestError, _route_record, normalise_negatives
from test_ingest_inputs import _ingest
from tests.conftest import make_pairs


@pytest.mark.unit
def test_a_rows_negatives_are_a_text_or_a_list_normalised_and_a_bad_one_is_quarantined():
    data = config.load(None, ["data.negative_column=neg", "data.heldout_fraction=0"]).data
    kept = {"a neg": ["a neg"], (" x\u0000y ", None, "", "  "): ["x y"], None: [], (): []}
    for value, texts in kept.items():
        [(kind, row)] = _route_record({"query": "q", "passage": "p", "neg": list(value) if isinstance(value, tuple)
                                       else value}, 1, data)
        assert kind == "pairs" and row["negatives"] == texts, value
    for value, reason in ((5, "negative_not_string:int"), ([1], "negative_not_string:int"),
                          ({"a": 1}, "negative_not_string:dict"), (["ok", "z" * 200_000], "over_long_negative"),
                          ([b"\xff"], "negative_invalid_utf8")):
        [(kind, row)] = _route_record({"query": "q", "passage": "p", "neg": value}, 1, data)
        assert kind == "quarantine" and row["reason"] == reason and row["negatives"], value  # kept, as text
    assert normalise_negatives(pa.array([["u", "v"]])[0].values.to_numpy(zero_copy_only=False), 10) == (["u", "v"],
                                                                                                          None)
    plain = config.load(None, ["data.heldout_fraction=0"]).data
    assert "negatives" not in _route_record({"query": "q", "passage": "p"}, 1, plain)[0][1]  # unset: pairs/ unchanged


@pytest.mark.unit
def test_negatives_in_several_columns_by_names_and_globs_in_every_format(tmp_path):
    names = ["q", "p", "negative_10", "negative_2", "negative_1", "hard", "negative_x"]
    assert negative_columns("negative_*", names) == ["negative_1", "negative_2", "negative_10", "negative_x"]
    assert negative_columns("hard, negative_?", names) == ["hard", "negative_1", "negative_2", "negative_x"]
    assert negative_columns("neg", names) == ["neg"] and negative_columns(None, names) == []
    (tmp_path / "c.yaml").write_text("data:\n  negative_column: [negative_1, hard]\n")  # a YAML list of names
    written = config.load(tmp_path / "c.yaml").data.negative_column
    assert written == "negative_1,hard" and negative_columns(written, names) == ["negative_1", "hard"]
    typed = config.load(None, ["data.negative_column=[negative_1, 'hard']"]).data.negative_column  # --set keeps text
    assert negative_columns(typed, names) == ["negative_1", "hard"]
    (tmp_path / "c.yaml").write_text("data:\n  negative_column: [a, 1]\n")
    with pytest.raises(config.ConfigError, match=r"data.negative_column must be a string, got \['a', 1\]"):
        config.load(tmp_path / "c.yaml")
    rows = [{"q": f"query {i}", "p": f"passage {i}", "id": i, **{f"negative_{j}": None if (i + j) % 5 == 0 else
            [f"n{i}.{j}", f"m{i}.{j}"] if j == 11 else f"n{i}.{j}" for j in range(1, 12)}} for i in range(30)]
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist([{**r, "negative_11": r["negative_11"]} for r in rows]), data / "a.parquet")
    (data / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(data / "c.csv", "w", newline="") as f:  # a CSV cell holds one text: negative_11 left out
        writer = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "negative_11"])
        writer.writeheader()
        writer.writerows({k: v for k, v in r.items() if k != "negative_11"} for r in rows)

    def expected(i: int, columns: range) -> list[str]:
        out = []
        for j in columns:
            if (i + j) % 5:
                out += [f"n{i}.{j}", f"m{i}.{j}"] if j == 11 else [f"n{i}.{j}"]
        return out

    tables, _ = _ingest(tmp_path, str(data), "data.negative_column=negative_*")
    pairs = tables["pairs"] + tables["heldout"]
    assert len(pairs) == 90 and not tables["quarantine"]
    for row in pairs:
        i, fmt = int(row["query"].split()[1]), row["pair_id"] >> 40  # files in sorted order: a.parquet, b, c.csv
        assert row["negatives"] == expected(i, range(1, 12 if fmt < 2 else 11)), (fmt, row)
    tables, _ = _ingest(tmp_path / "list", str(data / "b.jsonl"), "data.negative_column=negative_3, negative_1")
    assert all(r["negatives"] == [t for j in (3, 1) for t in expected(int(r["query"].split()[1]), [j])]
               for r in tables["pairs"] + tables["heldout"])
    with pytest.raises(IngestError, match=r"its pattern 'neg_\*' matches none besides the query, passage and source "
                                          r"columns\) not found\. Columns found: 'q', 'p'"):
        _ingest(tmp_path / "none", str(data / "a.parquet"), "data.negative_column=neg_*")


@pytest.mark.unit
def test_a_negative_glob_never_takes_the_pair_s_own_columns_nor_one_of_two_same_names(tmp_path):
    data = config.load(None, ["data.query_column=neg_q", "data.passage_column=neg_pos", "data.source_column=neg_src",
                              "data.negative_column=neg*", "data.heldout_fraction=0"]).data
    rec = {"neg_q": "q", "neg_pos": "P", "neg_src": "s", "neg_1": "n1", "__raw__": "x"}
    [(kind, row)] = _route_record(rec, 1, data)
    assert kind == "pairs" and row["negatives"] == ["n1"]  # not its own passage, query or source
    (tmp_path / "twice.csv").write_text("q,p,negative_1,negative_1\nquery,passage,n1,n2\n")
    with pytest.raises(IngestError, match=r"'negative_1' \(columns 3, 4\) appear more than once"):
        _ingest(tmp_path, str(tmp_path / "twice.csv"), "data.negative_column=negative_*")
    # A column whose very name holds a comma or a glob character is that column; a ragged row keeps a null.
    (tmp_path / "odd.csv").write_text('q,p,"hard,neg",negatives[0]\nquery,passage,h,n0\nragged\n')
    for spec, negatives in (("hard,neg", ["h"]), ("negatives[0]", ["n0"])):
        tables, _ = _ingest(tmp_path / spec, str(tmp_path / "odd.csv"), f"data.negative_column={spec}",
                            "data.heldout_fraction=0")
        assert [r["negatives"] for r in tables["pairs"]] == [negatives]
        assert [(r["reason"], r["negatives"]) for r in tables["quarantine"]] == [("csv_cells:1_of_4", None)]


@pytest.mark.unit
def test_the_first_rejected_row_is_shown_by_the_column_at_fault(tmp_path):
    from clusterscale.io.rundir import RunDir
    from clusterscale.stages.ingest import first_rejected

    path = tmp_path / "neg.jsonl"
    path.write_text('{"q": "a", "p": "b", "neg": {"x": 1}}\n{"q": "c", "p": "d", "neg": "e"}\n')
    cfg = config.load(None, ["data.negative_column=neg", "data.query_column=q", "data.passage_column=p"])
    _ingest(tmp_path, str(path), "data.negative_column=neg")
    shown = first_rejected(RunDir(str(tmp_path / "run")), cfg.data)
    assert shown == """ The first: negative_not_string:dict, data.negative_column='neg' holds {"x": 1}."""


@pytest.mark.unit
def test_a_random_draw_of_labeled_negatives_is_seeded_by_epoch_and_pair_and_keeps_the_listed_order():
    from clusterscale.train.trainer import labeled_negatives

    values = [[f"n{i}.{j}" for j in range(8)] for i in range(4)] + [["a", "b"], None]
    ids = [11, 12, 13, (5 << 40) | 7, 14, 15]
    first, empty = labeled_negatives(values, 3)
    assert [p for p, _ in first][:4] == [v[:3] for v in values[:4]] and empty == 1 + 3
    drawn, empty_drawn = labeled_negatives(values, 3, (0, 0, ids))
    again, _ = labeled_negatives(values, 3, (0, 0, ids))
    later, _ = labeled_negatives(values, 3, (0, 1, ids))
    assert drawn == again and empty_drawn == empty  # the same on every rank and after a resume
    for (p, q), v in zip(drawn[:4], values):
        assert len(set(p)) == 3 and set(p) <= set(v) and p == sorted(p, key=v.index) and q == [None] * 3
    assert [p for p, _ in drawn[:4]] != [p for p, _ in later[:4]]  # another draw next epoch
    assert drawn[4][0] == ["a", "b", None] and drawn[5][0] == [None] * 3  # fewer than asked: all, masked slots
    counts = {}
    for epoch in range(300):  # every negative is drawn, about as often as any other
        for text in labeled_negatives(values[:1], 3, (0, epoch, ids[:1]))[0][0][0]:
            counts[text] = counts.get(text, 0) + 1
    assert len(counts) == 8 and max(counts.values()) < 1.6 * min(counts.values())


def test_empty_slots_change_no_loss_and_no_gradient(tiny_model):
    """A step whose every negative slot is empty equals the in-batch step (loss and gradients); a real labeled
    negative changes both."""
    import torch

    from clusterscale.modeling.encoder import load_model, load_tokenizer
    from clusterscale.train.step import contrastive_backward

    tc = config.load(None, ["train.pooling=mean", "train.temperature=0.1"]).train
    rows = make_pairs(6).to_pylist()
    queries, passages = [r["q"] for r in rows], [r["p"] for r in rows]
    tokenizer = load_tokenizer(tiny_model)

    def step(negatives):
        torch.manual_seed(0)
        model = load_model(tiny_model).train(False)
        loss, _ = contrastive_backward(model, tokenizer, queries, passages, tc, torch.device("cpu"), pooling="mean",
                                       negatives=negatives, negative_queries=None if negatives is None else
                                       [None] * len(negatives))
        return float(loss), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    plain, empty = step(None), step([None] * len(queries))
    assert plain[0] == pytest.approx(empty[0], abs=1e-6) and torch.allclose(plain[1], empty[1], atol=1e-6)
    labeled = step(["an unrelated hard negative about nothing"] + [None] * (len(queries) - 1))
    assert labeled[0] > plain[0]


@pytest.mark.unit
def test_training_with_labeled_negatives_on_shards_without_them_is_refused_by_name(tmp_path):
    from types import SimpleNamespace

    from clusterscale.io.rundir import RunDir
    from clusterscale.stages.train import _check_labeled_negatives

    pq.write_table(make_pairs(4), tmp_path / "part.parquet")
    with pytest.raises(config.ConfigError, match="labeled_negatives_per_query=2 needs labeled negatives.*"
                                                 "data.negative_column"):  # at load, before Ray starts
        config.load(None, ["train.labeled_negatives_per_query=2"])
    cfg = config.load(None, ["train.labeled_negatives_per_query=2", "data.negative_column=neg"])
    with pytest.raises(config.ConfigError, match="labeled_negatives_per_query=2 needs labeled negatives.*"
                                                 "data.negative_column"):  # shards ingested without them
        _check_labeled_negatives(cfg, RunDir(str(tmp_path)), [SimpleNamespace(files=["part.parquet"])])


@pytest.mark.unit
def test_fewer_labeled_negatives_than_asked_for_are_said_at_the_start_of_training(tmp_path, capsys):
    """Ingest counts the labeled negatives of the training pairs; training that asks for more per query than they
    carry on average says so (the missing ones are masked slots), and is quiet when they suffice."""
    from types import SimpleNamespace

    from clusterscale.io.rundir import RunDir
    from clusterscale.stages.train import _check_labeled_negatives

    table = make_pairs(4).append_column("negatives", pa.array([["a"], [], ["b", "c"], []], pa.list_(pa.string())))
    pq.write_table(table, tmp_path / "part.parquet")
    run, manifests = RunDir(str(tmp_path)), [SimpleNamespace(files=["part.parquet"])]
    run.mark_done("pairs", "fp", {"pairs": 4, "labeled_negatives": 3, "without_labeled_negatives": 2})
    cfg = config.load(None, ["train.labeled_negatives_per_query=1", "data.negative_column=neg"])
    _check_labeled_negatives(cfg, run, manifests)
    out = capsys.readouterr().out
    assert "labeled_negatives_per_query=1, but the training pairs carry 0.8 labeled negatives each on average " \
           "(2 of 4 pairs with none; data.negative_column=neg)" in out, out
    run.mark_done("pairs", "fp", {"pairs": 4, "labeled_negatives": 4, "without_labeled_negatives": 2})
    _check_labeled_negatives(cfg, run, manifests)
    assert "warning" not in capsys.readouterr().out
    # Negatives ingested, none asked for: said, with the key that uses them.
    from clusterscale.stages.train import _note_unused_labeled_negatives
    _note_unused_labeled_negatives(config.load(None, ["data.negative_column=neg"]), run)
    assert "[train] note: the training pairs carry 1.0 labeled negatives each on average (data.negative_column=neg), " \
           "but train.labeled_negatives_per_query=0: training draws none." in capsys.readouterr().out
    run.mark_done("pairs", "fp", {"pairs": 4})  # ingested without data.negative_column
    _note_unused_labeled_negatives(config.load(None, []), run)
    assert capsys.readouterr().out == ""
