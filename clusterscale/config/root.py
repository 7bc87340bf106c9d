"""The whole config: its sections, building it from a nested dict (unknown keys and bad values are errors that
name the key), variants, fingerprints of sections, and the key reference that `clusterscale config` prints."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from clusterscale.config.sections import (ClusterConfig, DataConfig, DedupConfig, EmbedConfig, EvalConfig, MineConfig,
                                          RayConfig, ShardConfig)
from clusterscale.config.train import TrainConfig
from clusterscale.errors import bounded_repr
from clusterscale.knobs import ConfigError, Registry, check_type, output_keys
from clusterscale.redact import redact_values


class Fingerprint(str):
    """A config hash that also carries the values it covers, so a refused rerun can name the changed keys."""

    def __new__(cls, digest: str, values: dict | None = None) -> Fingerprint:
        obj = super().__new__(cls, digest)
        obj.values = values
        return obj


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mine: MineConfig = field(default_factory=MineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    stage_sections: dict = field(default_factory=dict, repr=False)
    """The sections of registered stages (executor.Stage.config), by stage name: read as cfg.<name> like a built-in."""

    def __post_init__(self) -> None:
        for name, section in registered_sections().items():
            self.stage_sections.setdefault(name, section())

    def __getattr__(self, name: str) -> Any:
        """A registered stage's section (one registered after this config was made gets its defaults)."""
        sections = registered_sections() if not name.startswith("_") and name != "stage_sections" else {}
        if name not in sections:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.__dict__.setdefault("stage_sections", {}).setdefault(name, sections[name]())

    def to_dict(self) -> dict:
        """{section: {key: value}}, flat under each section as in YAML (the train components' keys merged)."""
        return {name: getattr(self, name).to_dict() for name in all_sections()}

    def fingerprint(self, sections: tuple[str, ...], extra: dict | None = None) -> Fingerprint:
        """Hash of the output-affecting keys of `sections`: equal fingerprints = reusable outputs."""
        payload = {name: output_keys(getattr(self, name)) for name in sections}
        if extra:
            payload["extra"] = extra
        # Credentials in a URI do not change what a stage outputs: rotating a key keeps completed work.
        payload = redact_values(payload)
        return Fingerprint(hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16], payload)

    def hash(self) -> str:
        return str(self.fingerprint(all_sections()))

    def validate(self) -> None:
        """Each section checks its own keys (the first error raises ConfigError naming the key)."""
        for name in all_sections():
            getattr(self, name).validate()
        if self.cluster.side != "passage" and self.embed.side != "both":
            raise ConfigError(f"cluster.side={self.cluster.side} clusters the query vectors (`emb_query`), which "
                              f"embed.side={self.embed.side} does not write: set embed.side=both (a new --run-dir, or "
                              f"--replace of embeddings/), or cluster.side=passage.")
        labeled = self.train.objective.labeled_negatives_per_query
        if labeled and self.data.negative_column is None:  # known at load: it was found after Ray's start
            raise ConfigError(f"{self.train.key('labeled_negatives_per_query')}={labeled} needs labeled negatives: "
                              f"set data.negative_column to the input column(s) that hold them (one text or a list "
                              f"per row, or several columns: negative_1,negative_2 or negative_*; a new --run-dir, or "
                              f"--replace of pairs/), or set "
                              f"{self.train.key('labeled_negatives_per_query')}=0.")
        every = self.train.shards.recluster_every
        if every and self.dedup.enabled and self.dedup.apply_to_shards:
            raise ConfigError(f"{self.train.key('recluster_every')}={every} re-shards the pairs "
                              "from a fresh embedding, without the dedup stage, so its segments would train on "
                              "pairs dedup removed (duplicates, held-out leaks). Re-clustering with dedup applied to "
                              f"the shards is not supported yet: set {self.train.key('recluster_every')}=0, or "
                              "dedup.apply_to_shards=false (dedup then only reports), or turn dedup off.")

    def train_name(self) -> str:
        schedule = self.train.schedule
        return schedule.name or f"{schedule.sampler}-seed{schedule.seed}"


SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name != "stage_sections")  # the built-in ones

# The sections stages declare next to their code (executor.Stage.config, named like the stage). The pipeline hands
# them over (set_stage_sections; config sits below it) as a function read at every lookup, so they follow
# pipeline.STAGES as it is when a config is made.
_stage_sections: Callable[[], dict[str, type]] = dict


def set_stage_sections(provider: Callable[[], dict[str, type]]) -> None:
    """provider() -> {stage name: its Section class}, for every stage that declares one."""
    global _stage_sections
    _stage_sections = provider


def registered_sections() -> dict[str, type]:
    """The registered stages' sections, by name; a name taken by a built-in section is refused."""
    sections = _stage_sections()
    taken = sorted(set(sections) & set(SECTIONS))
    if taken:
        raise ConfigError(f"A stage's config section is named like the built-in section(s) {', '.join(taken)}: name "
                          "the stage otherwise (its section takes the stage's name).")
    return sections


def all_sections() -> tuple[str, ...]:
    """The built-in sections, then the registered stages' in pipeline order."""
    return SECTIONS + tuple(registered_sections())


def _key_text(key: Any) -> str:
    """A key as the user wrote it, bounded (a key can be any YAML value)."""
    return key if isinstance(key, str) and len(key) <= 60 else bounded_repr(key)


def from_dict(raw: dict | None) -> Config:
    """Build a Config from a nested dict, rejecting unknown sections/keys and bad values by name."""
    cfg = Config()
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"The config must be a mapping of sections ({', '.join(all_sections())}), got "
                          f"{type(raw).__name__}.")
    for section, values in raw.items():
        if section == "config_hash":  # present in a RUN/config.yaml fed back in
            continue
        if section not in all_sections():
            raise ConfigError(f"Unknown config section {bounded_repr(section)}; allowed sections: "
                              f"{', '.join(all_sections())} (a stage's own section is known while the stage is in "
                              "pipeline.STAGES).")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"Config section {section!r} must be a mapping of keys, got {bounded_repr(values)}.")
        known = getattr(cfg, section).knobs()
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"Unknown config key {section}.{_key_text(key)}; allowed keys in {section}: "
                                  f"{', '.join(sorted(known))}.")
            owner, f = known[key]
            setattr(owner, key, check_type(f"{section}.{key}", f, value))
    cfg.validate()
    return cfg


def variant(cfg: Config, **sections: dict) -> Config:
    """A copy of cfg with some keys changed, validated like a user's config (unknown values are errors)."""
    raw = cfg.to_dict()
    for section, updates in sections.items():
        raw[section].update(updates)
    return from_dict(raw)


def _choices(f) -> str:
    return "|".join(f.metadata["choices"]) + ("|an integer" if str(f.type) == "int | str" else "") \
        if f.metadata["choices"] else ""


def describe() -> str:
    """Every key with its default and doc: the reference printed by `clusterscale config`."""
    lines = []
    for section in all_sections():
        obj = getattr(Config(), section)
        lines.append(f"{section}:")
        for name, (owner, f) in obj.knobs().items():
            choices = f" ({_choices(f)})" if f.metadata["choices"] else ""
            lines.append(f"  {name}: {getattr(owner, name)!r}{choices}\n      {f.metadata['doc']}")
            if isinstance(f.metadata["choices"], Registry):  # every registered choice, a newcomer's too
                lines += [f"      - {choice}: {doc}" for choice, doc in f.metadata["choices"].docs()]
    return "\n".join(lines)


def describe_markdown() -> str:
    """The same reference as Markdown, one table per section: docs/configuration.md is this text
    (`clusterscale config --markdown`; a test keeps the copy equal)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = []
    for section in all_sections():
        obj = getattr(Config(), section)
        lines += [f"## `{section}`", "", "| key | default | meaning |", "|---|---|---|"]
        for name, (owner, f) in obj.knobs().items():
            choices = f" (one of {cell(_choices(f))})" if f.metadata["choices"] else ""
            doc = f.metadata["doc"]
            if isinstance(f.metadata["choices"], Registry):
                doc += " Registered: " + "; ".join(f"`{c}`: {d}" for c, d in f.metadata["choices"].docs()) + "."
            lines.append(f"| `{section}.{name}` | `{cell(repr(getattr(owner, name)))}`{choices} | {cell(doc)} |")
        lines.append("")
    return "\n".join(lines)
