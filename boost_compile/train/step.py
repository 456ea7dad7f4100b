"""What the training step functions share: :class:`StepOutput`, gradient clipping, and the
optimizer tail after the backward (:func:`make_optimizer_tail`). The one-process step is
:func:`boost_compile.train.loop.make_train_step`, the pipeline's :mod:`boost_compile.train.pipeline`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from boost_compile.train.optim import state_bytes
from boost_compile.train.parallel import Dist, is_dtensor


@dataclass
class StepOutput:
    """What one training step reports."""

    loss: float  # averaged over dp
    lr: float  # the learning rate the step used
    grad_norm: float | None = None  # before clipping; None without optim.grad_clip
    state: dict[str, int] | None = None  # the first step's: bytes of params, grads, optimizer state on this rank


StepFn = Callable[[torch.Tensor, torch.Tensor], StepOutput]


def clip_grad_norm(model: nn.Module, max_norm: float, dev: Dist) -> float:
    """Clip to the global gradient norm; returns it (before clipping).

    With ep, each rank's experts' squared norms are summed over its expert group (its replicas
    hold the same gradients). With tp, the
    shards of a parameter count once (their squared norms are summed
    over the tp group, a replicated parameter's are not; under FSDP2 each TP shard's squared norm is
    first summed over its dp_shard slices); with pp, every stage's
    squared norm is summed over the pp group, so every stage clips with the whole
    model's norm.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if dev.tp == 1 and dev.pp == 1 and dev.ep == 1:  # under FSDP2 the gradients are DTensor shards: torch sums their squares
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(total.full_tensor() if is_dtensor(total) else total)
    sharded = torch.zeros((), device=dev.device, dtype=torch.float32)
    whole = torch.zeros((), device=dev.device, dtype=torch.float32)
    experts = torch.zeros((), device=dev.device, dtype=torch.float32)
    for p in params:
        g = p.grad
        spec = getattr(p, "_boost_tp", None)
        if is_dtensor(g):  # vanilla's DTensor (whole once gathered), or FSDP2's slices of a TP shard
            sq = torch.linalg.vector_norm(g.detach().float()).full_tensor() ** 2
        else:
            sq = g.detach().float().pow(2).sum()
        if getattr(p, "_boost_ep", None) is not None:
            experts += sq
        elif spec is not None and spec.dim is not None:
            sharded += sq
        else:
            whole += sq
    if dev.tp > 1:
        dist.all_reduce(sharded, group=dev.group("tp"))
    if dev.ep > 1:  # each rank of the expert group its own experts
        dist.all_reduce(experts, group=dev.group("ep"))
    total = dev.sum_over_pp(sharded + whole + experts).sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if max_norm > 0 and coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return float(total)


def average_expert_replicas(model: nn.Module, dev: Dist) -> None:
    """With ``ep < dp``: each expert's gradient averaged over the ``dp / ep`` ranks that hold it.

    An expert's gradient on a rank is the mean over its expert group's tokens (the 1/ep inside the
    dispatch, expert_parallel.py); the data-parallel mean over every rank's tokens is the mean of
    those over the replicas: one all-reduce of every expert gradient, flattened, per step."""
    if dev.ep_mesh is None or dev.experts_fsdp_mesh is not None:  # FSDP2 reduce-scatters them over the replicas
        return
    grads = [p.grad for p in model.parameters() if getattr(p, "_boost_ep", None) is not None and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dev.group("edp"))
    flat /= dev.dp // dev.ep
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def make_optimizer_tail(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_clip: float,
    dev: Dist,
) -> Callable[[Callable[[], torch.Tensor]], StepOutput]:
    """``tail(reported_loss)``: what a step does once the gradients are in ``model``.

    Average the experts' gradients over their replicas (``ep < dp``), clip (``grad_clip > 0``),
    step the optimizer, measure the state on the first step (gradients and optimizer state all
    live), zero the gradients, step the schedule, and report :class:`StepOutput` with ``reported_loss()``: called last, so the step's
    loss reduction runs its collectives after the optimizer's.
    """
    first = [True]

    def tail(reported_loss: Callable[[], torch.Tensor]) -> StepOutput:
        average_expert_replicas(model, dev)
        grad_norm = clip_grad_norm(model, grad_clip, dev) if grad_clip > 0 else None
        optimizer.step()
        state = state_bytes(model, optimizer) if first[0] else None  # gradients and optimizer state all live
        first[0] = False
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        return StepOutput(loss=float(reported_loss()), lr=lr, grad_norm=grad_norm, state=state)

    return tail
