"""The embed stage's tokenise step: torch-free, equal to the transformers tokenizer, and a Ray Data operator of
its own whose output the encoder actors turn into the same vectors as the encoder core."""
from __future__ import annotations

import pickle
import re
import subprocess
import sys

import numpy as np
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from clusterscale import config as config_mod
from clusterscale.io.rundir import RunDir
from clusterscale.modeling.encoder import Encoder, load_tokenizer
from clusterscale.modeling.tokens import TextTokenizer, Tokens
from clusterscale.pipeline import STAGES, run_stage
from clusterscale.runtime.vectors import emb_matrix
from clusterscale.stages import embed
from tests.conftest import make_pairs
from tests.test_embed import mixed_texts


def test_token_ids_equal_the_transformers_tokenizer_cut_at_max_length(tiny_model):
    hf = load_tokenizer(tiny_model)
    texts = mixed_texts(60) + ["", "Ünïcode — text", "x " * 40]
    tokens = pickle.loads(pickle.dumps(TextTokenizer(hf, 24)))(texts)
    for i, ids in enumerate(hf(texts, truncation=False)["input_ids"]):
        expected = ids if len(ids) <= 24 else ids[:23] + ids[-1:]
        assert tokens.row(i).tolist() == expected and tokens.truncated[i] == (len(ids) > 24)
    back = Tokens.from_arrow(tokens.to_arrow().slice(3), tokens.truncated[3:])  # an Arrow slice keeps offsets
    assert back.row(0).tolist() == tokens.row(3).tolist() and len(back) == len(texts) - 3


def test_an_unpickled_tokenizer_needs_neither_torch_nor_transformers(tiny_model, tmp_path):
    (tmp_path / "tok.pkl").write_bytes(pickle.dumps(TextTokenizer(load_tokenizer(tiny_model), 16)))
    script = ("import sys, pickle; sys.modules['torch'] = sys.modules['transformers'] = None; "
              f"t = pickle.load(open({str(tmp_path / 'tok.pkl')!r}, 'rb')); print(t(['one two three']).lengths[0])")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5"  # [CLS] one two three [SEP]


def test_tokenise_is_its_own_ray_data_operator_and_vectors_equal_the_core(ray_local, tiny_model, tmp_path):
    pq.write_table(make_pairs(240), tmp_path / "pairs.parquet")
    cfg = config_mod.load(None, [f"data.path={tmp_path / 'pairs.parquet'}", "data.query_column=q",
                                 "data.passage_column=p", "data.heldout_fraction=0", f"embed.model={tiny_model}",
                                 "embed.max_length=16", "embed.rows_per_unit=60"])
    run = RunDir(str(tmp_path / "run"))
    run_stage("ingest", cfg, run)
    units = embed.plan_units(run, 60)
    tokenizer = TextTokenizer(load_tokenizer(tiny_model), 16)
    pool = embed.actor_pool_size(cfg.embed, STAGES["embed"].resources)
    ds = embed.embed_dataset(run, cfg, units, pool, run, tokenizer)
    results = ds.take_all()
    assert sorted(r["rows"] for r in results) == [60] * 4
    operators = re.findall(r"^Operator \d+ (\S+):", ds.stats(), re.MULTILINE)
    assert "MapBatches(TokenizeUnits)" in operators and "MapBatches(EncodeTokens)" in operators, operators  # unfused
    table = pads.dataset(run.files("embeddings"), format="parquet").to_table()
    assert table.column_names == ["pair_id", "query", "passage", "source", "emb", "truncated"]
    expected = Encoder(tiny_model, max_length=16, device="cpu").encode(table.column("passage").to_pylist())
    assert (emb_matrix(table.column("emb")) * expected).sum(axis=1).min() >= 0.999  # fp16 storage
    assert np.asarray(table.column("truncated")).sum() == sum(tokenizer(table.column("passage").to_pylist()).truncated)
