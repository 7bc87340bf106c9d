"""InfoNCE: false-negative masking and the symmetric term against a naive per-query implementation."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from clusterscale.train.loss import info_nce


def naive_info_nce(q, p, tau, qkeys, pkeys, symmetric=False):
    """One query at a time: the positive against every candidate that is not another positive."""
    def direction(a, b):
        total = 0.0
        for i in range(len(a)):
            logits = [float(a[i] @ b[i]) / tau]
            for j in range(len(b)):
                if j != i and qkeys[j] != qkeys[i] and pkeys[j] != pkeys[i]:
                    logits.append(float(a[i] @ b[j]) / tau)
            top = max(logits)
            total += -(logits[0] - top - math.log(sum(math.exp(x - top) for x in logits)))
        return total / len(a)

    loss = direction(q, p)
    return (loss + direction(p, q)) / 2 if symmetric else loss


def _batch(n=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    p = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    qkeys, pkeys = torch.arange(n), torch.arange(100, 100 + n)
    pkeys[7] = pkeys[2]   # the same passage text twice
    pkeys[9] = pkeys[2]
    qkeys[5] = qkeys[0]   # the same query twice
    return q, p, qkeys, pkeys


def test_masking_matches_naive():
    q, p, qkeys, pkeys = _batch()
    for symmetric in (False, True):
        loss, stats = info_nce(q, p, 0.05, qkeys, pkeys, symmetric)
        assert abs(float(loss) - naive_info_nce(q, p, 0.05, qkeys, pkeys, symmetric)) < 1e-9
    # 2<->7, 2<->9, 7<->9 and 0<->5, each counted in both rows
    assert int(stats["masked_false_negatives"]) == 8


def test_masking_changes_the_loss_and_stats():
    q, p, qkeys, pkeys = _batch()
    unmasked, _ = info_nce(q, p, 0.05, torch.arange(12), torch.arange(100, 112))
    masked, stats = info_nce(q, p, 0.05, qkeys, pkeys)
    assert abs(float(unmasked) - float(masked)) > 1e-3
    sims = q @ p.T
    assert abs(float(stats["pos_cos"]) - float(sims.diagonal().mean())) < 1e-12
    negatives = [(i, j) for i in range(12) for j in range(12)
                 if j != i and qkeys[i] != qkeys[j] and pkeys[i] != pkeys[j]]
    mean = sum(float(sims[i, j]) for i, j in negatives) / len(negatives)
    assert abs(float(stats["neg_cos_mean"]) - mean) < 1e-12
    row_max = [max(float(sims[i, j]) for a, j in negatives if a == i) for i in range(12)]
    assert abs(float(stats["neg_cos_max"]) - sum(row_max) / 12) < 1e-12


def test_gradient_matches_naive_autograd():
    q, p, qkeys, pkeys = _batch(seed=1)
    q.requires_grad_(True)
    loss, _ = info_nce(q, p, 0.1, qkeys, pkeys, symmetric=True)
    loss.backward()
    eps, i, k = 1e-6, 3, 2
    shifted = q.detach().clone()
    shifted[i, k] += eps
    numeric = (naive_info_nce(shifted, p, 0.1, qkeys, pkeys, True)
               - naive_info_nce(q.detach(), p, 0.1, qkeys, pkeys, True)) / eps
    assert abs(float(q.grad[i, k]) - numeric) < 1e-4
