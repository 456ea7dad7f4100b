"""AdamW with decoupled weight decay on matrices only, and its learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from boost_compile.train.config import OptimConfig


def lr_multiplier(total: int, warmup: int, schedule: str, min_ratio: float) -> Callable[[int], float]:
    """LambdaLR factor for step s: linear warmup to 1, then ``schedule`` down to ``min_ratio``."""

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "constant":
            return 1.0
        if schedule == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return scale


def make_optimizer(model: nn.Module, opt: OptimConfig, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]  # norms, biases: no decay
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": opt.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=opt.lr,
        betas=(opt.betas[0], opt.betas[1]),
        eps=opt.eps,
    )
    warmup = opt.warmup_steps if opt.warmup_steps is not None else max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(steps, warmup, opt.schedule, opt.min_lr_ratio)
    )
    return optimizer, scheduler
