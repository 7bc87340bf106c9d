"""infonce: InfoNCE of each query against every rank's passages and negatives (train/loss.py's info_nce)."""
from __future__ import annotations

from clusterscale.train.loss_config import LOSSES, LossConfig
from clusterscale.train.losses import Loss, LossInputs


def info_nce_of(x: LossInputs, objective: LossConfig):
    from clusterscale.train.loss import info_nce  # torch: imported when a step runs, not when the config is checked

    return info_nce(x.q, x.p, objective.temperature, x.query_keys, x.passage_keys, objective.symmetric, x.neg,
                    x.neg_keys, x.neg_query_keys)


@LOSSES.register
class InfoNCE(Loss):
    name = "infonce"
    doc = "InfoNCE over the in-batch passages of every rank and the negatives"

    def __call__(self, x: LossInputs, objective: LossConfig):
        return info_nce_of(x, objective)
