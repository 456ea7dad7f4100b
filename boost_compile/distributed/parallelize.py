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
  the embedding and the final norm replicated. A projection whose output reaches
  another projection that is not the block's output (multi-head latent attention's
  q_a_proj / kv_a_proj_with_mqa) is replicated, with the latent norm after it; the
  up projections it feeds are column-parallel (split by heads), and the rope key
  that all heads share is expanded to this rank's heads.

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

import copy
import functools
import logging
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from boost_compile import _torch_compat as compat
from boost_compile.analysis import GraphView, private_forward
from boost_compile.analysis.repeated import first_blocks
from boost_compile.distributed.collectives import tp_sentinel
from boost_compile.distributed.shard import (
    ParallelizeError,
    ShardSpec,
    VocabShard,
    aliases,
    shard_tensor,
    show_whole,
)
from boost_compile.distributed.tp_blocks import block_layout
from boost_compile.distributed.tp_roles import Roles, analyse, gemm_dim, repeat_roles
from boost_compile.distributed.vanilla import apply_vanilla
from boost_compile.meta_init import buffers_on_meta, is_on_meta, meta_twins

log = logging.getLogger("boost_compile")

PLANS = ("btp", "megatron", "vanilla", "auto")


@dataclass
class TPReport:
    plan: str
    world: int
    specs: dict[str, ShardSpec] = field(default_factory=dict)
    #: tp_localize's report on the sharded model's capture (nodes checked, repairs)
    check: Any = None
    #: what verify compared of this rank's program on the example inputs (None: not verified)
    verify: Any = None

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


def same_on_every_rank(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Every rank must start from the same weights: each keeps its slice of its own copy, and a
    replicated parameter that differs between ranks makes a model that no one process computes.
    A float64 sum and sum of squares per parameter, their minimum and maximum over the group."""
    named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.device.type != "meta"]
    if not named:
        return
    with torch.no_grad():
        sums = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for _, p in named])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    differ = [n for (n, _), lo, hi in zip(named, low, high, strict=True) if not torch.equal(lo, hi)]
    if differ:
        more = f" and {len(differ) - 1} more" if len(differ) > 1 else ""
        raise ParallelizeError(
            f"the model's weights differ between the ranks of the TP group ({differ[0]}{more}): each rank keeps "
            "its slice of its own copy, so build the model under the same seed on every rank "
            "(torch.manual_seed before constructing it) or load the same checkpoint first")


# ----------------------------------------------------------------------------- the entry point


def parallelize_(
    model: nn.Module,
    example_inputs: Sequence[Any],
    tp: Any,
    plan: str = "auto",
    vocab_parallel: bool | None = None,
    stream_io: bool = False,
    shard_logits: bool = False,
    verify: bool = True,
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

    ``verify``: run this rank's program (the backend's Torch-IR passes on the capture, the
    collectives included) once on ``example_inputs`` against the unsharded model and its
    float64 copy, every gradient included, as the compile's ``verify`` would at the first step:
    a model whose sharded program computes something else is refused here with a
    ``ParallelizeError`` that names the tensors, not at its first step.
    """
    if not dist.is_initialized():
        raise ParallelizeError("torch.distributed is not initialised (call init_process_group first)")
    group = _group_of(tp)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    validate(model, world, plan)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    on_meta = is_on_meta(model)
    if on_meta:  # built on meta (model.init=per_parameter): captured there, each rank materialises its shards after
        with buffers_on_meta(model):
            roles = _analyse(model, meta_twins(example_inputs))
    else:
        roles = _analyse(model, example_inputs)
    if plan == "auto":
        if roles.chains and not roles.dense:
            plan = "btp"
        elif roles.dense and not roles.chains:
            plan = "megatron"
        else:
            raise ParallelizeError(
                "plan='auto' needs blocks that are all bottlenecks (btp) or all dense (megatron); "
                f"found {len(roles.chains)} bottlenecks and {len(roles.dense)} dense linears "
                f"({', '.join(d[0] for d in roles.dense[:4])}{', ...' if len(roles.dense) > 4 else ''})"
            )
    if plan == "btp" and roles.dense:
        raise ParallelizeError(f"plan btp needs every block linear to be a bottleneck; dense: {[d[0] for d in roles.dense]}")
    if plan == "megatron" and roles.chains:
        raise ParallelizeError("plan megatron is for dense blocks; this model has bottlenecks (use btp or vanilla)")
    same_on_every_rank(model, group)
    if plan == "vanilla":
        if shard_logits:
            raise ParallelizeError("shard_logits is for btp and megatron stages; plan vanilla returns DTensor logits")
        apply_vanilla(model, roles, tp, group, bool(vocab_parallel))
        return TPReport("vanilla", world)
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
            specs[down] = spec("row", gemm_dim(down_layout, "row"))
            specs[up] = spec("col", gemm_dim(up_layout, "col"), up)
            if up in roles.biases:
                specs[roles.biases[up]] = spec("shard", 0, up)
            if down in roles.biases:
                raise ParallelizeError(f"{down}: a bias on a row-parallel down factor is not supported")
    else:  # megatron
        for weight, layout, role in roles.dense:
            if role == "replicate":  # a down projection into another projection (MLA): whole on every rank
                specs[weight] = spec("replicate", None)
            else:
                specs[weight] = spec(role, gemm_dim(layout, role), weight if role == "col" else None)
            if weight in roles.biases:
                specs[roles.biases[weight]] = spec("shard", 0, weight) if role == "col" else spec("replicate", None)

    params = dict(model.named_parameters())
    for norm, linear in roles.projection_norms.items():
        # a norm over a column-parallel projection's whole output (OLMo 2's q_norm over all heads): its
        # weight cut like that output, its statistic summed over the group (tp_collectives)
        if linear in specs and specs[linear].role == "col" and not specs[linear].sections and params[norm].dim() == 1:
            specs[norm] = spec("shard", 0)
    if vocab_parallel:
        for weight, layout, bias in roles.heads:
            dim = gemm_dim(layout, "col")
            vocab = params[weight].shape[dim]
            padded = vocab if vocab % world else None
            specs[weight] = spec("col", dim, size=padded, head=True)
            if bias is not None:
                specs[bias] = spec("shard", 0, size=padded, head=True)
    aliases_of = aliases(model)
    for name, s in specs.items():
        p = params[name]
        if s.dim is not None:
            if (p.shape[s.dim] % world and s.size is None) or any(part % world for part in s.sections or ()):
                sizes = f" (parts {list(s.sections)})" if s.sections else ""
                raise ParallelizeError(f"{name}: dim {s.dim} of {tuple(p.shape)}{sizes} is not divisible by {world}")
            with torch.no_grad():
                p.data = shard_tensor(p.data, s.dim, world, rank, s.sections, s.size is not None)
            for alias in aliases_of[id(p)]:
                show_whole(model, alias, s, plan)
        p._boost_tp = s  # read by the backend's tp_localize and tp_collectives passes

    # The guard goes on the embedding when there is one: a hook on a submodule is
    # traced into the model's graph, a hook on the root module would break it.
    # A pipeline stage without the embedding guards its stream input inside its forward.
    if roles.embedding is None and hasattr(model, "set_input_guard"):
        model.set_input_guard(functools.partial(tp_sentinel, plan=plan))
    else:
        guarded = model.get_submodule(roles.embedding.rsplit(".", 1)[0]) if roles.embedding else model
        model._boost_sentinel_handle = guarded.register_forward_pre_hook(_sentinel_hook(plan), with_kwargs=True)
    model._boost_tp_plan = plan
    model._boost_block_layout = block_layout(roles, specs, plan, group.group_name, world, rank, model,
                                             returns_stream=stream_io and plan == "btp" and not roles.heads)
    report = TPReport(plan, world, specs)
    if stream_io and plan == "btp":
        example_inputs = _shard_stream_io(model, roles, example_inputs, world, rank, plan)
    if shard_logits:
        _shard_logits(model, roles, specs, params, world, plan)
    if stream_io or shard_logits:  # a stage's markers change its program: capture the sharded stage
        if on_meta:  # captured on meta, checked node by node; verified at the first step (no values yet)
            with buffers_on_meta(model):
                report.check = check_local_program(model, meta_twins(example_inputs), verify=False)
        else:
            report.check = check_local_program(model, example_inputs, verify)
    else:
        gm = whole_view_graph(roles.view)
        report.check = check_captured(roles.view, copy.deepcopy(gm))
        if verify and on_meta:  # no values yet: the compile's verify checks this program at the first step
            log.info("parallelize_: the model is on the meta device; its rank program is verified at the first step")
        elif verify:
            report.verify = verify_rank_program(gm, roles.view.example_inputs, model)
    log.info("%s; %s", report, report.check.line())
    return report


#: the blocks parallelize_ captures of a deeper model (the rest read from the last of them): the
#: second block is the first that receives what a block hands the next (LaX's latents)
KEEP_BLOCKS = 2


def _analyse(model: nn.Module, example_inputs: Sequence[Any]) -> Roles:
    """``analyse`` on the model's first ``KEEP_BLOCKS`` blocks when it has more, every later block's
    roles read from the last of them, so sharding a 32-layer model costs what a 2-layer one
    does; on the whole model when the code does not run with fewer blocks or the blocks'
    parameters differ. A spec that a deeper block would not take is still caught: every graph
    compiled is checked node by node (tp_localize)."""
    try:
        with first_blocks(model, KEEP_BLOCKS) as blocks:
            roles = analyse(model, example_inputs) if blocks is not None else None
    except Exception as exc:  # noqa: BLE001 - any failure of the short capture: capture it whole
        log.debug("parallelize_: the capture of the first %d blocks failed (%s); capturing the whole model",
                  KEEP_BLOCKS, exc)
        blocks = roles = None
    if blocks is None or roles is None:
        return analyse(model, example_inputs)
    container, names = blocks
    params = dict(model.named_parameters())

    def shapes(block: str) -> dict[str, torch.Size]:
        return {n[len(block) + 1:]: p.shape for n, p in params.items() if n.startswith(f"{block}.")}

    source = shapes(names[KEEP_BLOCKS - 1])
    if any(shapes(block) != source for block in names[KEEP_BLOCKS:]):
        log.debug("parallelize_: the later blocks' parameters differ from block %d's; capturing the whole model",
                  KEEP_BLOCKS - 1)
        return analyse(model, example_inputs)
    whole = repeat_roles(roles, container, KEEP_BLOCKS - 1, len(names))
    return whole


def _shard_stream_io(model: nn.Module, roles: Roles, example_inputs: Sequence[Any], world: int, rank: int, plan: str) -> tuple:
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


def _shard_logits(model: nn.Module, roles: Roles, specs: dict[str, ShardSpec], params: dict[str, Any],
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


def check_captured(view: GraphView, gm: fx.GraphModule | None = None) -> Any:
    """``tp_localize`` on a copy of ``parallelize_``'s own capture of the unsharded model, whose
    parameters are now the shards: the check of :func:`check_local_program` without a second
    capture. The placeholders keep the whole shapes the capture saw, which is what
    ``tp_full_view`` shows the graph a compile captures; the pass reads each one's ShardSpec
    from the parameter behind it and checks every node against the whole shapes, as at compile.
    ``gm``: :func:`whole_view_graph` of ``view`` already made (it is rewritten in place).
    """
    from boost_compile.config import BoostConfig
    from boost_compile.pass_manager import PassContext
    from boost_compile.passes.tp_localize import TPLocalizePass

    gm = gm if gm is not None else whole_view_graph(view)
    config = BoostConfig()
    return TPLocalizePass(config).run(PassContext(gm, view.example_inputs, config, grad_enabled=True))


def whole_view_graph(view: GraphView) -> fx.GraphModule:
    """A copy of ``view``'s capture as a compile of the sharded model captures it: each sharded
    parameter's placeholder read through ``tp_full_view`` (the shard seen with its whole shape)."""
    gm = copy.deepcopy(view.gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, view.example_inputs, strict=False):
        spec = getattr(value, "_boost_tp", None)
        if spec is None or spec.dim is None:
            continue
        # placeholder (the shard) -> tp_full_view (the whole shape the capture saw), as a compile's capture reads it
        with gm.graph.inserting_after(node):
            whole = gm.graph.call_function(torch.ops.boost.tp_full_view.default,
                                           (node, spec.dim, spec.world, spec.plan, -1 if spec.size is None else spec.size))
        node.replace_all_uses_with(whole, delete_user_cb=lambda user, whole=whole: user is not whole)
        whole.meta = dict(node.meta)
        node.meta["example_value"] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    gm.recompile()
    return gm


def verify_rank_program(gm: fx.GraphModule, example_inputs: Sequence[Any], model: nn.Module | None = None) -> Any:
    """The backend's Torch-IR passes on ``gm`` (a capture of the sharded model, rewritten in
    place) under ``verify``: this rank's program against the unsharded model, built from the
    gathered shards, and its float64 copy, on ``example_inputs`` (every rank at once). A program
    that differs even without the rewrites verify may drop is refused with a ParallelizeError;
    returns verify's report (what it compared, what it dropped). ``model``: the parameters' names
    for the message (the graph's own are Dynamo's)."""
    from boost_compile.config import BoostConfig
    from boost_compile.pass_manager import PassContext, run_graph_passes
    from boost_compile.passes import graph_passes
    from boost_compile.verify import Verifier, VerifyError, VerifyWarning

    config = BoostConfig()
    ctx = PassContext(gm, example_inputs, config, grad_enabled=True)
    verifier = Verifier(gm, example_inputs, ctx.needs_grad(), False, "parallelize_", config.verify.max_gib)
    try:
        with warnings.catch_warnings(record=True) as dropped:  # a refusal below says it all
            warnings.simplefilter("always", VerifyWarning)
            run_graph_passes(graph_passes(config), ctx, None, verifier)
    except VerifyError as exc:
        first = [c for c in verifier.report.checks if c.status == "dropped"]
        detail = _with_parameter_names(f": {first[-1].detail}" if first else "", gm, example_inputs, model)
        raise ParallelizeError(
            f"this rank's program does not compute the unsharded model{detail}. {exc}. A construct the "
            "tensor-parallel passes do not shard exactly; shard this model with another plan, or leave "
            "tensor parallelism off for it") from None
    for w in dropped:  # a rewrite dropped, the program kept: the compile will say the same
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return verifier.report


def _with_parameter_names(text: str, gm: fx.GraphModule, example_inputs: Sequence[Any], model: nn.Module | None) -> str:
    """``text`` with each ``grad:<placeholder>`` of a parameter written ``grad:<its name in model>``."""
    if model is None:
        return text
    by_id = {id(p): name for name, p in model.named_parameters()}
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    names = {ph: by_id[id(x)] for ph, x in zip(placeholders, example_inputs, strict=False) if id(x) in by_id}
    return re.sub(r"grad:(\w+)", lambda m: f"grad:{names.get(m.group(1), m.group(1))}", text)


def check_local_program(model: nn.Module, example_inputs: Sequence[Any], verify: bool = False) -> Any:
    """Capture the sharded model on ``example_inputs`` and run ``tp_localize`` on it now.

    A model whose rank program cannot be built (or would not match the unsharded
    graph's shapes) is refused here, before any step, with the pass's
    ParallelizeError; otherwise returns the pass's report (nodes checked, repairs).
    """
    from boost_compile.config import BoostConfig
    from boost_compile.pass_manager import PassContext
    from boost_compile.passes.tp_localize import TPLocalizePass

    reports = []
    config = BoostConfig()

    def dry_run(gm: fx.GraphModule, inputs: Sequence[Any]) -> Any:
        program = copy.deepcopy(gm) if verify else None
        ctx = PassContext(gm, inputs, config, grad_enabled=torch.is_grad_enabled())
        reports.append(TPLocalizePass(config).run(ctx))
        if program is not None:
            verify_rank_program(program, inputs, model)
        raise _Checked

    try:
        with private_forward(model):
            torch.compile(model, backend=dry_run, dynamic=False)(*example_inputs)
    except compat.backend_compiler_failed() as exc:
        if isinstance(exc.inner_exception, ParallelizeError):
            raise exc.inner_exception from None
        if not isinstance(exc.inner_exception, _Checked):
            raise
    return reports[0]


def _sentinel_hook(plan: str):
    def hook(_module: nn.Module, args: tuple, kwargs: dict):
        if args and isinstance(args[0], torch.Tensor):
            return (tp_sentinel(args[0], plan), *args[1:]), kwargs
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor):
                return args, {**kwargs, key: tp_sentinel(value, plan)}
        raise ParallelizeError("a parallelized model needs a tensor argument")

    return hook
