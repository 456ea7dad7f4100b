"""The layout zoo: the zoo's tiny causal-LM architectures under distributed layouts, through boost.

Every architecture of :mod:`boost_compile.bench.zoo` (built tiny by :func:`zoo_models.build`) runs
:data:`STEPS` SGD steps (lr :data:`LR`) under a distributed layout on gloo ranks of this machine,
compiled by the boost backend (inner aot_eager). At every step the loss and every parameter
gradient, gathered to whole tensors, are judged by the parity rule
(:func:`boost_compile.parity.compare`) against the same model run eagerly in one process in
float32 and its float64 copy (the truth), both on the whole global batch with the same steps:

- ``tp2-megatron``: 2 ranks, ``bc.parallelize_(model, (ids,), WORLD, plan="megatron")``, then
  ``torch.compile(model, backend="boost")``; every rank runs the whole batch.
- ``tp2-btp``: ``bc.factorize_`` (rank ratio 0.25: every block linear a bottleneck) first, then
  ``plan="btp"``; the reference is the factorized model, the same weights.
- ``fsdp2``: 2 ranks, data parallel: rank r runs row r of the (2, 16) batch. torchtitan's order:
  the decoder blocks compiled one by one (``bc.compile_blocks``), then FSDP2 as boost-train
  applies it (``train.fsdp.shard_model``: the embedding, each block, the final norm with the head,
  then the root; blocks that share a parameter one unit). A model that fails under FSDP2 with
  no compile at all too is skipped with that error. FSDP2 averages the gradients over the ranks; the model's loss is the
  mean over its tokens, and every row holds as many, so the mean of the ranks' losses and
  gradients is the whole batch's (the loss compared is the ranks' mean).
- ``tp2xfsdp2``: 4 ranks, a DeviceMesh ("dp_shard", "tp") of 2 x 2: megatron over ``tp``, the
  blocks compiled one by one (the whole model where ``compile_blocks`` refuses a TP model), FSDP2
  over ``dp_shard`` as in ``fsdp2``; the two TP pairs run a batch row each. By default
  on :data:`SAMPLE` only (one architecture per construct).

Each architecture ends in one class of :data:`zoo.CLASSES`; ``topk_flip`` where the first step
outside the rule has only a router's gradient (or the loss) off and eager fp32 chooses other
experts than float64 (:class:`zoo.RouterTap` on the two reference runs).

    python -m boost_compile.bench.zoo_layouts [--layouts tp2-megatron,tp2-btp,fsdp2,tp2xfsdp2]
        [--only a,b] [--out benchmarks/zoo] [--stem zoo-layouts] [--timeout S] [--resume]

Speed: one gloo group per layout lives across the architectures (its ranks loop over them; the
eager float32 reference runs on rank 0 while rank 1 runs the float64 one). An architecture that
hangs or kills a rank costs itself only: the parent watches each one against ``--timeout`` (gloo's
collective timeout is the same), kills the group, records the architecture (``ERROR`` past the
reference runs, ``skipped`` before) and starts a new group from the next one. Results are appended
to ``DIR/<stem>-<layout>.jsonl`` as they land (``--resume`` keeps them); ``DIR/<stem>.md`` and
``.json`` hold a table per layout (a layout not run now keeps its section).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from boost_compile.bench import zoo, zoo_models
from boost_compile.bench.zoo_models import BATCH, SEQ, TOKEN_HIGH, TOKEN_LOW, ZooSkip, _one_line, architectures, build
from boost_compile.parity import Float64Program

STEPS, LR, SEED = 3, 0.1, 0
DEFAULT_TIMEOUT = 300.0
DEFAULT_STEM = "zoo-layouts"
#: tp2xfsdp2's architectures unless --only names others: one per construct (dense, q/k norms,
#: experts, latent attention, sinks and biases, post-norms, sliding windows, q/k norms and experts)
SAMPLE = ("llama", "qwen3", "mixtral", "deepseek_v3", "gpt_oss", "olmo2", "gemma3_text", "qwen3_moe")
#: stages before the tested run: a crash there says the architecture cannot run, not that boost failed
BEFORE_TESTED = ("start", "build", "factorize", "references")
#: a worker's exit status after a collective failed (the group is broken): the parent restarts it
EXIT_GROUP_BROKEN = 3
#: seconds the parent waits for the other ranks once one has exited, before it kills them
GRACE_S = 20.0
#: seconds a new group may take to start (imports, joining) on top of its first architecture's timeout
STARTUP_S = 120.0


@dataclass(frozen=True)
class Layout:
    """One distributed layout: processes, TP plan, FSDP2, factorized first."""

    name: str
    world: int
    plan: str | None = None  # parallelize_'s plan (None: no TP)
    fsdp: bool = False
    factorize: bool = False
    ep: bool = False  # expert_parallel_ over the world, each rank its batch row
    sample: tuple[str, ...] | None = None  # the default architectures (None: every one)
    about: str = ""


LAYOUTS: dict[str, Layout] = {
    "tp2-megatron": Layout("tp2-megatron", 2, plan="megatron",
                           about="2 gloo ranks, parallelize_(plan='megatron'), torch.compile(model, backend='boost'), "
                                 "the whole batch on every rank"),
    "tp2-btp": Layout("tp2-btp", 2, plan="btp", factorize=True,
                      about="factorize_(rank_ratio=0.25) then 2 gloo ranks, parallelize_(plan='btp'), "
                            "torch.compile(model, backend='boost'); reference: the factorized model"),
    "fsdp2": Layout("fsdp2", 2, fsdp=True,
                    about="2 gloo ranks, data parallel (rank r: batch row r), blocks compiled one by one "
                          "(compile_blocks, boost), then FSDP2 as boost-train applies it (train.fsdp.shard_model: embedding, "
                          "each block, norm+head, root); loss: the ranks' mean"),
    "tp2xfsdp2": Layout("tp2xfsdp2", 4, plan="megatron", fsdp=True, sample=SAMPLE,
                        about="4 gloo ranks, mesh (dp_shard 2, tp 2): parallelize_(plan='megatron') over tp, blocks "
                              "compiled one by one (whole model where compile_blocks refuses), FSDP2 over dp_shard as "
                              "boost-train applies it; each TP pair a batch row"),
    "ep2": Layout("ep2", 2, ep=True,
                  about="2 gloo ranks, data parallel (rank r: batch row r), expert_parallel_ (the experts sharded by "
                        "expert, tokens dispatched by all-to-all), torch.compile(model, backend='boost'); the replicated "
                        "gradients averaged over the ranks, the experts' gathered; mixtures of experts only"),
}


# ----------------------------------------------------------------------------- one result


@dataclass
class LayoutResult:
    """What one architecture did under one layout: its class and the evidence."""

    model_type: str
    layout: str = ""
    arch: str = ""
    cls: str = ""
    #: the one-line message (refused, ERROR), the reason (skipped) or a summary (WRONG ...)
    reason: str = ""
    #: ERROR: the innermost frame in boost_compile's code, if any
    frame: str = ""
    #: the last stage reached: start, build, factorize, references, shard, compile, step1.., judged
    stage: str = ""
    #: "lm": the model's own loss on labels = inputs; "logsumexp": its logits' mean logsumexp
    loss: str = ""
    #: the first step (1-based) outside the rule or missing a gradient; 0: none
    step: int = 0
    #: tensors outside the rule at that step, worst first: name, err, eager, bound
    worst: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    #: the largest err(tested) / bound over every tensor and step (below 1 inside the rule; -1: not judged)
    margin: float = -1.0
    routers: list[str] = field(default_factory=list)
    flips: dict[str, int] = field(default_factory=dict)
    #: boost's verify warnings (a rewrite it undid)
    verify: list[str] = field(default_factory=list)
    #: how the tested model was compiled: "whole", "blocks", or "whole (why not per block)"
    compiled: str = ""
    #: graphs Dynamo handed the backend on this rank (rank 0), over the steps (None: not compiled)
    graphs: int | None = None
    #: the one-process zoo's class of the architecture (benchmarks/zoo/zoo.json), where known
    one_process: str = ""
    params: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayoutResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# ----------------------------------------------------------------------------- judging (pure)

#: one step of a run: (loss, gradient by parameter name)
Run = tuple[Any, Mapping[str, Any]]


def judge_steps(result: LayoutResult, tested: Sequence[Run], eager: Sequence[Run], truth: Sequence[Run]) -> LayoutResult:
    """Classify ``result`` from the steps of the three runs (each a (loss, gradients) per step):
    ``MISSING_GRAD`` where a parameter eager has a gradient for has none in the tested run at any
    step; else the first step with a tensor outside the parity rule decides: ``topk_flip`` when
    only routers (and the loss) are off there and eager fp32 chose other experts than float64
    (``result.flips``), else ``WRONG``; ``exact`` when every step of every tensor is inside.

    Only the first step out counts: from there the tested weights have moved off the reference's."""
    if not (len(tested) == len(eager) == len(truth)) or not tested:
        raise ValueError(f"judge_steps needs as many steps of each run, got {len(tested)}, {len(eager)}, {len(truth)}")
    first_bad: tuple[int, list[Any]] | None = None
    for step, (t, e, f) in enumerate(zip(tested, eager, truth, strict=True), 1):
        bad, missing = zoo._judge((t[0], dict(t[1])), (e[0], dict(e[1])), (f[0], dict(f[1])))
        result.margin = max(result.margin, margin(t, e, f))
        if missing and not result.missing:
            result.missing, result.step = missing, step
        if bad and first_bad is None:
            first_bad = (step, bad)
    result.stage = "judged"
    if result.missing:
        result.cls = "MISSING_GRAD"
        result.reason = f"step {result.step}: no gradient for {len(result.missing)}: {', '.join(result.missing[:6])}"
        return result
    if first_bad is None:
        result.cls, result.reason = "exact", ""
        return result
    result.step, bad = first_bad
    result.worst = zoo._worst(bad)
    names = [m.name for m in bad]
    if result.flips and zoo._router_only(names, result.routers):
        result.cls = "topk_flip"
        result.reason = (f"step {result.step}: only {', '.join(names[:4])} off; eager fp32 chooses other experts than "
                         "float64 for " + ", ".join(f"{k}: {v} token(s)" for k, v in result.flips.items()))
    else:
        result.cls = "WRONG"
        result.reason = f"step {result.step}: {zoo._describe(result.worst)}"
        if len(bad) > 3:
            result.reason += f" (+{len(bad) - 3} more)"
    return result


def margin(tested: Run, eager: Run, truth: Run) -> float:
    """The largest err(tested) / bound of one step's tensors (the loss and every gradient both
    runs have), as :func:`boost_compile.parity.compare` measures them; -1 where none is finite."""
    import math

    import torch

    from boost_compile.parity import bound, norm64, rel_err

    named = [{"loss": run[0], **run[1]} for run in (tested, eager, truth)]
    scale = max((norm64(v) for v in named[2].values() if v is not None), default=0.0)
    worst = -1.0
    for name, ref in named[2].items():
        t, e = named[0].get(name), named[1].get(name)
        if ref is None or t is None or e is None:
            continue
        ratio = rel_err(t, ref, scale) / bound(rel_err(e, ref, scale), torch.float32)
        if math.isfinite(ratio):
            worst = max(worst, ratio)
    return worst


def crash_result(model_type: str, layout: str, stage: str, failure: str, tail: str = "", seconds: float = 0.0) -> LayoutResult:
    """The record of an architecture whose group died or hung: ``ERROR`` once the tested run has
    started (boost's or the layout's code), ``skipped`` before it (the architecture itself)."""
    stage = stage or "start"
    message = f"{failure} in stage {stage}" + (f" ({tail})" if tail else "")
    cls = "skipped" if stage in BEFORE_TESTED else "ERROR"
    return LayoutResult(model_type, layout=layout, arch=architectures().get(model_type, ""), cls=cls, reason=message,
                        stage=stage, seconds=round(seconds, 2))


# ----------------------------------------------------------------------------- a rank's work


class Rank:
    """This process's place in its layout's group: ranks, the TP group or mesh, the data rows."""

    def __init__(self, layout: Layout, rank: int, world: int, progress: Path | None = None) -> None:
        import torch.distributed as dist

        self.layout, self.rank, self.world, self.progress = layout, rank, world, progress
        self.mesh: Any = None
        self.tp: Any = None
        self.dp_mesh: Any = None
        self.dp_rank, self.dp_size = 0, 1
        if layout.fsdp and layout.plan is not None:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
            self.tp, self.dp_mesh = self.mesh["tp"], self.mesh["dp_shard"]
            self.dp_rank, self.dp_size = self.dp_mesh.get_local_rank(), world // 2
        elif layout.fsdp:
            from torch.distributed.device_mesh import init_device_mesh

            self.dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
            self.dp_rank, self.dp_size = rank, world
        elif layout.ep:
            self.dp_rank, self.dp_size = rank, world
        else:
            self.tp = dist.group.WORLD

    def stage(self, result: LayoutResult, stage: str) -> None:
        """Enter ``stage``; saved for the parent, which names it when this rank dies or hangs."""
        result.stage = stage
        if self.progress is not None:
            tmp = self.progress.with_suffix(".tmp")
            tmp.write_text(json.dumps({"model_type": result.model_type, "stage": stage, "time": time.time()}))
            tmp.replace(self.progress)

    def agree(self, status: tuple[str, str, str] | None) -> tuple[str, str, str] | None:
        """Every rank's (class, message, frame) of a failure, or None: the first rank's failure."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, status)
        return next((tuple(s) for s in out if s is not None), None)

    def local_rows(self, ids: Any) -> Any:
        """This rank's rows of the global batch (all of it without data parallelism)."""
        per = ids.shape[0] // self.dp_size
        return ids[self.dp_rank * per:(self.dp_rank + 1) * per]


def _one_graph_experts(model: Any) -> None:
    """Mixtures of experts on transformers' "batched_mm" experts: every expert's GEMM on every token,
    weighted by the router (zero where not chosen), so the model captures as one graph, as with the
    default grouped GEMM, and runs in float64 too. The one-process zoo's "eager" experts loop over
    the tokens each expert chose (``nonzero``), which breaks the graph, and parallelize_ needs one."""
    cfgs = [model.config, *(getattr(model.config, k) for k in zoo_models._sub_configs(model.config))]
    if all(getattr(c, "_experts_implementation", None) is None for c in cfgs):
        return
    with contextlib.suppress(Exception):  # an architecture without the choice keeps its eager experts
        model.set_experts_implementation("batched_mm")


def _broadcast_weights(model: Any) -> None:
    """Every rank starts from rank 0's weights and buffers (the builds should agree; now they do)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type != "meta" and t.is_contiguous() and t.numel():
                dist.broadcast(t.data, src=0)


def reference_steps(model: Any, ids: Any, seed: int = SEED, steps: int = STEPS, lr: float = LR) -> dict[str, Any]:
    """``steps`` eager SGD steps of ``model`` on ``ids`` (the loss :func:`zoo._eager_step` picks):
    each step's loss and gradients, the loss used, and each router's chosen experts."""
    import torch

    tap = zoo.RouterTap(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads, mode = [], [], ""
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            if not mode:
                (loss, g), mode = zoo._eager_step(model, ids, seed)
            else:
                loss, g = zoo._step(model, ids, mode, seed)
            losses.append(loss.detach().clone())
            grads.append({n: None if v is None else v.detach().clone() for n, v in g.items()})
            opt.step()
    finally:
        tap.remove()
    return {"mode": mode, "losses": losses, "grads": grads, "chosen": tap.chosen}


def _references(ctx: Rank, model: Any, ids: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The eager fp32 and float64 runs on the whole batch, rank 0 the one and rank 1 the other
    (one rank both in a group of one); every rank gets both. A failure is in the payload's ``error``."""
    import torch.distributed as dist

    mine: list[str] = ["fp32", "fp64"] if ctx.world == 1 else (["fp32"] if ctx.rank == 0 else ["fp64"] if ctx.rank == 1 else [])
    payloads: dict[str, Any] = {}
    for kind in mine:
        label = "float64" if kind == "fp64" else "fp32"
        try:
            try:
                run = copy.deepcopy(model)
            except Exception as exc:  # noqa: BLE001
                raise ZooSkip(f"the model cannot be copied: {_one_line(exc)}") from exc
            if kind == "fp64":
                with Float64Program():
                    payloads[kind] = reference_steps(run.double(), ids)
            else:
                payloads[kind] = reference_steps(run, ids)
        except ZooSkip as exc:  # zoo's "eager fails: ..." (the LM loss and the logsumexp both)
            text = str(exc)
            payloads[kind] = {"error": text.replace("eager fails", "eager float64 fails", 1) if kind == "fp64" else text}
        except Exception as exc:  # noqa: BLE001
            payloads[kind] = {"error": f"eager {label} fails: {_one_line(exc)}"}
    if ctx.world == 1:
        return payloads["fp32"], payloads["fp64"]
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, payloads)
    return out[0]["fp32"], out[1]["fp64"]


def _reference_problem(eager: Mapping[str, Any], truth: Mapping[str, Any]) -> str:
    """Why the references cannot judge anything ("" where they can)."""
    import torch

    for run in (eager, truth):
        if "error" in run:
            return run["error"]
    if eager["mode"] != truth["mode"]:
        return f"eager float64 runs the {truth['mode']} loss where fp32 runs the {eager['mode']} one"
    bad = [i + 1 for i, loss in enumerate(eager["losses"]) if not torch.isfinite(loss)]
    return f"eager fp32 loss is not finite at step {bad[0]}" if bad else ""


def _shard(ctx: Rank, model: Any, local_ids: Any, result: LayoutResult) -> tuple[Any, dict[str, Any]]:
    """Apply the layout to ``model`` in place; (what to call, the TP spec of each TP-sharded parameter)."""
    import torch

    import boost_compile as bc
    from boost_compile import _torch_compat as compat
    from boost_compile.train.fsdp import tp_specs_by_name

    layout = ctx.layout
    options = {"inner": "aot_eager"}
    specs: dict[str, Any] = {}
    if layout.ep:
        ctx.stage(result, "shard")
        bc.expert_parallel_(model)
    if layout.plan is not None:
        ctx.stage(result, "shard")
        bc.parallelize_(model, (local_ids,), ctx.tp, plan=layout.plan)
        specs = tp_specs_by_name(model)
        compat.dynamo_counters().clear()  # result.graphs counts the compile's graphs, not parallelize_'s captures
    if not layout.fsdp:
        ctx.stage(result, "compile")
        result.compiled = "whole"
        return torch.compile(model, backend="boost", options=options), specs
    from boost_compile.train.fsdp import shard_model

    blocks = _blocks(model)
    ctx.stage(result, "compile")
    fn = model
    try:
        bc.compile_blocks(model, options, blocks=blocks)
        result.compiled = "blocks"
    except bc.BlockCompileError as exc:
        if layout.plan is None:
            raise
        result.compiled = f"whole ({_one_line(exc)})"  # as boost-train does: a TP model whose code around the blocks
        fn = torch.compile(model, backend="boost", options=options)  # cannot run eagerly on its shards compiles whole
    ctx.stage(result, "shard")
    shard_model(model, ctx.dp_mesh, "fp32", reshard_after_forward=True)  # boost-train's units (and its TP specs kept)
    return fn, specs


def _fsdp_fails_eagerly(ctx: Rank, model_type: str, ids: Any, seed: int) -> str:
    """Where a data-parallel layout's tested run failed: the same model under FSDP2 with no compile
    at all, one step; its one-line error ("" where it runs). A model FSDP2 itself cannot run
    (Reformer's reversible layers call a block's modules outside the block's forward, where FSDP2
    has not gathered their weights) is skipped with that reason, not counted against boost."""
    import torch

    from boost_compile.train.fsdp import shard_model

    status: tuple[str, str, str] | None = None
    try:
        model = build(model_type, seed)
        _one_graph_experts(model)
        _broadcast_weights(model)
        shard_model(model, ctx.dp_mesh, "fp32", reshard_after_forward=True)
        torch.manual_seed(seed)
        zoo._call(model, ctx.local_rows(ids), "logits").backward()
    except Exception as exc:  # noqa: BLE001
        status = ("failed", _one_line(exc), "")
    status = ctx.agree(status)
    return "" if status is None else status[1]


def _blocks(model: Any) -> list[str]:
    """The decoder blocks FSDP2 shards one by one (``blocks.find_blocks``); none is a skip."""
    from boost_compile.blocks import BlockCompileError, find_blocks

    try:
        return find_blocks(model)
    except BlockCompileError as exc:
        raise ZooSkip(f"no decoder blocks to shard: {exc}") from exc


def _full_grads(model: Any, specs: Mapping[str, Any], ep: int = 0) -> dict[str, Any]:
    """Every parameter's whole gradient (a collective, in the same order on every rank): FSDP2's
    DTensor gathered, then a TP shard gathered by its spec. ``ep``: the expert-parallel world
    (data parallel without a wrapper): an expert's gradient gathered on the expert dim, the others
    averaged over the ranks and put back for the optimizer's step, as DDP would."""
    import torch
    import torch.distributed as dist

    from boost_compile.distributed.expert_parallel import is_expert_parameter
    from boost_compile.distributed.shard import full_tensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if ep and p.requires_grad:  # every rank takes part, a grad or not (a rank no token reached)
            g = torch.zeros_like(p) if g is None else g.detach().clone()
            if is_expert_parameter(p):
                parts = [torch.empty_like(g) for _ in range(ep)]
                dist.all_gather(parts, g.contiguous())
                g = torch.cat(parts)
            else:
                dist.all_reduce(g)
                g /= ep
                p.grad = g.clone()
        elif g is not None:
            if hasattr(g, "full_tensor"):
                g = g.full_tensor()
            g = full_tensor(g, specs.get(name)) if name in specs else g.detach().clone()
        out[name] = g
    return out


def _mean_loss(loss: Any, world: int) -> Any:
    """The ranks' mean of the loss: the global batch's loss under data parallelism (every TP
    rank of a pair holds the same)."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / world


def run_architecture(ctx: Rank, model_type: str, seed: int = SEED) -> LayoutResult | None:
    """One architecture under ``ctx``'s layout, collectively on every rank: build, (factorize),
    the references, shard and compile, :data:`STEPS` steps, judged on rank 0. Rank 0 returns the
    result, the other ranks None. A failure of a collective itself propagates (the group is broken)."""
    import torch

    from boost_compile import _torch_compat as compat

    start = time.perf_counter()
    result = LayoutResult(model_type, layout=ctx.layout.name, arch=architectures().get(model_type, ""))

    def finish(status: tuple[str, str, str]) -> LayoutResult | None:
        result.cls, result.reason, result.frame = status
        result.seconds = round(time.perf_counter() - start, 2)
        return result if ctx.rank == 0 else None

    # build: every rank the same model, then rank 0's weights everywhere
    status: tuple[str, str, str] | None = None
    model = None
    ids = torch.randint(TOKEN_LOW, TOKEN_HIGH, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    try:
        ctx.stage(result, "build")
        try:
            model = build(model_type, seed)
        except ZooSkip:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ZooSkip(f"building fails: {_one_line(exc)}") from exc
        _one_graph_experts(model)
        if ctx.layout.ep:
            from boost_compile.distributed.expert_parallel import find_experts

            try:
                experts = find_experts(model)
            except Exception as exc:  # noqa: BLE001 - an experts module of another form: refused, named
                status = zoo.classify_exception(exc)
            else:
                if not experts:
                    raise ZooSkip("no mixture-of-experts layer (nothing for expert parallelism to shard)")
        if ctx.layout.factorize:
            ctx.stage(result, "factorize")
            import boost_compile as bc

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    bc.factorize_(model, bc.FactorizeConfig(rank_ratio=0.25), example_inputs=(ids,))
                except Exception as exc:  # noqa: BLE001
                    status = zoo.classify_exception(exc)
    except ZooSkip as exc:
        status = ("skipped", str(exc), "")
    status = ctx.agree(status)
    if status is not None:
        return finish(status)
    result.params = sum(p.numel() for p in model.parameters())
    _broadcast_weights(model)

    # the references: eager fp32 (rank 0) and float64 (rank 1) on the whole batch
    ctx.stage(result, "references")
    eager, truth = _references(ctx, model, ids)
    problem = _reference_problem(eager, truth)
    if problem:
        return finish(("skipped", problem, ""))
    result.loss = eager["mode"]
    if ctx.rank == 0:
        result.routers = sorted(eager["chosen"])
        flips = zoo.RouterTap.flips(SimpleNamespace(chosen=eager["chosen"]), SimpleNamespace(chosen=truth["chosen"]))
        result.flips = {k: v for k, v in flips.items() if v}

    # the tested run
    local_ids = ctx.local_rows(ids)
    tested: list[Run] = []
    compat.reset_dynamo()
    counters = compat.dynamo_counters()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn, specs = _shard(ctx, model, local_ids, result)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
        except ZooSkip as exc:
            status = ("skipped", str(exc), "")
        except Exception as exc:  # noqa: BLE001
            status = zoo.classify_exception(exc)
        status = ctx.agree(status)
        for step in range(1, STEPS + 1):
            if status is not None:
                break
            ctx.stage(result, f"step{step}")
            try:
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                loss = zoo._call(fn, local_ids, result.loss)
                loss.backward()
            except Exception as exc:  # noqa: BLE001
                status = zoo.classify_exception(exc)
            status = ctx.agree(status)
            if status is None:
                grads = _full_grads(model, specs, ctx.world if ctx.layout.ep else 0)
                tested.append((_mean_loss(loss, ctx.world), grads))
                opt.step()
    result.verify = zoo._verify_notes(caught)
    result.graphs = int(counters["stats"]["unique_graphs"]) if result.compiled else None  # None: not compiled
    if status is not None and status[0] == "ERROR" and ctx.layout.fsdp and ctx.layout.plan is None:
        eager_error = _fsdp_fails_eagerly(ctx, model_type, ids, seed)
        if eager_error:
            status = ("skipped", f"FSDP2 fails without boost too (no compile): {eager_error}", "")
    if status is not None:
        return finish(status)
    if ctx.rank != 0:
        return None
    eager_runs = list(zip(eager["losses"], eager["grads"], strict=True))
    truth_runs = list(zip(truth["losses"], truth["grads"], strict=True))
    judge_steps(result, tested, eager_runs, truth_runs)
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def worker(layout_name: str, rank: int, world: int, store: str, names: Sequence[str], results: str, folder: str,
           timeout: float) -> int:
    """One rank of a layout's group: join it, then every architecture of ``names`` in turn
    (rank 0 appends each result to ``results``). A collective that fails ends the process with
    :data:`EXIT_GROUP_BROKEN` before the architecture is recorded: the parent records it."""
    import torch
    import torch.distributed as dist

    from boost_compile import _torch_compat as compat
    from boost_compile.process_exit import exit_without_finalizing

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    with contextlib.suppress(Exception):
        import transformers

        transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    ctx = Rank(LAYOUTS[layout_name], rank, world, Path(folder) / f"progress-{rank}.json")
    code = 0
    for name in names:
        try:
            result = run_architecture(ctx, name)
        except Exception:  # noqa: BLE001 - a broken group: the parent records this architecture
            print(f"rank {rank}, {name}: the group failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            code = EXIT_GROUP_BROKEN
            break
        if result is not None:
            with open(results, "a") as f:
                f.write(json.dumps(result.to_dict(), default=str) + "\n")
        compat.reset_dynamo()
        import gc

        gc.collect()
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001
            print(f"rank {rank}: the barrier after {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            code = EXIT_GROUP_BROKEN
            break
    if code == 0:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    exit_without_finalizing(code)  # gloo's threads outlive the group (boost_compile/process_exit.py)


# ----------------------------------------------------------------------------- the parent


def read_results(path: Path) -> list[LayoutResult]:
    """The results in a json-lines file (a torn last line, from a killed run, is left out)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(LayoutResult.from_dict(json.loads(line)))
    return out


def _append(path: Path, result: LayoutResult) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(result.to_dict(), default=str) + "\n")


def _kill(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL the process groups of the ranks this run started (each its own session)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=30)


def _launch(layout: Layout, names: Sequence[str], results: Path, folder: Path, timeout: float) -> list[subprocess.Popen]:
    folder.mkdir(parents=True)
    (folder / "names.json").write_text(json.dumps(list(names)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(layout.world):
        cmd = [sys.executable, "-m", "boost_compile.bench.zoo_layouts", "--worker", layout.name, "--rank", str(rank),
               "--store", str(folder / "store"), "--folder", str(folder), "--results", str(results),
               "--timeout", str(timeout)]
        with open(folder / f"stderr-{rank}.log", "w") as err:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True))
    return procs


def _progress(folder: Path, rank: int) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        return json.loads((folder / f"progress-{rank}.json").read_text())
    return {}


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        return zoo._last_line(path.read_text(errors="replace"))
    return ""


def run_layout(layout: Layout, names: Sequence[str], jsonl: Path, timeout: float, resume: bool = False,
               one_process: Mapping[str, str] | None = None, echo: Callable[[str], None] = print) -> tuple[list[LayoutResult], int]:
    """Every architecture of ``names`` under ``layout``: groups of ranks looping over them, a new group
    from the next architecture whenever one dies or hangs. Returns the results in ``names``' order
    and the number of groups started."""
    one_process = one_process or {}
    done = {r.model_type: r for r in read_results(jsonl)} if resume else {}
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    if not resume:
        jsonl.write_text("")
    todo = [n for n in names if n not in done]
    width = max((len(n) for n in names), default=1)
    seen = len(jsonl.read_text().splitlines())
    groups, failed_starts = 0, 0

    def land(r: LayoutResult) -> None:
        done[r.model_type] = r
        if r.model_type in todo:
            todo.remove(r.model_type)
        r.one_process = one_process.get(r.model_type, "")
        echo(f"[{len(done):3d}/{len(names)}] {layout.name} {r.model_type:<{width}} {r.cls:<12} {r.seconds:6.1f}s  "
             f"{zoo._cell(message(r), 160)}")

    def poll_lines() -> None:
        nonlocal seen
        lines = jsonl.read_text().splitlines()
        for line in lines[seen:]:
            with contextlib.suppress(ValueError):
                land(LayoutResult.from_dict(json.loads(line)))
        seen = len(lines)

    with tempfile.TemporaryDirectory(prefix="boost-zoo-layouts-") as tmp:
        while todo:
            groups += 1
            folder = Path(tmp) / f"group-{groups}"
            procs = _launch(layout, todo, jsonl, folder, timeout)
            first = todo[0]
            current, since, first_exit, failure, failed_rank = None, time.monotonic(), None, "", None
            while True:
                time.sleep(0.5)
                poll_lines()
                now = time.monotonic()
                head = todo[0] if todo else None
                if head != current:
                    current, since = head, now
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    bad = [(i, c) for i, c in enumerate(codes) if c]
                    if bad:
                        failed_rank, code = min(bad, key=lambda ic: ic[1] == EXIT_GROUP_BROKEN)
                        failure = f"rank {failed_rank} exited with {zoo._exit_text(code)}"
                    break
                if any(c is not None for c in codes):
                    if first_exit is None:
                        first_exit = now
                        dead = [(i, c) for i, c in enumerate(codes) if c is not None]
                        failed_rank, code = min(dead, key=lambda ic: ic[1] == EXIT_GROUP_BROKEN)
                        failure = f"rank {failed_rank} exited with {zoo._exit_text(code)}"
                    elif now - first_exit > GRACE_S:
                        _kill(procs)
                        break
                limit = timeout + (STARTUP_S if current == first else 0)  # the group's imports and joining
                if current is not None and now - since > limit:
                    failure, failed_rank = f"timed out after {timeout:g} s", None
                    _kill(procs)
                    break
            poll_lines()
            if not todo:
                break
            # the group ended with architectures left: the first of them is the one it was on
            current = todo[0]
            ranks = range(layout.world) if failed_rank is None else [failed_rank, *range(layout.world)]
            stage, tail = "", ""
            for r in ranks:
                prog = _progress(folder, r)
                if prog.get("model_type") == current:
                    stage = prog.get("stage", "")
                    break
            if failed_rank is not None:
                tail = _last_line(folder / f"stderr-{failed_rank}.log")
            if not stage:
                failed_starts += 1
                if failed_starts >= 2:
                    raise RuntimeError(f"the {layout.name} group failed twice before its first architecture: "
                                       f"{failure or 'no result'} ({tail})")
            else:
                failed_starts = 0
            record = crash_result(current, layout.name, stage, failure or "the group ended without a result", tail,
                                  time.monotonic() - since)
            _append(jsonl, record)
            poll_lines()
    return [done[n] for n in names if n in done], groups


# ----------------------------------------------------------------------------- tables


def counts(results: Sequence[LayoutResult]) -> dict[str, int]:
    return {c: n for c in zoo.CLASSES if (n := sum(r.cls == c for r in results))}


def message(r: LayoutResult) -> str:
    """The table's message of a result: reason, boost frame, verify notes, context."""
    parts = [r.reason]
    if r.cls == "ERROR" and r.frame:
        parts.append(f"[innermost boost_compile frame: {r.frame}]")
    if r.verify:
        parts.append(f"[verify undid: {'; '.join(r.verify)}]")
    if r.compiled.startswith("whole (") or (r.compiled == "whole" and LAYOUTS.get(r.layout, Layout("", 0)).fsdp):
        parts.append(f"[compiled {r.compiled}]")
    if r.cls == "topk_flip" or (r.cls == "WRONG" and r.flips):
        parts.append(f"[routers checked: {', '.join(r.routers)}]")
    if r.loss == "logsumexp":
        parts.append("(loss: logits' logsumexp)")
    return " ".join(p for p in parts if p)


def layout_markdown(name: str, section: Mapping[str, Any]) -> str:
    """One layout's section: its meta, counts, refusals, then every architecture."""
    results = [LayoutResult.from_dict(r) for r in section["results"]]
    lines = [f"## {name}", ""]
    lines += [f"- {k}: {v}" for k, v in section["meta"].items()]
    lines += ["", "| class | count |", "|---|---:|"]
    lines += [f"| {c} | {n} |" for c, n in counts(results).items()]
    refusals = [r for r in results if r.cls == "refused"]
    if refusals:
        lines += ["", "Refusals:", ""]
        lines += [f"- {r.model_type}: {zoo._cell(r.reason, 400)}" for r in refusals]
    lines += ["", "| model_type | class | one process | err/bound | graphs | message / reason |", "|---|---|---|---:|---:|---|"]
    lines += [f"| {r.model_type} | {r.cls} | {r.one_process or '-'} | {_ratio(r)} | {'-' if r.graphs is None else r.graphs} "
              f"| {zoo._cell(message(r))} |" for r in results]
    return "\n".join(lines) + "\n"


def _ratio(r: LayoutResult) -> str:
    return "-" if r.margin < 0 else f"{r.margin:.2g}"


def markdown(sections: Mapping[str, Mapping[str, Any]]) -> str:
    head = ["# boost layout zoo: the zoo's tiny causal-LM architectures under distributed layouts", "",
            f"{STEPS} SGD steps (lr {LR}) on random tokens ({BATCH}, {SEQ}), labels = inputs; at every step the loss "
            "and every gradient (gathered whole) judged by the parity rule (boost_compile.parity.compare) against the "
            "same model eager in one process (fp32) and its float64 copy, on the whole batch. "
            "Written by `python -m boost_compile.bench.zoo_layouts` (`make zoo-layouts`); "
            "'one process': the class in zoo.md (zoo-rerun.md where rerun); err/bound: the largest err(tested) / bound "
            "over every tensor and step (above 1 breaks the rule); graphs: the graphs Dynamo handed boost on rank 0.", "", ""]
    body = [layout_markdown(name, sections[name]) for name in [*LAYOUTS, *sorted(set(sections) - set(LAYOUTS))]
            if name in sections]
    return "\n".join(head) + "\n".join(body)


def write_tables(sections: Mapping[str, Mapping[str, Any]], out: Path, stem: str) -> None:
    """``out/<stem>.json`` and ``.md``: the layouts of ``sections``, with those of the files
    already there that this run did not redo."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    merged: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        merged = dict(json.loads(path.read_text()).get("layouts", {}))
    merged.update(sections)
    path.write_text(json.dumps({"layouts": merged}, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(markdown(merged))


def _one_process_classes(out: Path) -> dict[str, str]:
    """The one-process zoo's class per architecture: ``out/zoo.json``, then its reruns (``zoo-rerun.json``)."""
    classes: dict[str, str] = {}
    for stem in ("zoo", "zoo-rerun"):
        with contextlib.suppress(Exception):
            classes.update({r["model_type"]: r["cls"] for r in json.loads((out / f"{stem}.json").read_text())["results"]})
    return classes


def _source() -> str:
    """The code a run imports: the commit, and whether the work tree holds changes beyond it."""
    def git(*args: str) -> str:
        with contextlib.suppress(Exception):
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parent).stdout.strip()
        return ""

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit} + uncommitted changes" if commit and dirty else commit


def _meta(layout: Layout, timeout: float, wall: float, n: int, groups: int, source: str, started: str) -> dict[str, Any]:
    base = zoo._meta("aot_eager", timeout, wall, n)
    return {
        "command": "python -m boost_compile.bench.zoo_layouts " + " ".join(sys.argv[1:]),
        "layout": layout.about,
        "processes": layout.world,
        "architectures": n,
        "groups started": groups,
        **{k: base[k] for k in ("torch", "transformers", "machine")},
        "commit": source,
        "date": started,
        **{k: base[k] for k in ("timeout_s", "wall_s")},
        "model": base["model"].replace("eager experts", "experts as batched_mm (one graph)"),
        "run": f"{STEPS} SGD steps, lr {LR}, boost inner aot_eager; parity rule at every step vs eager fp32 and float64",
    }


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m boost_compile.bench.zoo_layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layouts (default: %(default)s)")
    p.add_argument("--only", default="", help="comma-separated model types (default: every one; tp2xfsdp2: its sample)")
    p.add_argument("--out", default=zoo.DEFAULT_OUT, help="folder of the tables (default: %(default)s)")
    p.add_argument("--stem", default=DEFAULT_STEM, help="file name of the tables, without suffix (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per architecture (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="keep the results already in DIR/<stem>-<layout>.jsonl")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--results", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        names = json.loads((Path(args.folder) / "names.json").read_text())
        return worker(args.worker, args.rank, LAYOUTS[args.worker].world, args.store, names, args.results, args.folder,
                      args.timeout)

    layouts = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    known = architectures()
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in only if n not in known]
    if bad:
        p.error(f"unknown model type(s) {bad}; see transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    out = Path(args.out)
    one_process = _one_process_classes(Path(zoo.DEFAULT_OUT)) or _one_process_classes(out)
    sections: dict[str, Any] = {}
    for name in layouts:
        layout = LAYOUTS[name]
        names = only or list(layout.sample or known)
        source, started, start = _source(), time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter()
        results, groups = run_layout(layout, names, out / f"{args.stem}-{name}.jsonl", args.timeout, args.resume,
                                     one_process)
        wall = time.perf_counter() - start
        sections[name] = {"meta": _meta(layout, args.timeout, wall, len(names), groups, source, started), "counts": counts(results),
                          "results": [r.to_dict() for r in results]}
        write_tables(sections, out, args.stem)
        summary = ", ".join(f"{c} {n}" for c, n in counts(results).items())
        print(f"{name}: {len(results)} architectures in {wall:.0f} s ({groups} group(s)): {summary}", flush=True)
    print(f"tables: {out / (args.stem + '.md')}, {out / (args.stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
