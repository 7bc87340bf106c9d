"""One contrastive gradient step on this rank's slice of a global batch (plain torch; Ray only wraps it).

`contrastive_backward` embeds the queries, passages and optional mined negatives (and, for a loss that needs them,
each negative's own query), computes train.loss on them (train/losses/: InfoNCE against every rank's passages and
negatives, or CLP's) and accumulates the parameter gradients, directly or with GradCache. The caller owns the optimizer; tests call this
function on a 2-rank gloo group and compare with one process.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.nn.functional as F

from clusterscale.config import ConfigError, TrainConfig
from clusterscale.train.gradcache import grad_cache_backward
from clusterscale.train.loss import EMPTY_SLOT_KEY, NO_QUERY_KEY, clp_usable
from clusterscale.train.losses import Loss, LossInputs, loss as get_loss
from clusterscale.modeling.student import embed, text_keys
from clusterscale.modeling.moe import MoeChunkAux, moe_aux_loss


def step_seed(seed: int, step: int, rank: int) -> int:
    """The dropout seed of (step, rank): a resumed run replays the same masks without saved RNG state."""
    digest = hashlib.blake2b(f"{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def negative_query_keys(negative_queries: list[str | None] | None, num_negatives: int) -> torch.Tensor:
    """Keys of the mined negatives' own queries; NO_QUERY_KEY where the text is missing."""
    texts = negative_queries if negative_queries is not None else [None] * num_negatives
    keys = text_keys([t or "" for t in texts])
    keys[torch.tensor([not t for t in texts], dtype=torch.bool)] = NO_QUERY_KEY
    return keys


def _check_negatives(n: int, negatives: list[str] | None, negative_queries: list | None, loss: Loss) -> int:
    """M, the mined negatives per query (0 = none); errors name the setting to fix."""
    if not negatives:
        if loss.needs_mined_negatives:
            raise ValueError(f"train.loss={loss.name} needs mined negatives: set train.negatives_per_query >= 1 and "
                             f"run `clusterscale mine` first.")
        return 0
    if len(negatives) % n:
        raise ValueError(f"contrastive_backward: {len(negatives)} negatives for {n} queries; pass M per query "
                         f"(train.negatives_per_query), grouped by query.")
    if negative_queries is not None and len(negative_queries) != len(negatives):
        raise ValueError(f"contrastive_backward: {len(negative_queries)} negative_queries for {len(negatives)} "
                         f"negatives; pass one (or None) per negative.")
    if loss.needs_negative_queries and negative_queries is None:
        raise ValueError(f"train.loss={loss.name} needs negative_queries: the query of each mined negative's own "
                         f"pair.")
    return len(negatives) // n


def contrastive_backward(model: torch.nn.Module, tokenizer, queries: list[str], passages: list[str],
                         tc: TrainConfig, device: torch.device, negatives: list[str] | None = None,
                         negative_queries: list[str | None] | None = None, *, pooling: str | None = None,
                         amp: bool = False) -> tuple[torch.Tensor, dict]:
    """Accumulate the gradient of the global-batch loss into .grad; returns (loss, stats).

    tc: the train section; the step reads its loss (tc.objective), token limits (tc.student), GradCache chunk
    (tc.compute.grad_cache_chunk) and MoE aux weight (tc.moe). pooling: the student's resolved pooling (default
    tc.student.pooling, which must then not be 'auto'); amp: bf16 autocast (GPU).

    negatives: optional b*M negative passages (labeled, then mined), M per query, grouped by query (every rank the
    same M; None = an empty slot, masked for every query); negative_queries: the query text of each negative's own
    pair, or None where unknown (masks a negative that shares the anchor's query; q* of the CLP penalty).
    stats: pos_cos, neg_cos_mean, neg_cos_max, masked_false_negatives, mined_neg_cos_mean,
    masked_mined_negatives, clp_penalty (tensors; clp_penalty is the global mean, 0 without CLP);
    mined_negatives, clp_skipped (ints: this rank's negatives, and those without a usable q*);
    tokens (int, the tokens this rank's forwards computed: padded, or the texts' own when packed) and
    flops_per_param_token (6, or 8 with GradCache's extra forward). The returned loss is this rank's share: its mean over ranks is the
    global loss.
    """
    objective, student = tc.objective, tc.student
    pooling = pooling or student.pooling
    if pooling == "auto":
        raise ValueError("contrastive_backward needs the student's resolved pooling (build_student returns it), "
                         "not 'auto'.")
    chunk, aux_weight = tc.compute.grad_cache_chunk, tc.moe.moe_aux_loss_weight
    n = len(queries)
    loss_of = get_loss(objective.loss)  # train/losses/: an unknown name is a ConfigError naming them
    m = _check_negatives(n, negatives, negative_queries, loss_of)
    clp = bool(m) and loss_of.needs_negative_queries  # embeds each negative's own query
    counters: dict = {"tokens": 0}
    moe_aux_loss(model)  # drop MoE routing records left by any earlier forward
    query_keys, passage_keys = text_keys(queries).to(device), text_keys(passages).to(device)
    neg_keys = neg_query_keys = usable = None
    if m:  # a None negative is an empty slot (a row short of labeled negatives): masked for every query
        neg_keys = text_keys([t or "" for t in negatives])
        neg_keys[torch.tensor([t is None for t in negatives], dtype=torch.bool)] = EMPTY_SLOT_KEY
        neg_keys = neg_keys.to(device)
        negatives = [t or "" for t in negatives]
        neg_query_keys = negative_query_keys(negative_queries, len(negatives)).to(device)
        usable = clp_usable(neg_query_keys, query_keys)
    usable_rows = usable.nonzero().flatten().tolist() if clp else []

    def embed_texts(texts: list[str], side: str) -> torch.Tensor:
        """Queries or passages (mined negatives are passages) at their token limit, after their prompt."""
        prompt, limit = ((student.query_prompt, student.query_max_length) if side == "query" else
                         (student.passage_prompt, student.passage_max_length))
        return embed(model, tokenizer, [prompt + t for t in texts] if prompt else texts, limit, pooling, device,
                     counters)

    def forward(rows: slice) -> tuple[torch.Tensor, ...]:
        """Embeddings of queries `rows`: (q, p), then their negatives, then those negatives' own queries."""
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext()
        with autocast:
            q = embed_texts(queries[rows], "query")
            p = embed_texts(passages[rows], "passage")
            out = [q, p]
            if m:
                out.append(embed_texts(negatives[rows.start * m:rows.stop * m], "passage"))
            if clp:  # every negative's own query, usable or not: the same forward calls on every rank and chunk
                own = [t or "" for t in negative_queries[rows.start * m:rows.stop * m]]
                out.append(embed_texts(own, "query"))
        return tuple(x.float() for x in out)

    def one_loss(q: torch.Tensor, p: torch.Tensor, neg: torch.Tensor | None = None,
                 own_queries: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        return loss_of(LossInputs(q, p, neg, own_queries, query_keys, passage_keys, neg_keys, neg_query_keys,
                                  usable), objective)

    def loss_fn(*embeddings: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """The loss at the full dimension (its figures are the step's), plus each Matryoshka term's: the same loss
        on the first d dimensions of every embedding, re-normalised, times its weight."""
        loss, stats = one_loss(*embeddings)
        for dim, weight in objective.matryoshka_terms():
            full = embeddings[0].shape[1]
            if dim >= full:
                raise ConfigError(f"train.matryoshka_dims holds {dim}, not below the model's {full} dimensions: list "
                                 f"only the nested ones (the full dimension always counts).")
            cut = [None if x is None else F.normalize(x[:, :dim], dim=-1) for x in embeddings]
            loss = loss + weight * one_loss(*cut)[0]
        return loss, stats

    if chunk and chunk < n:
        moe_aux = MoeChunkAux(model, aux_weight)
        loss, stats = grad_cache_backward(model, forward, n, chunk, loss_fn, device, moe_aux)
        stats["moe_aux_loss"] = moe_aux.value
        stats["tokens"], stats["flops_per_param_token"] = counters["tokens"] // 2, 8  # one extra forward
    else:
        loss, stats = loss_fn(*forward(slice(0, n)))
        aux = moe_aux_loss(model)  # None without experts; read even at weight 0 so records never pile up
        (loss if aux is None else loss + aux_weight * aux).backward()
        stats["moe_aux_loss"] = 0.0 if aux is None else float(aux.detach())
        loss = loss.detach()
        stats["tokens"], stats["flops_per_param_token"] = counters["tokens"], 6  # forward 2 + backward 4
    zero = loss.new_zeros(())
    stats.setdefault("mined_neg_cos_mean", zero)
    stats.setdefault("masked_mined_negatives", zero)
    stats.setdefault("clp_penalty", zero)
    stats.pop("clp_negatives", None)
    stats["mined_negatives"] = m * n
    stats["clp_skipped"] = m * n - len(usable_rows) if clp else 0
    return loss, stats
