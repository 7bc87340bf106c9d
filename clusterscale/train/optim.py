"""The optimiser and learning-rate schedule of training: AdamW, linear warm-up, then linear decay to train.final_lr."""
from __future__ import annotations

import torch

from clusterscale.train.optim_config import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, num_steps: int) -> float:
    """Linear warmup 0 -> lr over warmup_steps, then linear decay to final_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, num_steps - 1 - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr + (cfg.final_lr - cfg.lr) * frac


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig,
                    num_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters, and the scheduler that sets lr_at(step) (stepped once per global step)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, num_steps) / cfg.lr)
    return optimizer, scheduler
