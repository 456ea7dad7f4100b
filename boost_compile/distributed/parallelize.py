"""``parallelize_``: shard a model for tensor parallelism from its captured graph.

    report = bc.parallelize_(model, (tokens,), tp_mesh, plan="btp")
    step = torch.compile(model, backend="boost")

Plans (BOOST.md section 2):

- ``"btp"``: bottleneck-aware. The residual stream is sharded on d (the
  embedding's columns are sharded, so its output is the local slice); every down
  factor is row-parallel (a [T, r] all-reduce follows), every up factor
  column-parallel (identity forward, [T, r] all-reduce of its input gradient);
  attention runs on local heads, the MLP on local d_ff slices; block norms hold
  d/p of their weight and get their statistic through the next all-reduce
  (online RMSNorm). The stream is all-gathered once before the final norm; the
  final norm, the output head and the loss are replicated (each rank computes the
  same logits; their gradients need no collective).
- ``"megatron"``: dense blocks; q/k/v/gate/up column-parallel, o/down row-parallel,
  everything else replicated.
- ``"vanilla"``: the baseline for low-rank models: each factor pair is its own
  Megatron chunk (down column-parallel on r, up row-parallel on r), written with
  PyTorch's DTensor ``parallelize_module``; attention runs unsharded.
- ``"auto"``: btp when every block linear is in a bottleneck, megatron when none is.

Each rank keeps only its slices, cut from the unsharded weights it had. The
boost backend reads the shard spec attached to each parameter and inserts the
collectives; run without it, the model raises (``tp_sentinel``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from boost_compile.analysis import GraphView, capture_views
from boost_compile.distributed.collectives import gather_from_tp, tp_sentinel

log = logging.getLogger("boost_compile")

PLANS = ("btp", "megatron", "vanilla", "auto")


class ParallelizeError(ValueError):
    """The model, the mesh and the plan do not fit together."""


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the TP group.

    ``role``: "row" (a GEMM weight sharded on its input dim: partial outputs),
    "col" (sharded on its output dim), "shard" (any other tensor cut on ``dim``:
    embedding columns, norm weights), "replicate".
    """

    role: str
    dim: int | None
    group_name: str
    world: int
    rank: int
    plan: str


@dataclass
class TPReport:
    plan: str
    world: int
    specs: dict[str, ShardSpec] = field(default_factory=dict)

    def __str__(self) -> str:
        roles: dict[str, int] = {}
        for s in self.specs.values():
            roles[s.role] = roles.get(s.role, 0) + 1
        return f"parallelized with plan {self.plan!r} over {self.world} ranks: {roles}"


def _group_of(tp: Any) -> dist.ProcessGroup:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(tp, DeviceMesh):
        if tp.ndim != 1:
            if "tp" not in (tp.mesh_dim_names or ()):
                raise ParallelizeError("a multi-dimensional DeviceMesh needs a dimension named 'tp'")
            tp = tp["tp"]
        return tp.get_group()
    if isinstance(tp, dist.ProcessGroup):
        return tp
    raise ParallelizeError(f"tp must be a DeviceMesh or a ProcessGroup, got {type(tp).__name__}")


def _config_value(model: nn.Module, *names: str) -> int | None:
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def validate(model: nn.Module, world: int, plan: str) -> None:
    """Clear errors before any work: divisibility of heads, kv-heads, d and d_ff."""
    if plan not in PLANS:
        raise ParallelizeError(f"plan={plan!r} is not valid; choose one of {PLANS}")
    if not dist.is_initialized():
        raise ParallelizeError("torch.distributed is not initialised (call init_process_group first)")
    checks = {
        "heads": _config_value(model, "n_heads", "num_attention_heads"),
        "kv-heads": _config_value(model, "n_kv_heads", "num_key_value_heads"),
        "d": _config_value(model, "dim", "hidden_size"),
        "d_ff": _config_value(model, "ffn_dim", "intermediate_size"),
    }
    bad = [f"{k} ({v})" for k, v in checks.items() if v is not None and v % world]
    if bad:
        raise ParallelizeError(f"TP degree {world} must divide {', '.join(bad)}")
    if plan in ("btp", "auto") and getattr(getattr(model, "config", None), "tie_embeddings", False):
        raise ParallelizeError("plan btp shards the embedding on d but keeps the head whole; untie them")


# ----------------------------------------------------------------------------- roles


@dataclass
class _Roles:
    """What the graph says each parameter is."""

    view: GraphView
    embedding: str | None
    block_norms: list[str]
    final_norm: str | None
    chains: list[tuple[str, str, str, str]]  # (down weight, down layout, up weight, up layout)
    dense: list[tuple[str, str, str]]  # (weight, layout, "row"|"col")
    biases: dict[str, str]  # weight -> bias


def _analyse(model: nn.Module, example_inputs: Sequence[Any]) -> _Roles:
    views = capture_views(model, *example_inputs)
    if len(views) != 1:
        raise ParallelizeError(f"the model must capture as one graph (found {len(views)}; fix the graph breaks)")
    view = views[0]
    stream = view.residual_stream
    if not stream:
        raise ParallelizeError("no residual stream found: parallelize_ understands pre-norm residual blocks")
    names = view.param_names
    source = stream[0]
    embedding = None
    if source.op == "call_function" and source.target is torch.nn.functional.embedding:
        embedding = names.get(source.args[1])
    stream_set = set(stream)
    block_norms = [s.param_name for s in view.rmsnorms if s.input in stream_set and s.input is not stream[-1] and s.param_name]
    final = [s for s in view.rmsnorms if s.input is stream[-1]]
    final_norm = final[0].param_name if final else None
    in_chain = set()
    chains = []
    for c in view.bottlenecks:
        if not view.in_block(c.down):
            continue
        chains.append((c.down.param_name, c.down.layout, c.up.param_name, c.up.layout))
        in_chain |= {c.down.node, c.up.node}
    dense = []
    for site in view.block_linears:
        if site.node in in_chain:
            continue
        dense.append((site.param_name, site.layout, "row" if _feeds_stream(site.node, stream_set, view) else "col"))
    biases = {s.param_name: names[s.bias] for s in view.linears if s.bias is not None and s.bias in names}
    return _Roles(view, embedding, block_norms, final_norm, chains, dense, biases)


def _feeds_stream(node: fx.Node, stream: set[fx.Node], view: GraphView) -> bool:
    """Whether the output reaches a residual add without passing another linear."""
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stream:
            return True
        if n in view.linear_by_node:
            continue
        todo.extend(n.users)
    return False


def _gemm_dim(layout: str, role: str) -> int:
    """Dim to cut: out_in weights are [d_out, d_in], in_out weights [d_in, d_out]."""
    if layout == "out_in":
        return 1 if role == "row" else 0
    return 0 if role == "row" else 1


# ----------------------------------------------------------------------------- the entry point


def parallelize_(
    model: nn.Module,
    example_inputs: Sequence[Any],
    tp: Any,
    plan: str = "auto",
) -> TPReport:
    """Shard ``model`` in place for tensor parallelism over ``tp`` (a DeviceMesh or ProcessGroup)."""
    if not dist.is_initialized():
        raise ParallelizeError("torch.distributed is not initialised (call init_process_group first)")
    group = _group_of(tp)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    validate(model, world, plan)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    roles = _analyse(model, example_inputs)
    if plan == "auto":
        if roles.chains and not roles.dense:
            plan = "btp"
        elif roles.dense and not roles.chains:
            plan = "megatron"
        else:
            raise ParallelizeError(
                "plan='auto' needs blocks that are all bottlenecks (btp) or all dense (megatron); "
                f"found {len(roles.chains)} bottlenecks and {len(roles.dense)} dense linears"
            )
    if plan == "btp" and roles.dense:
        raise ParallelizeError(f"plan btp needs every block linear to be a bottleneck; dense: {[d[0] for d in roles.dense]}")
    if plan == "megatron" and roles.chains:
        raise ParallelizeError("plan megatron is for dense blocks; this model has bottlenecks (use btp or vanilla)")
    if plan == "vanilla":
        return _vanilla(model, roles, tp, group, world)

    spec = lambda role, dim: ShardSpec(role, dim, group.group_name, world, rank, plan)  # noqa: E731
    specs: dict[str, ShardSpec] = {}
    if plan == "btp":
        if roles.embedding is None or roles.final_norm is None:
            raise ParallelizeError("plan btp needs the residual stream to start at an embedding and end in an RMSNorm")
        specs[roles.embedding] = spec("shard", 1)
        for name in roles.block_norms:
            specs[name] = spec("shard", 0)
        for down, down_layout, up, up_layout in roles.chains:
            specs[down] = spec("row", _gemm_dim(down_layout, "row"))
            specs[up] = spec("col", _gemm_dim(up_layout, "col"))
            if up in roles.biases:
                specs[roles.biases[up]] = spec("shard", 0)
            if down in roles.biases:
                raise ParallelizeError(f"{down}: a bias on a row-parallel down factor is not supported")
    else:  # megatron
        for weight, layout, role in roles.dense:
            specs[weight] = spec(role, _gemm_dim(layout, role))
            if weight in roles.biases:
                specs[roles.biases[weight]] = spec("shard", 0) if role == "col" else spec("replicate", None)

    params = dict(model.named_parameters())
    for name, s in specs.items():
        p = params[name]
        if s.dim is not None:
            if p.shape[s.dim] % world:
                raise ParallelizeError(f"{name}: dim {s.dim} of {tuple(p.shape)} is not divisible by {world}")
            with torch.no_grad():
                p.data = p.data.chunk(world, dim=s.dim)[rank].clone()
        p._boost_tp = s  # read by the backend's tp_collectives pass
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if s.role == "shard" and isinstance(getattr(owner, "normalized_shape", None), tuple):
            # nn.RMSNorm checks its width; the statistic's true width is restored by the pass
            owner.normalized_shape = tuple(p.shape)

    if plan == "btp":
        final = model.get_submodule(roles.final_norm.rsplit(".", 1)[0])
        name, w, r = group.group_name, world, rank
        final.register_forward_pre_hook(lambda _m, args: (gather_from_tp(args[0], name, w, r), *args[1:]))
    # The guard goes on the embedding when there is one: a hook on a submodule is
    # traced into the model's graph, a hook on the root module would break it.
    guarded = model.get_submodule(roles.embedding.rsplit(".", 1)[0]) if roles.embedding else model
    guarded.register_forward_pre_hook(_sentinel_hook(plan), with_kwargs=True)
    model._boost_tp_plan = plan
    report = TPReport(plan, world, specs)
    log.info("%s", report)
    return report


def _sentinel_hook(plan: str):
    def hook(_module: nn.Module, args: tuple, kwargs: dict):
        if args and isinstance(args[0], torch.Tensor):
            return (tp_sentinel(args[0], plan), *args[1:]), kwargs
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                return args, {**kwargs, key: tp_sentinel(value, plan)}
        raise ParallelizeError("a parallelized model needs a tensor argument")

    return hook


def _vanilla(model: nn.Module, roles: _Roles, tp: Any, group: dist.ProcessGroup, world: int) -> TPReport:
    """Each factor pair as its own Megatron chunk, with PyTorch's DTensor plans."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if not roles.chains:
        raise ParallelizeError("plan vanilla is the low-rank baseline; this model has no bottlenecks")
    mesh = tp if isinstance(tp, DeviceMesh) else DeviceMesh.from_group(group, device_type="cpu")
    if mesh.ndim != 1:
        mesh = mesh["tp"]
    layout_plan: dict[str, Any] = {}
    for down, down_layout, up, up_layout in roles.chains:
        if down_layout != "out_in" or up_layout != "out_in":
            raise ParallelizeError("plan vanilla needs the factors as nn.Linear modules")
        layout_plan[down.rsplit(".", 1)[0]] = ColwiseParallel()
        layout_plan[up.rsplit(".", 1)[0]] = RowwiseParallel()
    parallelize_module(model, mesh, layout_plan)
    model._boost_tp_plan = "vanilla"
    report = TPReport("vanilla", world)
    return report


# ----------------------------------------------------------------------------- gathering back


def full_tensor(t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The whole tensor from this rank's shard (an all-gather on the shard dim)."""
    if hasattr(t, "full_tensor"):  # DTensor (vanilla plan)
        return t.full_tensor()
    if spec is None or spec.dim is None:
        return t.detach().clone()
    group = dist.distributed_c10d._resolve_process_group(spec.group_name)
    parts = [torch.empty_like(t) for _ in range(spec.world)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=spec.dim)


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
