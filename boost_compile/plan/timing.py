"""The planner's step time: the scale model's iteration, plus recompute, ZeRO-1 and the schedule.

:func:`boost_compile.costmodel.scale_model.predict` prices one iteration of a (tp, pp,
dp) layout under 1F1B without recomputation. A layout also names a checkpoint
mode, ZeRO and a schedule; this module adds what each costs:

- **recompute** (``checkpoint=lowrank`` or ``full``), per layer and micro-batch: the
  forward of what the backward recomputes, as ``passes/activation_checkpoint.py``
  decides it. Collectives are never recomputed and their outputs are kept, so
  under TP a factor whose output is all-reduced is not recomputed either.
  lowrank: the up GEMMs whose outputs the backward reads (btp: q, k, v, gate, up;
  megatron: gate/up; vanilla: none, each up output being all-reduced), attention's
  forward, and the forward passes of the norms, RoPE, SiLU and SwiGLU. full: the
  whole block but its collectives (btp adds the o and down up factors, and at
  tp = 1 the down factors; megatron at tp = 1 every GEMM, else q/k/v and gate/up;
  vanilla every down factor).
- **ZeRO-1** (``zero=1``): each data-parallel rank steps 1/dp of the parameters and
  then all-gathers the updated ones. PyTorch's ZeroRedundancyOptimizer broadcasts
  each parameter tensor (``tensors``) from its owner, all issued asynchronously and
  waited for together: the first pays ``collective_latency`` (the ranks meeting
  after their compute), each further one the hardware's
  ``queued_collective_latency``, and the bytes go at the bus bandwidth. On the CPU
  file the two differ tenfold: a gloo collective that follows compute waits for the
  other rank and its communication thread, queued ones do not (priced at 3.0 ms per
  tensor, a cola-60m DP2 step with ``zero=1`` was predicted 0.40 s slower than without;
  measured, it ran 0.03-0.25 s slower in three runs).
- **nodes**: a data-parallel group spanning nodes (tp x dp ranks of a stage beyond one
  node) all-reduces, and pipeline stages on different nodes send, at the hardware
  file's ``internode_bus_bandwidth``.
- **data-parallel overlap** (``overlap_s``, negative): boost-train compiles a model without
  pipeline parallelism block by block (with or without TP), and DDP all-reduces each block's gradient
  bucket as that block's backward ends, beside the backward of the blocks below. Of the
  scale model's data-parallel all-reduce (``dp_s``, priced after the backward) the hardware's
  ``dp_overlap`` share of what the backward can hide is taken off: everything but the
  bottom block's bucket (``dp_s / layers``), at most the backward of the blocks above it
  (two thirds of the step's compute per layer, plus any recompute). Pipeline stages issue each
  bucket during the schedule's backward once its gradients are final (``train/dp_buckets.py``):
  there it hides behind the busiest stage's last micro-batch backward, one of the ``m + pp - 1``
  stage slots of its critical path, above its bottom block.
- **schedule**: GPipe and 1F1B have the same bubble (the scale model's
  ``sum + (m - 1) max``); interleaved 1F1B and zero-bubble with ``v`` stages per
  rank shrink the warm-up and drain to 1/v of a stage's time, for v times the sends.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from boost_compile.costmodel import scale_model as sm
from boost_compile.costmodel.hardware import Hardware

#: the plan's system in the scale model
SYSTEMS = {"btp": "btp", "vanilla": "vanilla", "megatron": "full-rank"}
#: forward share of the element passes a recompute repeats (norms, RoPE, SwiGLU, SiLU)
_RECOMPUTED_OPS = ("rmsnorm", "rope", "swiglu", "silu")
FORWARD_SHARE = sum(sm.PASSES[o][0] for o in _RECOMPUTED_OPS) / sum(sum(sm.PASSES[o]) for o in _RECOMPUTED_OPS)

# indices into scale_model.layer_gemms(system, ...) of the forward GEMMs each mode recomputes
_BTP = {"lowrank": (1, 2, 3, 7, 8), "full_tp": (1, 2, 3, 5, 7, 8, 10), "full": tuple(range(11))}
_FULL_RANK = {"lowrank": (2,), "full_tp": (0, 2), "full": (0, 1, 2, 3)}
_VANILLA = {"lowrank": (), "full_tp": tuple(range(0, 14, 2)), "full": tuple(range(14))}
RECOMPUTED_GEMMS = {"btp": _BTP, "full-rank": _FULL_RANK, "vanilla": _VANILLA}


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step of a layout, with the parts the planner adds."""

    step_s: float
    base_s: float  # the scale model's iteration (no recompute, 1F1B, optimizer on every rank)
    recompute_s: float
    zero_s: float  # ZeRO-1's all-gather, less the optimizer work it saves
    schedule_s: float  # interleaving's change to the bubble and the sends
    internode_s: float  # a data-parallel all-reduce or pipeline sends across nodes: their extra time
    prediction: sm.Prediction
    overlap_s: float = 0.0  # the data-parallel all-reduce hidden behind the backward (<= 0)


def recompute_cost(system: str, shape: sm.Shape, batch: int, seq: int, p: int, mode: str, hw: Hardware,
                   wl: sm.Workload) -> float:
    """Seconds one layer spends recomputing its forward for one micro-batch under ``mode``."""
    if mode in ("none", "budget"):
        return 0.0
    tokens, e = batch * seq, wl.dtype_bytes
    key = "lowrank" if mode == "lowrank" else ("full_tp" if p > 1 else "full")
    gemms = sm.layer_gemms(system, shape, tokens, p)
    gemm_s = sum(sm.gemm_time(g.m, g.k, g.n, hw, e) for i, g in enumerate(gemms) if i in RECOMPUTED_GEMMS[system][key])
    width = sm.attention_heads(system, shape, p) * shape.head_dim
    attn_s = sm.attention_time(sm.attention_flops(batch, seq, width, wl.causal_fraction), shape.head_dim, hw)
    ew = sm.layer_elementwise_bytes(system, shape, tokens, p, e) * FORWARD_SHARE
    return gemm_s + attn_s + sm.elementwise_time(ew, hw)


def step_time(shape: sm.Shape, plan: str, *, tp: int, pp: int, dp: int, microbatches: int, schedule: str,
              stages_per_rank: int, checkpoint: str, zero: int, hw: Hardware, wl: sm.Workload,
              param_bytes: int, head: str = sm.DEFAULT_HEAD, dp_across_nodes: bool = False,
              p2p_across_nodes: bool = False, tensors: int = 1) -> StepTime:
    """The step of one layout: :func:`scale_model.predict` and the terms above."""
    system = SYSTEMS[plan]
    m = microbatches if pp > 1 else 1
    pred = sm.predict(shape, system, tp, pp, hw, replace(wl, micro_batches=m), head=head, dp=dp)
    mb = wl.batch // dp // m
    layers = max(sm.stage_layers(shape.layers, pp))
    # the busiest stage recomputes its layers for each micro-batch (on the critical path m + pp - 1 times)
    per_mb = recompute_cost(system, shape, mb, wl.seq, tp, checkpoint, hw, wl) * layers
    recompute_s = per_mb * (m + pp - 1)
    zero_s = 0.0
    if zero and dp > 1:
        params = max(sm.stage_params(system, shape, tp, pp, head))
        # one broadcast per parameter tensor from its owner, queued behind the first
        queued = hw.queued_collective_latency or hw.collective_latency
        zero_s = (sm.allgather_time(1, params * param_bytes, dp, hw) + (max(1, tensors) - 1) * queued
                  - pred.optimizer_s * (1 - 1 / dp))
    internode_s = dp_internode_s = 0.0
    if dp_across_nodes and dp > 1 and hw.internode_bus_bandwidth:
        # the gradient all-reduce's ring crosses the nodes: it runs at the slower links' rate
        params = max(sm.stage_params(system, shape, tp, pp, head))
        payload = params * wl.grad_bytes
        slow = replace(hw, allreduce_bus_bandwidth=hw.internode_bus_bandwidth)
        internode_s = dp_internode_s = sm.allreduce_time(1, payload, dp, slow) - sm.allreduce_time(1, payload, dp, hw)
    if p2p_across_nodes and pp > 1 and hw.internode_bus_bandwidth:
        # the stages sit on different nodes: the sends go over the slower links
        tokens = mb * wl.seq
        slow = replace(hw, p2p_bandwidth=hw.internode_bus_bandwidth)
        internode_s += 2 * (pp - 1) * (sm.p2p_time(tokens, shape, slow, wl.dtype_bytes, system, tp)
                                       - sm.p2p_time(tokens, shape, hw, wl.dtype_bytes, system, tp))
    schedule_s = 0.0
    if pp > 1 and schedule in ("interleaved_1f1b", "zero_bubble") and stages_per_rank > 1:
        v = stages_per_rank
        stage_s = (pred.iteration_s - pred.optimizer_s - pred.dp_s - pred.p2p_s) / (m + pp - 1)
        schedule_s = -(pp - 1) * stage_s * (1 - 1 / v) + pred.p2p_s * (v - 1)
    # pipeline stages: the buckets go out during the busiest stage's last micro-batch backward
    # (one of the m + pp - 1 stage slots on its critical path)
    overlap_s = dp_overlap(pred, layers, recompute_s, dp_internode_s, hw, m + pp - 1 if pp > 1 else 1) if dp > 1 else 0.0
    total = pred.iteration_s + recompute_s + zero_s + schedule_s + internode_s + overlap_s
    return StepTime(total, pred.iteration_s, recompute_s, zero_s, schedule_s, internode_s, pred, overlap_s)


def dp_overlap(pred: sm.Prediction, layers: int, recompute_s: float, internode_s: float, hw: Hardware,
               slots: int = 1) -> float:
    """Seconds (<= 0) of the data-parallel all-reduce hidden behind a per-block backward (see above);
    ``layers``: the busiest stage's, ``slots``: the stage slots on its critical path (pipeline
    stages: ``m + pp - 1``, of which only the last micro-batch's backward can hide the reduction)."""
    reduce_s = pred.dp_s + internode_s
    compute_s = pred.gemm_s + pred.attention_s + pred.elementwise_s
    hideable = (2 / 3 * compute_s + recompute_s) / slots * (layers - 1) / layers
    return -hw.dp_overlap * min(reduce_s * (layers - 1) / layers, hideable)


def cold_compile(layers: int, tp: int, pp: int, hw: Hardware, unit: str = "block") -> float | None:
    """Seconds of one rank's cold compile before its first step (None: not measured for ``hw``).

    Per block (boost-train's ``passes.unit=block``, under any tp and pp) one block graph,
    whatever the depth (``parallelize_`` captures the first two blocks only); the whole model
    (``unit="model"``) grows by ``cold_compile_per_layer_s`` for each layer its stage holds
    beyond two (the depth the per-block figure was measured from)."""
    if not hw.cold_compile_s:
        return None
    if unit == "block":
        return hw.cold_compile_s
    stage = max(sm.stage_layers(layers, pp))
    return hw.cold_compile_s + hw.cold_compile_per_layer_s * max(0, stage - 2)
