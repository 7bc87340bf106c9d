"""The mixture-of-experts keys of the train section (config only, torch-free; the layers are modeling/moe.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import NON_NEGATIVE, ConfigError, Section, knob


@dataclass
class MoeConfig(Section):
    """Mixture of experts in the student's feed-forward layers."""
    section: ClassVar[str] = "train"

    moe_experts: int = knob(0, "Mixture of experts: replace every layer's intermediate (FFN expansion) "
                               "Linear with this many routed copies of it plus a linear gate (the CLP "
                               "paper's MoE adapter); 0 = off, else >= 2.")
    moe_top_k: int = knob(2, "Experts per token (1..moe_experts); their gate probabilities (softmax over "
                             "all experts) are renormalised to weights that sum to 1.")
    moe_aux_loss_weight: float = knob(0.01, "Weight of the Switch-Transformer load-balancing loss (about 1.0 "
                                            "per layer and forward pass when balanced) added to InfoNCE.",
                                     bounds=NON_NEGATIVE)
    moe_train_only_intermediate: bool = knob(False, "Train only the intermediate projections (the experts and "
                                                    "gates under MoE, the dense ones otherwise); freeze the rest.")

    def check_rules(self) -> None:
        if self.moe_experts < 0 or self.moe_experts == 1:
            raise ConfigError(f"{self.key('moe_experts')} must be 0 (off) or >= 2, got {self.moe_experts}.")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ConfigError(f"{self.key('moe_top_k')} must be in [1, {self.key('moe_experts')}="
                              f"{self.moe_experts}], got {self.moe_top_k}.")
