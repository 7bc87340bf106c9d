"""Model folders that need their own Python code (`auto_map`): refused in the driver, before any actor or worker loads
them. Reads one or two small JSON files per folder; no torch, no network (a hub id is left to the loader)."""
from __future__ import annotations

import json
import os

from clusterscale.config import KEYWORDS, MODEL_PATH_KEYS, Config, ConfigError
from clusterscale.errors import bounded_repr

CODE_FILES = ("config.json", "tokenizer_config.json")  # where transformers finds a model's or tokenizer's own code
EMBED_CODE_KEY = "embed.trust_remote_code"  # the encoders: embed.model, and mine.encoder (mine re-embeds with it)
MOE_EXPORT_KEY = "clusterscale_moe"  # clusterscale's MoE export: rebuilt by clusterscale's code (modeling/moe_hf.py)


def custom_code(folder: str) -> tuple[str, dict] | None:
    """(file, its auto_map) of the first of CODE_FILES in `folder` that names the model's own code; None if none."""
    for name in CODE_FILES:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                document = json.load(f)
        except (OSError, ValueError):  # absent or unreadable: the loader says what is wrong with it
            continue
        if not isinstance(document, dict) or not document.get("auto_map"):
            continue
        if name == "config.json" and MOE_EXPORT_KEY in document:
            continue
        return name, document["auto_map"]
    return None


def check_model_code(cfg: Config) -> None:
    """Raise ConfigError for a local model folder of cfg whose own code would have to run and may not: the encoders
    run it only with embed.trust_remote_code=true, training (train.init, train.tokenizer) never does."""
    for section, key in MODEL_PATH_KEYS:
        value = getattr(cfg, section).get_key(key)
        folder = os.path.expanduser(value)
        if value in KEYWORDS or "://" in value or not os.path.isdir(folder):
            continue
        if (section, key) == ("train", "tokenizer") and cfg.train.get_key("init") != "scratch":
            continue  # the tokenizer key serves a student trained from scratch only
        allowed_by = EMBED_CODE_KEY if section in ("embed", "mine") else None
        if allowed_by and cfg.embed.trust_remote_code:
            continue
        found = custom_code(folder)
        if found is None:
            continue
        name, auto_map = found
        found_text = (f"{section}.{key}={folder}: its {name} names the model's own Python code (auto_map: "
                      f"{bounded_repr(auto_map)})")  # a file's text: bounded, control characters escaped
        if allowed_by:
            raise ConfigError(f"{found_text}, which the encoders run only when allowed: set {allowed_by}=true if you "
                              f"trust that code, or choose a model without custom code.")
        raise ConfigError(f"{found_text}; training builds the student with transformers' own classes and never runs "
                          f"a model folder's code: choose a model that transformers supports without custom code.")
