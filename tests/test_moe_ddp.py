"""MoE under DDP (2 gloo ranks, plain DDP as loop.py sets it up) vs one process, with an idle expert.

Idle experts stay in the graph with a zero contribution (moe.py), so DDP needs no find_unused_parameters
(which breaks when an expert is idle in one of the several forward calls of a step but not in another)."""
from __future__ import annotations

import os

import pytest
import torch

from clusterscale.modeling.encoder import load_model, load_tokenizer
from clusterscale.modeling.student import embed
from clusterscale.modeling.moe import add_moe, moe_aux_loss, moe_layers
from clusterscale.config import TrainConfig
from clusterscale.train.step import contrastive_backward
from tests.conftest import make_pairs
from tests.test_train_grad import _free_port, start_two_ranks

N, AUX_WEIGHT, IDLE_EXPERT = 12, 0.5, 3
CASES = {"plain": 0, "gradcache": 4}


def _texts() -> tuple[list[str], list[str]]:
    table = make_pairs(N, seed=4)
    return table.column("q").to_pylist(), table.column("p").to_pylist()


def _model(path: str) -> torch.nn.Module:
    model = load_model(path).eval()  # no dropout: every rank and the reference see the same network
    add_moe(model, 4, 2)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in moe_layers(model):
            for expert in layer.experts:
                expert.weight.add_(torch.randn_like(expert.weight) * 0.2 * expert.weight.std())
            # expert 3 is never chosen: its parameters get a zero gradient on every rank
            layer.gate.register_forward_hook(lambda m, i, out: out - 1e4 * (torch.arange(4) == IDLE_EXPERT))
    for name, param in model.named_parameters():
        if name.startswith("pooler."):
            param.requires_grad_(False)
    return model


def _settings(chunk: int, aux_weight: float = AUX_WEIGHT) -> TrainConfig:
    return TrainConfig.of(temperature=0.05, query_max_length=16, passage_max_length=32, pooling="mean",
                          grad_cache_chunk=chunk, moe_aux_loss_weight=aux_weight)


def _grads(model) -> torch.Tensor:
    model = model.module if hasattr(model, "module") else model
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                      for p in model.parameters() if p.requires_grad])


def _worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    queries, passages = _texts()
    mine = slice(rank * N // world, (rank + 1) * N // world)
    for case, chunk in CASES.items():
        ddp = DistributedDataParallel(_model(path))
        for _ in range(2):  # a second step: DDP errors here if the idle expert broke the first reduction
            ddp.zero_grad(set_to_none=True)
            contrastive_backward(ddp, load_tokenizer(path), queries[mine], passages[mine], _settings(chunk),
                                 torch.device("cpu"))
        if rank == 0:
            torch.save(_grads(ddp), os.path.join(out_dir, f"{case}.pt"))
    dist.destroy_process_group()


def _reference(path: str) -> tuple[torch.Tensor, bool]:
    """InfoNCE over the whole batch in one process, plus the mean of the ranks' own load-balancing losses."""
    model, tokenizer = _model(path), load_tokenizer(path)
    queries, passages = _texts()
    contrastive_backward(model, tokenizer, queries, passages, _settings(0, aux_weight=0.0), torch.device("cpu"))
    for half in (slice(0, N // 2), slice(N // 2, N)):
        embed(model, tokenizer, queries[half], 16, "mean", "cpu")
        embed(model, tokenizer, passages[half], 32, "mean", "cpu")
        (AUX_WEIGHT / 2 * moe_aux_loss(model)).backward()  # DDP averages the two ranks' gradients
    idle = all(p.grad is None or not p.grad.any() for layer in moe_layers(model)
               for p in layer.experts[IDLE_EXPERT].parameters())
    return _grads(model), idle


@pytest.fixture(scope="module")
def ddp_grads(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-ddp")
    start_two_ranks(_worker, _free_port(), tiny_model, str(out))
    return {case: torch.load(out / f"{case}.pt", weights_only=True) for case in CASES}


@pytest.fixture(scope="module")
def reference(tiny_model):
    return _reference(tiny_model)


@pytest.mark.parametrize("case", list(CASES))
def test_moe_ddp_with_an_idle_expert_equals_one_process(ddp_grads, reference, case):
    grads, idle_is_idle = reference
    assert idle_is_idle  # the case the test is about: some parameters get a zero gradient
    assert float((ddp_grads[case] - grads).norm() / grads.norm()) < 1e-5
