"""Prompts (issue 54 item 1): train.query_prompt / passage_prompt for the student, embed.query_prompt /
passage_prompt for the frozen encoder (its folder's own prompts when unset), applied wherever each model embeds, and
exported as the sentence-transformers prompts named 'query' and 'passage'."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from clusterscale import config
from clusterscale.config import TrainConfig
from clusterscale.modeling.model_files import frozen_prompts
from clusterscale.train.step import contrastive_backward
from tests.conftest import make_pairs


def test_a_prompt_is_set_as_typed_and_changes_no_fingerprint_unset():
    cfg = config.load(None, ["train.query_prompt=query: ", "train.passage_prompt=passage: ",
                             "embed.query_prompt=Represent this question: "])
    assert (cfg.train.student.query_prompt, cfg.train.student.passage_prompt) == ("query: ", "passage: ")
    assert cfg.embed.query_prompt == "Represent this question: "  # not a YAML mapping, its space kept
    default = config.load(None, [])
    assert default.embed.query_prompt is None and default.train.student.query_prompt == ""
    for section in ("embed", "train"):  # added keys: runs made before them keep their fingerprints
        assert config.load(None, ["train.query_prompt="]).fingerprint((section,)) == default.fingerprint((section,))
    assert cfg.fingerprint(("train",)) != default.fingerprint(("train",))
    assert cfg.fingerprint(("embed",)) != default.fingerprint(("embed",))


def test_the_frozen_encoders_own_prompts_apply_unless_set(tmp_path):
    folder = tmp_path / "enc"
    folder.mkdir()
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "search_query: ", "document": "search_document: "}}))
    own = config.load(None, [f"embed.model={folder}"]).embed
    assert frozen_prompts(own) == ("search_query: ", "search_document: ")
    assert frozen_prompts(config.load(None, [f"embed.model={folder}", "embed.query_prompt="]).embed) == \
        ("", "search_document: ")
    assert frozen_prompts(config.load(None, []).embed) == ("", "")  # the bundled MiniLM names none


def test_exported_prompts_make_sentence_transformers_encode_as_trained(tiny_model, tmp_path):
    """The student's export carries its prompts: SentenceTransformer.encode(q, prompt_name="query") equals the
    training step's own embedding of "query: " + q (and passages likewise), and unprompted encode does not."""
    from sentence_transformers import SentenceTransformer

    from clusterscale.modeling.encoder import load_model, load_tokenizer, save_sentence_transformers_dir
    from clusterscale.modeling.student import embed

    model, tokenizer = load_model(tiny_model).eval(), load_tokenizer(tiny_model)
    out = tmp_path / "exported"
    save_sentence_transformers_dir(model, tokenizer, str(out), "mean", 32, ("query: ", "passage: "))
    st = SentenceTransformer(str(out), device="cpu")
    assert st.prompts == {"query": "query: ", "passage": "passage: ", "document": "passage: "}
    queries = make_pairs(5).column("q").to_pylist()
    with torch.no_grad():
        trained = embed(model, tokenizer, ["query: " + q for q in queries], 32, "mean", torch.device("cpu")).numpy()
    prompted = st.encode(queries, prompt_name="query")
    np.testing.assert_allclose(prompted, trained, atol=1e-5)
    assert np.abs(st.encode(queries) - trained).max() > 1e-3
    np.testing.assert_allclose(st.encode_query(queries), trained, atol=1e-5)
    plain = tmp_path / "plain"
    save_sentence_transformers_dir(model, tokenizer, str(plain), "mean", 32)
    assert json.loads((plain / "config_sentence_transformers.json").read_text())["prompts"] == {}


def test_the_training_step_puts_each_prompt_before_its_side(tiny_model):
    """contrastive_backward with prompts equals the same step on texts that already carry them (queries, passages
    and mined negatives alike)."""
    from clusterscale.modeling.encoder import load_model, load_tokenizer

    table = make_pairs(6, seed=4)
    queries, passages = table.column("q").to_pylist(), table.column("p").to_pylist()
    negatives = passages[1:] + passages[:1]
    settings = dict(temperature=0.05, query_max_length=16, passage_max_length=32, pooling="mean",
                    negatives_per_query=1)
    results = []
    for prompts, q, p, n in ((("Q: ", "P: "), queries, passages, negatives),
                             (("", ""), [f"Q: {t}" for t in queries], [f"P: {t}" for t in passages],
                              [f"P: {t}" for t in negatives])):
        torch.manual_seed(0)
        model, tokenizer = load_model(tiny_model).eval(), load_tokenizer(tiny_model)
        tc = TrainConfig.of(**settings, query_prompt=prompts[0], passage_prompt=prompts[1])
        loss, _ = contrastive_backward(model, tokenizer, q, p, tc, torch.device("cpu"), negatives=n)
        results.append((float(loss), torch.cat([x.grad.flatten() for x in model.parameters() if x.grad is not None])))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1])


def test_embed_tokenises_each_side_after_its_frozen_prompt(tmp_path):
    """The embed stage's tokeniser (Ray-free here) puts embed's prompts before queries and passages."""
    from clusterscale.io.rundir import RunDir
    from clusterscale.modeling.encoder import load_tokenizer, resolve_model_path
    from clusterscale.modeling.tokens import TextTokenizer
    from clusterscale.stages.embed import TOKENS, TokenizeUnits, output_columns

    run = RunDir(str(tmp_path / "run"))
    table = pa.table({"pair_id": [0, 1], "query": ["what is a comet", "bake bread"],
                      "passage": ["a comet is ice", "flour and water"]})
    run.write_parquet("pairs/part-00000.parquet", table)
    hf = load_tokenizer(resolve_model_path("bundled"))
    tokenizer = TextTokenizer(hf, 32)
    unit = {"input": "pairs/part-00000.parquet", "start": 0, "stop": 2, "output": "embeddings/u.parquet"}
    out = TokenizeUnits(run.uri, tokenizer, "both", ("query: ", "passage: ")).tokenize_unit(unit)
    for (text, suffix) in output_columns("both"):
        expect = tokenizer([("query: " if text == "query" else "passage: ") + t for t in table.column(text).to_pylist()])
        assert [list(r) for r in out.column(f"{TOKENS}{suffix}").to_pylist()] == [list(expect.row(i)) for i in range(2)]
