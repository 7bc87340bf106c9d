"""A model folder that needs its own Python code (`auto_map`) is refused by the driver, before Ray starts."""
from __future__ import annotations

import json
import re

import pytest

from clusterscale import cli
from clusterscale import config as config_mod
from clusterscale.config import ConfigError
from clusterscale.modeling.model_code import check_model_code

AUTO_MAP = {"AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel"}


def model_folder(path, config: dict | None = None, tokenizer_config: dict | None = None) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config or {"model_type": "bert"}))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(path)


def test_custom_code_is_refused_per_key_and_allowed_only_for_the_encoders(tmp_path):
    custom = model_folder(tmp_path / "custom", {"model_type": "custom_bert", "auto_map": AUTO_MAP})
    encoders, training = "set embed.trust_remote_code=true", "training builds the student"
    for key, fix in (("embed.model", encoders), ("mine.encoder", encoders), ("train.init", training),
                     ("train.tokenizer", training)):
        found = f"{key}={custom}: its config.json names the model's own Python code (auto_map: {AUTO_MAP!r})"
        with pytest.raises(ConfigError, match=f"{re.escape(found)}.*{fix}"):
            scratch = ["train.init=scratch"] if key == "train.tokenizer" else []  # the key only scratch reads
            check_model_code(config_mod.load(None, [f"{key}={custom}", *scratch]))
    check_model_code(config_mod.load(None, [f"train.tokenizer={custom}", "train.init=bundled"]))  # unused: not read
    allowed = ["embed.trust_remote_code=true"]
    check_model_code(config_mod.load(None, [f"embed.model={custom}", f"mine.encoder={custom}", *allowed]))
    with pytest.raises(ConfigError, match="train.init="):  # no knob lets training run it
        check_model_code(config_mod.load(None, [f"train.init={custom}", *allowed]))
    tokenizer = model_folder(tmp_path / "tok", tokenizer_config={"auto_map": {"AutoTokenizer": ["tok.T", None]}})
    with pytest.raises(ConfigError, match="its tokenizer_config.json names"):
        check_model_code(config_mod.load(None, [f"embed.model={tokenizer}"]))
    # clusterscale's MoE export carries an auto_map for other tools; clusterscale rebuilds it with its own code
    moe = model_folder(tmp_path / "moe", {"model_type": "clusterscale_moe", "auto_map": AUTO_MAP,
                                          "clusterscale_moe": {"experts": 4, "top_k": 1}})
    plain = model_folder(tmp_path / "plain")
    hub_id = "train.tokenizer=some/hub-id"  # left to the loader
    check_model_code(config_mod.load(None, [f"train.init={moe}", f"embed.model={plain}", hub_id]))


def test_the_cli_refuses_it_as_one_paragraph_before_ray_starts(tmp_path, monkeypatch, capsys):
    from clusterscale.runtime import session

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(session, "init_ray", no_ray)
    custom = model_folder(tmp_path / "custom", {"model_type": "custom_bert", "auto_map": AUTO_MAP})
    assert cli.main(["embed", "--run-dir", str(tmp_path / "run"), "--set", f"embed.model={custom}"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: embed.model={custom}: its config.json") and err.count("\n") == 1
    assert "Traceback" not in out + err and not (tmp_path / "run").exists()
