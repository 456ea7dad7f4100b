"""Expert parallelism: each MoE layer's experts sharded by expert over a group of ranks, tokens sent
to the rank that holds their expert by all-to-all and the results sent back.

Patterns (the experts modules of transformers 5, found by their contract, not their class):

    routed   forward(hidden [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]
             every direct parameter [num_experts, ...], the matrices 3-D: Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss, OLMoE...
    dense    forward(hidden [E * T, D]) -> [E * T, D], each expert's T rows in turn (Llama 4: every
             token through every expert, scaled by its router score before)

Anything else named ``experts`` (a ``ModuleList`` of expert MLPs, older code) is refused in one
line naming it. The ranks of the group are data-parallel ranks (torchtitan's EP borrows them):
each holds ``num_experts / ep`` experts and its own tokens; attention, router and shared experts
stay whole on every rank.

A routed layer's forward on each rank:

1. sort its (token, slot) assignments by expert (the sentinel index ``num_experts`` of a dropped
   assignment is left out); the experts are contiguous per rank, so the sorted rows are grouped
   by destination rank;
2. exchange the counts per expert (``all_to_all_single``), then the rows (uneven splits, the
   autograd all-to-all: the backward sends the gradients the other way);
3. run the module's own forward on the rows it received, each with its local expert id and a
   weight of 1 (exact: the module's math, biases and activation included, is untouched);
4. send the results back, weight them and add them per token in expert order, as the module adds
   them in one process.

Gradients: a rank's expert parameters receive the sum of every rank's tokens' gradients; they
are to be the data-parallel mean the replicated parameters get from their all-reduce, so the
gradient entering the experts' outputs is divided by ``ep`` and the one leaving their inputs
multiplied back (:class:`_ScaleGrad`, in the graph: no tensor hook, which a parameter re-created
by ``materialize_`` or FSDP2 would lose; exact for ep a power of two). Expert parameters carry
``_boost_ep`` (their :class:`ExpertShard`): a data-parallel wrapper must not all-reduce them over
the EP group.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROUTED = "routed"
DENSE = "dense"


class ExpertParallelError(ValueError):
    """A model or group expert parallelism cannot shard; the message names the module."""


@dataclass(frozen=True)
class ExpertShard:
    """What an expert parameter of this rank holds: experts ``[start, start + local)`` of ``total``."""

    fqn: str
    total: int
    local: int
    start: int
    ep: int


@dataclass
class ExpertParallelReport:
    """What :func:`expert_parallel_` sharded: each experts module's fqn and pattern."""

    ep: int
    layers: dict[str, str] = field(default_factory=dict)
    experts_per_rank: int = 0
    local_numel: int = 0
    total_numel: int = 0


# ----------------------------------------------------------------------------- finding experts


def _forward_arity(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def experts_pattern(module: nn.Module) -> str | None:
    """``routed`` or ``dense`` for an experts module of a known contract, None for anything else."""
    n = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    if not isinstance(n, int) or n < 1 or not params or any(p.dim() < 2 or p.shape[0] != n for p in params):
        return None
    if not any(p.dim() == 3 for p in params):
        return None  # a router's [num_experts, D] weight: no expert matrices
    if any(True for _ in module.children()) and any(
            any(True for _ in child.parameters()) for child in module.children()):
        return None  # parameters below the module: not the stacked-weights form
    arity = _forward_arity(module)
    return {3: ROUTED, 1: DENSE}.get(arity)


def find_experts(model: nn.Module) -> dict[str, str]:
    """Every experts module of ``model``: fqn -> pattern. ExpertParallelError, naming it, for a
    module called ``experts`` of another form."""
    found: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if any(fqn == f or fqn.startswith(f + ".") for f in found):
            continue
        pattern = experts_pattern(module)
        if pattern is not None:
            found[fqn] = pattern
        elif fqn.rsplit(".", 1)[-1] == "experts":
            kind = type(module).__name__
            raise ExpertParallelError(
                f"{fqn} ({kind}) holds experts in a form expert parallelism does not shard: it shards a module "
                "whose parameters are stacked [num_experts, ...] with forward(hidden, top_k_index, top_k_weights) "
                "or forward(hidden) over each expert's rows (transformers' experts modules)")
    return found


# ----------------------------------------------------------------------------- the layer


class _ScaleGrad(torch.autograd.Function):
    """The identity, its gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _experts_mean(forward: Any, ep: int, rows: torch.Tensor, *args: Any) -> torch.Tensor:
    """``forward(rows, *args)`` with the experts' parameter gradients divided by ``ep`` (the
    data-parallel mean of every rank's tokens) and the rows' gradient left as it is."""
    out = forward(_ScaleGrad.apply(rows, float(ep)), *args)
    return _ScaleGrad.apply(out, 1.0 / ep)


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    from boost_compile import _torch_compat as compat

    return compat.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


class ExpertParallel:
    """Mixed into an experts module's class by :func:`shard_experts` (as FSDP2's ``fully_shard``
    does): the module keeps its name, its parameters (now this rank's experts) and its own forward,
    which runs on the rows this rank receives; this forward dispatches every rank's tokens to it."""

    _ep_shard: ExpertShard
    _ep_pattern: str
    _ep_group: dist.ProcessGroup

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self._ep_pattern == DENSE:
            return self._dense(hidden)
        return self._routed(hidden, top_k_index, top_k_weights)

    @torch.compiler.disable
    def _routed(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Run eagerly under ``torch.compile``: the splits are counts read on the host, which would
        make every step's shapes a new graph; the graph breaks here, as transformers' own eager
        experts loop breaks it."""
        s, group = self._ep_shard, self._ep_group
        k = index.shape[-1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] < s.total]  # a dropped assignment (the sentinel) goes nowhere
        token = torch.div(order, k, rounding_mode="floor")
        counts = torch.bincount(flat[order], minlength=s.total)
        if self.training:  # this rank's tokens per expert, read and reset by expert_load
            self.tokens_per_expert.add_(counts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send = counts.view(s.ep, s.local).sum(1).tolist()
        recv = recv_counts.view(s.ep, s.local).sum(1).tolist()
        rows = _a2a(hidden[token], recv, send, group)
        # received: by source rank, then local expert; the module wants each expert's rows together
        local_ids = torch.arange(s.local, device=hidden.device).repeat(s.ep).repeat_interleave(recv_counts)
        by_expert = torch.argsort(local_ids, stable=True)
        ones = torch.ones(len(by_expert), 1, dtype=hidden.dtype, device=hidden.device)
        out = _experts_mean(super().forward, s.ep, rows[by_expert], local_ids[by_expert].unsqueeze(1), ones)
        if rows.shape[0] == 0 and torch.is_grad_enabled():
            out = out + 0 * self._anchor(rows)
        out = out[torch.argsort(by_expert)]
        back = _a2a(out, send, recv, group)
        weight = weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(hidden).index_add(0, token, (back * weight).to(hidden.dtype))

    def _anchor(self, rows: torch.Tensor) -> torch.Tensor:
        """A zero that depends on the received rows and on every expert parameter. A rank that
        received no rows must still run both all-to-alls' backward (the other ranks wait for it)
        and give its experts a zero gradient (as one process does for an expert no token chose);
        the module's forward on no rows returns a tensor that depends on neither."""
        terms = [rows.sum()] + [p.sum() for p in self.parameters(recurse=False) if p.requires_grad]
        return torch.stack(terms).sum()

    def _dense(self, hidden: torch.Tensor) -> torch.Tensor:
        s = self._ep_shard
        dim = hidden.shape[-1]
        per = hidden.shape[0] // s.total  # each expert's rows
        split = [s.local * per] * s.ep
        rows = _a2a(hidden, split, split, self._ep_group)  # [ep source, local, per, D]
        rows = rows.view(s.ep, s.local, per, dim).transpose(0, 1).reshape(-1, dim)
        out = _experts_mean(super().forward, s.ep, rows).view(s.local, s.ep, per, dim).transpose(0, 1).reshape(-1, dim)
        return _a2a(out, split, split, self._ep_group)


@functools.cache
def _expert_parallel_class(cls: type) -> type:
    """One class per experts class (every layer's module the same type: ``torch.compile`` guards on
    it, and a class per module would compile each layer anew)."""
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})


def shard_experts(experts: nn.Module, pattern: str, group: dist.ProcessGroup, fqn: str = "") -> ExpertShard:
    """Keep this rank's experts of ``experts`` and make it dispatch tokens over ``group``, in place."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    total = int(experts.num_experts)
    if total % ep:
        raise ExpertParallelError(f"{fqn or type(experts).__name__}: {total} experts do not split over ep={ep} ranks")
    local = total // ep
    shard = ExpertShard(fqn, total, local, rank * local, ep)
    with torch.no_grad():
        for name, p in list(experts.named_parameters(recurse=False)):
            kept = nn.Parameter(p[shard.start:shard.start + local].clone(), requires_grad=p.requires_grad)
            kept._boost_ep = shard
            setattr(experts, name, kept)
    on = torch.device("cpu") if any(p.is_meta for p in experts.parameters()) else next(experts.parameters()).device
    experts.register_buffer("tokens_per_expert", torch.zeros(total, dtype=torch.long, device=on), persistent=False)
    experts.__class__ = _expert_parallel_class(type(experts))
    experts.num_experts = local
    experts._ep_shard, experts._ep_pattern, experts._ep_group = shard, pattern, group
    return shard


# ----------------------------------------------------------------------------- the model


def expert_parallel_(model: nn.Module, group: dist.ProcessGroup | None = None) -> ExpertParallelReport:
    """Shard every experts module of ``model`` by expert over ``group`` (default: the world), in place.

    Every rank must hold the same weights before (the same init or checkpoint); after, each keeps
    its ``num_experts / ep`` experts. ExpertParallelError, naming the module, for a model with no
    experts module, an experts module of another form, or experts that do not split evenly."""
    group = group or dist.group.WORLD
    ep = dist.get_world_size(group)
    found = find_experts(model)
    if not found:
        raise ExpertParallelError(f"{type(model).__name__} has no experts module to shard (no mixture-of-experts layer)")
    report = ExpertParallelReport(ep)
    for fqn, pattern in found.items():
        experts = model.get_submodule(fqn)
        report.total_numel += sum(p.numel() for p in experts.parameters(recurse=False))
        report.experts_per_rank = shard_experts(experts, pattern, group, fqn).local
        report.layers[fqn] = pattern
        report.local_numel += sum(p.numel() for p in experts.parameters(recurse=False))
    return report


def expert_load(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """The tokens each expert received since the last call, over every rank of ``group`` (a
    collective): ``experts_tokens`` (a list per routed layer, a count per expert) and
    ``experts_max_over_mean`` (the most loaded expert over the mean, worst layer: 1 is balanced,
    ``num_experts / top_k`` all on one). The counts are reset. Empty for a model without routed layers."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallel) and m._ep_pattern == ROUTED]
    if not layers:
        return {}
    counts = torch.stack([m.tokens_per_expert for m in layers])
    dist.all_reduce(counts, group=group)
    for m in layers:
        m.tokens_per_expert.zero_()
    mean = counts.double().mean(1).clamp_min(1e-12)
    return {"experts_tokens": counts.tolist(),
            "experts_max_over_mean": float((counts.double().max(1).values / mean).max())}


def is_expert_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is one of this rank's experts (its gradient is not all-reduced over the EP group)."""
    return getattr(p, "_boost_ep", None) is not None
