"""The pipeline config, loaded from YAML and validated before any work starts.

Each section is a dataclass of knobs (clusterscale/knobs.py): the stage sections in config/sections.py, the train
section composed of component configs that live next to their code (config/train.py); config/root.py builds and
fingerprints the whole, config/load.py reads files, --set overrides and a run's config.yaml. Torch-free."""
from clusterscale.config.load import (KEYWORDS, MODEL_PATH_KEYS, absolute_paths, load, parse_override, parse_yaml,
                                      to_yaml)
from clusterscale.config.root import (SECTIONS, Config, Fingerprint, all_sections, describe, describe_markdown, from_dict,
                                      registered_sections, set_stage_sections, variant)
from clusterscale.config.sections import (ClusterConfig, DataConfig, DedupConfig, EmbedConfig, EvalConfig, MineConfig,
                                          RayConfig, ShardConfig)
from clusterscale.config.train import TrainConfig
from clusterscale.knobs import Bounds, ComposedSection, ConfigError, Section, knob, output_keys

__all__ = ["KEYWORDS", "MODEL_PATH_KEYS", "SECTIONS", "Bounds", "ClusterConfig", "ComposedSection", "Config",
           "ConfigError", "DataConfig", "DedupConfig", "EmbedConfig", "EvalConfig", "Fingerprint", "MineConfig",
           "RayConfig", "Section", "ShardConfig", "TrainConfig", "absolute_paths", "all_sections", "describe",
           "describe_markdown", "from_dict", "knob", "load", "output_keys", "parse_override", "parse_yaml",
           "registered_sections", "set_stage_sections", "to_yaml", "variant"]
