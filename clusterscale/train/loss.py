"""InfoNCE with in-batch negatives gathered across ranks (with autograd), false negatives masked."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All ranks' rows, in rank order; gradients flow back to the rank that made each row."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    import torch.distributed.nn.functional as dist_fn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated name, still the autograd-aware gather in torch 2.x
        return torch.cat(dist_fn.all_gather(x), dim=0)


def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out, dim=0)


def info_nce(q: torch.Tensor, p: torch.Tensor, temperature: float, query_keys: torch.Tensor,
             passage_keys: torch.Tensor, symmetric: bool = False) -> tuple[torch.Tensor, dict]:
    """Mean InfoNCE of this rank's queries against every rank's passages.

    q, p: (b, d) L2-normalised rows of this rank. *_keys: (b,) int64 text hashes; a candidate with
    the same passage text or the same query as the positive is another positive, not a negative,
    so it is masked out. With DDP's gradient averaging, the gradient equals that of the mean loss
    over the whole global batch in one process.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    b = q.shape[0]
    p_all = gather_with_grad(p)
    pk_all, qk_all = gather_no_grad(passage_keys), gather_no_grad(query_keys)
    labels = torch.arange(b, device=q.device) + rank * b
    sims = q @ p_all.T
    same = (pk_all[None, :] == passage_keys[:, None]) | (qk_all[None, :] == query_keys[:, None])
    false_neg = same.clone()
    false_neg[torch.arange(b), labels] = False
    logits = (sims / temperature).masked_fill(false_neg, float("-inf"))
    loss = F.cross_entropy(logits, labels)
    if symmetric:
        q_all = gather_with_grad(q)
        sims_t = p @ q_all.T
        logits_t = (sims_t / temperature).masked_fill(false_neg, float("-inf"))
        loss = (loss + F.cross_entropy(logits_t, labels)) / 2
    with torch.no_grad():
        neg = ~same
        neg_sims = sims.detach().masked_fill(~neg, float("nan"))
        has_neg = neg.any(1)
        stats = {"pos_cos": sims.detach()[torch.arange(b), labels].mean(),
                 "neg_cos_mean": torch.nanmean(neg_sims[has_neg]) if has_neg.any() else sims.new_tensor(0.0),
                 "neg_cos_max": neg_sims[has_neg].nan_to_num(float("-inf")).amax(1).mean() if has_neg.any()
                 else sims.new_tensor(0.0),
                 "masked_false_negatives": false_neg.sum().to(sims.dtype)}
    return loss, stats
