"""Packed (unpadded) encoder batches: the same vectors as padded ones, the packing itself, the fallbacks."""
from __future__ import annotations

import numpy as np
import pytest

from clusterscale.modeling import packing
from clusterscale.modeling.encoder import Encoder, EncoderLoadError
from tests.test_embed import mixed_texts


def test_pack_lays_texts_end_to_end_with_restarting_positions():
    ids = np.arange(100, 112, dtype=np.int32)  # texts: [100..102], [103..106], [107..111]
    offsets = np.array([0, 3, 7, 12])
    out = packing.pack(ids, offsets, np.array([2, 0]), position_offset=2)
    assert out["input_ids"].tolist() == [[107, 108, 109, 110, 111, 100, 101, 102]]
    assert out["position_ids"].tolist() == [[2, 3, 4, 5, 6, 2, 3, 4]]
    assert out["cu"].tolist() == [0, 5, 8] and out["cu"].dtype == np.int32
    assert out["segments"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert out["lengths"].tolist() == [5, 3]


def test_packed_batches_cover_every_row_once_within_the_token_budget():
    lengths = np.random.default_rng(0).integers(1, 120, size=500)
    lengths[7] = 900  # longer than the budget: alone in its pass
    batches = packing.packed_batches(lengths, batch_size=64, max_tokens=1000)
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))
    assert batches[0].tolist() == [7]
    for b in batches:
        assert len(b) <= 64 and (len(b) == 1 or lengths[b].sum() <= 1000)
    # real tokens, not rows x longest: a pass holds more texts than a padded one under the same budget
    assert np.mean([lengths[b].sum() for b in batches[1:-1]]) > 0.85 * 1000 or max(map(len, batches)) == 64


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_packed_vectors_equal_padded_ones(tiny_model, pooling):
    texts = mixed_texts(40)  # short queries, passages and texts cut at max_length, in mixed order
    padded = Encoder(tiny_model, pooling=pooling, max_length=64, device="cpu", packing="padded")
    packed = Encoder(tiny_model, pooling=pooling, max_length=64, device="cpu", packing="packed")
    assert padded.batching == "padded" and packed.batching == "packed (one attention call per text)"
    expected = padded.encode(texts, batch_size=16, max_tokens_per_batch=512)
    got = packed.encode(texts, batch_size=16, max_tokens_per_batch=512)
    assert np.abs(got - expected).max() < 1e-5
    assert packed.last_truncated.tolist() == padded.last_truncated.tolist()
    one_pass = packed.encode(texts, batch_size=1000, max_tokens_per_batch=100_000)  # every text in one row
    assert np.abs(one_pass - expected).max() < 1e-5


def test_auto_pads_on_a_cpu(tiny_model):
    """'auto' packs only on a GPU with a variable-length kernel: one attention call per text is slower on CPUs."""
    assert Encoder(tiny_model, max_length=32, device="cpu").batching == "padded"


def test_a_model_that_does_not_pack_alike_is_padded_or_refused(tiny_model, monkeypatch, capsys):
    """Positions counted from the wrong start (as if the model were RoBERTa-like) change the vectors: the check on
    the model's own weights catches it; 'auto' pads and says why, 'packed' refuses naming the key."""
    kernel = packing.Kernel("test-kernel", None, dropout=True)
    monkeypatch.setattr(packing, "kernel_for", lambda device: kernel)  # as on a GPU with a kernel
    assert Encoder(tiny_model, max_length=32, device="cpu").batching == "packed (test-kernel)"
    monkeypatch.setattr(packing, "position_offset", lambda model: 2)
    assert Encoder(tiny_model, max_length=32, device="cpu").batching == "padded"
    assert "packed passes differ from its padded ones (cosine" in capsys.readouterr().out
    with pytest.raises(EncoderLoadError, match="embed.packing=padded"):
        Encoder(tiny_model, max_length=32, device="cpu", packing="packed")


def test_the_packed_attention_keeps_texts_apart():
    """Each text attends to itself only: the packed attention of two texts equals each one's own attention."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4) for _ in range(3))
    out, _ = packing.packed_attention(None, q, k, v, None, scaling=0.5,
                                      cu_seq_lens_q=torch.tensor([0, 3, 7], dtype=torch.int32), max_length_q=4)
    assert out.shape == (1, 7, 2, 4)
    for start, stop in ((0, 3), (3, 7)):
        alone = F.scaled_dot_product_attention(q[..., start:stop, :], k[..., start:stop, :], v[..., start:stop, :],
                                               scale=0.5)
        assert torch.allclose(out[0, start:stop], alone[0].transpose(0, 1), atol=1e-6)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packing.packed_attention(None, q, k, v, None)


@pytest.mark.parametrize("chunk", [0, 5])
def test_a_packed_training_step_gives_the_padded_gradients(tiny_model, chunk):
    """train.packing=packed: the student's loss and gradients equal the padded step's (with GradCache too), and the
    step counts the texts' own tokens, not the padding."""
    import torch

    from clusterscale.modeling.student import choose_packing
    from clusterscale.train.step import contrastive_backward
    from tests.test_train_grad import _grads, _model, _rel, _settings, _texts

    queries, passages = _texts()
    results = {}
    for mode in ("padded", "packed"):
        model, tokenizer = _model(tiny_model, dropout=False)
        batching = choose_packing(model, tokenizer, "mean", mode, 32, "cpu")
        assert batching == ("padded" if mode == "padded" else "packed (one attention call per text)")
        loss, stats = contrastive_backward(model, tokenizer, queries, passages, _settings(grad_cache_chunk=chunk),
                                           torch.device("cpu"))
        results[mode] = float(loss), _grads(model), stats["tokens"]
    (ref_loss, ref_grads, padded_tokens), (loss, grads, packed_tokens) = results["padded"], results["packed"]
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss) and _rel(grads, ref_grads) < 1e-4
    cut = [len(ids) for ids in tokenizer(queries, truncation=True, max_length=16)["input_ids"]] + \
          [len(ids) for ids in tokenizer(passages, truncation=True, max_length=32)["input_ids"]]
    assert packed_tokens == sum(cut) < padded_tokens  # (GradCache's second forward is in flops_per_param_token)


def test_auto_packs_the_student_on_a_cpu_and_pads_on_a_gpu_without_a_kernel(tiny_model, monkeypatch):
    """A training batch is not sorted by length: 'auto' packs it on CPUs (one attention call per text); on a GPU
    without a variable-length kernel it pads. The check leaves the student in the mode it was in."""
    import torch

    from clusterscale.modeling import packing
    from clusterscale.modeling.student import choose_packing
    from tests.test_train_grad import _model

    model, tokenizer = _model(tiny_model, dropout=True)
    assert choose_packing(model, tokenizer, "mean", "auto", 32, "cpu") == "packed (one attention call per text)"
    assert packing.is_packed(model) and model.training
    model, tokenizer = _model(tiny_model, dropout=True)
    assert choose_packing(model, tokenizer, "mean", "padded", 32, "cpu") == "padded" and not packing.is_packed(model)
    monkeypatch.setattr(packing, "kernel_for", lambda device: None)  # as on a GPU without a kernel
    assert packing.choose(model, "auto", torch.device("cuda"), None, None, "train.packing", auto_on_cpu=True) == "padded"


def test_packed_attention_applies_the_models_attention_dropout():
    """In train mode BERT hands its attention dropout to the attention function: the packed one applies it (the
    same masks as one SDPA call per text under the same seed), and none in eval (dropout 0)."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 2, 7, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    plain, _ = packing.packed_attention(None, q, k, v, None, cu_seq_lens_q=cu, max_length_q=4)
    torch.manual_seed(5)
    dropped, _ = packing.packed_attention(None, q, k, v, None, dropout=0.5, cu_seq_lens_q=cu, max_length_q=4)
    assert not torch.allclose(dropped, plain)
    torch.manual_seed(5)
    for start, stop in ((0, 3), (3, 7)):
        alone = F.scaled_dot_product_attention(*(t[..., start:stop, :] for t in (q, k, v)), dropout_p=0.5)
        assert torch.allclose(dropped[0, start:stop], alone[0].transpose(0, 1), atol=1e-6)


def test_gradcache_replays_the_dropout_of_packed_passes(tiny_model):
    """With dropout on, a packed GradCache step equals packed chunks forwarded with autograd under the same seed."""
    import torch

    from clusterscale.modeling.student import choose_packing
    from clusterscale.train.step import contrastive_backward
    from tests import test_train_grad as grad

    def packed_model(path, dropout):
        model, tokenizer = unpacked(path, dropout)
        assert choose_packing(model, tokenizer, "mean", "packed", 32, "cpu").startswith("packed")
        return model, tokenizer
    unpacked = grad._model
    try:
        grad._model = packed_model
        reference = grad._chunked_with_grad(tiny_model, 4, seed=11)
        model, tokenizer = grad._model(tiny_model, dropout=True)
        queries, passages = grad._texts()
        torch.manual_seed(11)
        contrastive_backward(model, tokenizer, queries, passages, grad._settings(grad_cache_chunk=4),
                             torch.device("cpu"))
        assert grad._rel(grad._grads(model), reference) < 1e-5
        assert grad._rel(grad._chunked_with_grad(tiny_model, 4, seed=12), reference) > 1e-3  # masks matter
    finally:
        grad._model = unpacked


def test_a_kernel_without_dropout_does_not_pack_a_student_that_trains_with_it(tiny_model, monkeypatch, capsys):
    """torch's varlen_attn has no attention dropout: a student in train mode with dropout stays padded under 'auto'
    and is refused under 'packed'; a failure of the padded pass is raised, not taken for a packing mismatch."""
    import torch

    from clusterscale.modeling.student import choose_packing
    from tests.test_train_grad import _model

    monkeypatch.setattr(packing, "kernel_for", lambda device: packing.Kernel("torch-varlen", None, dropout=False))
    model, tokenizer = _model(tiny_model, dropout=True)
    assert choose_packing(model, tokenizer, "mean", "auto", 32, "cpu") == "padded" and not packing.is_packed(model)
    assert "torch-varlen has no attention dropout" in capsys.readouterr().out
    with pytest.raises(packing.PackingError, match="train.packing=padded"):
        choose_packing(model, tokenizer, "mean", "packed", 32, "cpu")
    model.eval()  # no dropout: the same kernel packs it
    assert choose_packing(model, tokenizer, "mean", "auto", 32, "cpu") == "packed (torch-varlen)"

    def broken() -> torch.Tensor:
        raise MemoryError("the padded pass failed")
    with pytest.raises(MemoryError):
        packing.choose(model, "auto", torch.device("cpu"), lambda: torch.ones(1, 2), broken, "train.packing",
                       auto_on_cpu=True)
