"""Config: defaults, YAML + --set layering, and errors that name the key."""
from __future__ import annotations

import pytest
import yaml

from clusterscale import config
from clusterscale.config import ConfigError


def test_embedded_default_applies_only_to_bundled_data():
    cfg = config.load()
    assert cfg.data.path == "builtin:docstrings" and cfg.data.limit == 4000 and cfg.train.steps == 40
    user = config.load(None, ["data.path=/data/pairs.parquet"])
    assert user.data.limit is None and user.train.steps is None


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"k": 16}, "train": {"lr": "2e-4"}}))
    cfg = config.load(path, ["cluster.k=32", "eval.k_values=[1,5]"])
    assert cfg.cluster.k == 32 and cfg.train.lr == 2e-4 and cfg.eval.k_values == [1, 5]


@pytest.mark.parametrize("override, message", [
    (["cluster.kk=3"], "Unknown config key cluster.kk; allowed keys in cluster:"),
    (["clusters.k=3"], "Unknown config section 'clusters'"),
    (["embed.side=both_sides"], "embed.side must be one of"),
    (["cluster.k=0"], "cluster.k must be greater than 0"),
    (["cluster.k=many"], "cluster.k must be an integer"),
    (["train.global_batch_size=33"], "must be divisible by train.num_workers"),
    (["data.heldout_fraction=1.5"], "data.heldout_fraction must be in [0, 1)"),
    (["data.query_column=x", "data.passage_column=x"], "must name different columns"),
    (["cluster.k"], "--set expects section.key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        config.load(None, override)
    assert message in str(err.value)


def test_resolved_config_round_trips_with_hash(tmp_path):
    cfg = config.load(None, ["cluster.k=5"])
    text = config.to_yaml(cfg)
    raw = yaml.safe_load(text)
    assert raw["config_hash"] == cfg.hash()
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert config.load(path).hash() == cfg.hash()


def test_fingerprint_ignores_execution_only_keys():
    a = config.load(None, ["embed.num_actors=1", "train.num_workers=2"])
    b = config.load(None, ["embed.num_actors=4", "embed.batch_size=8", "train.num_workers=4"])
    assert a.fingerprint(("data", "embed")) == b.fingerprint(("data", "embed"))
    c = config.load(None, ["embed.max_length=32"])
    assert a.fingerprint(("data", "embed")) != c.fingerprint(("data", "embed"))


def test_describe_documents_every_key():
    text = config.describe()
    for section in config.SECTIONS:
        for key in config.output_keys(getattr(config.Config(), section)):
            assert f"  {key}:" in text
