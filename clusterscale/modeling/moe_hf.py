"""Exported MoE encoders: mark the folder, rebuild the model in clusterscale, and load it with transformers.

An MoE export's config.json has `model_type: clusterscale_moe` and a `clusterscale_moe` entry (experts,
top_k, base_model_type), so a plain `AutoModel.from_pretrained` fails loudly instead of loading random
intermediate weights. For BERT bases the folder also carries this file and moe.py as transformers remote
code: `AutoModel.from_pretrained(folder, trust_remote_code=True)` (and sentence-transformers with
`trust_remote_code=True`) rebuild it. clusterscale's own loader (`load_moe_model`) runs no code from
the folder.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

from .moe import add_moe, moe_layers

MODEL_TYPE = "clusterscale_moe"


class ClusterscaleMoeBertConfig(BertConfig):
    model_type = MODEL_TYPE


class ClusterscaleMoeBertModel(BertModel):
    """BertModel whose intermediate projections are MoE layers of the shape in config.clusterscale_moe."""

    config_class = ClusterscaleMoeBertConfig

    def __init__(self, config, add_pooling_layer: bool = True):
        super().__init__(config, add_pooling_layer=add_pooling_layer)
        shape = config.clusterscale_moe
        add_moe(self, int(shape["experts"]), int(shape["top_k"]))


def mark_moe_export(model: torch.nn.Module, out_dir: str) -> None:
    """After save_pretrained: record the MoE shape in config.json; add remote code for BERT bases."""
    layers = moe_layers(model)
    out = Path(out_dir)
    config = json.loads((out / "config.json").read_text())
    base = config.get("model_type")
    config["clusterscale_moe"] = {"experts": layers[0].num_experts, "top_k": layers[0].top_k,
                                  "base_model_type": base, "layers": len(layers)}
    config["model_type"] = MODEL_TYPE  # unknown to plain transformers: no silent random intermediate weights
    if base == "bert":
        config["architectures"] = [ClusterscaleMoeBertModel.__name__]
        config["auto_map"] = {"AutoConfig": f"moe_hf.{ClusterscaleMoeBertConfig.__name__}",
                              "AutoModel": f"moe_hf.{ClusterscaleMoeBertModel.__name__}"}
        here = Path(__file__).parent
        for name in ("moe.py", "moe_hf.py"):
            shutil.copyfile(here / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def load_moe_model(model_path: str, config: dict, attn_implementation: str | None = None) -> torch.nn.Module:
    """The base architecture with MoE layers of the recorded shape, weights from the folder's safetensors."""
    from safetensors.torch import load_file
    from transformers import CONFIG_MAPPING, AutoModel

    config = dict(config)
    shape = config.pop("clusterscale_moe")
    base = shape["base_model_type"]
    config.pop("auto_map", None)
    config.pop("architectures", None)
    config["model_type"] = base
    base_config = CONFIG_MAPPING[base].from_dict(config)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        model = AutoModel.from_config(base_config, **kwargs)
    except (ValueError, ImportError):  # this architecture has no such attention: use its default
        model = AutoModel.from_config(base_config)
    add_moe(model, int(shape["experts"]), int(shape["top_k"]))
    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        state.update(load_file(str(path)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("pooler.")]  # exports without a pooler (unused)
    if missing or unexpected:
        raise ValueError(f"The MoE export {model_path} does not match its config.json clusterscale_moe entry "
                         f"{shape}: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    return model.eval()
