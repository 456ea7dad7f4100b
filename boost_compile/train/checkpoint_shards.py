"""How a tensor-parallel rank's plain shards go into a checkpoint and come back.

``parallelize_`` (btp, megatron) keeps each parameter as a plain tensor holding
this rank's shard, described by its ``ShardSpec`` (``p._boost_tp``). A DCP
checkpoint must hold the whole, layout-free tensor, so that a run on another
layout (TP2 -> one process, one process -> TP2, DP2) reads it:
:func:`to_saved` turns each shard (of a parameter and of its optimizer state)
into a distributed tensor DCP saves chunk by chunk, :func:`to_local` turns what
DCP loaded back into the plain shards the model and optimizer hold.

Where a shard's rows lie in the whole tensor is :func:`shard_layout`: one run of
rows for a plain shard (a DTensor ``Shard``), one shorter run for a padded
vocabulary shard (its zero tail is no part of the whole: an uneven DTensor
``Shard``), one run per part for a fused weight cut part by part (``[q_r | k_r | v_r]``,
no DTensor placement: saved as the even ``Shard`` of the whole it gathers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from boost_compile.distributed.collectives import local_size
from boost_compile.distributed.shard import ShardSpec, full_tensor, shard_tensor
from boost_compile.train.parallel import is_dtensor


@dataclass(frozen=True)
class Chunk:
    """A run of rows (on ``spec.dim``) of a rank's shard that is one run of the whole tensor."""

    local: int  # its first row in the shard
    start: int  # its first row in the whole tensor
    length: int  # 0 for a rank wholly in a padded dim's tail


@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's shard lies in the whole tensor, on ``spec.dim``; the rows no chunk
    covers are padding (zeros)."""

    chunks: tuple[Chunk, ...]
    local: int  # the shard's size, padding included
    whole: int  # the whole tensor's size


def shard_layout(spec: ShardSpec, length: int, rank: int | None = None) -> ShardLayout:
    """The layout ``shard_tensor`` cuts for ``rank`` (``spec.rank`` by default); ``length``: the
    shard's size on ``spec.dim`` (a plain shard's whole is ``length * world``).

    Each part (``spec.sections``; else the padded ``spec.size``; else the whole) is cut as
    ``torch.chunk`` does: rank r holds rows ``[r * local, min((r + 1) * local, part))`` of it,
    ``local = ceil(part / world)``, then zeros up to ``local``.
    """
    rank = spec.rank if rank is None else rank
    parts = spec.sections or ((spec.size,) if spec.size is not None else (length * spec.world,))
    chunks, local, whole = [], 0, 0
    for part in parts:
        share = local_size(part, spec.world)
        start = min(rank * share, part)
        chunks.append(Chunk(local, whole + start, min(share, part - start)))
        local += share
        whole += part
    if local != length:
        raise ValueError(f"a shard of {length} rows on dim {spec.dim} does not fit {spec} ({local} rows)")
    return ShardLayout(tuple(chunks), local, whole)


def _specs(model: nn.Module) -> dict[str, ShardSpec | None]:
    """Each parameter's ``ShardSpec`` under every name it has (a tied head is in the state dict twice)."""
    return {name: getattr(p, "_boost_tp", None) for name, p in model.named_parameters(remove_duplicate=False)}


def to_saved(model: nn.Module, mesh: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict, dict]:
    """Plain TP shards (``parallelize_``'s btp/megatron) as DTensors over ``mesh`` (the tp
    mesh), so DCP saves each where it belongs in the whole tensor (see :func:`saved_form`).

    New dicts: the optimizer's state dict shares its per-parameter dicts with
    the live optimizer, which must keep its plain tensors. Collective on the tp group
    for a fused weight: every tp rank calls it, with the same keys.
    """
    specs = _specs(model)

    def wrap(name: str, t: Any) -> Any:
        spec = specs.get(name)
        if spec is None or spec.dim is None or not isinstance(t, torch.Tensor) or is_dtensor(t) or t.dim() == 0:
            return t
        return saved_form(t, spec, mesh)

    model_sd = {name: wrap(name, t) for name, t in model_sd.items()}
    return model_sd, map_optim_state(optim_sd, wrap)


def experts_saved(model: nn.Module, mesh: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any],
                  sharded_mesh: Any = None) -> tuple[dict, dict]:
    """Expert parallelism: each rank's experts (``_boost_ep``), and their optimizer state, as
    DTensors ``Shard(0)`` of the whole over ``mesh`` (the dp ranks they are sharded over; a 2-D
    ``(edp, ep)`` mesh where groups of ranks hold the same experts: ``Replicate(), Shard(0)``), so DCP
    saves every rank's experts where they belong and loads them into any other ``ep`` or into one
    process. Plain tensors under one name would be taken for replicas: one rank's experts saved
    for all. Experts FSDP2 shards over their replicas' ranks (DTensors over ``edp``) are saved over
    ``sharded_mesh`` (``(ep, edp)``) as ``Shard(0), Shard(0)``: cut by ep, then by FSDP2. New dicts,
    as :func:`to_saved`'s."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]

    shards = {name: p._boost_ep for name, p in model.named_parameters() if getattr(p, "_boost_ep", None) is not None}

    def wrap(name: str, t: Any) -> Any:
        shard = shards.get(name)
        if shard is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        shape = torch.Size((shard.total, *t.shape[1:]))
        if is_dtensor(t):  # FSDP2's Shard(0) of this rank's experts over their replicas
            if sharded_mesh is None:
                return t
            return DTensor.from_local(t.to_local(), sharded_mesh["ep", "edp"], [Shard(0), Shard(0)], run_check=False,
                                      shape=shape, stride=torch.empty(shape, device="meta").stride())
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    return {name: wrap(name, t) for name, t in model_sd.items()}, map_optim_state(optim_sd, wrap)


def saved_form(t: torch.Tensor, spec: ShardSpec, mesh: Any) -> Any:
    """One shard ``t`` as DCP saves it: a DTensor ``Shard`` of the whole tensor, its padding dropped.

    A shard that is one run of the whole (plain, padded) is its DTensor as it is, uneven
    where padded (``torch.chunk``'s offsets are the layout's). A fused weight's rank holds
    one run per part, which no DTensor placement describes: it is gathered whole (parts in
    order) and this rank keeps the ``torch.chunk`` slice of it, at the cost of an all-gather
    of the weight per save. (A ShardedTensor of the part runs needs no collective, but DCP's
    staging for ``async_save`` cannot copy one, and torch deprecates it.)
    """
    from torch.distributed.tensor import DTensor, Shard

    dim = spec.dim
    layout = shard_layout(spec, t.shape[dim])
    shape = list(t.shape)
    shape[dim] = layout.whole
    if len(layout.chunks) == 1:
        (c,) = layout.chunks
        mine = t if c.length == layout.local else t.narrow(dim, c.local, c.length).contiguous()
    else:
        whole = full_tensor(t, spec)
        size, offset = Shard.local_shard_size_and_offset(layout.whole, spec.world, spec.rank)
        mine = whole.narrow(dim, offset, size).clone()  # not a view: the whole is freed
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(mine, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=stride)


def to_local(model: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict, dict]:
    """What :func:`to_saved` made, after DCP loaded into it, back as the plain shards
    ``parallelize_`` keeps (a model whose parameters are DTensors keeps DTensors), each the
    live shard's shape: padding zeros re-added, a fused weight gathered and cut part by part
    again (collective on the tp group, as :func:`to_saved`); under TP x FSDP2 a slice in
    :func:`over_tp`'s form is this rank's FSDP2 slice as it is, any other shard is cut again into
    it (:func:`refit`)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    specs = _specs(model)

    def unwrap(name: str, t: Any) -> Any:
        live, spec = params.get(name), specs.get(name)
        tp_shard = spec is not None and spec.dim is not None and live is not None
        if isinstance(t, torch.Tensor) and t.dim() == 0:  # an optimizer's step count: the same everywhere
            return t
        if is_dtensor(t) and is_dtensor(live) and "tp" in (t.device_mesh.mesh_dim_names or ()):  # over_tp's form
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(t.to_local(), live.device_mesh, live.placements, run_check=False,
                                      shape=live.shape, stride=live.stride())
        if is_dtensor(live) and not tp_shard:  # vanilla's or FSDP2's DTensor: loaded in place, or under
            return t if is_dtensor(t) else refit(t, live)  # TP x FSDP2 a whole replicated tensor to cut
        if not is_dtensor(t):
            return t
        if not tp_shard:
            return t.to_local()
        mine = local_form(t, spec, live.shape)  # an FSDP2 DTensor's shape is its TP shard's
        return refit(mine, live) if is_dtensor(live) else mine

    model_sd = {name: unwrap(name, t) for name, t in model_sd.items()}
    return model_sd, map_optim_state(optim_sd, unwrap)


def over_fsdp(model: nn.Module, mesh: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict, dict]:
    """TP x FSDP2: each rank's FSDP2 slice of its TP shard as DCP saves it, gathering nothing: a
    DTensor of the whole tensor over FSDP2's mesh dims and ``tp`` (:func:`over_tp`). A padded
    vocabulary's or a fused weight's TP shard, which no placement describes, is gathered whole from
    its FSDP2 slices (collective on the dp_shard group, in the keys' order) for :func:`to_saved`."""
    specs = _specs(model)

    def form(name: str, t: Any) -> Any:
        spec = specs.get(name)
        if not is_dtensor(t) or spec is None or spec.dim is None or t.dim() == 0:
            return t  # FSDP2's own DTensor of a parameter TP keeps whole: saved as it is
        if spec.sections or spec.size is not None:
            return t.full_tensor()
        return over_tp(t, spec, mesh)

    return {name: form(name, t) for name, t in model_sd.items()}, map_optim_state(optim_sd, form)


def over_tp(t: Any, spec: ShardSpec, mesh: Any) -> Any:
    """FSDP2's DTensor ``t`` of a TP shard (one run of the whole on ``spec.dim``) as a DTensor of
    the whole tensor over ``mesh``'s FSDP2 dims and ``tp``: its local slice as it is. FSDP2 cuts
    the TP shard, so a dim both cut is a ``_StridedShard`` on FSDP2's dims (TP's cut is outer)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    names = (*t.device_mesh.mesh_dim_names, "tp")
    placements = [_StridedShard(p.dim, split_factor=spec.world) if isinstance(p, Shard) and p.dim == spec.dim else p
                  for p in t.placements]
    shape = list(t.shape)
    shape[spec.dim] *= spec.world
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t.to_local(), mesh[names], [*placements, Shard(spec.dim)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def refit(mine: torch.Tensor, live: Any) -> Any:
    """This rank's TP shard ``mine`` as FSDP2 holds it: ``live``'s DTensor layout over the dp_shard mesh."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(mine.to(live.dtype), live.device_mesh, live.placements)


def local_form(t: Any, spec: ShardSpec, shape: torch.Size) -> torch.Tensor:
    """This rank's shard of ``shape`` from the DTensor :func:`saved_form` made of it."""
    if len(shard_layout(spec, shape[spec.dim]).chunks) > 1:  # a fused weight: its parts' runs from the whole
        return shard_tensor(t.full_tensor(), spec.dim, spec.world, spec.rank, spec.sections)
    return with_padding(t.to_local(), spec, shape)


def with_padding(mine: torch.Tensor, spec: ShardSpec, shape: torch.Size) -> torch.Tensor:
    """The shard of ``shape`` whose one run of the whole is ``mine``, the rest zeros (a padded
    vocabulary's tail, as ``parallelize_`` cut it); ``mine`` itself when it is the whole shard."""
    layout = shard_layout(spec, shape[spec.dim])
    (c,) = layout.chunks
    if c.length == layout.local:
        return mine
    out = mine.new_zeros(shape)
    out.narrow(spec.dim, c.local, c.length).copy_(mine)
    return out


def map_optim_state(optim_sd: dict[str, Any], fn: Callable[[str, Any], Any]) -> dict[str, Any]:
    """A new optimizer state dict with ``fn(parameter name, value)`` applied to each state value.

    Takes both layouts of ``get_state_dict``: nested (``{"state": {name: {"exp_avg": ...}}}``)
    and flattened (``{"state.<name>.exp_avg": ...}``, pipeline runs).
    """
    if "state" in optim_sd:
        states = {name: {k: fn(name, t) for k, t in st.items()} for name, st in optim_sd["state"].items()}
        return {**optim_sd, "state": states}
    out = {}
    for key, value in optim_sd.items():
        if key.startswith("state."):
            name = key[len("state.") :].rsplit(".", 1)[0]
            value = fn(name, value)
        out[key] = value
    return out
