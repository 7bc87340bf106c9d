"""The optimizer's keys of the train section: AdamW and the learning-rate schedule (config only, torch-free; the
optimizer is train/optim.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clusterscale.knobs import NON_NEGATIVE, POSITIVE, ConfigError, Section, knob


@dataclass
class OptimizerConfig(Section):
    """Optimiser (AdamW) and learning-rate schedule."""
    section: ClassVar[str] = "train"

    lr: float = knob(5e-5, "Peak learning rate of AdamW (paper, from scratch: 4e-4).", bounds=POSITIVE)
    final_lr: float = knob(5e-6, "Learning rate at the last step after linear decay (paper: 4e-5).")
    warmup_steps: int = knob(10, "Linear warmup steps from 0 to lr (paper: 50).", bounds=NON_NEGATIVE)
    weight_decay: float = knob(0.01, "AdamW weight decay (PyTorch's default).", bounds=NON_NEGATIVE)
    max_grad_norm: float = knob(1.0, "Gradient clipping norm.", bounds=POSITIVE)

    def check_rules(self) -> None:
        if not 0 <= self.final_lr <= self.lr:
            raise ConfigError(f"{self.key('final_lr')} must be in [0, {self.key('lr')}={self.lr}], "
                              f"got {self.final_lr}.")
