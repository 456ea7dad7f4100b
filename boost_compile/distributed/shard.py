"""Shard mechanics for tensor parallelism: how a parameter is split (``ShardSpec``),
cutting a tensor into this rank's slice, showing a shard with its whole shape to
Dynamo, and gathering whole tensors back (state dicts, gradients).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from boost_compile import _torch_compat as compat
from boost_compile.distributed.collectives import local_size, tp_full_view


class ParallelizeError(ValueError):
    """The model, the mesh and the plan do not fit together."""


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the TP group.

    ``role``: "row" (a GEMM weight sharded on its input dim: partial outputs),
    "col" (sharded on its output dim), "shard" (any other tensor cut on ``dim``:
    embedding columns, norm weights), "replicate".
    ``sections``: the whole sizes of the parts a fused weight's output is split
    into (nanoGPT's ``c_attn`` -> q, k, v); each part is cut separately, so a
    rank holds ``[q_r | k_r | v_r]``.
    ``size``: the whole size of ``dim`` when the TP degree does not divide it (a
    vocabulary): each rank holds ceil(size / world), the last rank's tail zeros.
    ``head``: the output head's weight or bias, cut on the vocabulary.
    """

    role: str
    dim: int | None
    group_name: str
    world: int
    rank: int
    plan: str
    sections: tuple[int, ...] | None = None
    size: int | None = None
    head: bool = False


@dataclass(frozen=True)
class VocabShard:
    """A stage's logits as this rank returns them (``shard_logits``): columns
    ``[rank * local, (rank + 1) * local)`` of ``vocab``, ``local = ceil(vocab / world)``."""

    group_name: str
    world: int
    rank: int
    vocab: int


def shard_tensor(
    t: torch.Tensor, dim: int, world: int, rank: int, sections: Sequence[int] | None = None, pad: bool = False
) -> torch.Tensor:
    """This rank's slice of ``t`` on ``dim``; with ``sections``, its slice of each part; with
    ``pad``, ``dim`` is first padded with zeros to a multiple of ``world``."""
    if pad:
        local = local_size(t.shape[dim], world)
        start = min(rank * local, t.shape[dim])
        mine = t.narrow(dim, start, min(local, t.shape[dim] - start))
        shape = list(t.shape)
        shape[dim] = local - mine.shape[dim]
        return torch.cat([mine, t.new_zeros(shape)], dim=dim).contiguous()
    if not sections:
        return t.chunk(world, dim=dim)[rank].clone()
    return torch.cat([part.chunk(world, dim=dim)[rank] for part in t.split(list(sections), dim=dim)], dim=dim)


def shard_index(spec: ShardSpec, size: int) -> torch.Tensor:
    """Where each row (on ``spec.dim``) of the slice ``shard_tensor`` cuts for ``spec.rank`` lies in
    the whole dim of ``size``: -1 for a padded vocabulary's zero tail. Each part (``sections``, or
    the whole) is cut as ``torch.chunk`` cuts it."""
    if spec.size is not None:  # padded: ceil(size / world) rows a rank, the last ones zeros
        local = local_size(size, spec.world)
        start = min(spec.rank * local, size)
        mine = torch.arange(start, min(start + local, size))
        return torch.cat([mine, torch.full((local - len(mine),), -1, dtype=torch.long)])
    pieces, offset = [], 0
    for part in spec.sections or (size,):
        chunk = -(-part // spec.world)
        start = min(spec.rank * chunk, part)
        pieces.append(torch.arange(offset + start, offset + min(start + chunk, part)))
        offset += part
    return torch.cat(pieces)


def aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name under which each parameter is reachable (a tied weight has several)."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def show_whole(model: nn.Module, name: str, spec: ShardSpec, plan: str) -> None:
    """Make ``module.<attr>`` read as ``tp_full_view(shard)`` while Dynamo traces.

    The module gets a subclass of its own class with a property for the
    attribute: under tracing it returns the shard seen with its whole shape; in
    eager code it returns the shard itself (state-dict and optimizer code that
    reads attributes keeps working; the forward pass is guarded by the sentinel).
    Modules of one class whose attributes are cut alike share one subclass, so the
    blocks of a model compiled one by one keep one class, and one compiled artifact.
    """
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    cls = type(owner)
    base = cls.__dict__.get("_boost_base", cls) if getattr(cls, "_boost_full_view", False) else cls
    views = dict(getattr(cls, "_boost_views", {})) if base is not cls else {}
    views[attr] = (spec.dim, spec.world, -1 if spec.size is None else spec.size, plan)
    key = tuple(sorted(views.items()))
    cache = base.__dict__.get("_boost_view_classes")
    if cache is None:
        cache = {}
        base._boost_view_classes = cache
    if key not in cache:
        props = {a: property(_whole_reader(a, *v)) for a, v in views.items()}
        cache[key] = type(base.__name__, (base,), {"_boost_full_view": True, "_boost_base": base, "_boost_views": views,
                                                   "__module__": base.__module__, **props})
    owner.__class__ = cache[key]


def _whole_reader(attr: str, dim: int, world: int, size: int, plan: str):
    def read(self: nn.Module) -> torch.Tensor:
        shard = self._parameters[attr]
        if torch.compiler.is_compiling():
            return tp_full_view(shard, dim, world, plan, size)
        return shard

    return read


# ----------------------------------------------------------------------------- gathering back


def full_tensor(t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The whole tensor from this rank's shard (an all-gather on the shard dim)."""
    if hasattr(t, "full_tensor"):  # DTensor (vanilla plan)
        return t.full_tensor()
    if spec is None or spec.dim is None:
        return t.detach().clone()
    group = compat.resolve_process_group(spec.group_name)
    parts = [torch.empty_like(t) for _ in range(spec.world)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    if spec.size is not None:  # a padded dim: drop the padding
        return torch.cat(parts, dim=spec.dim).narrow(spec.dim, 0, spec.size).clone()
    if not spec.sections:
        return torch.cat(parts, dim=spec.dim)
    local = [size // spec.world for size in spec.sections]
    per_rank = [part.split(local, dim=spec.dim) for part in parts]
    return torch.cat([torch.cat([r[i] for r in per_rank], dim=spec.dim) for i in range(len(local))], dim=spec.dim)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A state dict of whole tensors (every rank gets the same), from a parallelized model."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full_tensor(p.data if not hasattr(p, "full_tensor") else p, getattr(p, "_boost_tp", None))
    for name, b in model.named_buffers():
        out[name] = b.detach().clone()
    return out


def gather_full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (None where a parameter has none)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else full_tensor(g, getattr(p, "_boost_tp", None))
    return out
