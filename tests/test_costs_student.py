"""The cost model sizes the from-scratch student with the builder that training uses."""
from __future__ import annotations

from clusterscale import config as config_mod
from clusterscale.modeling.student import build_student
from clusterscale.stages.costs import student_param_count


def test_scratch_param_count_equals_the_built_student():
    cfg = config_mod.load(None, ["train.init=scratch", "train.scratch_hidden_size=32", "train.scratch_num_layers=1",
                                 "train.scratch_num_heads=2", "train.scratch_intermediate_size=64",
                                 "train.passage_max_length=600"])
    model, _, _ = build_student(cfg.train)
    assert student_param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert model.config.max_position_embeddings == 600 and model.config.hidden_size == 32
