"""How a tensor-parallel rank's plain shards go into a checkpoint and come back.

``parallelize_`` (btp, megatron) keeps each parameter as a plain tensor holding
this rank's shard, described by its ``ShardSpec`` (``p._boost_tp``). A DCP
checkpoint must hold the whole, layout-free tensor, so that a run on another
layout (TP2 -> one process, one process -> TP2, DP2) reads it:
:func:`to_saved` turns each shard (of a parameter and of its optimizer state)
into a distributed tensor DCP saves chunk by chunk, :func:`to_local` turns what
DCP loaded back into the plain shards the model and optimizer hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from boost_compile.train.parallel import is_dtensor


def to_saved(model: nn.Module, mesh: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict, dict]:
    """Plain TP shards (``parallelize_``'s btp/megatron) as DTensors over ``mesh`` (the tp
    mesh), so DCP saves each shard where it belongs in the whole tensor.

    New dicts: the optimizer's state dict shares its per-parameter dicts with
    the live optimizer, which must keep its plain tensors.
    """
    from torch.distributed.tensor import DTensor, Shard

    specs = {name: getattr(p, "_boost_tp", None) for name, p in model.named_parameters()}

    def wrap(name: str, t: Any) -> Any:
        spec = specs.get(name)
        if spec is None or spec.dim is None or not isinstance(t, torch.Tensor) or is_dtensor(t) or t.dim() == 0:
            return t
        if spec.sections:
            # a fused weight cut part by part ([q_r | k_r | v_r]) is no DTensor Shard: saved as
            # one, its whole tensor would come back with the parts in the wrong order
            raise NotImplementedError(
                f"{name}: checkpointing a fused weight sharded part by part (parts {list(spec.sections)}) "
                "is not supported; use separate q/k/v projections, or parallel.tp=1"
            )
        if spec.size is not None:
            # a padded vocabulary shard: DCP's Shard layout has no room for the padding
            raise NotImplementedError(
                f"{name}: checkpointing a head padded to a multiple of the TP degree (vocabulary {spec.size}) "
                "is not supported; use a vocabulary the TP degree divides (boost-train rounds it up to 64)"
            )
        return DTensor.from_local(t, mesh, [Shard(spec.dim)], run_check=False)

    model_sd = {name: wrap(name, t) for name, t in model_sd.items()}
    return model_sd, map_optim_state(optim_sd, wrap)


def to_local(model: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict, dict]:
    """What :func:`to_saved` made, after DCP loaded into it, back as the plain shards
    ``parallelize_`` keeps (a model whose parameters are DTensors keeps DTensors)."""
    params = dict(model.named_parameters())

    def unwrap(name: str, t: Any) -> Any:
        return t.to_local() if is_dtensor(t) and not is_dtensor(params.get(name)) else t

    model_sd = {name: unwrap(name, t) for name, t in model_sd.items()}
    return model_sd, map_optim_state(optim_sd, unwrap)


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
