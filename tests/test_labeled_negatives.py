"""Labeled hard negatives (data.negative_column -> `negatives`, train.labeled_negatives_per_query): ingest keeps them
normalised or quarantines the row with a reason, the step masks a row's empty slots for every query, and training on
shards without them is refused by name. A whole run that carries them to training: tests/test_extending.py."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clusterscale import config
from clusterscale.stages.ingest import _route_record, normalise_negatives
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
