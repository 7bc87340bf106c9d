"""Config: defaults, YAML + --set layering, and errors that name the key."""
from __future__ import annotations

import pytest
import yaml

from clusterscale import config
from clusterscale.config import ConfigError


def test_embedded_default_applies_only_to_bundled_data():
    cfg = config.load()
    assert cfg.data.path == "builtin:docstrings" and cfg.data.limit == 4000 and cfg.train.schedule.steps == 40
    user = config.load(None, ["data.path=/data/pairs.parquet"])
    assert user.data.limit is None and user.train.schedule.steps is None


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"k": 16}, "train": {"lr": "2e-4"}}))
    cfg = config.load(path, ["cluster.k=32", "eval.k_values=[1,5]"])
    assert cfg.cluster.k == 32 and cfg.train.optimizer.lr == 2e-4 and cfg.eval.k_values == [1, 5]


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


@pytest.mark.parametrize("override, message", [
    (["mine.margin=0"], "mine.margin must be greater than 0 (or null = off), got 0.0."),
    (["embed.num_actors=-1"], "embed.num_actors must be >= 0 (0 = automatic), got -1."),
    (["embed.max_tokens_per_batch=100", "embed.max_length=256"],
     "embed.max_tokens_per_batch (100) must be at least embed.max_length (256)"),
    (["train.moe_experts=4", "train.moe_top_k=5"], "train.moe_top_k must be in [1, train.moe_experts=4], got 5."),
    (["train.lr=1e-5", "train.final_lr=1e-4"], "train.final_lr must be in [0, train.lr=1e-05], got 0.0001."),
    (["train.recluster_every=5", "train.sampler=random"], "train.recluster_every needs train.sampler=clustered"),
    (["mine.range_min=30"], "mine.range_min (30) must be >= 0 and below mine.range_max (30)."),
    (["eval.k_values=[]"], "eval.k_values must be a non-empty list of positive integers"),
])
def test_section_rules_name_their_keys(override, message):
    with pytest.raises(ConfigError) as err:
        config.load(None, override)
    assert message in str(err.value)


def bounded_keys() -> list[tuple[str, config.Bounds]]:
    """Every knob with numeric bounds, found from the dataclasses (so a new one is covered too)."""
    return [(f"{section}.{name}", f.metadata["bounds"]) for section in config.SECTIONS
            for name, (_, f) in getattr(config.Config(), section).knobs().items() if f.metadata["bounds"] is not None]


def test_every_bounded_knob_rejects_a_value_outside_its_bounds():
    assert {"cluster.k", "train.lr", "train.clp_lambda", "mine.ivf_nlist"} <= {key for key, _ in bounded_keys()}
    for key, bounds in bounded_keys():
        below = bounds.low - 1 if bounds.low_inclusive else bounds.low
        with pytest.raises(ConfigError, match=rf"^{key} must be "):
            config.load(None, [f"{key}={below}"])
        if bounds.high is not None:
            with pytest.raises(ConfigError, match=rf"^{key} must be in \["):
                config.load(None, [f"{key}={bounds.high}"])


def test_sections_know_their_yaml_names():
    cfg = config.Config()
    for section in config.SECTIONS:
        assert getattr(cfg, section).section == section
    assert cfg.train.key("moe_top_k") == "train.moe_top_k"
    with pytest.raises(AttributeError):
        cfg.train.key("moe_topk")  # a typo in a rule's message fails here, not in front of a user


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


def float_keys() -> list[str]:
    """Every float knob of every section, found from the dataclasses (so a new one is covered too)."""
    keys = []
    for section in config.SECTIONS:
        obj = getattr(config.Config(), section)
        keys += [f"{section}.{name}" for name, value in obj.to_dict().items() if isinstance(value, float)]
    return keys


@pytest.mark.parametrize("bad", [".nan", ".inf", "-.inf", "nan", "1e999"])
def test_every_float_knob_rejects_nan_and_inf(bad):
    assert {"train.temperature", "train.lr", "mine.margin"} <= set(float_keys())
    for key in float_keys():
        with pytest.raises(ConfigError) as err:
            config.load(None, [f"{key}={bad}"])
        assert f"{key} must be a finite number" in str(err.value)


@pytest.mark.parametrize("key", ["cluster.k", "train.steps", "data.limit"])
def test_true_is_not_an_integer(key):
    with pytest.raises(ConfigError, match=f"{key} must be an integer, got True"):
        config.load(None, [f"{key}=true"])
    with pytest.raises(ConfigError, match="eval.k_values must be a non-empty list of positive integers"):
        config.load(None, ["eval.k_values=[1, true]"])


def billion_laughs(levels: int, width: int) -> str:
    """A config whose data.source_column is a list of nested aliases: width^levels leaves in a few hundred bytes."""
    items = ["&a0 lol"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return f"data:\n  source_column: [{', '.join(items)}]\n"


def test_yaml_aliases_are_refused_and_messages_stay_small(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(6, 10))  # 10^6 leaves: its repr alone is ~7 MB (a real bomb has 10^9)
    assert path.stat().st_size < 1024
    with pytest.raises(ConfigError) as err:
        config.load(path)
    message = str(err.value)
    assert len(message) < 2000 and str(path) in message and "aliases and anchors are not allowed" in message


def test_bounded_repr_never_expands_shared_structure():
    from clusterscale.errors import bounded_repr

    value: list = ["lol"]
    for _ in range(30):  # 10^30 leaves by reference
        value = [value] * 10
    assert len(bounded_repr(value)) < 200 and len(bounded_repr("x" * 10**6)) < 100


def test_duplicate_keys_are_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("cluster:\n  k: 4\n  k: 16\n")
    with pytest.raises(ConfigError, match=r"(?s)dup.yaml is not valid YAML.*duplicate key 'k'"):
        config.load(path)
    path.write_text("cluster: {k: 4}\ncluster: {niter: 3}\n")
    with pytest.raises(ConfigError, match="duplicate key 'cluster'"):
        config.load(path)
    with pytest.raises(ConfigError, match=r"(?s)--set eval.k_values is not valid YAML.*duplicate key 'a'"):
        config.load(None, ["eval.k_values={a: 1, a: 2}"])


def test_non_utf8_config_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert f"Config file {path} is not UTF-8 text" in str(err.value) and "save it as UTF-8" in str(err.value)


def test_set_values_follow_the_file_rules(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match="train.lr must be a finite number"):
        config.load(path)
    with pytest.raises(ConfigError, match="aliases and anchors are not allowed"):
        config.load(None, ["eval.k_values=[&x 1, *x]"])


def test_recluster_with_dedup_is_refused_with_the_way_out():
    """Re-clustering re-shards without the dedup stage: with dedup applied to the shards the config is refused,
    naming the ways out; dedup beside the shards (apply_to_shards=false) is allowed."""
    with pytest.raises(ConfigError, match=r"train\.recluster_every=5 re-shards.*train\.recluster_every=0, or "
                                          r"dedup\.apply_to_shards=false"):
        config.load(None, ["train.recluster_every=5", "dedup.exact=true"])
    cfg = config.load(None, ["train.recluster_every=5", "dedup.exact=true", "dedup.apply_to_shards=false"])
    assert cfg.train.shards.recluster_every == 5 and not cfg.train.shards.dedup
