"""``parallelize_``: shard a model for tensor parallelism from its captured graph.

    report = bc.parallelize_(model, (tokens,), tp_mesh, plan="btp")
    step = torch.compile(model, backend="boost")

Plans (BOOST.md section 2):

- ``"btp"``: bottleneck-aware. The residual stream is sharded on d (the
  embedding's columns are sharded, so its output is the local slice; a tied
  embedding stays whole and its output is sliced where it enters the stream); every down
  factor is row-parallel (a [T, r] all-reduce follows), every up factor
  column-parallel (identity forward, [T, r] all-reduce of its input gradient);
  attention runs on local heads, the MLP on local d_ff slices; block norms hold
  d/p of their weight and get their statistic through the next all-reduce
  (online RMSNorm). The stream is all-gathered once before the final norm,
  which is replicated.
- ``"megatron"``: dense blocks; q/k/v/gate/up column-parallel, o/down row-parallel,
  the embedding and the final norm replicated.

Under both, the output head is vocabulary-parallel (``vocab_parallel=True``): its
weight is cut on V (column-parallel; a vocabulary the TP degree does not divide
is padded), each rank computes its [T, V/p] logits, and a cross-entropy in the
graph becomes ``vocab_parallel_cross_entropy`` (all-reduces of [T] only); logits
the model returns are gathered. A head tied to the embedding stays whole on
every rank, as with ``vocab_parallel=False``.
- ``"vanilla"``: the baseline for low-rank models: each factor pair is its own
  Megatron chunk (down column-parallel on r, up row-parallel on r), written with
  PyTorch's DTensor ``parallelize_module``; attention runs unsharded.
- ``"auto"``: btp when every block linear is in a bottleneck, megatron when none is.

Each rank keeps only its slices, cut from the unsharded weights it had. Under
``torch.compile`` the model's code still sees every sharded parameter with its
whole shape (``tp_full_view``), so the captured graph is the unsharded model's
and everything the code derives from shapes is right; the boost backend's
``tp_localize`` pass turns it into this rank's program (checking every node's
shape against the unsharded one) and ``tp_collectives`` inserts the
collectives. Run without the backend, the model raises (``tp_sentinel``).
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from boost_compile.analysis import GraphView, capture_views, private_forward
from boost_compile.distributed.collectives import local_size, tp_full_view, tp_sentinel

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


@dataclass
class TPReport:
    plan: str
    world: int
    specs: dict[str, ShardSpec] = field(default_factory=dict)
    #: tp_localize's report on the sharded model's capture (nodes checked, repairs)
    check: Any = None

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
    """A size from the model's config object (``config``: ours and Hugging Face's; ``params``: Meta's)."""
    for holder in ("config", "params", "args"):
        config = getattr(model, holder, None)
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
        "heads": _config_value(model, "n_heads", "num_attention_heads", "n_head"),
        "kv-heads": _config_value(model, "n_kv_heads", "num_key_value_heads"),
        "d": _config_value(model, "dim", "hidden_size", "n_embd"),
        "d_ff": _config_value(model, "ffn_dim", "intermediate_size"),
    }
    bad = [f"{k} ({v})" for k, v in checks.items() if v is not None and v % world]
    if bad:
        raise ParallelizeError(f"TP degree {world} must divide {', '.join(bad)}")


# ----------------------------------------------------------------------------- roles


@dataclass
class _Roles:
    """What the graph says each parameter is."""

    view: GraphView
    embedding: str | None  # the module whose input carries the eager-mode guard
    shardable_embeddings: list[str]  # weights of embeddings that feed the stream and nothing else
    block_norms: list[str]
    chains: list[tuple[str, str, str, str]]  # (down weight, down layout, up weight, up layout)
    dense: list[tuple[str, str, str]]  # (weight, layout, "row"|"col")
    biases: dict[str, str]  # weight -> bias
    sections: dict[str, tuple[int, ...]]  # column-parallel weight -> whole sizes of its output's split
    heads: list[tuple[str, str, str | None]]  # untied output heads: (weight, layout, bias)


def _analyse(model: nn.Module, example_inputs: Sequence[Any]) -> _Roles:
    views = capture_views(model, *example_inputs)
    if len(views) != 1:
        raise ParallelizeError(f"the model must capture as one graph (found {len(views)}; fix the graph breaks)")
    view = views[0]
    stream = view.residual_stream
    if not stream:
        raise ParallelizeError("no residual stream found: parallelize_ understands pre-norm residual blocks")
    names = view.param_names
    # embeddings that reach the stream's start: token and learned position embeddings,
    # through scaling (Gemma), dropout or their sum; one whose weight is used anywhere
    # else (a head tied to it) stays whole
    lookups = [n for n in ({stream[0]} | view.ancestors(stream[0])) if _is_embedding(n) and n.args[1] in names]
    lookups.sort(key=lambda n: list(view.graph.nodes).index(n))
    embedding = names[lookups[0].args[1]] if lookups else None
    shardable = [names[n.args[1]] for n in lookups if len(n.args[1].users) == 1]
    stream_set = set(stream)
    block_norms = [s.param_name for s in view.rmsnorms if s.input in stream_set and s.input is not stream[-1] and s.param_name]
    in_chain = set()
    chains = []
    sections: dict[str, tuple[int, ...]] = {}
    for c in view.bottlenecks:
        if not view.in_block(c.down):
            continue
        chains.append((c.down.param_name, c.down.layout, c.up.param_name, c.up.layout))
        in_chain |= {c.down.node, c.up.node}
        if (parts := _split_sections(c.up.node)) is not None:
            sections[c.up.param_name] = parts
    dense = []
    for site in view.block_linears:
        if site.node in in_chain:
            continue
        role = "row" if _feeds_stream(site.node, stream_set, view) else "col"
        dense.append((site.param_name, site.layout, role))
        if role == "col" and (parts := _split_sections(site.node)) is not None:
            sections[site.param_name] = parts
    biases = {s.param_name: names[s.bias] for s in view.linears if s.bias is not None and s.bias in names}
    after = view.descendants(stream[-1])
    heads = [
        (s.param_name, s.layout, biases.get(s.param_name))
        for s in view.linears
        if s.param_name and s.node in after and not view.in_block(s) and _read_only_by(s.weight, s.node, names)
    ]
    return _Roles(view, embedding, shardable, block_norms, chains, dense, biases, sections, heads)


def _read_only_by(weight: fx.Node, gemm: fx.Node, names: dict[fx.Node, str]) -> bool:
    """Whether the parameter behind ``weight`` (possibly through ``.t()``) feeds ``gemm`` alone:
    a head tied to the embedding does not."""
    param = weight
    while param not in names:
        if len(param.all_input_nodes) != 1:
            return False
        param = param.all_input_nodes[0]
    node = param
    while node is not gemm:
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
    return True


def _last_dim_slice(node: fx.Node) -> slice | None:
    """``x[..., a:b]`` -> slice(a, b)."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], tuple):
        return None
    idx = node.args[1]
    if len(idx) == 2 and idx[0] is Ellipsis and isinstance(idx[1], slice) and idx[1].step in (None, 1):
        return idx[1]
    return None


def _slice_sections(node: fx.Node, width: int) -> tuple[int, ...] | None:
    """Sizes of the parts when the users' last-dim slices tile [0, width) exactly (Phi-3's qkv)."""
    spans = sorted(((s.start or 0), width if s.stop is None else s.stop) for s in map(_last_dim_slice, node.users))
    if len(spans) < 2 or spans[0][0] != 0 or spans[-1][1] != width:
        return None
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:], strict=False)):
        return None
    return tuple(b - a for a, b in spans)


def _is_reshape(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in ("view", "reshape")) or (
        node.op == "call_function" and node.target is torch.reshape
    )


def _is_embedding(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.nn.functional.embedding


def _split_sections(node: fx.Node) -> tuple[int, ...] | None:
    """Whole sizes of the parts a GEMM's output is split into on its last dim (fused q/k/v)."""
    out = node.meta.get("example_value")
    if out is None:
        return None
    if len(node.users) > 1 and all(_last_dim_slice(u) is not None for u in node.users):
        return _slice_sections(node, int(out.shape[-1]))
    users = list(node.users)
    if len(users) != 1:
        return None
    split = users[0]
    reshaped = split.meta.get("example_value")
    if (  # a reshape that keeps the last dim whole first (GPT-2's Conv1D: [B*T, 3d] -> [B, T, 3d])
        _is_reshape(split) and reshaped is not None
        and reshaped.shape[-1] == out.shape[-1] and len(split.users) == 1
    ):
        node, split = split, next(iter(split.users))
    is_split = (split.op == "call_method" and split.target in ("split", "chunk")) or (
        split.op == "call_function" and split.target in (torch.split, torch.chunk)
    )
    if not is_split or split.args[0] is not node:
        return None
    out = node.meta.get("example_value")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if out is None or dim not in (-1, out.dim() - 1):
        return None
    width = int(out.shape[-1])
    size = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size_or_sections", split.kwargs.get("chunks"))
    if split.target in ("chunk", torch.chunk):
        if not isinstance(size, int) or width % size:
            return None
        return (width // size,) * size
    if isinstance(size, int):
        return (size,) * (width // size) + ((width % size,) if width % size else ())
    if isinstance(size, (list, tuple)) and all(isinstance(v, int) for v in size):
        return tuple(size)
    return None


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
    vocab_parallel: bool | None = None,
    stream_io: bool = False,
    shard_logits: bool = False,
) -> TPReport:
    """Shard ``model`` in place for tensor parallelism over ``tp`` (a DeviceMesh or ProcessGroup).

    ``vocab_parallel``: cut the (untied) output head on the vocabulary. The default
    (None) is True for btp and megatron, whose compiled graph gets the
    vocabulary-parallel cross-entropy, and False for vanilla: there True gives
    PyTorch's own layout (the head ``ColwiseParallel`` with logits a DTensor
    sharded on V), which needs the caller to run the forward and backward under
    ``torch.distributed.tensor.parallel.loss_parallel()`` and returns a DTensor loss.

    ``stream_io``: ``model`` is a pipeline stage (``boost_compile.distributed.pipeline``).
    Under btp, a stage without the embedding takes this rank's d-slice of the
    residual stream as its input and a stage without the head returns its
    d-slice, so the activation sent between stages is [mb, s, d/p]. Pass the whole
    stream as ``example_inputs``; the stage then reads ``_boost_stream_shards = p``.

    ``shard_logits``: ``model`` is a pipeline's last stage (btp or megatron, a
    vocabulary-parallel head) and returns this rank's vocabulary slice of the
    logits, [mb, s, ceil(V/p)], instead of gathering them: the schedule's loss
    must then be ``boost_compile.distributed.pipeline.vocab_parallel_loss(stage)``
    (``build_schedule`` refuses any other). The stage reads ``_boost_vocab_shard``.
    """
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
        if shard_logits:
            raise ParallelizeError("shard_logits is for btp and megatron stages; plan vanilla returns DTensor logits")
        return _vanilla(model, roles, tp, group, world, bool(vocab_parallel))
    if shard_logits and vocab_parallel is False:
        raise ParallelizeError("shard_logits=True returns the vocabulary-parallel head's slice: it needs vocab_parallel")
    vocab_parallel = True if vocab_parallel is None else vocab_parallel

    def spec(role: str, dim: int | None, weight: str | None = None, size: int | None = None, head: bool = False) -> ShardSpec:
        parts = roles.sections.get(weight) if weight is not None else None
        return ShardSpec(role, dim, group.group_name, world, rank, plan, parts, size, head)

    specs: dict[str, ShardSpec] = {}
    if plan == "btp":
        for name in roles.shardable_embeddings:
            specs[name] = spec("shard", 1)
        for name in roles.block_norms:
            specs[name] = spec("shard", 0)
        for down, down_layout, up, up_layout in roles.chains:
            specs[down] = spec("row", _gemm_dim(down_layout, "row"))
            specs[up] = spec("col", _gemm_dim(up_layout, "col"), up)
            if up in roles.biases:
                specs[roles.biases[up]] = spec("shard", 0, up)
            if down in roles.biases:
                raise ParallelizeError(f"{down}: a bias on a row-parallel down factor is not supported")
    else:  # megatron
        for weight, layout, role in roles.dense:
            specs[weight] = spec(role, _gemm_dim(layout, role), weight if role == "col" else None)
            if weight in roles.biases:
                specs[roles.biases[weight]] = spec("shard", 0, weight) if role == "col" else spec("replicate", None)

    params = dict(model.named_parameters())
    if vocab_parallel:
        for weight, layout, bias in roles.heads:
            dim = _gemm_dim(layout, "col")
            vocab = params[weight].shape[dim]
            padded = vocab if vocab % world else None
            specs[weight] = spec("col", dim, size=padded, head=True)
            if bias is not None:
                specs[bias] = spec("shard", 0, size=padded, head=True)
    aliases = _aliases(model)
    for name, s in specs.items():
        p = params[name]
        if s.dim is not None:
            if (p.shape[s.dim] % world and s.size is None) or any(part % world for part in s.sections or ()):
                sizes = f" (parts {list(s.sections)})" if s.sections else ""
                raise ParallelizeError(f"{name}: dim {s.dim} of {tuple(p.shape)}{sizes} is not divisible by {world}")
            with torch.no_grad():
                p.data = shard_tensor(p.data, s.dim, world, rank, s.sections, s.size is not None)
            for alias in aliases[id(p)]:
                _show_whole(model, alias, s, plan)
        p._boost_tp = s  # read by the backend's tp_localize and tp_collectives passes

    # The guard goes on the embedding when there is one: a hook on a submodule is
    # traced into the model's graph, a hook on the root module would break it.
    # A pipeline stage without the embedding guards its stream input inside its forward.
    if roles.embedding is None and hasattr(model, "set_input_guard"):
        model.set_input_guard(functools.partial(tp_sentinel, plan=plan))
    else:
        guarded = model.get_submodule(roles.embedding.rsplit(".", 1)[0]) if roles.embedding else model
        guarded.register_forward_pre_hook(_sentinel_hook(plan), with_kwargs=True)
    model._boost_tp_plan = plan
    report = TPReport(plan, world, specs)
    if stream_io and plan == "btp":
        example_inputs = _shard_stream_io(model, roles, example_inputs, world, rank, plan)
    if shard_logits:
        _shard_logits(model, roles, specs, params, world, plan)
    report.check = check_local_program(model, example_inputs)
    log.info("%s; %s", report, report.check.line())
    return report


def _shard_stream_io(model: nn.Module, roles: _Roles, example_inputs: Sequence[Any], world: int, rank: int, plan: str) -> tuple:
    """A btp pipeline stage: its stream input (no embedding) and output (no head) are this rank's d-slice.

    The stage module applies the markers itself (``set_stream_markers``, as the
    stages of ``boost_compile.distributed.pipeline`` do): hooks on the root
    module would run outside the compiled graph. Returns the example inputs as
    the stage receives them (the input's slice).
    """
    from boost_compile.distributed.collectives import tp_stream_in, tp_stream_out

    if not hasattr(model, "set_stream_markers"):
        raise ParallelizeError(
            f"stream_io=True needs a pipeline stage that applies stream markers (set_stream_markers), such as "
            f"boost_compile.distributed.pipeline.split_model's; got {type(model).__name__}"
        )

    def stream_in(x: torch.Tensor) -> torch.Tensor:
        return tp_stream_in(x, world, plan) if torch.compiler.is_compiling() else x

    def stream_out(h: torch.Tensor) -> torch.Tensor:
        return tp_stream_out(h, world, plan) if torch.compiler.is_compiling() else h

    takes_stream, returns_stream = roles.embedding is None, not roles.heads
    model.set_stream_markers(stream_in if takes_stream else None, stream_out if returns_stream else None)
    if takes_stream:
        example_inputs = (shard_tensor(example_inputs[0], example_inputs[0].dim() - 1, world, rank), *example_inputs[1:])
    model._boost_stream_shards = world
    return tuple(example_inputs)


@dataclass(frozen=True)
class VocabShard:
    """A stage's logits as this rank returns them (``shard_logits``): columns
    ``[rank * local, (rank + 1) * local)`` of ``vocab``, ``local = ceil(vocab / world)``."""

    group_name: str
    world: int
    rank: int
    vocab: int


def _shard_logits(model: nn.Module, roles: _Roles, specs: dict[str, ShardSpec], params: dict[str, Any],
                  world: int, plan: str) -> None:
    """A pipeline's last stage returns its vocabulary slice of the logits (see ``parallelize_``)."""
    from boost_compile.distributed.collectives import tp_vocab_out

    if not hasattr(model, "set_logits_marker"):
        raise ParallelizeError(
            f"shard_logits=True needs a pipeline stage that marks its logits (set_logits_marker), such as "
            f"boost_compile.distributed.pipeline.split_model's last stage; got {type(model).__name__}"
        )
    heads = [w for w, _layout, _bias in roles.heads if w in specs and specs[w].head]
    if len(heads) != 1:
        raise ParallelizeError(
            "shard_logits=True needs one untied output head cut on the vocabulary (vocab_parallel); "
            f"this stage has {len(roles.heads)} head(s), {len(heads)} of them vocabulary-parallel"
        )
    spec = specs[heads[0]]
    vocab = spec.size if spec.size is not None else params[heads[0]].shape[spec.dim] * world

    def logits_out(x: torch.Tensor) -> torch.Tensor:
        return tp_vocab_out(x, world, plan) if torch.compiler.is_compiling() else x

    model.set_logits_marker(logits_out)
    model._boost_vocab_shard = VocabShard(spec.group_name, world, spec.rank, vocab)


class _Checked(Exception):
    """Raised by the dry-run backend once the check has passed (nothing is compiled)."""


def check_local_program(model: nn.Module, example_inputs: Sequence[Any]) -> Any:
    """Capture the sharded model on ``example_inputs`` and run ``tp_localize`` on it now.

    A model whose rank program cannot be built (or would not match the unsharded
    graph's shapes) is refused here, before any step, with the pass's
    ParallelizeError; otherwise returns the pass's report (nodes checked, repairs).
    """
    from torch._dynamo.exc import BackendCompilerFailed

    from boost_compile.config import BoostConfig
    from boost_compile.pass_manager import PassContext
    from boost_compile.passes.tp_localize import TPLocalizePass

    reports = []
    config = BoostConfig()

    def dry_run(gm: fx.GraphModule, inputs: Sequence[Any]) -> Any:
        ctx = PassContext(gm, inputs, config, grad_enabled=torch.is_grad_enabled())
        reports.append(TPLocalizePass(config).run(ctx))
        raise _Checked

    try:
        with private_forward(model):
            torch.compile(model, backend=dry_run, dynamic=False)(*example_inputs)
    except BackendCompilerFailed as exc:
        if isinstance(exc.inner_exception, ParallelizeError):
            raise exc.inner_exception from None
        if not isinstance(exc.inner_exception, _Checked):
            raise
    return reports[0]


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


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """Every name under which each parameter is reachable (a tied weight has several)."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def _show_whole(model: nn.Module, name: str, spec: ShardSpec, plan: str) -> None:
    """Make ``module.<attr>`` read as ``tp_full_view(shard)`` while Dynamo traces.

    The module gets a subclass of its own class with a property for the
    attribute: under tracing it returns the shard seen with its whole shape; in
    eager code it returns the shard itself (state-dict and optimizer code that
    reads attributes keeps working; the forward pass is guarded by the sentinel).
    """
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    cls = type(owner)
    if not getattr(cls, "_boost_full_view", False):
        cls = type(cls.__name__, (cls,), {"_boost_full_view": True, "__module__": cls.__module__})
        owner.__class__ = cls
    dim, world, size = spec.dim, spec.world, -1 if spec.size is None else spec.size

    def read(self: nn.Module) -> torch.Tensor:
        shard = self._parameters[attr]
        if torch.compiler.is_compiling():
            return tp_full_view(shard, dim, world, plan, size)
        return shard

    setattr(cls, attr, property(read))


def _sentinel_hook(plan: str):
    def hook(_module: nn.Module, args: tuple, kwargs: dict):
        if args and isinstance(args[0], torch.Tensor):
            return (tp_sentinel(args[0], plan), *args[1:]), kwargs
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                return args, {**kwargs, key: tp_sentinel(value, plan)}
        raise ParallelizeError("a parallelized model needs a tensor argument")

    return hook


def _vanilla(model: nn.Module, roles: _Roles, tp: Any, group: dist.ProcessGroup, world: int, vocab_parallel: bool) -> TPReport:
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
    if vocab_parallel:  # PyTorch's loss-parallel layout: logits stay a DTensor sharded on V
        from torch.distributed.tensor import Shard

        for weight, layout, _bias in roles.heads:
            if layout != "out_in":
                raise ParallelizeError(f"plan vanilla with vocab_parallel needs the head {weight} as an nn.Linear")
            layout_plan[weight.rsplit(".", 1)[0]] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
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
