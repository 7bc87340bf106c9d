"""clp: (1 - clp_lambda) * InfoNCE + clp_lambda * the mean over mined negatives of 1 - cos(negative, its own pair's
query) (CLP, arXiv 2412.17364; train/loss.py's clp_penalty)."""
from __future__ import annotations

from clusterscale.knobs import ConfigError
from clusterscale.train.loss_config import LOSSES, LossConfig
from clusterscale.train.losses import Loss, LossInputs
from clusterscale.train.losses.infonce import info_nce_of


@LOSSES.register
class CLP(Loss):
    name = "clp"
    doc = "InfoNCE plus the CLP penalty pulling each mined negative towards its own pair's query"
    needs_mined_negatives = True
    needs_negative_queries = True

    def check(self, objective: LossConfig) -> None:
        if objective.negatives_curriculum_steps:
            raise ConfigError(f"{objective.key('negatives_curriculum_steps')}={objective.negatives_curriculum_steps} "
                              f"leaves the first steps without mined negatives, which {objective.key('loss')}=clp's "
                              f"penalty needs at every step: set it to 0, or use loss=infonce.")

    def __call__(self, x: LossInputs, objective: LossConfig):
        from clusterscale.train.loss import clp_penalty  # torch: when a step runs

        loss, stats = info_nce_of(x, objective)
        term, clp_stats = clp_penalty(x.neg[x.usable], x.own_queries[x.usable])
        stats.update(clp_stats)
        return (1.0 - objective.clp_lambda) * loss + objective.clp_lambda * term, stats

    def chance(self, infonce_chance: float, objective: LossConfig) -> float:
        return (1 - objective.clp_lambda) * infonce_chance
