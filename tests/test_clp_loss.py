"""Mined negatives in InfoNCE and the CLP penalty against naive per-query implementations (pure torch)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clusterscale import config
from clusterscale.config import ConfigError
from clusterscale.train.loss import NO_QUERY_KEY, clp_penalty, clp_usable, info_nce

B, M, D, TAU = 6, 2, 8, 0.05


def _unit(g: torch.Generator, n: int) -> torch.Tensor:
    return F.normalize(torch.randn(n, D, generator=g, dtype=torch.float64), dim=-1)


def _batch(seed: int = 0):
    """Queries, positives and M mined negatives per query, with every masking case present."""
    g = torch.Generator().manual_seed(seed)
    q, p, neg, own = _unit(g, B), _unit(g, B), _unit(g, B * M), _unit(g, B * M)
    qkeys, pkeys = torch.arange(B), torch.arange(100, 100 + B)
    neg_pkeys, neg_qkeys = torch.arange(200, 200 + B * M), torch.arange(300, 300 + B * M)
    neg_pkeys[2] = pkeys[1]       # query 1's own negative is its positive passage
    neg_qkeys[7] = qkeys[3]       # query 3's negative comes from a pair with query 3: a positive
    neg_qkeys[0] = qkeys[4]       # query 0's negative belongs to query 4: masked for query 4 only
    neg_pkeys[9] = pkeys[5]       # query 4's negative is query 5's positive passage
    neg_qkeys[5] = NO_QUERY_KEY   # no known query: kept as a negative, skipped by CLP
    return q, p, neg, own, qkeys, pkeys, neg_pkeys, neg_qkeys


def naive_info_nce(q, p, neg, qkeys, pkeys, neg_pkeys, neg_qkeys, tau=TAU, symmetric=False):
    """One query at a time, in torch ops (so autograd gives the naive gradient too)."""
    cands = [(p[j], pkeys[j], qkeys[j]) for j in range(len(p))]
    cands += [(neg[j], neg_pkeys[j], neg_qkeys[j]) for j in range(len(neg))]
    total = 0.0
    for i in range(len(q)):
        logits = [q[i] @ p[i] / tau]
        logits += [q[i] @ e / tau for j, (e, pk, qk) in enumerate(cands)
                   if j != i and pk != pkeys[i] and qk != qkeys[i]]
        total = total - (logits[0] - torch.logsumexp(torch.stack(logits), 0))
    loss = total / len(q)
    if symmetric:  # passage -> query over the positives only
        back = 0.0
        for i in range(len(p)):
            logits = [p[i] @ q[i] / tau] + [p[i] @ q[j] / tau for j in range(len(q))
                                             if j != i and pkeys[j] != pkeys[i] and qkeys[j] != qkeys[i]]
            back = back - (logits[0] - torch.logsumexp(torch.stack(logits), 0))
        loss = (loss + back / len(p)) / 2
    return loss


def naive_clp(q, p, neg, own, qkeys, pkeys, neg_pkeys, neg_qkeys, lam, symmetric=False):
    nce = naive_info_nce(q, p, neg, qkeys, pkeys, neg_pkeys, neg_qkeys, symmetric=symmetric)
    m = len(neg) // len(q)
    gaps = [1 - F.cosine_similarity(neg[j], own[j], dim=0) for j in range(len(neg))
            if neg_qkeys[j] != NO_QUERY_KEY and neg_qkeys[j] != qkeys[j // m]]
    return (1 - lam) * nce + lam * torch.stack(gaps).mean(), len(neg) - len(gaps)


def _clp(q, p, neg, own, qkeys, pkeys, neg_pkeys, neg_qkeys, lam, symmetric=False):
    nce, stats = info_nce(q, p, TAU, qkeys, pkeys, symmetric, neg, neg_pkeys, neg_qkeys)
    usable = clp_usable(neg_qkeys, qkeys)
    term, clp_stats = clp_penalty(neg[usable], own[usable])
    return (1 - lam) * nce + lam * term, {**stats, **clp_stats}


@pytest.mark.parametrize("symmetric", [False, True])
def test_info_nce_with_negatives_matches_naive(symmetric):
    q, p, neg, _, qkeys, pkeys, neg_pkeys, neg_qkeys = _batch()
    tensors = [t.clone().requires_grad_(True) for t in (q, p, neg)]
    loss, stats = info_nce(*tensors[:2], TAU, qkeys, pkeys, symmetric, tensors[2], neg_pkeys, neg_qkeys)
    loss.backward()
    naive_tensors = [t.clone().requires_grad_(True) for t in (q, p, neg)]
    naive = naive_info_nce(*naive_tensors, qkeys, pkeys, neg_pkeys, neg_qkeys, symmetric=symmetric)
    naive.backward()
    assert abs(float(loss.detach()) - float(naive.detach())) < 1e-12
    for got, want in zip(tensors, naive_tensors):
        assert float((got.grad - want.grad).abs().max()) < 1e-12
    # masked mined candidates: 2 (query 1), 7 (query 3), 0 (query 4), 9 (query 5)
    assert int(stats["masked_mined_negatives"]) == 4


def test_masking_of_mined_negatives_matters():
    """Each planted duplicate changes the loss when left unmasked (so the test above can fail)."""
    q, p, neg, _, qkeys, pkeys, neg_pkeys, neg_qkeys = _batch()
    masked, _ = info_nce(q, p, 1.0, qkeys, pkeys, False, neg, neg_pkeys, neg_qkeys)  # tau 1: every logit counts
    for j, field in ((2, "p"), (7, "q"), (0, "q"), (9, "p")):
        pk, qk = neg_pkeys.clone(), neg_qkeys.clone()
        (pk if field == "p" else qk)[j] = 999_999
        unmasked, _ = info_nce(q, p, 1.0, qkeys, pkeys, False, neg, pk, qk)
        assert abs(float(unmasked) - float(masked)) > 1e-3, j


def test_negative_stats():
    q, p, neg, _, qkeys, pkeys, neg_pkeys, neg_qkeys = _batch()
    _, plain = info_nce(q, p, TAU, qkeys, pkeys)
    _, stats = info_nce(q, p, TAU, qkeys, pkeys, False, neg, neg_pkeys, neg_qkeys)
    for key in plain:  # in-batch figures stay comparable with runs without mined negatives
        assert abs(float(plain[key]) - float(stats[key])) < 1e-12, key
    own = [float(q[j // M] @ neg[j]) for j in range(B * M) if j not in (2, 7)]  # 2 and 7 are masked for their own query
    assert abs(float(stats["mined_neg_cos_mean"]) - sum(own) / len(own)) < 1e-12


def test_none_negatives_is_the_plain_loss():
    q, p, _, _, qkeys, pkeys, _, _ = _batch()
    plain, stats = info_nce(q, p, TAU, qkeys, pkeys, True)
    again, stats_again = info_nce(q, p, TAU, qkeys, pkeys, True, None)
    assert torch.equal(plain, again) and stats.keys() == stats_again.keys() == {
        "pos_cos", "neg_cos_mean", "neg_cos_max", "masked_false_negatives"}


@pytest.mark.parametrize("lam, symmetric", [(0.1, False), (0.5, True), (0.0, False)])
def test_clp_matches_naive(lam, symmetric):
    q, p, neg, own, qkeys, pkeys, neg_pkeys, neg_qkeys = _batch(seed=1)
    tensors = [t.clone().requires_grad_(True) for t in (q, p, neg, own)]
    loss, stats = _clp(*tensors, qkeys, pkeys, neg_pkeys, neg_qkeys, lam, symmetric)
    loss.backward()
    naive_tensors = [t.clone().requires_grad_(True) for t in (q, p, neg, own)]
    naive, skipped = naive_clp(*naive_tensors, qkeys, pkeys, neg_pkeys, neg_qkeys, lam, symmetric)
    naive.backward()
    assert abs(float(loss.detach()) - float(naive.detach())) < 1e-12
    for got, want in zip(tensors, naive_tensors):
        assert float((got.grad - want.grad).abs().max()) < 1e-12
    assert skipped == 2 and stats["clp_negatives"] == B * M - 2   # negative 5 (no query) and 7 (anchor's query)
    gaps = [1 - float(F.cosine_similarity(neg[j], own[j], dim=0)) for j in range(B * M) if j not in (5, 7)]
    assert abs(float(stats["clp_penalty"]) - sum(gaps) / len(gaps)) < 1e-12


def test_clp_weights_the_contrastive_term_by_one_minus_lambda():
    """The sign the reference code uses (the paper prints lambda - 1): both terms are minimised."""
    q, p, neg, own, qkeys, pkeys, neg_pkeys, neg_qkeys = _batch()
    nce, _ = info_nce(q, p, TAU, qkeys, pkeys, False, neg, neg_pkeys, neg_qkeys)
    loss, stats = _clp(q, p, neg, own, qkeys, pkeys, neg_pkeys, neg_qkeys, 0.3)
    assert abs(float(loss) - (0.7 * float(nce) + 0.3 * float(stats["clp_penalty"]))) < 1e-12


def test_penalty_falls_as_a_negative_moves_toward_its_own_query():
    _, _, neg, own, *_ = _batch(seed=2)
    penalties = []
    for t in (0.0, 0.25, 0.5, 0.75, 1.0):
        moved = neg.clone()
        moved[3] = F.normalize(neg[3] + t * (own[3] - neg[3]), dim=-1)
        penalties.append(float(clp_penalty(moved, own)[1]["clp_penalty"]))
    assert all(a > b for a, b in zip(penalties, penalties[1:]))
    # and a gradient step on the penalty moves the negatives that way
    start = neg.clone().requires_grad_(True)
    term, before = clp_penalty(start, own)
    term.backward()
    _, after = clp_penalty(start.detach() - 0.1 * start.grad, own)
    assert float(after["clp_penalty"]) < float(before["clp_penalty"])


def test_clp_usable():
    _, _, _, _, qkeys, _, _, neg_qkeys = _batch()
    usable = clp_usable(neg_qkeys, qkeys)
    assert usable.tolist() == [j not in (5, 7) for j in range(B * M)]


@pytest.mark.parametrize("override, message", [
    (["train.loss=clp"], "train.loss=clp needs mined negatives: set train.negatives_per_query"),
    (["train.loss=clp", "train.negatives_per_query=2", "train.clp_lambda=1.0"], "train.clp_lambda must be in [0, 1)"),
    (["train.clp_lambda=-0.1"], "train.clp_lambda must be in [0, 1)"),
    (["train.negatives_per_query=-1"], "train.negatives_per_query must be >= 0"),
    (["train.loss=triplet"], "train.loss must be one of"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        config.load(None, override)
    assert message in str(err.value)


def test_config_accepts_clp():
    cfg = config.load(None, ["train.loss=clp", "train.negatives_per_query=4", "train.clp_lambda=0.2"])
    objective = cfg.train.objective
    assert (objective.loss, objective.negatives_per_query, objective.clp_lambda) == ("clp", 4, 0.2)
