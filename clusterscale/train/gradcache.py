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

# forward_chunk(rows) -> embeddings of this rank's rows `rows`: (queries, passages) and optionally more
# tensors (mined negatives and their own queries); each may have its own number of rows per chunk.
ChunkForward = Callable[[slice], tuple[torch.Tensor, ...]]
LossFn = Callable[..., tuple[torch.Tensor, dict]]


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

    forward_chunk(rows) -> a tuple of embedding tensors of this rank's rows `rows` (queries, passages,
    and whatever else the loss needs, each tensor with any number of rows per chunk); loss_fn(*tensors)
    -> (loss, stats) over each tensor's chunks concatenated in order. Every rank must use the same n
    and chunk so that the collectives inside loss_fn and DDP line up. moe_aux (a
    train.moe.MoeChunkAux) adds each chunk's share of the MoE load-balancing loss to its surrogate.
    """
    slices = chunk_slices(n, chunk)
    states, chunks = [], []
    with torch.no_grad():
        for rows in slices:
            states.append(RngState(device))
            chunks.append([x.float() for x in forward_chunk(rows)])
            if moe_aux is not None:
                moe_aux.observe()
    full = [torch.cat(parts).requires_grad_(True) for parts in zip(*chunks)]
    loss, stats = loss_fn(*full)
    loss.backward()
    grads = [x.grad for x in full]  # None for a tensor the loss did not use
    starts = [0] * len(full)
    after = RngState(device)
    for i, rows in enumerate(slices):
        last = i == len(slices) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            states[i].restore()
            surrogate = 0.0
            for k, x in enumerate(forward_chunk(rows)):
                stop = starts[k] + x.shape[0]
                if grads[k] is not None:
                    surrogate = surrogate + (x.float() * grads[k][starts[k]:stop]).sum()
                starts[k] = stop
            if moe_aux is not None:
                surrogate = surrogate + moe_aux.chunk_loss()
            surrogate.backward()
    after.restore()  # leave the RNG where the uncached step would: after one forward of every chunk
    return loss.detach(), stats
