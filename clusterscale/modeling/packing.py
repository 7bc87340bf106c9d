"""Packed (unpadded) forward passes: a batch's texts laid end to end in one row, attention within each text.

A padded batch computes every layer on rows x longest tokens; a packed one on the real tokens only, and its
attention needs no mask, so on a GPU it runs a variable-length flash kernel (flash-attn's
`flash_attn_varlen_func` when installed, else torch's `torch.nn.attention.varlen.varlen_attn`). The attention
reaches the model through transformers' own extension point (`AttentionInterface`, registered as PACKED): the
model's code is not copied; its embeddings get restarting `position_ids` and its attention the texts' bounds
(`cu_seq_lens_q`), which transformers passes down to the attention function. Where no kernel runs (CPU, or a GPU
without one) the attention is one SDPA call per text: exact, slow, for checks.

Whether a model packs correctly is checked on its own weights when an Encoder chooses packing (`check`): an
architecture whose positions or attention do not follow this layout falls back to padded batches.
"""
from __future__ import annotations

import threading
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

PACKED = "clusterscale_packed"  # the attention implementation's name in transformers' AttentionInterface
MODES = ("auto", "packed", "padded")


class Kernel(NamedTuple):
    """A variable-length attention kernel on CUDA: fn(q, k, v, cu_seq, max_len, scale, dropout) -> out, q/k/v
    (tokens, heads, dim); `dropout`: whether it applies attention dropout (training with it needs one that does)."""
    name: str
    fn: Callable
    dropout: bool


def varlen_kernel() -> Kernel | None:
    """flash-attn's kernel when installed (it has attention dropout), else torch's varlen_attn (none), else None."""
    try:
        from flash_attn import flash_attn_varlen_func

        return Kernel("flash-attn", lambda q, k, v, cu, longest, scale, dropout: flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scale, causal=False), True)
    except ImportError:
        pass
    try:
        from torch.nn.attention.varlen import varlen_attn  # torch >= 2.10
    except ImportError:
        return None
    import inspect

    with_scale = "scale" in inspect.signature(varlen_attn).parameters  # torch >= 2.11

    def torch_varlen(q, k, v, cu, longest, scale, dropout):
        if dropout:
            raise ValueError(f"torch {torch.__version__}'s varlen_attn has no attention dropout ({dropout})")
        if with_scale:
            return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale)
        if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-9:  # torch 2.10: 1/sqrt(head dim) only
            raise ValueError(f"torch {torch.__version__}'s varlen_attn has no scale argument (this model's {scale})")
        return varlen_attn(q, k, v, cu, cu, longest, longest)

    return Kernel("torch-varlen", torch_varlen, False)


def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float | None = None, dropout: float = 0.0, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature on one packed row: query/key/value (1, heads, tokens, dim) -> (1, tokens,
    heads, dim), each text attending to itself only (cu_seq_lens_q: the texts' bounds, int32), with the attention
    dropout the model asks for (`dropout`: its probability in train mode, 0 in eval)."""
    if cu_seq_lens_q is None:
        raise ValueError(f"The {PACKED} attention needs cu_seq_lens_q (clusterscale.modeling.packing.forward).")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    kernel = _KERNEL if query.is_cuda else None
    if kernel is not None:
        out = kernel.fn(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, int(max_length_q), scaling,
                        dropout)
        return out.unsqueeze(0), None
    out = torch.empty_like(q)
    bounds = cu_seq_lens_q.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):  # the reference path: one text at a time
        part = [t[start:stop].transpose(0, 1) for t in (q, k, v)]
        out[start:stop] = F.scaled_dot_product_attention(*part, dropout_p=dropout, scale=scaling).transpose(0, 1)
    return out.unsqueeze(0), None


_KERNEL: Kernel | None = None
_REGISTER_LOCK = threading.Lock()


def register() -> Kernel | None:
    """Register PACKED with transformers (once per process); the GPU kernel it will use, None if there is none."""
    global _KERNEL
    from transformers import AttentionInterface

    with _REGISTER_LOCK:  # the kernel is known before the name is: no caller sees PACKED without it
        if PACKED not in AttentionInterface._global_mapping:
            _KERNEL = varlen_kernel() if torch.cuda.is_available() else None
            AttentionInterface.register(PACKED, packed_attention)
    return _KERNEL


def kernel_for(device: torch.device) -> Kernel | None:
    """Register PACKED; the variable-length kernel when `device` is a GPU that has one, else None."""
    kernel = register()
    return kernel if device.type == "cuda" else None


def choose(model: torch.nn.Module, mode: str, device: torch.device, packed: Callable[[], torch.Tensor],
           padded: Callable[[], torch.Tensor], key: str, auto_on_cpu: bool = False, dropout: float = 0.0) -> str:
    """Switch `model` to packed passes where `mode` (auto | packed | padded, the config key `key`) asks for them and
    they embed alike: 'packed (<kernel>)' with the model's attention set to PACKED, else 'padded' (and the model as it
    was). packed() / padded(): a few texts' L2-normalised vectors each way (called with the attention set for it; an
    error in packed() counts against packing, one in padded() is raised). 'auto' packs on a GPU with a variable-length
    kernel (and, with auto_on_cpu, on a CPU: one attention call per text), and pads, saying why, a model whose vectors
    differ. dropout: the attention dropout training will apply; a kernel without dropout does not pack it."""
    if mode not in MODES:
        raise ValueError(f"{key} must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "padded":
        return "padded"
    kernel = kernel_for(device)
    if mode == "auto" and kernel is None and not (auto_on_cpu and device.type == "cpu"):
        return "padded"
    padded_attention = model.config._attn_implementation
    vectors, mismatch = None, None
    if kernel is not None and dropout and not kernel.dropout:
        mismatch = f"{kernel.name} has no attention dropout, which this model trains with ({dropout})"
    else:
        try:
            model.set_attn_implementation(PACKED)
            vectors = packed()
        except Exception as exc:  # noqa: BLE001 - an architecture or kernel that cannot run packed passes
            mismatch = f"{type(exc).__name__}: {exc}"
        finally:
            model.set_attn_implementation(padded_attention)
    if vectors is not None:
        cosine = float((vectors.float() * padded().float()).sum(-1).min())
        # fp32 on a CPU agrees to rounding; bf16 on a GPU to its 8-bit mantissa
        if cosine < (0.999 if device.type == "cuda" else 1 - 1e-5):
            mismatch = f"cosine {cosine:.5f} between a text's two vectors"
    if mismatch is None:
        model.set_attn_implementation(PACKED)
        return f"packed ({kernel.name if kernel else 'one attention call per text'})"
    if mode == "packed":
        raise PackingError(f"{key}=packed: this model's packed passes differ from its padded ones ({mismatch}); set "
                           f"{key}=padded (or auto).")
    print(f"[{key.split('.')[0]}] padded batches: this model's packed passes differ from its padded ones ({mismatch})",
          flush=True)
    return "padded"


class PackingError(ValueError):
    """A model asked to pack (embed.packing / train.packing = packed) whose packed passes differ from padded ones."""


PROBE_TEXTS = ["a", "the quick brown fox jumps over the lazy dog", "packing check, three"]


def is_packed(model: torch.nn.Module) -> bool:
    """Whether `model` (or the module a DDP wrapper holds) runs PACKED attention (choose)."""
    inner = getattr(model, "module", model)
    return getattr(getattr(inner, "config", None), "_attn_implementation", None) == PACKED


def packed_batches(lengths: np.ndarray, batch_size: int, max_tokens: int) -> list[np.ndarray]:
    """Row indices per packed pass, longest first: at most batch_size texts and max_tokens real tokens each (a text
    longer than the budget goes alone)."""
    order = np.argsort(-lengths, kind="stable")
    ends = np.cumsum(lengths[order])
    batches, start = [], 0
    while start < len(order):
        before = int(ends[start - 1]) if start else 0
        fits = int(np.searchsorted(ends, before + max_tokens, side="right"))
        stop = min(start + batch_size, max(start + 1, fits))
        batches.append(order[start:stop])
        start = stop
    return batches


def pack(ids: np.ndarray, offsets: np.ndarray, rows: np.ndarray, position_offset: int = 0) -> dict[str, np.ndarray]:
    """The texts `rows` of a flat token array (ids, offsets) end to end: input_ids and position_ids (1, tokens),
    their bounds cu (texts + 1, int32), each text's segment id per token and its length."""
    lengths = (offsets[rows + 1] - offsets[rows]).astype(np.int64)
    cu = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    within = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lengths)
    return {"input_ids": ids[np.repeat(offsets[rows], lengths) + within].astype(np.int64)[None],
            "position_ids": (within + position_offset)[None], "cu": cu.astype(np.int32),
            "segments": np.repeat(np.arange(len(rows)), lengths), "lengths": lengths}


def position_offset(model: torch.nn.Module) -> int:
    """First position id of a text: RoBERTa-style embeddings count from padding_idx + 1, BERT's from 0."""
    embeddings = getattr(model, "embeddings", None)
    padding_idx = getattr(embeddings, "padding_idx", None)
    return int(padding_idx) + 1 if padding_idx is not None else 0


def forward(model: torch.nn.Module, packed: dict[str, np.ndarray], device: torch.device) -> torch.Tensor:
    """Last hidden states (tokens, hidden) of one packed row; the model's attention must be PACKED."""
    cu = torch.from_numpy(packed["cu"]).to(device)
    longest = int(packed["lengths"].max())
    out = model(input_ids=torch.from_numpy(packed["input_ids"]).to(device),
                position_ids=torch.from_numpy(packed["position_ids"]).to(device),
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return out.last_hidden_state[0]


def pool(hidden: torch.Tensor, packed: dict[str, np.ndarray], pooling: str) -> torch.Tensor:
    """(texts, hidden): each text's first token (cls) or the mean of its tokens (mean)."""
    starts = torch.from_numpy(packed["cu"][:-1].astype(np.int64)).to(hidden.device)
    if pooling == "cls":
        return hidden[starts]
    segments = torch.from_numpy(packed["segments"]).to(hidden.device)
    sums = torch.zeros((len(starts), hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    sums.index_add_(0, segments, hidden)
    lengths = torch.from_numpy(packed["lengths"]).to(hidden.device, hidden.dtype).clamp(min=1)
    return sums / lengths.unsqueeze(1)
