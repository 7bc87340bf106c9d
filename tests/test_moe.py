"""The MoE adapter (train.moe_*): equivalence at init, gate gradients, the load-balancing loss, GradCache, export."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from clusterscale.config import ConfigError, TrainConfig, from_dict
from clusterscale.modeling.encoder import load_model, load_tokenizer, save_sentence_transformers_dir
from clusterscale.modeling.moe import MoeLinear, add_moe, freeze_all_but_intermediate, moe_aux_loss, moe_layers
from clusterscale.train.step import contrastive_backward
from tests.conftest import make_pairs


def _batch(tokenizer, n: int = 6):
    table = make_pairs(n, seed=5)
    return tokenizer(table.column("p").to_pylist(), padding=True, truncation=True, max_length=24,
                     return_tensors="pt")


def _perturb_experts(model: torch.nn.Module, scale: float = 0.2) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in moe_layers(model):
            for expert in layer.experts:
                expert.weight.add_(torch.randn_like(expert.weight) * scale * expert.weight.std())


def _moe_model(path: str, experts: int = 4, top_k: int = 2, perturb: bool = True):
    model = load_model(path).eval()  # eval: no dropout, so two runs see the same network
    assert add_moe(model, experts, top_k) == 2
    if perturb:
        _perturb_experts(model)
    return model


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_identical_experts_reproduce_the_dense_model(tiny_model, top_k):
    tokenizer = load_tokenizer(tiny_model)
    batch = _batch(tokenizer)
    assert (batch["attention_mask"] == 0).any()  # padding present
    dense = load_model(tiny_model).eval()
    moe = _moe_model(tiny_model, 4, top_k, perturb=False)
    with torch.no_grad():
        expected = dense(**batch).last_hidden_state
        got = moe(**batch).last_hidden_state
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    # the gates do route tokens to different experts (otherwise the check above would be trivial)
    used = {int(e) for layer in moe_layers(moe) for e in layer.records[-1][0].nonzero()}
    assert len(used) > 1


def _gate_grad_norm(model) -> float:
    return float(sum(layer.gate.weight.grad.norm() for layer in moe_layers(model)))


@pytest.mark.parametrize("top_k", [1, 2])
def test_gate_gets_gradient_from_the_task_loss(tiny_model, top_k):
    tokenizer = load_tokenizer(tiny_model)
    model = _moe_model(tiny_model, 4, top_k)
    hidden = model(**_batch(tokenizer)).last_hidden_state
    torch.manual_seed(2)
    (hidden * torch.randn_like(hidden)).sum().backward()  # no aux loss in this graph
    assert _gate_grad_norm(model) > 1e-3


def test_gate_gets_gradient_from_the_aux_loss_alone(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    model = _moe_model(tiny_model, 4, 2, perturb=False)  # identical experts: task loss gives the gate nothing
    model(**_batch(tokenizer))
    aux = moe_aux_loss(model)
    aux.backward()
    assert _gate_grad_norm(model) > 1e-6
    assert moe_aux_loss(model) is None  # read and cleared


def test_aux_loss_equals_hand_computation():
    torch.manual_seed(0)
    layer = MoeLinear(torch.nn.Linear(2, 3), num_experts=3, top_k=2)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
    x = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [-1.0, -2.0], [5.0, 5.0]]])  # (batch 1, 4 tokens, 2)
    layer.token_mask = torch.tensor([[1, 1, 1, 0]])  # the last token is padding: not counted
    layer(x)
    logits = [[2.0, 0.0, -2.0], [0.0, 2.0, -2.0], [-1.0, -2.0, 3.0]]  # gate . x of the real tokens, by hand
    probs = torch.tensor(logits).softmax(dim=-1)
    # top-2 per real token: token 0 -> experts 0, 1; token 1 -> 1, 0; token 2 -> 2, 0
    f = torch.tensor([3.0, 2.0, 1.0]) / 6
    expected = 3 * float(f @ probs.mean(0))
    assert float(moe_aux_loss(layer).detach()) == pytest.approx(expected, rel=1e-6)


def test_routing_records_skip_inference_and_stay_bounded():
    from clusterscale.modeling.moe import MAX_RECORDS

    layer = MoeLinear(torch.nn.Linear(4, 4), num_experts=2, top_k=1).eval()
    x = torch.randn(3, 4)
    with torch.inference_mode():
        layer(x)
    assert not layer.records  # Encoder / sentence-transformers inference keeps nothing
    with torch.no_grad():  # GradCache's first pass needs them
        for _ in range(MAX_RECORDS + 3):
            layer(x)
    assert len(layer.records) == MAX_RECORDS


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                      for p in model.parameters() if p.requires_grad])


@functools.lru_cache(maxsize=None)
def _step(path: str, chunk: int, aux_weight: float) -> tuple[float, float, torch.Tensor]:
    model, tokenizer = _moe_model(path), load_tokenizer(path)
    for name, param in model.named_parameters():
        if name.startswith("pooler."):
            param.requires_grad_(False)
    table = make_pairs(12, seed=3)
    settings = TrainConfig.of(temperature=0.05, query_max_length=16, passage_max_length=32, pooling="mean",
                              grad_cache_chunk=chunk, moe_aux_loss_weight=aux_weight)
    loss, stats = contrastive_backward(model, tokenizer, table.column("q").to_pylist(), table.column("p").to_pylist(),
                                       settings, torch.device("cpu"))
    assert all(not layer.records for layer in moe_layers(model))  # nothing left over for the next step
    return float(loss), stats["moe_aux_loss"], _grads(model)


@pytest.mark.parametrize("chunk", [5, 4])
def test_gradcache_with_moe_equals_the_uncached_step(tiny_model, chunk):
    loss, aux, grads = _step(tiny_model, 0, aux_weight=0.5)
    loss_gc, aux_gc, grads_gc = _step(tiny_model, chunk, aux_weight=0.5)
    assert loss_gc == pytest.approx(loss, rel=1e-6)
    assert aux_gc == pytest.approx(aux, rel=1e-5)
    assert float((grads_gc - grads).norm() / grads.norm()) < 1e-5
    _, _, grads_no_aux = _step(tiny_model, 0, aux_weight=0.0)
    assert float((grads_no_aux - grads).norm() / grads.norm()) > 1e-4  # the aux term is in the gradient


def test_export_round_trip_gives_identical_embeddings(tiny_model, tmp_path):
    from transformers import AutoModel

    from clusterscale.modeling.encoder import Encoder

    tokenizer = load_tokenizer(tiny_model)
    model = _moe_model(tiny_model, 3, 2)
    out = tmp_path / "export"
    save_sentence_transformers_dir(model, tokenizer, str(out), pooling="mean", max_length=64)
    shape = json.loads((out / "config.json").read_text())["clusterscale_moe"]
    assert (shape["experts"], shape["top_k"], shape["base_model_type"]) == (3, 2, "bert")
    texts = make_pairs(5, seed=9).column("p").to_pylist()
    reference = Encoder(tiny_model, device="cpu")
    reference.model = model  # the in-memory MoE model, same tokenizer and pooling
    expected = reference.encode(texts)
    loaded = Encoder(str(out), device="cpu")
    assert isinstance(loaded.model.encoder.layer[0].intermediate.dense, MoeLinear)
    assert (loaded.encode(texts) == expected).all()
    with pytest.raises(Exception):  # plain transformers must not load random intermediate weights
        AutoModel.from_pretrained(str(out))
    remote = AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()
    batch = _batch(tokenizer)
    with torch.no_grad():
        assert torch.equal(remote(**batch).last_hidden_state, model(**batch).last_hidden_state)
    sentence_transformers = pytest.importorskip("sentence_transformers")
    st = sentence_transformers.SentenceTransformer(str(out), trust_remote_code=True, device="cpu")
    assert abs(st.encode(texts) - expected).max() < 1e-6


def test_train_only_intermediate_and_build_student(tiny_model, tmp_path):
    from clusterscale.modeling.student import build_student

    model, _, _ = build_student(TrainConfig.of(init=tiny_model, moe_experts=3, moe_top_k=1,
                                            moe_train_only_intermediate=True))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".intermediate.dense.experts." in n or ".intermediate.dense.gate." in n
                             for n in trainable)
    assert len(trainable) == 2 * (3 * 2 + 1)  # 2 layers x (3 experts x (weight, bias) + gate)
    dense, _, _ = build_student(TrainConfig.of(init=tiny_model, moe_train_only_intermediate=True))
    assert {n for n, p in dense.named_parameters() if p.requires_grad} == {
        f"encoder.layer.{i}.intermediate.dense.{w}" for i in (0, 1) for w in ("weight", "bias")}
    # an MoE export as init keeps its experts; a different expert count is an error naming the key
    save_sentence_transformers_dir(model, load_tokenizer(tiny_model), str(tmp_path / "m"), "mean", 64)
    again, _, _ = build_student(TrainConfig.of(init=str(tmp_path / "m"), moe_experts=3, moe_top_k=1))
    assert len(moe_layers(again)) == 2
    with pytest.raises(ValueError, match="train.moe_experts"):
        build_student(TrainConfig.of(init=str(tmp_path / "m"), moe_experts=4))


def test_matmul_params_count_the_experts_a_token_uses(tiny_model):
    from clusterscale.modeling.student import matmul_params

    dense = matmul_params(load_model(tiny_model))
    moe = _moe_model(tiny_model, 4, 2, perturb=False)
    per_layer = 32 * 64 + 64  # one intermediate Linear
    assert matmul_params(moe) == dense + 2 * (per_layer + 32 * 4)  # 2 of 4 experts run, plus the gate


def test_add_moe_names_a_model_without_intermediate_layers():
    with pytest.raises(ValueError, match="Sequential"):
        add_moe(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2, 1)
    with pytest.raises(ValueError, match="top_k"):
        MoeLinear(torch.nn.Linear(2, 2), 2, 3)


@pytest.mark.parametrize("values, key", [({"moe_experts": 1}, "train.moe_experts"),
                                         ({"moe_experts": -2}, "train.moe_experts"),
                                         ({"moe_experts": 2, "moe_top_k": 3}, "train.moe_top_k"),
                                         ({"moe_experts": 4, "moe_top_k": 0}, "train.moe_top_k"),
                                         ({"moe_aux_loss_weight": -0.1}, "train.moe_aux_loss_weight")])
def test_config_errors_name_the_key(values, key):
    with pytest.raises(ConfigError, match=key):
        from_dict({"train": values})
    assert from_dict({"train": {"moe_experts": 4, "moe_top_k": 4}}).train.moe.moe_top_k == 4


def test_freeze_without_intermediate_layers_is_an_error():
    with pytest.raises(ValueError, match="intermediate"):
        freeze_all_but_intermediate(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_on_gpu_in_bf16(tiny_model):
    device = torch.device("cuda")
    tokenizer = load_tokenizer(tiny_model)
    batch = _batch(tokenizer).to(device)
    dense = load_model(tiny_model).eval().to(device)
    moe = _moe_model(tiny_model, 4, 2, perturb=False).to(device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected, got = dense(**batch).last_hidden_state, moe(**batch).last_hidden_state
    assert got.dtype == expected.dtype
    assert torch.allclose(got.float(), expected.float(), atol=5e-2)  # bf16 rounding
    grads = {}
    for chunk in (0, 4):
        model = _moe_model(tiny_model).to(device)
        table = make_pairs(12, seed=3)
        settings = TrainConfig.of(temperature=0.05, query_max_length=16, passage_max_length=32, pooling="mean",
                                  grad_cache_chunk=chunk, moe_aux_loss_weight=0.5)
        contrastive_backward(model, tokenizer, table.column("q").to_pylist(), table.column("p").to_pylist(),
                             settings, device, amp=True)
        grads[chunk] = _grads(model).float().cpu()
    assert torch.isfinite(grads[0]).all()
    assert float((grads[4] - grads[0]).norm() / grads[0].norm()) < 5e-2  # bf16 autocast in both paths
