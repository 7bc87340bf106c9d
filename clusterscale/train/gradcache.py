"""GradCache (Gao et al. 2021): the gradient of a contrastive loss over a large batch in bounded memory.

1. Embed the batch in chunks without autograd (activation memory of one chunk), remembering the
   RNG state before each chunk so dropout masks can be replayed.
2. Compute the loss on the detached embeddings (the cross-rank gather happens here) and its
   gradient with respect to every embedding.
3. Re-forward each chunk with autograd under the same RNG state and backpropagate the cached
   embedding gradient: sum over chunks of d(emb . g)/dtheta equals d(loss)/dtheta.
Under DDP, gradients are all-reduced only in the last chunk's backward (no_sync on the others).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

ChunkForward = Callable[[slice], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


class RngState:
    """The CPU (and current CUDA device) RNG state, to replay a forward pass's dropout masks."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def chunk_slices(n: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]


def grad_cache_backward(model: torch.nn.Module, forward_chunk: ChunkForward, n: int, chunk: int,
                        loss_fn: LossFn, device: torch.device, moe_aux=None) -> tuple[torch.Tensor, dict]:
    """Accumulate d(loss)/d(params) into .grad; returns (detached loss, loss stats).

    forward_chunk(rows) -> (query embeddings, passage embeddings) of this rank's rows `rows`;
    loss_fn(q, p) -> (loss, stats) over this rank's full (n, d) embeddings. Every rank must use the
    same n and chunk so that the collectives inside loss_fn and DDP line up. moe_aux (a
    train.moe.MoeChunkAux) adds each chunk's share of the MoE load-balancing loss to its surrogate.
    """
    slices = chunk_slices(n, chunk)
    states, qs, ps = [], [], []
    with torch.no_grad():
        for rows in slices:
            states.append(RngState(device))
            q, p = forward_chunk(rows)
            qs.append(q.float())
            ps.append(p.float())
            if moe_aux is not None:
                moe_aux.observe()
    q_all = torch.cat(qs).requires_grad_(True)
    p_all = torch.cat(ps).requires_grad_(True)
    loss, stats = loss_fn(q_all, p_all)
    loss.backward()
    grad_q, grad_p = q_all.grad, p_all.grad
    after = RngState(device)
    for i, rows in enumerate(slices):
        last = i == len(slices) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            states[i].restore()
            q, p = forward_chunk(rows)
            surrogate = (q.float() * grad_q[rows]).sum() + (p.float() * grad_p[rows]).sum()
            if moe_aux is not None:
                surrogate = surrogate + moe_aux.chunk_loss()
            surrogate.backward()
    after.restore()  # leave the RNG where the uncached step would: after one forward of every chunk
    return loss.detach(), stats
