"""Mixture-of-Experts adapter: each layer's intermediate (expansion) Linear becomes E routed copies of itself.

`add_moe(model, num_experts, top_k)` replaces every `*.intermediate.dense` in place; the training
step adds `weight x moe_aux_loss(model)` (Switch-Transformer load balancing) to its loss. This file
imports only torch: it is also copied into exported MoE model folders as transformers remote code.
"""
from __future__ import annotations

import torch
from torch import nn

INTERMEDIATE_SUFFIX = "intermediate.dense"  # BERT-family name of the FFN expansion projection
# Routing records kept per layer until read: a step reads ~2 (query and passage forward); the cap only
# bounds memory for callers that never read them (e.g. a no-grad evaluation loop outside inference mode).
MAX_RECORDS = 256


class MoeLinear(nn.Module):
    """Top-k routed experts in place of one nn.Linear, with a linear gate over all experts.

    Gate probabilities are a softmax over ALL expert logits, taken before the top-k selection; the
    selected probabilities are renormalised to weights that sum to 1, so identical experts reproduce
    the dense layer. With top_k=1 the normaliser carries no gradient, so the gate still learns. Each
    forward outside torch.inference_mode records routing statistics for the load-balancing loss (also
    under no_grad: GradCache's first pass needs the routing counts), read and cleared by `moe_aux_loss`.
    """

    def __init__(self, dense: nn.Linear, num_experts: int, top_k: int, generator: torch.Generator | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}.")
        self.num_experts, self.top_k = num_experts, top_k
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.experts = nn.ModuleList(nn.Linear(dense.in_features, dense.out_features, bias=dense.bias is not None)
                                     for _ in range(num_experts))
        with torch.no_grad():
            for expert in self.experts:
                expert.to(device=dense.weight.device, dtype=dense.weight.dtype)
                expert.weight.copy_(dense.weight)
                if dense.bias is not None:
                    expert.bias.copy_(dense.bias)
        self.gate = nn.Linear(dense.in_features, num_experts, bias=False, device=dense.weight.device,
                              dtype=dense.weight.dtype)
        with torch.no_grad():  # small random logits break the tie between identical experts
            noise = torch.randn(self.gate.weight.shape, generator=generator) * 0.02
            self.gate.weight.copy_(noise.to(self.gate.weight))
        self.train(dense.training)
        self.token_mask: torch.Tensor | None = None  # (batch, seq) attention mask set by add_moe's hook
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slot counts (E,), prob sums (E,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        probs = self.gate(flat).float().softmax(dim=-1)  # (tokens, E), over all experts
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        norm = top_p.sum(dim=-1, keepdim=True)
        # top_k=1: p / p would be a constant 1 and starve the gate; p / stop_grad(p) is still exactly 1
        # (the dense output) but passes the Switch-Transformer gradient d(log p) to the gate.
        weights = top_p / (norm.detach() if self.top_k == 1 else norm)
        out, dtype, idle = None, None, []
        for e, expert in enumerate(self.experts):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                if torch.is_grad_enabled():  # keep it in the graph (zero gradient): see `idle` below
                    idle += [p.sum() for p in expert.parameters() if p.requires_grad]
                continue
            y = expert(flat.index_select(0, rows))
            if out is None:
                dtype = y.dtype
                out = torch.zeros(flat.shape[0], self.out_features, device=y.device, dtype=torch.float32)
            out.index_add_(0, rows, y.float() * weights[rows, slot].unsqueeze(-1))
        if out is None:  # no tokens at all
            out, dtype = flat.new_zeros(0, self.out_features, dtype=torch.float32), x.dtype
        if idle:
            # A step calls the model several times (queries, passages, negatives) before one backward. An expert
            # idle in one call but not another would make DDP's find_unused_parameters mark it ready twice, so
            # every expert takes part in every call's graph instead, with an exact zero contribution.
            out = out + 0.0 * torch.stack(idle).sum()
        if not torch.is_inference_mode_enabled():  # inference (Encoder, sentence-transformers) never reads them
            self.records = self.records[-(MAX_RECORDS - 1):] + [self._routing_stats(probs, top_i, x.shape[:-1])]
        return out.to(dtype).reshape(*x.shape[:-1], self.out_features)

    def _routing_stats(self, probs: torch.Tensor, top_i: torch.Tensor, lead_shape: torch.Size):
        """(token-slots per expert, sum of gate probabilities per expert) over the real (unpadded) tokens."""
        mask = self.token_mask
        if mask is not None and tuple(mask.shape) == tuple(lead_shape):
            real = mask.reshape(-1).bool()
            probs, top_i = probs[real], top_i[real]
        counts = torch.bincount(top_i.reshape(-1), minlength=self.num_experts).to(probs.dtype)
        return counts, probs.sum(dim=0)


def moe_layers(model: nn.Module) -> list[MoeLinear]:
    return [m for m in model.modules() if isinstance(m, MoeLinear)]


def intermediate_names(model: nn.Module) -> list[str]:
    """Qualified names of the intermediate projections (dense or already MoE)."""
    return [name for name, m in model.named_modules()
            if name.endswith(INTERMEDIATE_SUFFIX) and isinstance(m, (nn.Linear, MoeLinear))]


def _remember_attention_mask(model: nn.Module, args: tuple, kwargs: dict) -> None:
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    for layer in moe_layers(model):
        layer.token_mask = mask if isinstance(mask, torch.Tensor) else None


def add_moe(model: nn.Module, num_experts: int, top_k: int, seed: int = 0) -> int:
    """Replace every `*.intermediate.dense` Linear by a MoeLinear (in place); returns how many.

    The gates are initialised from `seed` (own generator: the global RNG is untouched). A forward
    pre-hook hands the attention mask to the layers so that padding does not count in the
    load-balancing loss.
    """
    names = [n for n in intermediate_names(model) if isinstance(model.get_submodule(n), nn.Linear)]
    if not names:
        raise ValueError(f"add_moe: {type(model).__name__} has no `*.{INTERMEDIATE_SUFFIX}` nn.Linear layers "
                         f"(BERT-family encoders have one per layer); cannot add experts to this model.")
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, MoeLinear(getattr(parent, child), num_experts, top_k, generator))
    model.register_forward_pre_hook(_remember_attention_mask, with_kwargs=True)
    return len(names)


def _aux(records: list[tuple[torch.Tensor, torch.Tensor]], total_counts: list[torch.Tensor] | None,
         top_k: list[int]) -> torch.Tensor:
    """Switch load balancing, E x sum_i f_i x P_i per record, summed over records.

    f_i (slot fraction, no gradient) and the token count come from `total_counts` when given (GradCache:
    the whole slice's routing), so per-chunk terms add up to the whole slice's loss and gradient."""
    total = None
    for j, (counts, prob_sum) in enumerate(records):
        all_counts = total_counts[j] if total_counts is not None else counts
        tokens = all_counts.sum() / top_k[j]
        num_experts = counts.shape[0]
        term = num_experts * (all_counts / (tokens * top_k[j]).clamp(min=1)) @ (prob_sum / tokens.clamp(min=1))
        total = term if total is None else total + term
    return total


def _take(model: nn.Module) -> tuple[list, list[int]]:
    records, top_k = [], []
    for layer in moe_layers(model):
        records += layer.records
        top_k += [layer.top_k] * len(layer.records)
        layer.records = []
    return records, top_k


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the load-balancing losses of every MoE layer and forward since the last call (then cleared).

    1.0 per layer and forward pass when routing is balanced. None when the model has no experts or
    nothing was recorded."""
    records, top_k = _take(model)
    return _aux(records, None, top_k) if records else None


class MoeChunkAux:
    """The load-balancing loss under GradCache: chunk terms that add up to the uncached step's loss.

    Call `observe()` after each no-grad chunk forward of the first pass (it keeps the routing counts
    and drops the records), then `chunk_loss()` after each chunk's re-forward: weight x that chunk's
    share of the loss, normalised by the whole slice's routing."""

    def __init__(self, model: nn.Module, weight: float):
        self.model, self.weight = model, weight
        self.counts: list[torch.Tensor] | None = None  # per layer call: the whole slice's slot counts
        self.value = 0.0  # the unweighted loss of the whole slice, summed over chunks

    def observe(self) -> None:
        records, _ = _take(self.model)
        if self.counts is None:
            self.counts = [c.clone() for c, _ in records]
        elif len(records) != len(self.counts):
            raise RuntimeError("MoE: chunks of one GradCache step ran different numbers of MoE layer calls.")
        else:
            self.counts = [total + c for total, (c, _) in zip(self.counts, records)]

    def chunk_loss(self) -> torch.Tensor | float:
        records, top_k = _take(self.model)
        if not records or self.counts is None:
            return 0.0
        aux = _aux(records, self.counts, top_k)
        self.value += float(aux.detach())
        return self.weight * aux


def freeze_all_but_intermediate(model: nn.Module) -> int:
    """Train only the intermediate projections (experts and gates under MoE); returns trainable params."""
    keep = {id(p) for name in intermediate_names(model) for p in model.get_submodule(name).parameters()}
    if not keep:
        raise ValueError(f"{type(model).__name__} has no `*.{INTERMEDIATE_SUFFIX}` layers to keep trainable.")
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
