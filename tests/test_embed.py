"""The encoder core without Ray: equality with sentence-transformers, token-budget batching, truncation, bad models."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from clusterscale.stages.embed import EmbeddingError, check_finite
from clusterscale.modeling.encoder import Encoder, EncoderLoadError, check_encoder, token_budget_batches
from tests.conftest import make_pairs


def save_nan_model(tiny_model: str, out: str) -> str:
    """The tiny BERT with one layer's weights set to NaN: a broken checkpoint."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from clusterscale.modeling.encoder import save_sentence_transformers_dir

    model = AutoModel.from_pretrained(tiny_model)
    with torch.no_grad():
        model.encoder.layer[0].output.dense.weight.fill_(float("nan"))
    save_sentence_transformers_dir(model, AutoTokenizer.from_pretrained(tiny_model), out, "mean", 64)
    return out


def mixed_texts(n: int) -> list[str]:
    """Short queries, medium passages and some texts far over a 64-token limit, in mixed order."""
    table = make_pairs(n)
    texts = []
    for i, (q, p) in enumerate(zip(table.column("q").to_pylist(), table.column("p").to_pylist())):
        texts.append(q if i % 3 == 0 else p if i % 3 == 1 else " ".join([p] * 6))
    return texts


@pytest.fixture(scope="module")
def minilm() -> Encoder:
    return Encoder("bundled", max_length=64, device="cpu", threads=2)


@pytest.mark.integration
def test_equals_sentence_transformers_fp32(minilm):
    from sentence_transformers import SentenceTransformer

    from clusterscale.modeling.encoder import resolve_model_path

    texts = mixed_texts(150)
    st = SentenceTransformer(resolve_model_path("bundled"), device="cpu")
    st.max_seq_length = 64
    expected = st.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    got = minilm.encode(texts, batch_size=256, max_tokens_per_batch=1024)
    assert got.dtype == np.float32 and got.shape == expected.shape
    cosine = (got * expected).sum(axis=1)
    assert cosine.min() >= 0.999, np.argsort(cosine)[:5]
    assert minilm.last_truncated.sum() == sum(i % 3 == 2 for i in range(150))  # the long ones only


def test_order_is_restored_and_batching_does_not_change_vectors(minilm):
    texts = mixed_texts(12)
    one_by_one = np.stack([minilm.encode([t])[0] for t in texts])
    batched = minilm.encode(texts, batch_size=7, max_tokens_per_batch=200)
    assert (one_by_one * batched).sum(axis=1).min() >= 0.9999


def test_token_budget_batches_cover_every_row_once_within_budget():
    lengths = np.random.default_rng(0).integers(1, 120, size=500)
    batches = token_budget_batches(lengths, batch_size=64, max_tokens_per_batch=1000)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(500))
    for b in batches:
        assert len(b) <= 64
        assert len(b) == 1 or len(b) * lengths[b].max() <= 1000
    flat = lengths[rows]
    assert (np.diff(flat) <= 0).all()  # longest first: each batch pads only to its own longest text
    assert max(len(b) for b in batches) > len(batches[0])  # short texts go in bigger batches


def test_truncation_keeps_the_closing_token_and_is_counted(tiny_model):
    enc = Encoder(tiny_model, max_length=16, device="cpu")
    tokens = enc.tokenize(["one two", "word " * 50, "x"])
    assert tokens.truncated.tolist() == [False, True, False]
    assert tokens.lengths.tolist()[1] == 16
    assert tokens.row(1)[-1] == enc.tokenizer.sep_token_id
    enc.encode(["word " * 50] * 3 + ["short"])
    assert enc.truncated == 3


def test_nan_vectors_name_the_rows():
    vectors = np.ones((5, 4), dtype=np.float32)
    vectors[[1, 3], 2] = np.nan
    with pytest.raises(EmbeddingError, match=r"2 passage texts \(pair_ids \[11, 13\]\)"):
        check_finite(vectors, np.arange(10, 15), "passage", "m")


def test_broken_checkpoint_gives_nan(tiny_model, tmp_path):
    vectors = Encoder(save_nan_model(tiny_model, str(tmp_path / "nan")), max_length=16, device="cpu").encode(["a b c", "d e"])
    assert np.isnan(vectors).all()


def test_model_folder_without_weights_or_tokenizer(tiny_model, tmp_path):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(EncoderLoadError, match="No safetensors weights"):
        check_encoder(str(no_weights))
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny_model}/{name}", no_tokenizer / name)
    with pytest.raises(EncoderLoadError, match="No usable tokenizer"):
        check_encoder(str(no_tokenizer))
    with pytest.raises(EncoderLoadError, match="does not exist"):
        check_encoder(str(tmp_path / "missing"))


@pytest.mark.gpu
def test_gpu_bf16_matches_cpu_fp32():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    texts = mixed_texts(64)
    cpu = Encoder("bundled", max_length=64, device="cpu").encode(texts)
    gpu = Encoder("bundled", max_length=64, device="cuda").encode(texts)
    assert (cpu * gpu).sum(axis=1).min() >= 0.99  # bf16 autocast
