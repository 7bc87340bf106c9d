"""The cost model sizes the from-scratch student with the builder that training uses."""
from __future__ import annotations

from clusterscale import config as config_mod
from clusterscale.modeling.student import build_student
from clusterscale.stages.costs import student_param_count


def test_scratch_param_count_equals_the_built_student():
    cfg = config_mod.load(None, ["train.init=scratch", "train.scratch_hidden_size=32", "train.scratch_num_layers=1",
                                 "train.scratch_num_heads=2", "train.scratch_intermediate_size=64",
                                 "train.passage_max_length=600"])
    model, _, _ = build_student(cfg.train)
    assert student_param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert model.config.max_position_embeddings == 600 and model.config.hidden_size == 32


def test_mean_tokens_caps_long_documents_as_the_stages_do_without_the_indexing_warning(tmp_path):
    """A passage far longer than the model's maximum is counted at the caps (the embed and training lengths), as
    untruncated tokenising would count it, and transformers does not warn that it "will result in indexing errors"."""
    import logging

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from clusterscale.io.rundir import RunDir
    from clusterscale.modeling.encoder import load_tokenizer, resolve_model_path
    from clusterscale.stages.costs import mean_tokens

    queries = ["short query", "a somewhat longer query about tokens"]
    passages = ["word " * 3000, "a short passage"]  # ~3,000 tokens: past the bundled model's 512
    (tmp_path / "pairs").mkdir()
    pq.write_table(pa.table({"query": queries, "passage": passages}), tmp_path / "pairs" / "part-00000.parquet")
    cfg = config_mod.load(None, ["embed.side=both", "embed.max_length=256", "train.query_max_length=8",
                                 "train.passage_max_length=600"])
    warned: list[str] = []
    keep = logging.Handler()
    keep.emit = lambda record: warned.append(record.getMessage())
    hf = logging.getLogger("transformers")  # its own handler (propagate off): record what reaches it
    hf.addHandler(keep)
    try:
        tokens = mean_tokens(RunDir(str(tmp_path)), cfg)
    finally:
        hf.removeHandler(keep)
    full = load_tokenizer(resolve_model_path(cfg.embed.model))
    q = np.array([len(full(t, verbose=False)["input_ids"]) for t in queries])
    p = np.array([len(full(t, verbose=False)["input_ids"]) for t in passages])
    assert p[0] > 2_000
    assert tokens["embed"] == np.minimum(q, 256).mean() + np.minimum(p, 256).mean()
    assert tokens["train_query"] == np.minimum(q, 8).mean() and tokens["train_passage"] == np.minimum(p, 600).mean()
    assert not [m for m in warned if "indexing errors" in m], warned


def test_mean_tokens_counts_the_students_lengths_with_the_students_tokenizer(tmp_path):
    """A student whose tokenizer splits text otherwise (here letter by letter) than the frozen encoder's: training's
    token counts (its FLOPs) are the student's, embed's the encoder's."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import BertTokenizerFast

    from clusterscale.io.rundir import RunDir
    from clusterscale.modeling.encoder import load_tokenizer, resolve_model_path
    from clusterscale.stages.costs import mean_tokens

    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(tmp_path / "letters")
    queries, passages = ["tokens per query", "another question"], ["a passage about cost models", "short"]
    (tmp_path / "run" / "pairs").mkdir(parents=True)
    pq.write_table(pa.table({"query": queries, "passage": passages}), tmp_path / "run" / "pairs" / "part-0.parquet")
    cfg = config_mod.load(None, ["train.init=scratch", f"train.tokenizer={tmp_path / 'letters'}",
                                 "train.query_max_length=64", "train.passage_max_length=64"])
    tokens = mean_tokens(RunDir(str(tmp_path / "run")), cfg)
    frozen = load_tokenizer(resolve_model_path(cfg.embed.model))

    def mean(tok, texts):
        return np.mean([len(tok(t)["input_ids"]) for t in texts])

    assert tokens["train_query"] == np.mean([len(q.replace(" ", "")) + 2 for q in queries])  # a token per letter
    assert tokens["train_passage"] == mean(BertTokenizerFast.from_pretrained(tmp_path / "letters"), passages)
    assert tokens["embed"] == mean(frozen, passages) < tokens["train_passage"]  # embed.side=passage
