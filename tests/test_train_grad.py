"""Gradient correctness of the training step: 2 gloo ranks (DDP) vs one process; GradCache vs no cache."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from clusterscale.config import TrainConfig
from clusterscale.train.step import contrastive_backward
from tests.conftest import make_pairs

N = 16  # global batch


def _texts():
    table = make_pairs(N, seed=3)
    queries, passages = table.column("q").to_pylist(), table.column("p").to_pylist()
    passages[9] = passages[1]  # duplicates across the two ranks' halves: masked false negatives
    queries[12] = queries[3]
    return queries, passages


def _model(path: str, dropout: bool):
    from clusterscale.modeling.encoder import load_model, load_tokenizer

    model, tokenizer = load_model(path), load_tokenizer(path)
    model.train(dropout)  # train(False) = no dropout, so ranks and the reference see the same network
    for name, param in model.named_parameters():
        if name.startswith("pooler."):
            param.requires_grad_(False)
    return model, tokenizer


def _settings(**kw) -> TrainConfig:
    """The train section of these tests (the keys as in YAML; not validated, like a step's inputs)."""
    return TrainConfig.of(temperature=0.05, query_max_length=16, passage_max_length=32, pooling="mean", **kw)


def _grads(model) -> torch.Tensor:
    model = model.module if hasattr(model, "module") else model
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def _reference(path: str, settings: TrainConfig) -> tuple[float, torch.Tensor]:
    model, tokenizer = _model(path, dropout=False)
    queries, passages = _texts()
    loss, _ = contrastive_backward(model, tokenizer, queries, passages, settings, torch.device("cpu"))
    return float(loss), _grads(model)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


CASES = {"plain": {}, "symmetric": {"symmetric": True}, "gradcache": {"grad_cache_chunk": 3},
         "gradcache_symmetric": {"grad_cache_chunk": 5, "symmetric": True}}


def _ddp_worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    queries, passages = _texts()
    per_rank = N // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for case, kw in CASES.items():
        model, tokenizer = _model(path, dropout=False)
        ddp = DistributedDataParallel(model)
        loss, _ = contrastive_backward(ddp, tokenizer, queries[mine], passages[mine], _settings(**kw),
                                       torch.device("cpu"))
        losses = torch.stack([loss])
        dist.all_reduce(losses)
        if rank == 0:
            torch.save({"loss": float(losses[0]) / world, "grads": _grads(ddp)}, os.path.join(out_dir, f"{case}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The gloo ranks of this module, test_train_grad_clp, test_train_metrics and test_moe_ddp start from one forkserver
# that has imported torch, transformers' BERT and these modules once: each rank is a fork of it (a spawned rank would
# import them again, ~5 CPU-seconds each, 8 ranks in all). The forkserver runs no torch op before forking (no
# threads to fork).
FORKSERVER_PRELOAD = ["torch", "transformers.models.bert.modeling_bert", "tests.test_train_grad",
                      "tests.test_train_grad_clp", "tests.test_train_metrics", "tests.test_moe_ddp"]


def start_two_ranks(worker, *args) -> None:
    """worker(rank, 2, *args) on two processes forked from the preloaded forkserver; raises if a rank fails."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the forkserver starts (first call)
    mp.start_processes(worker, args=(2, *args), nprocs=2, join=True, start_method="forkserver")


def spawn_two_ranks(worker, path: str, out, cases) -> dict:
    """Run worker(rank, 2, port, path, out) on a 2-rank gloo group; load the {case}.pt files rank 0 saved."""
    start_two_ranks(worker, _free_port(), path, str(out))
    return {case: torch.load(out / f"{case}.pt", weights_only=True) for case in cases}


@pytest.fixture(scope="module")
def ddp_results(tiny_model, tmp_path_factory):
    return spawn_two_ranks(_ddp_worker, tiny_model, tmp_path_factory.mktemp("ddp"), CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_two_gloo_ranks_equal_one_process(ddp_results, tiny_model, case):
    symmetric = CASES[case].get("symmetric", False)
    ref_loss, ref_grads = _reference(tiny_model, _settings(symmetric=symmetric))
    got = ddp_results[case]
    assert abs(got["loss"] - ref_loss) < 1e-5 * abs(ref_loss)
    assert _rel(got["grads"], ref_grads) < 1e-5


def test_detached_gather_would_be_caught(tiny_model, ddp_results):
    """The tolerance is meaningful: half a batch (no cross-rank negatives) is far outside it."""
    ref_loss, ref_grads = _reference(tiny_model, _settings())
    model, tokenizer = _model(tiny_model, dropout=False)
    queries, passages = _texts()
    contrastive_backward(model, tokenizer, queries[:8], passages[:8], _settings(), torch.device("cpu"))
    assert _rel(_grads(model), ref_grads) > 1e-2


@pytest.mark.parametrize("chunk", [3, 7])
def test_gradcache_equals_uncached_step(tiny_model, chunk):
    ref_loss, ref_grads = _reference(tiny_model, _settings())
    loss, grads = _reference(tiny_model, _settings(grad_cache_chunk=chunk))
    assert abs(loss - ref_loss) < 1e-6 * abs(ref_loss)
    assert _rel(grads, ref_grads) < 1e-5


def _chunked_with_grad(path: str, chunk: int, seed: int) -> torch.Tensor:
    """Reference for dropout: forward each chunk with autograd (same RNG order as GradCache's first pass)."""
    from clusterscale.train.loss import info_nce
    from clusterscale.modeling.student import embed, text_keys

    model, tokenizer = _model(path, dropout=True)
    queries, passages = _texts()
    torch.manual_seed(seed)
    qs, ps = [], []
    for start in range(0, N, chunk):
        rows = slice(start, start + chunk)
        qs.append(embed(model, tokenizer, queries[rows], 16, "mean", "cpu"))
        ps.append(embed(model, tokenizer, passages[rows], 32, "mean", "cpu"))
    loss, _ = info_nce(torch.cat(qs), torch.cat(ps), 0.05, text_keys(queries), text_keys(passages))
    loss.backward()
    return _grads(model)


def test_gradcache_replays_dropout_masks(tiny_model):
    reference = _chunked_with_grad(tiny_model, 4, seed=11)
    model, tokenizer = _model(tiny_model, dropout=True)
    queries, passages = _texts()
    torch.manual_seed(11)
    contrastive_backward(model, tokenizer, queries, passages, _settings(grad_cache_chunk=4), torch.device("cpu"))
    assert _rel(_grads(model), reference) < 1e-5
    assert _rel(_chunked_with_grad(tiny_model, 4, seed=12), reference) > 1e-3  # masks matter at this size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gradcache_on_gpu_in_bf16(tiny_model):
    device = torch.device("cuda")
    grads = {}
    for chunk in (0, 4):
        model, tokenizer = _model(tiny_model, dropout=False)
        model.to(device)
        queries, passages = _texts()
        contrastive_backward(model, tokenizer, queries, passages, _settings(grad_cache_chunk=chunk), device,
                             amp=True)
        grads[chunk] = _grads(model).float().cpu()
    assert _rel(grads[4], grads[0]) < 2e-2  # bf16 autocast: both paths round differently
