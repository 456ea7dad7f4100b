"""AdamW with decoupled weight decay on matrices only, and its learning-rate schedule."""

from __future__ import annotations

import math
import sys
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


def make_optimizer(
    model: nn.Module, opt: OptimConfig, steps: int, zero_group: Any = None
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW and its schedule. ``zero_group``: shard the optimizer state over this (dp) process
    group, ZeRO stage 1, with PyTorch's ``ZeroRedundancyOptimizer``: each rank keeps the AdamW
    state of a share of the parameters, updates that share and broadcasts it to the others."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]  # norms, biases: no decay
    groups = [{"params": matrices, "weight_decay": opt.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    hyper = {"lr": opt.lr, "betas": (opt.betas[0], opt.betas[1]), "eps": opt.eps}
    optimizer: torch.optim.Optimizer
    if zero_group is None:
        optimizer = torch.optim.AdamW(groups, **hyper)
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            [g for g in groups if g["params"]], optimizer_class=torch.optim.AdamW, process_group=zero_group, **hyper
        )
    warmup = opt.warmup_steps if opt.warmup_steps is not None else max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(steps, warmup, opt.schedule, opt.min_lr_ratio)
    )
    return optimizer, scheduler


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: ZeRO's local AdamW, or ``optimizer`` itself.

    Importing ``torch.distributed.optim`` costs about 0.4 s (it scripts its functional
    optimizers), so a run without ZeRO never does: an optimizer can only be a
    ZeroRedundancyOptimizer once that module is loaded.
    """
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return optimizer.optim if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer) else optimizer


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards only)."""

    def nbytes(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    params = list(model.parameters())
    state = local_optimizer(optimizer).state
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params),
        "optimizer": sum(nbytes(v) for st in state.values() for v in st.values()),
    }
