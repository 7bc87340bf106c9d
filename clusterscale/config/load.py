"""Reading a config: the YAML of a file or a --set value (hardened), overrides, the embedded default, merging
with an existing run's config.yaml (and the check that a file agrees with it), absolute local paths, and the
resolved config as stored in RUN/config.yaml."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from clusterscale.config.root import Config, _key_text, all_sections, from_dict
from clusterscale.config.sections import DataConfig
from clusterscale.errors import bounded_repr
from clusterscale.knobs import PROMPT_CONTROLS, ConfigError, check_text, output_keys, refuse_control_characters
from clusterscale.redact import redact_values

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "default.yaml"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases (a 1 KB file of nested aliases expands to gigabytes) or duplicate keys
    (the later one would silently win)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"found the alias *{event.anchor[:60]}: "
                                              "aliases and anchors are not allowed in a config; write the "
                                              "value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = (key_node.tag, key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found the duplicate key {bounded_repr(key_node.value)}: keep one", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


MAX_CONFIG_BYTES = 1 << 20  # a real config is a few KiB; PyYAML parses ~0.3 MiB/s, so 1 MiB is ~3 s
MAX_ALIASED_NODES = 10_000  # what a cluster file's aliases may stand for in all: a KubeRay manifest shares a few maps


class _SharingLoader(_StrictLoader):
    """_StrictLoader that allows aliases (KubeRay manifests share `requests: &r` as `limits: *r`), as long as
    all of them stand for at most MAX_ALIASED_NODES nodes, counted as expanded (so nested aliases, the billion-laughs
    bomb, are refused without being expanded)."""

    def compose_document(self):
        self.aliased_nodes = 0
        return super().compose_document()

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            self.aliased_nodes += _expanded_size(self.anchors.get(event.anchor), {})
            if self.aliased_nodes > MAX_ALIASED_NODES:
                raise yaml.composer.ComposerError(None, None, f"the aliases (*{event.anchor[:60]} and those before it) "
                                                  f"stand for more than {MAX_ALIASED_NODES:,} values: write the "
                                                  f"values out", event.start_mark)
            return yaml.composer.Composer.compose_node(self, parent, index)
        return super().compose_node(parent, index)


def _expanded_size(node, sizes: dict) -> int:
    """How many nodes `node` stands for with every alias inside it expanded (each distinct node visited once)."""
    if node is None:
        return 0
    if id(node) not in sizes:
        sizes[id(node)] = 1  # a cycle (an alias inside its own anchor) counts once, and cannot be expanded anyway
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
        sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[id(node)]


def parse_yaml(data: bytes | str, source: str, aliases: bool = False, quote_hint: bool = False) -> Any:
    """YAML of a config file or a --set value (`source` names it in errors): UTF-8, at most MAX_CONFIG_BYTES,
    no aliases (aliases=True: bounded ones, for cluster files), no duplicate keys. quote_hint: a --set value, whose
    error says how to quote it."""
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source} is larger than {MAX_CONFIG_BYTES:,} bytes (1 MiB), the most a config may hold: "
                          f"a config is a few keys, and parsing this would take minutes and copy it into "
                          f"RUN/config.yaml. Check that it is the right file; keep long lists out of the config.")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source} is not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}): "
                              f"save it as UTF-8.") from None
    try:
        return yaml.load(data, Loader=_SharingLoader if aliases else _StrictLoader)
    except yaml.YAMLError as exc:
        hint = (" A text key's value is taken as typed unless it starts with a quote: leave the quotes out, or "
                "close them.") if quote_hint else ""
        raise ConfigError(f"{source} is not valid YAML: {exc}.{hint}") from None
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer beyond Python's 4300 digits
        raise ConfigError(f"{source} cannot be read as a config: {bounded_repr(str(exc))}.") from None


PROMPT_SUFFIX = "_prompt"  # embed.query_prompt, train.passage_prompt, ...: --set takes their text as typed
NULLS = ("null", "Null", "NULL", "~")  # YAML's nulls: what `--set data.source_column=null` means


def _text_key(section: str, key: str) -> str | None:
    """The type of a text knob ('str' or 'str | None': a path, a column or model name, a word), else None."""
    try:
        found = getattr(Config(), section).knobs().get(key)
    except AttributeError:  # an unknown section: from_dict names the allowed ones
        return None
    kind = str(found[1].type) if found else None
    return kind if kind in ("str", "str | None") else None


def parse_override(text: str) -> tuple[str, str, Any]:
    """'section.key=value' -> (section, key, value). A text key's value is taken as typed (stripped; a prompt's not
    even that), so that a path or column name holding ` #`, a leading `*` or `yes` stays what it says; quoted, it is
    read as YAML; `null` for a key that may be null. Any other value is YAML. A string value is checked here
    (check_text), so that a command can refuse a wrong --set before it opens the run directory."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set expects section.key=value, got {bounded_repr(text)} (e.g. --set cluster.k=16).")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    source = f"--set {_key_text(lhs)}"
    prompt = key.strip().endswith(PROMPT_SUFFIX)
    # Before YAML, which folds a newline into a space (a prompt's own newlines and tabs stay: knobs.PROMPT_CONTROLS).
    refuse_control_characters(source, rhs.strip(), allowed=PROMPT_CONTROLS if prompt else "")
    text_kind = _text_key(section.strip(), key.strip())
    if prompt:  # verbatim: "query: " is a prompt, not a YAML mapping, and its space counts
        value = rhs
    elif text_kind and not rhs.strip().startswith(("'", '"')):
        value = None if text_kind == "str | None" and rhs.strip() in NULLS else rhs.strip()
    else:
        value = parse_yaml(rhs, source, quote_hint=bool(text_kind)) if rhs.strip() else ""
    if isinstance(value, str) and not prompt:
        check_text(source, value)
    return section, key, value


def load(path: str | Path | None = None, overrides: list[str] | None = None,
         run_config: dict | None = None) -> Config:
    """The embedded default, updated by the YAML file at `path`, then by `section.key=value` overrides.

    run_config: the RUN/config.yaml of an existing run; it replaces the default, and a file at `path` must agree
    with it on every output-affecting key the file sets. Local paths come back absolute (see absolute_paths)."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"Config file {p} does not exist.")
        try:
            with p.open("rb") as f:  # read no more than the cap (the file may be huge, or a pipe)
                data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"Config file {p} cannot be read ({exc.strerror}): pass a readable YAML file.") from None
        raw = parse_yaml(data, f"Config file {p}") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"Config file {p} must hold a mapping of sections, got {type(raw).__name__}.")
    parsed = [parse_override(text) for text in overrides or []]
    if run_config is not None:
        if path is not None:
            _check_agrees(run_config, raw, str(path))
        raw = _merged(run_config, raw)
    elif path is None and _path_after(parsed) == "builtin:docstrings":
        raw = yaml.safe_load(DEFAULT_YAML.read_text())
    for section, key, value in parsed:
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        if not isinstance(raw[section], dict):
            raise ConfigError(f"Config section {bounded_repr(section)} must be a mapping.")
        raw[section][key] = value
    return absolute_paths(from_dict(raw))


def _merged(base: dict, top: dict) -> dict:
    """base with top's keys set over it, section by section (neither is modified)."""
    merged = copy.deepcopy(base)
    for section, values in top.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = copy.deepcopy(values)
    return merged


def _check_agrees(run_config: dict, file_raw: dict, path: str) -> None:
    """A config file given for an existing run may only change keys that do not change any output."""
    run_cfg, file_cfg = absolute_paths(from_dict(run_config)), absolute_paths(from_dict(_merged(run_config, file_raw)))
    differing = []
    for section, values in file_raw.items():
        if section not in all_sections() or not isinstance(values, dict):
            continue
        outputs, file_section = output_keys(getattr(run_cfg, section)), getattr(file_cfg, section)
        for key in values:
            if key in outputs and file_section.get_key(key) != outputs[key]:
                differing.append(f"{section}.{key} (run: {outputs[key]!r}, {path}: {file_section.get_key(key)!r})")
    if differing:
        raise ConfigError(f"{path} disagrees with the run's config.yaml on keys that change outputs: "
                          f"{'; '.join(differing)}. Verbs on an existing run start from its config.yaml: leave out "
                          f"the config file, change keys with --set, or use a new --run-dir for this config.")


# Keys that name a model folder or are a keyword / hub id; only an existing local folder is made absolute.
MODEL_PATH_KEYS = (("embed", "model"), ("train", "init"), ("train", "tokenizer"), ("mine", "encoder"))
KEYWORDS = ("bundled", "scratch", "frozen")


def absolute_paths(cfg: Config) -> Config:
    """cfg with its local paths made absolute against this process's working directory (cfg is changed).

    Ray workers (and Ray Train's) run in their own working directory: a relative path must never reach them."""
    data_path = cfg.data.path
    if data_path and not data_path.startswith("builtin:") and "://" not in data_path:
        cfg.data.path = os.path.abspath(os.path.expanduser(data_path))
    for section, key in MODEL_PATH_KEYS:
        value = getattr(cfg, section).get_key(key)
        local = os.path.expanduser(value)
        if value not in KEYWORDS and "://" not in value and os.path.exists(local):
            getattr(cfg, section).set_key(key, os.path.abspath(local))
    return cfg


def _path_after(parsed: list[tuple[str, str, Any]]) -> Any:
    """data.path once the overrides are applied to the defaults."""
    path = DataConfig().path
    for section, key, value in parsed:
        if (section, key) == ("data", "path"):
            path = value
    return path


def to_yaml(cfg: Config) -> str:
    """The resolved config as stored in RUN/config.yaml: credentials in URIs redacted."""
    return yaml.safe_dump(redact_values({"config_hash": cfg.hash(), **cfg.to_dict()}), sort_keys=False)


