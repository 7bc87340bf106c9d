"""The loss's keys of the train section: InfoNCE, mined hard negatives and the CLP penalty (config only, torch-
free; the loss is train/loss.py, the step train/step.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import FRACTION, POSITIVE, ConfigError, Section, knob, zero_means


@dataclass
class LossConfig(Section):
    """Loss: InfoNCE, mined hard negatives and the CLP penalty."""
    section: ClassVar[str] = "train"

    temperature: float = knob(0.05, "InfoNCE temperature tau (paper: 0.02 from scratch).", bounds=POSITIVE)
    symmetric: bool = knob(False, "Add the passage->query InfoNCE term (mean of both directions).")
    negatives_per_query: int = knob(0, "Mined hard negatives added per query to the in-batch candidates "
                                       "(every rank's, masked like in-batch false negatives); 0 = off. Needs "
                                       "the output of `clusterscale mine`; costs M more passage embeddings "
                                       "per query.", bounds=zero_means("no mined negatives"))
    loss: str = knob("infonce", "Training loss: 'infonce', or 'clp' = (1 - clp_lambda) * InfoNCE + clp_lambda "
                                "* mean over mined negatives of 1 - cos(negative, its own pair's query) "
                                "(CLP, arXiv 2412.17364; needs negatives_per_query >= 1).", ("infonce", "clp"))
    clp_lambda: float = knob(0.1, "Weight of the CLP penalty, in [0, 1) (paper: 0.1); used with loss=clp.",
                             bounds=FRACTION)

    def check_rules(self) -> None:
        if self.loss == "clp" and self.negatives_per_query < 1:
            raise ConfigError(f"{self.key('loss')}=clp needs mined negatives: set {self.key('negatives_per_query')} "
                              f">= 1 (e.g. 4) and run `clusterscale mine` before training.")
