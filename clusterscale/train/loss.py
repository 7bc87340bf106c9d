"""InfoNCE with in-batch (and optionally mined) negatives gathered across ranks, and the CLP penalty."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

# The query key of a mined negative whose pair has no usable query text: equal to no real text's key
# (keys are 64-bit hashes, so a collision is as unlikely as any other key collision).
NO_QUERY_KEY = torch.iinfo(torch.int64).min
EMPTY_SLOT_KEY = torch.iinfo(torch.int64).max  # a negative's passage key for a slot with no negative: masked for all


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
             passage_keys: torch.Tensor, symmetric: bool = False, neg: torch.Tensor | None = None,
             neg_passage_keys: torch.Tensor | None = None,
             neg_query_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Mean InfoNCE of this rank's queries against every rank's passages (and mined negatives).

    q, p: (b, d) L2-normalised rows of this rank. *_keys: (b,) int64 text hashes; a candidate with
    the same passage text or the same query as the positive is another positive, not a negative,
    so it is masked out. With DDP's gradient averaging, the gradient equals that of the mean loss
    over the whole global batch in one process.

    neg: optional (b*M, d) mined negatives of this rank, M per query in query order (rows i*M..i*M+M-1
    belong to query i), with the keys of their passage texts and of their own pairs' queries
    (NO_QUERY_KEY where unknown). Every rank's negatives join every query's candidates, masked by
    the same rule; a negative whose passage key is EMPTY_SLOT_KEY is masked for every query. Every rank
    must pass the same M. The symmetric term stays over positives only.
    Stats: pos_cos, neg_cos_mean, neg_cos_max, masked_false_negatives (in-batch passages only, as
    without mined negatives); with neg also mined_neg_cos_mean (each query against its own unmasked
    mined negatives) and masked_mined_negatives (masked mined candidates of this rank's queries).
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    b = q.shape[0]
    p_all = gather_with_grad(p)
    pk_all, qk_all = gather_no_grad(passage_keys), gather_no_grad(query_keys)
    num_positives = p_all.shape[0]
    candidates = p_all
    if neg is not None:
        if neg_passage_keys is None or neg_query_keys is None or neg.shape[0] % max(b, 1) or not neg.shape[0]:
            raise ValueError(f"info_nce: neg must hold M >= 1 rows per query ({b} queries, got {neg.shape[0]}) "
                             "and come with neg_passage_keys and neg_query_keys.")
        candidates = torch.cat([p_all, gather_with_grad(neg)])
        pk_all = torch.cat([pk_all, gather_no_grad(neg_passage_keys)])
        qk_all = torch.cat([qk_all, gather_no_grad(neg_query_keys)])
    labels = torch.arange(b, device=q.device) + rank * b
    sims = q @ candidates.T
    same = (pk_all[None, :] == passage_keys[:, None]) | (qk_all[None, :] == query_keys[:, None]) | \
        (pk_all == EMPTY_SLOT_KEY)[None, :]  # a row short of labeled negatives fills its slots with none
    false_neg = same.clone()
    false_neg[torch.arange(b), labels] = False
    logits = (sims / temperature).masked_fill(false_neg, float("-inf"))
    loss = F.cross_entropy(logits, labels)
    if symmetric:
        q_all = gather_with_grad(q)
        sims_t = p @ q_all.T
        logits_t = (sims_t / temperature).masked_fill(false_neg[:, :num_positives], float("-inf"))
        loss = (loss + F.cross_entropy(logits_t, labels)) / 2
    with torch.no_grad():
        stats = _in_batch_stats(sims[:, :num_positives].detach(), same[:, :num_positives],
                                false_neg[:, :num_positives], labels)
        if neg is not None:
            stats.update(_mined_stats(sims.detach(), same, num_positives, rank, neg.shape[0] // b))
    return loss, stats


def _in_batch_stats(sims: torch.Tensor, same: torch.Tensor, false_neg: torch.Tensor,
                    labels: torch.Tensor) -> dict:
    b = sims.shape[0]
    negative = ~same
    neg_sims = sims.masked_fill(~negative, float("nan"))
    has_neg = negative.any(1)
    return {"pos_cos": sims[torch.arange(b), labels].mean(),
            "neg_cos_mean": torch.nanmean(neg_sims[has_neg]) if has_neg.any() else sims.new_tensor(0.0),
            "neg_cos_max": neg_sims[has_neg].nan_to_num(float("-inf")).amax(1).mean() if has_neg.any()
            else sims.new_tensor(0.0),
            "masked_false_negatives": false_neg.sum().to(sims.dtype)}


def _mined_stats(sims: torch.Tensor, same: torch.Tensor, num_positives: int, rank: int, m: int) -> dict:
    """How hard each query's own mined negatives are, and how many mined candidates were masked."""
    b = sims.shape[0]
    own = num_positives + rank * b * m + torch.arange(b, device=sims.device)[:, None] * m \
        + torch.arange(m, device=sims.device)[None, :]
    own_sims, own_same = sims.gather(1, own), same.gather(1, own)
    kept = own_sims[~own_same]
    return {"mined_neg_cos_mean": kept.mean() if kept.numel() else sims.new_tensor(0.0),
            "masked_mined_negatives": same[:, num_positives:].sum().to(sims.dtype)}


def clp_usable(neg_query_keys: torch.Tensor, query_keys: torch.Tensor) -> torch.Tensor:
    """(b*M,) bool: mined negatives with an own query q* that can anchor the CLP penalty.

    Unusable: q* unknown (NO_QUERY_KEY), or q* equal to the anchor query (that pair is a positive).
    """
    m = neg_query_keys.shape[0] // max(query_keys.shape[0], 1)
    return (neg_query_keys != NO_QUERY_KEY) & (neg_query_keys != query_keys.repeat_interleave(m))


def clp_penalty(neg: torch.Tensor, own_queries: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """CLP's penalty (arXiv 2412.17364): mean over the global batch's usable mined negatives j of
    1 - cos(e(neg_j), e(q*_j)), where q*_j is the query of the pair whose passage neg_j is.

    neg, own_queries: (v, d) this rank's usable negatives and their own queries' embeddings, row by
    row; v may differ between ranks. Returns (term, stats). term = world * local sum / global count:
    after DDP averages gradients over ranks, the gradient is that of the global mean, as in one
    process. stats (the same on every rank): clp_penalty, the global mean (detached), and
    clp_negatives, the global count of usable negatives.
    """
    gaps = 1.0 - F.cosine_similarity(neg, own_queries, dim=-1)
    totals = torch.stack([gaps.detach().sum(), gaps.new_tensor(float(gaps.shape[0]))]).double()
    if world_size() > 1:
        dist.all_reduce(totals)
    count = float(totals[1])
    term = gaps.sum() * (world_size() / count) if count else gaps.sum() * 0.0
    penalty = (totals[0] / count if count else totals[0] * 0.0).to(gaps.dtype)
    return term, {"clp_penalty": penalty, "clp_negatives": int(count)}
