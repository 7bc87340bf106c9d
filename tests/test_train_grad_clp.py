"""Mined negatives and the CLP loss in the training step: 2 gloo ranks (DDP) vs one process; GradCache."""
from __future__ import annotations

import os

import pytest
import torch

from clusterscale.train.step import contrastive_backward
from tests.conftest import make_pairs
from tests.test_train_grad import N, _grads, _model, _rel, _settings, _texts, spawn_two_ranks

M = 2  # mined negatives per query


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core box spinning OpenMP
    threads made this file ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _negatives() -> tuple[list[str], list[str | None]]:
    """N*M negatives grouped by query, with their pairs' queries; the planted cases sit in rank 0's
    half only, so the two ranks have different numbers of usable CLP negatives."""
    queries, passages = _texts()
    pool = make_pairs(40, seed=7)
    pool_q, pool_p = pool.column("q").to_pylist(), pool.column("p").to_pylist()
    negatives = [pool_p[j % 40] for j in range(N * M)]
    negative_queries: list[str | None] = [pool_q[j % 40] for j in range(N * M)]
    negatives[1 * M] = passages[1]              # query 1's negative is its own positive: masked
    negative_queries[2 * M + 1] = queries[2]    # from a pair of query 2 itself: masked, skipped by CLP
    negative_queries[4 * M] = None              # unknown query: a negative, skipped by CLP
    negative_queries[5 * M + 1] = None
    negatives[6 * M] = passages[10]             # a positive on the other rank: masked for query 10
    negative_queries[7 * M + 1] = queries[13]   # a pair of query 13 (other rank): masked for query 13
    return negatives, negative_queries


def _step(model, tokenizer, rows: slice, settings) -> tuple[torch.Tensor, dict]:
    queries, passages = _texts()
    negatives, negative_queries = _negatives()
    neg_rows = slice(rows.start * M, rows.stop * M)
    return contrastive_backward(model, tokenizer, queries[rows], passages[rows], settings, torch.device("cpu"),
                                negatives[neg_rows], negative_queries[neg_rows])


def _reference(path: str, settings) -> tuple[float, torch.Tensor, dict]:
    model, tokenizer = _model(path, dropout=False)
    loss, stats = _step(model, tokenizer, slice(0, N), settings)
    return float(loss), _grads(model), stats


CASES = {"negatives": {}, "clp": {"loss": "clp", "clp_lambda": 0.3},
         "clp_gradcache": {"loss": "clp", "clp_lambda": 0.3, "grad_cache_chunk": 3},
         "clp_symmetric_gradcache": {"loss": "clp", "clp_lambda": 0.5, "symmetric": True, "grad_cache_chunk": 5}}


def _ddp_worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    per_rank = N // world
    for case, kw in CASES.items():
        model, tokenizer = _model(path, dropout=False)
        ddp = DistributedDataParallel(model)
        loss, stats = _step(ddp, tokenizer, slice(rank * per_rank, (rank + 1) * per_rank), _settings(**kw))
        totals = torch.stack([loss, stats["clp_penalty"], torch.tensor(float(stats["clp_skipped"]))])
        dist.all_reduce(totals)
        if rank == 0:
            torch.save({"loss": float(totals[0]) / world, "clp_penalty": float(totals[1]) / world,
                        "clp_skipped": int(totals[2]), "grads": _grads(ddp)}, os.path.join(out_dir, f"{case}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tiny_model, tmp_path_factory):
    return spawn_two_ranks(_ddp_worker, tiny_model, tmp_path_factory.mktemp("ddp-clp"), CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_two_gloo_ranks_equal_one_process(ddp_results, tiny_model, case):
    kw = {k: v for k, v in CASES[case].items() if k != "grad_cache_chunk"}
    ref_loss, ref_grads, ref_stats = _reference(tiny_model, _settings(**kw))
    got = ddp_results[case]
    assert abs(got["loss"] - ref_loss) < 1e-5 * abs(ref_loss)
    assert _rel(got["grads"], ref_grads) < 1e-5
    assert abs(got["clp_penalty"] - float(ref_stats["clp_penalty"])) < 1e-5
    assert got["clp_skipped"] == ref_stats["clp_skipped"]


def test_reference_stats_and_that_each_part_moves_the_gradient(tiny_model):
    _, plain, _ = _reference_plain(tiny_model)
    _, mined, stats = _reference(tiny_model, _settings())
    _, clp, clp_stats = _reference(tiny_model, _settings(loss="clp", clp_lambda=0.3))
    assert stats["mined_negatives"] == N * M and stats["clp_skipped"] == 0 and float(stats["clp_penalty"]) == 0
    assert clp_stats["clp_skipped"] == 3  # anchor's own query once, unknown query twice
    # query 1 and 9 (passage 9 = passage 1) see their positive text, query 2 its own query, queries 10 and 13
    # their duplicates on the other rank
    assert int(stats["masked_mined_negatives"]) == 5
    assert 0 < float(clp_stats["clp_penalty"]) < 2
    assert _rel(mined, plain) > 1e-2 and _rel(clp, mined) > 1e-2


def _reference_plain(path: str):
    model, tokenizer = _model(path, dropout=False)
    queries, passages = _texts()
    loss, stats = contrastive_backward(model, tokenizer, queries, passages, _settings(), torch.device("cpu"))
    return float(loss), _grads(model), stats


@pytest.mark.parametrize("chunk", [3, 7])
def test_gradcache_with_negatives_and_clp_equals_uncached(tiny_model, chunk):
    ref_loss, ref_grads, ref_stats = _reference(tiny_model, _settings(loss="clp"))
    loss, grads, stats = _reference(tiny_model, _settings(loss="clp", grad_cache_chunk=chunk))
    assert abs(loss - ref_loss) < 1e-6 * abs(ref_loss)
    assert _rel(grads, ref_grads) < 1e-5
    assert abs(float(stats["clp_penalty"]) - float(ref_stats["clp_penalty"])) < 1e-6


def test_gradcache_replays_dropout_masks_of_negatives(tiny_model):
    """GradCache's second forward of each chunk (queries, passages, negatives, their queries) sees the
    same dropout masks as its first: equal to embedding the chunks with autograd in that order."""
    from clusterscale.train.loss import clp_penalty, clp_usable, info_nce
    from clusterscale.modeling.student import embed, text_keys
    from clusterscale.train.step import negative_query_keys

    queries, passages = _texts()
    negatives, negative_queries = _negatives()
    qk, nqk = text_keys(queries), negative_query_keys(negative_queries, N * M)
    usable = clp_usable(nqk, qk)

    def reference(seed: int) -> torch.Tensor:
        model, tokenizer = _model(tiny_model, dropout=True)
        torch.manual_seed(seed)
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for start in range(0, N, 4):
            neg_rows = range(start * M, (start + 4) * M)
            parts[0].append(embed(model, tokenizer, queries[start:start + 4], 16, "mean", "cpu"))
            parts[1].append(embed(model, tokenizer, passages[start:start + 4], 32, "mean", "cpu"))
            parts[2].append(embed(model, tokenizer, negatives[neg_rows.start:neg_rows.stop], 32, "mean", "cpu"))
            own = [negative_queries[j] or "" for j in neg_rows]  # all of them, usable or not (same forward calls)
            parts[3].append(embed(model, tokenizer, own, 16, "mean", "cpu"))
        q, p, neg, own_q = (torch.cat(x) for x in parts)
        nce, _ = info_nce(q, p, 0.05, qk, text_keys(passages), False, neg, text_keys(negatives), nqk)
        term, _ = clp_penalty(neg[usable], own_q[usable])
        (0.9 * nce + 0.1 * term).backward()
        return _grads(model)

    model, tokenizer = _model(tiny_model, dropout=True)
    torch.manual_seed(11)
    _step(model, tokenizer, slice(0, N), _settings(loss="clp", grad_cache_chunk=4))
    assert _rel(_grads(model), reference(11)) < 1e-5
    assert _rel(reference(12), reference(11)) > 1e-3  # masks matter at this size


def test_bad_negatives_name_the_fix(tiny_model):
    model, tokenizer = _model(tiny_model, dropout=False)
    queries, passages = _texts()
    negatives, negative_queries = _negatives()
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="train.negatives_per_query >= 1 and run `clusterscale mine`"):
        contrastive_backward(model, tokenizer, queries, passages, _settings(loss="clp"), cpu)
    with pytest.raises(ValueError, match="pass M per query"):
        contrastive_backward(model, tokenizer, queries, passages, _settings(), cpu, negatives[:-1])
    with pytest.raises(ValueError, match="needs negative_queries"):
        contrastive_backward(model, tokenizer, queries, passages, _settings(loss="clp"), cpu, negatives)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gradcache_with_clp_on_gpu_in_bf16(tiny_model):
    queries, passages = _texts()
    negatives, negative_queries = _negatives()
    device, grads = torch.device("cuda"), {}
    for chunk in (0, 4):
        model, tokenizer = _model(tiny_model, dropout=False)
        model.to(device)
        settings = _settings(loss="clp", grad_cache_chunk=chunk)
        contrastive_backward(model, tokenizer, queries, passages, settings, device, negatives, negative_queries,
                             amp=True)
        grads[chunk] = _grads(model).float().cpu()
    assert _rel(grads[4], grads[0]) < 2e-2  # bf16 autocast: both paths round differently
