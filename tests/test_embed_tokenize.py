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
    """Four small input files (one pairs/ part each) and a large one: the small ones share units, the large one is
    cut; every pair is embedded once."""
    pairs = make_pairs(240)
    (tmp_path / "data").mkdir()
    for i, (start, rows) in enumerate(((0, 30), (30, 30), (60, 30), (90, 30), (120, 120))):
        pq.write_table(pairs.slice(start, rows), tmp_path / "data" / f"part-{i}.parquet")
    cfg = config_mod.load(None, [f"data.path={tmp_path / 'data'}", "data.query_column=q",
                                 "data.passage_column=p", "data.heldout_fraction=0", f"embed.model={tiny_model}",
                                 "embed.max_length=16", "embed.rows_per_unit=60"])
    run = RunDir(str(tmp_path / "run"))
    run_stage("ingest", cfg, run)
    units = embed.plan_units(run, 60)
    assert [len(embed.unit_pieces(u)) for u in units] == [2, 2, 1, 1]
    tokenizer = TextTokenizer(load_tokenizer(tiny_model), 16)
    pool = embed.actor_pool_size(cfg.embed, STAGES["embed"].resources)
    ds = embed.embed_dataset(run, cfg, units, pool, run, tokenizer)
    results = ds.take_all()
    assert sorted(r["rows"] for r in results) == [60] * 4 and len(run.files("embeddings")) == 4
    operators = re.findall(r"^Operator \d+ (\S+):", ds.stats(), re.MULTILINE)
    assert "MapBatches(TokenizeUnits)" in operators and "MapBatches(EncodeTokens)" in operators, operators  # unfused
    table = pads.dataset(run.files("embeddings"), format="parquet").to_table()
    assert table.column_names == ["pair_id", "query", "passage", "source", "emb", "truncated"]
    expected = Encoder(tiny_model, max_length=16, device="cpu").encode(table.column("passage").to_pylist())
    assert (emb_matrix(table.column("emb")) * expected).sum(axis=1).min() >= 0.999  # fp16 storage
    assert np.asarray(table.column("truncated")).sum() == sum(tokenizer(table.column("passage").to_pylist()).truncated)
    assert sorted(table.column("pair_id").to_pylist()) == sorted(pq.read_table(run.files("pairs")).column("pair_id")
                                                                 .to_pylist())  # each pair once


def test_small_files_share_units_of_at_most_rows_per_unit(tmp_path):
    """plan_units: consecutive whole files smaller than a unit are grouped up to rows_per_unit rows, a larger file is
    cut as before (a unit of one file keeps the plan's old form); every row is in exactly one unit."""
    (tmp_path / "pairs").mkdir()
    sizes = [10] * 7 + [100] + [10] * 3 + [35, 20]
    for i, rows in enumerate(sizes):
        pq.write_table(make_pairs(rows), tmp_path / "pairs" / f"part-{i:05d}-00000-00000.parquet")
    units = embed.plan_units(RunDir(str(tmp_path)), 35)
    assert [embed.unit_rows(u) for u in units] == [30, 30, 10, 35, 35, 30, 30, 35, 20]
    assert [len(embed.unit_pieces(u)) for u in units] == [3, 3, 1, 1, 1, 1, 3, 1, 1]
    assert "inputs" not in units[2] and units[2]["stop"] == 10 and "inputs" in units[0]
    pieces = [piece for u in units for piece in embed.unit_pieces(u)]
    assert sum(stop - start for _, start, stop in pieces) == sum(sizes)
    assert len({u["output"] for u in units}) == len(units)
