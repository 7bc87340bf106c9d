"""The student encoder: fine-tuned from an HF model/folder, or a BERT built from scratch."""
from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F

from clusterscale.config import TrainConfig
from clusterscale.modeling.moe_config import MoeConfig
from clusterscale.modeling.student_config import StudentConfig
from clusterscale.modeling import packing
from clusterscale.modeling.encoder import detect_pooling, load_model, load_tokenizer, pool, resolve_model_path
from clusterscale.runtime.hashing import text_hashes
from clusterscale.modeling.moe import add_moe, freeze_all_but_intermediate, moe_layers


def build_student(cfg: TrainConfig) -> tuple[torch.nn.Module, object, str]:
    """(model, tokenizer, pooling). Unused heads (BERT's pooler) are frozen so DDP sees no idle params."""
    student = cfg.student
    if student.init == "scratch":
        tokenizer = load_tokenizer(resolve_model_path(student.tokenizer))
        torch.manual_seed(cfg.schedule.seed)
        model = scratch_bert(student, len(tokenizer))
        # Mean, not the paper's CLS: a BERT from scratch with CLS pooling collapsed (loss at chance, every text one
        # direction) under every lr, temperature, warm-up, depth, width and init scale tried; mean pooling learned
        # under all of them (benchmarks/RESULTS.md, "Why CLS from scratch collapses").
        pooling = "mean" if student.pooling == "auto" else student.pooling
    else:
        path = resolve_model_path(student.init)
        tokenizer = load_tokenizer(path)
        model = load_model(path)
        pooling = detect_pooling(path) if student.pooling == "auto" else student.pooling
    for name, param in model.named_parameters():
        if name.startswith("pooler."):
            param.requires_grad_(False)
    apply_moe_options(model, cfg.moe, seed=cfg.schedule.seed)
    return model, tokenizer, pooling


def scratch_bert(cfg: StudentConfig, vocab_size: int) -> torch.nn.Module:
    """The randomly initialised BERT of train.init=scratch (train.scratch_*), without a pooler: the student pools
    itself. Built under `torch.device("meta")` it gives the parameter count without memory (the cost model)."""
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(
        vocab_size=vocab_size, hidden_size=cfg.scratch_hidden_size, num_hidden_layers=cfg.scratch_num_layers,
        num_attention_heads=cfg.scratch_num_heads, intermediate_size=cfg.scratch_intermediate_size,
        max_position_embeddings=max(512, cfg.passage_max_length)), add_pooling_layer=False)


def apply_moe_options(model: torch.nn.Module, cfg: MoeConfig, seed: int) -> None:
    """train.moe_experts / moe_top_k / moe_train_only_intermediate on a freshly built student."""
    existing = moe_layers(model)  # init from an MoE export: keep its experts
    if cfg.moe_experts and not existing:
        add_moe(model, cfg.moe_experts, cfg.moe_top_k, seed=seed)
    elif cfg.moe_experts and (existing[0].num_experts, existing[0].top_k) != (cfg.moe_experts, cfg.moe_top_k):
        raise ValueError(f"train.init is an MoE model with {existing[0].num_experts} experts, top_k "
                         f"{existing[0].top_k}; set train.moe_experts/moe_top_k to those (or 0 to keep them).")
    if cfg.moe_train_only_intermediate:
        freeze_all_but_intermediate(model)


def embed(model, tokenizer, texts: list[str], max_length: int, pooling: str, device,
          counters: dict | None = None) -> torch.Tensor:
    """L2-normalised pooled embeddings; adds the token count the forward computed (padded, or packed: the texts'
    own) to counters["tokens"] when given. A model set to packed passes (choose_packing) gets the texts end to end."""
    if texts and packing.is_packed(model):
        return embed_packed(model, tokenizer, texts, max_length, pooling, device, counters)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
    if counters is not None:
        counters["tokens"] = counters.get("tokens", 0) + int(batch["input_ids"].numel())
    hidden = model(**batch).last_hidden_state
    return F.normalize(pool(hidden.float(), batch["attention_mask"], pooling), dim=-1)


def embed_packed(model, tokenizer, texts: list[str], max_length: int, pooling: str, device,
                 counters: dict | None = None) -> torch.Tensor:
    """embed's vectors from one packed pass: no padding tokens (modeling/packing.py)."""
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(row) for row in ids], out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(offsets[-1]))
    batch = packing.pack(flat, offsets, np.arange(len(ids)), packing.position_offset(getattr(model, "module", model)))
    if counters is not None:
        counters["tokens"] = counters.get("tokens", 0) + int(offsets[-1])
    hidden = packing.forward(model, batch, torch.device(device))
    return F.normalize(packing.pool(hidden.float(), batch, pooling), dim=-1)


def choose_packing(model: torch.nn.Module, tokenizer, pooling: str, mode: str, max_length: int, device) -> str:
    """train.packing on the student (before DDP wraps it): 'packed (<kernel>)' or 'padded' (packing.choose, checked
    on a few texts in eval mode, so that dropout does not tell the two apart, with a backward pass through the packed
    forward: a kernel without one would fail at the first step). 'auto' packs on CPUs too: a training batch is not
    sorted by length, and one attention call per text beat padding there (a step 0.59x as long on the bundled data,
    benchmarks/RESULTS.md). A GPU kernel without attention dropout (torch's varlen_attn) does not pack a student
    that trains with it."""
    device = torch.device(device)
    was_training = model.training
    dropout = float(getattr(model.config, "attention_probs_dropout_prob", 0.0) or 0.0) if was_training else 0.0
    model.to(device).eval()

    def vectors(backward: bool) -> torch.Tensor:
        with torch.set_grad_enabled(backward), \
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = embed(model, tokenizer, packing.PROBE_TEXTS, max_length, pooling, device)
        if backward:
            out.float().sum().backward()
            model.zero_grad(set_to_none=True)
        return out.detach()
    try:
        return packing.choose(model, mode, device, lambda: vectors(True), lambda: vectors(False), "train.packing",
                              auto_on_cpu=True, dropout=dropout)
    finally:
        model.train(was_training)


def text_keys(texts: list[str]) -> torch.Tensor:
    """text_hashes as a tensor, for the loss's masking of equal texts."""
    return torch.from_numpy(text_hashes(texts))


def matmul_params(model: torch.nn.Module) -> int:
    """Trainable parameters that take part in a token's matmuls (embedding tables excluded), for FLOP estimates."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    total = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in embeddings)
    # a token passes through top_k of the E experts of an MoE layer, not all of them
    idle = sum((1 - layer.top_k / layer.num_experts) * p.numel()
               for layer in moe_layers(model) for p in layer.experts.parameters() if p.requires_grad)
    return int(total - idle)
