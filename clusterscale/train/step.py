"""One contrastive gradient step on this rank's slice of a global batch (plain torch; Ray only wraps it).

`contrastive_backward` embeds the queries and passages, computes InfoNCE against every rank's
passages and accumulates the parameter gradients, directly or with GradCache. The caller owns the
optimizer; tests call this function on a 2-rank gloo group and compare with one process.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch

from clusterscale.train.gradcache import grad_cache_backward
from clusterscale.train.loss import info_nce
from clusterscale.train.model import embed, text_keys
from clusterscale.train.moe import MoeChunkAux, moe_aux_loss


@dataclass(frozen=True)
class StepSettings:
    temperature: float
    query_max_length: int
    passage_max_length: int
    pooling: str
    symmetric: bool = False
    grad_cache_chunk: int = 0      # 0 = embed the whole slice with autograd in one pass
    amp: bool = False              # bf16 autocast (GPU)
    moe_aux_loss_weight: float = 0.0  # weight of the MoE load-balancing loss (train.moe_aux_loss_weight)

    @classmethod
    def from_train_config(cls, tc, pooling: str, amp: bool) -> "StepSettings":
        return cls(tc.temperature, tc.query_max_length, tc.passage_max_length, pooling, tc.symmetric,
                   tc.grad_cache_chunk, amp, moe_aux_loss_weight=tc.moe_aux_loss_weight)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The dropout seed of (step, rank): a resumed run replays the same masks without saved RNG state."""
    digest = hashlib.blake2b(f"{seed}/{step}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def contrastive_backward(model: torch.nn.Module, tokenizer, queries: list[str], passages: list[str],
                         settings: StepSettings, device: torch.device) -> tuple[torch.Tensor, dict]:
    """Accumulate the gradient of the global-batch InfoNCE into .grad; returns (loss, stats).

    stats: pos_cos, neg_cos_mean, neg_cos_max, masked_false_negatives (tensors); tokens (int, padded
    tokens of this rank's texts) and flops_per_param_token (6, or 8 with GradCache's extra forward).
    """
    counters: dict = {"tokens": 0}
    moe_aux_loss(model)  # drop MoE routing records left by any earlier forward
    query_keys, passage_keys = text_keys(queries).to(device), text_keys(passages).to(device)

    def forward(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if settings.amp else contextlib.nullcontext()
        with autocast:
            q = embed(model, tokenizer, queries[rows], settings.query_max_length, settings.pooling, device, counters)
            p = embed(model, tokenizer, passages[rows], settings.passage_max_length, settings.pooling, device,
                      counters)
        return q.float(), p.float()

    def loss_fn(q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return info_nce(q, p, settings.temperature, query_keys, passage_keys, settings.symmetric)

    n = len(queries)
    if settings.grad_cache_chunk and settings.grad_cache_chunk < n:
        moe_aux = MoeChunkAux(model, settings.moe_aux_loss_weight)
        loss, stats = grad_cache_backward(model, forward, n, settings.grad_cache_chunk, loss_fn, device, moe_aux)
        stats["moe_aux_loss"] = moe_aux.value
        stats["tokens"], stats["flops_per_param_token"] = counters["tokens"] // 2, 8  # one extra forward
    else:
        q, p = forward(slice(0, n))
        loss, stats = loss_fn(q, p)
        aux = moe_aux_loss(model)  # None without experts; read even at weight 0 so records never pile up
        (loss if aux is None else loss + settings.moe_aux_loss_weight * aux).backward()
        stats["moe_aux_loss"] = 0.0 if aux is None else float(aux.detach())
        loss = loss.detach()
        stats["tokens"], stats["flops_per_param_token"] = counters["tokens"], 6  # forward 2 + backward 4
    return loss, stats
