"""After every optimizer step: the reference MoE's routing over the step's whole batch, its router
biases moved, and what the metrics rows carry.

Each :class:`~boost_compile.models.moe.MoE` layer counts, in its training forwards, the assignments
its router chose and kept per expert and the sum of its sequences' balance losses (buffers, in the
compiled graphs too). :func:`after_step` sums them over the data-parallel ranks (one all-reduce:
every rank then holds the global batch's numbers), moves each layer's ``router_bias`` by
``router_bias_rate * sign(mean load - load_e)`` (the same on every rank, whatever the layout), resets
the counts and returns the metrics:

    experts_tokens          per layer, per expert: the assignments it received (kept) this step
    experts_max_over_mean   the most loaded expert over the mean, worst layer (1: balanced)
    moe_aux_loss            the mean over layers and sequences of E * sum_e f_e * P_e (1: balanced),
                            reported with or without router_aux_loss_coef, so runs compare
    moe_dropped             the fraction of the step's assignments dropped by expert_capacity_factor
                            (only with one)

With pipeline stages each rank holds some layers: their rows are gathered over the pipeline ranks,
listed by pipeline rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from boost_compile.models.moe import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    """The reference model's MoE layers of ``model`` (this rank's stages), in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def step_counts(layers: list[MoE]) -> torch.Tensor:
    """[L, 2E + 2] float64: each layer's chosen and kept assignments per expert, its sum of sequence
    balance losses and its sequences; the layers' counts are reset."""
    rows = []
    for m in layers:
        rows.append(torch.cat((m.routed_tokens.reshape(-1).double(), m.aux_stats.double())))
        m.routed_tokens.zero_()
        m.aux_stats.zero_()
    return torch.stack(rows)


@torch.no_grad()
def after_step(model: nn.Module, dp_group: Any = None, pp_group: Any = None) -> dict[str, Any]:
    """This step's routing over every data-parallel rank of ``dp_group`` (an all-reduce when it has
    several), the router biases moved from it, the counts reset; the metrics (module docstring).
    ``pp_group``: with pipeline stages, the rows of every stage's layers are gathered (a collective).
    Empty, and no collective, for a model without the reference MoE."""
    layers = moe_layers(model)
    if not layers:
        return {}
    counts = step_counts(layers)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    e = layers[0].num_experts
    for m, row in zip(layers, counts, strict=True):
        m.update_bias(row[:e])
    capacity = any(m.capacity_factor is not None for m in layers)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, (counts.cpu(), capacity), group=pp_group)
        counts = torch.cat([c for c, _ in gathered])
        capacity = any(c for _, c in gathered)
    return balance_metrics(counts, e, capacity)


def balance_metrics(counts: torch.Tensor, n_experts: int, capacity: bool) -> dict[str, Any]:
    """The metrics of :func:`after_step` from the summed counts ([L, 2E + 2], :func:`step_counts`)."""
    e = n_experts
    chosen, kept, aux = counts[:, :e], counts[:, e:2 * e], counts[:, 2 * e:]
    mean = kept.mean(1).clamp_min(1e-12)
    out: dict[str, Any] = {
        "experts_tokens": kept.long().tolist(),
        "experts_max_over_mean": float((kept.max(1).values / mean).max()),
    }
    if aux[:, 1].sum() > 0:
        out["moe_aux_loss"] = float(aux[:, 0].sum() / aux[:, 1].sum())
    if capacity:
        out["moe_dropped"] = float(1 - kept.sum() / chosen.sum().clamp_min(1))
    return out
