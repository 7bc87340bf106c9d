"""Text encoders: load (safetensors only), pool, L2-normalise, and export in sentence-transformers layout.

`Encoder` is the plain compute core of the embed and evaluate stages: it runs without Ray.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clusterscale.modeling.model_files import (BUNDLED, EncoderLoadError, _read_model_file,  # noqa: F401 (re-exported)
                                               check_encoder_files, check_tokenizer_files, check_weights,
                                               folder_prompts, frozen_prompts, resolve_model_path, with_prompt)
from clusterscale.modeling import packing
from clusterscale.modeling.moe import moe_layers
from clusterscale.modeling.tokens import TextTokenizer, Tokens

def detect_pooling(model_path: str) -> str:
    """The model's own pooling per its sentence-transformers config; CLS when it has none."""
    cfg = _read_model_file(model_path, "1_Pooling/config.json")
    if cfg and cfg.get("pooling_mode_mean_tokens"):
        return "mean"
    return "cls"


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "cls":
        return hidden[:, 0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def load_tokenizer(model_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise EncoderLoadError(f"No usable tokenizer at {model_path!r} ({type(exc).__name__}: {exc}). "
                               f"The folder needs tokenizer.json or vocab.txt with tokenizer_config.json; "
                               f"an HF id needs network access.") from exc


def load_model(model_path: str, trust_remote_code: bool = False,
               attn_implementation: str | None = None) -> torch.nn.Module:
    """AutoModel from safetensors; `attn_implementation` ('sdpa') is a wish, dropped if the model lacks it."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per actor and rank; workers stay quiet
    check_weights(model_path)
    config = _read_model_file(model_path, "config.json") or {}
    kwargs = dict(use_safetensors=True, trust_remote_code=trust_remote_code)
    try:
        if "clusterscale_moe" in config:  # a clusterscale MoE export: rebuilt by our own code, not the folder's
            from clusterscale.modeling.moe_hf import load_moe_model

            return load_moe_model(model_path, config, attn_implementation)
        if attn_implementation:
            try:
                return AutoModel.from_pretrained(model_path, attn_implementation=attn_implementation, **kwargs)
            except (ValueError, ImportError):  # this architecture has no such attention: use its default
                pass
        return AutoModel.from_pretrained(model_path, **kwargs)
    except Exception as exc:
        raise EncoderLoadError(f"Cannot load encoder weights from {model_path!r} ({type(exc).__name__}: {exc}).") from exc


def check_encoder(model: str, trust_remote_code: bool = False) -> None:
    """Fail fast in the driver (clear message, no dead actors) when the encoder cannot load."""
    path = resolve_model_path(model)
    check_weights(path)  # (its message names embed.model)
    check_tokenizer_files(path)
    load_tokenizer(path, trust_remote_code)


def token_budget_batches(lengths: np.ndarray, batch_size: int, max_tokens_per_batch: int) -> list[np.ndarray]:
    """Row indices per batch: longest first, each batch's padded size (rows x longest) within the budget.

    Sorting by length makes padding small; the budget keeps the activation size about constant, so
    short texts go in large batches (better matmul efficiency) and long texts in small ones."""
    order = np.argsort(-lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        longest = int(lengths[order[start]])
        rows = max(1, min(batch_size, max_tokens_per_batch // max(1, longest)))
        batches.append(order[start:start + rows])
        start += rows
    return batches


class Encoder:
    """A frozen encoder: texts -> L2-normalised float32 vectors (fp32 on CPU, bf16 autocast on GPU).

    Texts are tokenised once, sorted by length and batched by a token budget; vectors come back in
    the input order. packing (embed.packing): 'auto' packs a batch's texts end to end (no padding, a
    variable-length attention kernel; modeling/packing.py) on a GPU that has such a kernel and pads them
    elsewhere; 'packed' packs wherever it runs (on a CPU: exact, slower); 'padded' never packs. Packing is
    checked against padding on the model's own weights first, and a model that does not pack alike is padded."""

    def __init__(self, model: str, pooling: str = "auto", max_length: int = 256, device: str | None = None,
                 trust_remote_code: bool = False, threads: int | None = None, max_tokens_per_batch: int = 0,
                 packing: str = "auto"):
        if threads:
            torch.set_num_threads(threads)
        path = resolve_model_path(model)
        self.tokenizer = load_tokenizer(path, trust_remote_code)
        self.model = load_model(path, trust_remote_code, attn_implementation="sdpa").eval()
        self.pooling = detect_pooling(path) if pooling == "auto" else pooling
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.dim = int(self.model.config.hidden_size)
        # Padded tokens per forward pass; larger on a GPU, where big matmuls are needed to fill it.
        self.max_tokens_per_batch = max_tokens_per_batch or (65_536 if self.device.type == "cuda" else 8_192)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.pad_left = getattr(self.tokenizer, "padding_side", "right") == "left"
        self.text_tokenizer = TextTokenizer(self.tokenizer, max_length)  # max_length lives here (see the property)
        self.truncated = 0  # texts cut at max_length, counted for the stage stats
        self.last_truncated = np.zeros(0, dtype=bool)  # per text of the latest encode() call
        self.batching = self._choose_batching(packing)  # 'padded', or 'packed (<attention kernel>)'

    @property
    def packed(self) -> bool:
        return self.batching != "padded"

    def _choose_batching(self, mode: str) -> str:
        """'padded' or 'packed (<kernel>)' (packing.choose, on a few texts of different lengths)."""
        self.position_offset = packing.position_offset(self.model)
        tokens = self.tokenize(packing.PROBE_TEXTS)
        try:
            return packing.choose(
                self.model, mode, self.device, key="embed.packing",
                packed=lambda: torch.from_numpy(self._encode_packed(tokens, len(tokens), self.max_tokens_per_batch)),
                padded=lambda: torch.from_numpy(self._encode_padded(tokens, len(tokens), self.max_tokens_per_batch)))
        except packing.PackingError as exc:
            raise EncoderLoadError(str(exc)) from None

    @property
    def max_length(self) -> int:
        """Tokens per text; setting it (evaluate: queries and passages at their own lengths) re-cuts the tokenizer."""
        return self.text_tokenizer.max_length

    @max_length.setter
    def max_length(self, value: int) -> None:
        self.text_tokenizer.max_length = value

    def tokenize(self, texts: list[str]) -> Tokens:
        """Tokenise once, cut at max_length keeping the closing special token, flag the cuts."""
        return self.text_tokenizer(texts)

    def _collate(self, tokens: Tokens, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Pad one batch with numpy (tokenizer.pad is a Python loop per row)."""
        width = int(tokens.lengths[rows].max())
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for r, i in enumerate(rows):
            n = int(tokens.lengths[i])
            cols = slice(width - n, width) if self.pad_left else slice(0, n)
            ids[r, cols] = tokens.row(i)
            mask[r, cols] = 1
        batch = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
        if self.device.type == "cuda":
            return {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch

    def encode_tokens(self, tokens: Tokens, batch_size: int = 64, max_tokens_per_batch: int | None = None) -> np.ndarray:
        """Vectors of already tokenised texts, in their order."""
        budget = max_tokens_per_batch or self.max_tokens_per_batch
        if self.packed:
            return self._encode_packed(tokens, batch_size, budget)
        return self._encode_padded(tokens, batch_size, budget)

    @torch.inference_mode()
    def _encode_packed(self, tokens: Tokens, batch_size: int, budget: int) -> np.ndarray:
        """Each pass: texts end to end, at most `budget` real tokens."""
        out = torch.empty((len(tokens), self.dim), dtype=torch.float32, device=self.device)
        for rows in packing.packed_batches(tokens.lengths, batch_size, budget):
            batch = packing.pack(tokens.ids, tokens.offsets, rows, self.position_offset)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                hidden = packing.forward(self.model, batch, self.device)
            vec = F.normalize(packing.pool(hidden.float(), batch, self.pooling), dim=-1)
            out[torch.from_numpy(rows).to(self.device)] = vec
        return out.cpu().numpy()

    @torch.inference_mode()
    def _encode_padded(self, tokens: Tokens, batch_size: int, budget: int) -> np.ndarray:
        """Each pass: texts of about one length, padded to the longest, at most `budget` padded tokens."""
        out = torch.empty((len(tokens), self.dim), dtype=torch.float32, device=self.device)
        for rows in token_budget_batches(tokens.lengths, batch_size, budget):
            batch = self._collate(tokens, rows)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                hidden = self.model(**batch).last_hidden_state
            vec = F.normalize(pool(hidden.float(), batch["attention_mask"], self.pooling), dim=-1)
            out[torch.from_numpy(rows).to(self.device)] = vec
        return out.cpu().numpy()  # one device sync per call, not one per batch

    def encode(self, texts: list[str], batch_size: int = 64, max_tokens_per_batch: int | None = None) -> np.ndarray:
        """Embed `texts` in their order (at most `batch_size` texts and the token budget per pass)."""
        if not len(texts):
            self.last_truncated = np.zeros(0, dtype=bool)
            return np.zeros((0, self.dim), dtype=np.float32)
        tokens = self.tokenize(texts)
        self.last_truncated = tokens.truncated
        self.truncated += int(tokens.truncated.sum())
        return self.encode_tokens(tokens, batch_size, max_tokens_per_batch)


def save_sentence_transformers_dir(model, tokenizer, out_dir: str, pooling: str, max_length: int,
                                   prompts: tuple[str, str] = ("", "")) -> None:
    """Export a model folder that transformers (AutoModel) and sentence-transformers load directly; `prompts`
    (query, passage), when set, become its prompts named 'query' and 'passage'."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if moe_layers(model):  # record the expert shape so that loaders rebuild it (train.moe_experts)
        from clusterscale.modeling.moe_hf import mark_moe_export

        mark_moe_export(model, str(out))
    tokenizer.save_pretrained(out)
    dim = int(model.config.hidden_size)
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": dim, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length,
                                                                "do_lower_case": False}))
    # What SentenceTransformer.save writes next to modules.json: the versions it was saved with and the
    # similarity the vectors are meant for (they are L2-normalised, so cosine).
    (out / "config_sentence_transformers.json").write_text(json.dumps({
        "__version__": _library_versions(), "prompts": export_prompts(prompts), "default_prompt_name": None,
        "similarity_fn_name": "cosine", "model_type": "SentenceTransformer"}, indent=2))


def export_prompts(prompts: tuple[str, str]) -> dict[str, str]:
    """The sentence-transformers prompts of (query, passage): named 'query' and 'passage', and the passage's also as
    'document' (what SentenceTransformer.encode_document uses); none when both are ''."""
    query, passage = prompts
    return {"query": query, "passage": passage, "document": passage} if query or passage else {}


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name, dist in (("sentence_transformers", "sentence-transformers"), ("transformers", "transformers"),
                       ("pytorch", "torch")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:  # sentence-transformers is optional; the folder is still loadable by it
            continue
    return out
