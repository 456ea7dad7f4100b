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
- **FSDP2** (``dp_shard = n > 1``, HSDP with ``dp > 1``; ``fsdp_s``): the scale model's step
  for ``dp * n`` data-parallel ranks, less its DDP all-reduce (``dp_s``) and ``1 - 1/n`` of
  its optimizer (each rank steps its slice), plus FSDP2's collectives per unit
  (:func:`fsdp_unit_params`: the embedding, each block, the final norm with the head, as
  the scale model counts a TP rank's parameters P_u). With G_u = P_u e (the gathered
  dtype: the activations') and R_u = P_u w (the reduce dtype: the weights'), over the
  shard group's ring (at ``internode_bus_bandwidth`` when tp n ranks span nodes)::

      all-gather     ag_u = alpha + (n - 1)/n G_u / busbw
      reduce-scatter rs_u = alpha + (n - 1)/n R_u / busbw  [+ HSDP: all-reduce of R_u / n over dp]

  The forward gathers every unit; the backward gathers again each unit resharded after
  its forward (the blocks and the embedding under ``reshard_after_forward``; never the
  head, which boost-train keeps) and reduce-scatters every unit. Each gather is issued
  as the unit before it starts computing (forward prefetch; in the backward, the unit
  after it), and each reduce-scatter as its unit's backward ends, so that while unit k
  computes (c_k: a third of its compute in the forward, two thirds plus its recompute in
  the backward) the network carries q_k = ag_(k+1) + rs_(k-1). Exposed::

      fsdp_s = ag_first + sum_k (q_k - dp_overlap min(q_k, c_k)) + rs_last + copies

  (forward and backward, in their orders), ``dp_overlap`` being the hardware file's share
  of a collective that runs beside compute. ``copies``: FSDP2's copy-out of each gather (2
  passes over G_u) and the reduce-scatter's copy-in (G_u read, R_u written), at the
  elementwise rate, exposed. Under gradient accumulation the micro-steps before the last
  gather but do not reduce: the reduce-scatters' share and the optimizer are paid once.
- **FSDP2 under pipeline stages** (``pp > 1``, ``dp_shard = n > 1``; :func:`fsdp_pipeline_time`):
  the pipeline's step for ``dp * n`` data ranks, less its DDP all-reduce (and the share of it
  hidden) and ``1 - 1/n`` of its optimizer, plus the collectives of the busiest rank's units (its
  blocks and the larger of the embedding and the head). PyTorch's ``PipelineStage`` keeps every
  unit gathered and its gradients unsharded from its first backward to the step's end, then
  reduce-scatters the whole stage at once: with ``reshard_after_forward=false`` each unit is
  gathered once a step (in the first micro-batch's forward, prefetched as above); with true each
  micro-batch's forward gathers it again, and so may the backward after it (2 m gathers: an upper
  bound). The reduce-scatters (and HSDP's all-reduces) run after the last backward with nothing to
  hide behind: all exposed, as are the copies.
- **mixture of experts** (:class:`Moe`, :func:`moe_layer_time`): the scale model prices a dense
  Llama block; an MoE block replaces its MLP, per micro-batch of T tokens on a rank, by the
  router ([T, d] x [d, E]), the routed experts over T top_k rows (each SwiGLU matrix one GEMM of
  all the rank's rows: the grouped GEMM priced as one, at the GEMM efficiency of its whole shape)
  times the load imbalance under EP (``imbalance``: the busiest EP rank's rows over the mean), the
  shared experts (a dense MLP split by TP), and their SwiGLU and the dispatch's gathers and
  scatters at the elementwise rate; the experts are whole on every TP rank, so each TP rank computes
  all its replica's routed rows. Expert parallelism adds four all-to-alls per MoE block and
  micro-batch (dispatch and combine in the forward, their gradients in the backward), each moving
  T top_k d bytes of which (ep - 1) / ep leave the rank (times ``imbalance`` for the busiest):
  the share to ranks on the node at ``allreduce_bus_bandwidth``, the share to other nodes at
  ``internode_bus_bandwidth``, both at once, plus ``collective_latency``; exposed (boost-train runs
  the dispatch eagerly, between the compiled graphs). Parameters are counted from the model's
  tensors, not the dense shape: AdamW's passes over the rank's (its experts / ep) and DDP's
  all-reduce of all but the experts under EP; without EP the experts are whole on every rank,
  all-reduced by DDP or gathered by FSDP2 with their block. With ep below the data ranks the
  experts' gradients are all-reduced over their data_ranks / ep replicas after the backward
  (:func:`expert_replicas_time`, exposed; across nodes when the data ranks span them). Under
  FSDP2 / HSDP with EP (tp = 1) FSDP2 ignores the experts: its gathers and reduce-scatters move
  each block less its experts (every block's unit priced on its own, :attr:`Moe.block_units`), the
  optimizer steps the rank's experts whole and 1/n of the rest, and the all-to-alls and the
  replicas' all-reduce are those of DDP's EP.
  Multi-head latent attention (or a head width other than d / heads) is priced from the scale
  model's attention GEMMs scaled by the attention's parameters over the dense block's 4 d^2, and its
  core attention at its own widths (q.k over qk_head_dim, p.v over v_head_dim: their mean).
  Recompute under checkpointing is the dense block's.
"""

from __future__ import annotations

import math
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


#: forward GEMMs of the dense MLP in scale_model.layer_gemms, per system (replaced by an MoE block's)
DENSE_MLP_GEMMS = {"full-rank": (2, 3), "btp": (6, 7, 8, 9, 10), "vanilla": tuple(range(8, 14))}
#: element passes (read + write) of the dispatch per routed row of width d: gather in, scatter-add out,
#: forward and backward
DISPATCH_PASSES = 8


@dataclass(frozen=True)
class Moe:
    """What the time model needs of a mixture of experts (and latent attention) beyond the scale
    model's dense shape, for one layout (``plan/search.py`` fills it from the model's tensors)."""

    dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    expert_rank: int | None
    shared_ffn: int
    #: MoE blocks in all, and in the busiest pipeline stage
    layers: int
    stage_layers: int
    #: parameters the busiest rank holds (its experts / ep), those DDP all-reduces, the largest block's
    #: FSDP2 unit (under EP less its experts, which FSDP2 ignores)
    params: float
    reduced: float
    block_params: float
    ep: int = 1
    imbalance: float = 1.1
    #: the EP group's ranks on one node (ep when the group stays in a node)
    ep_per_node: int = 1
    #: under EP, the busiest rank's expert parameters, averaged over the dp / ep groups that hold
    #: them (an all-reduce after DDP's), and whether those replicas lie on other nodes
    expert_params: float = 0.0
    replicas_across_nodes: bool = False
    #: attention priced by parameters (0: the scale model's): one rank's attention parameters per block,
    #: its attention width (local heads x the mean of qk and v head widths) and qk head width
    attn_params: float = 0.0
    attn_width: float = 0.0
    attn_head_dim: int = 0
    #: each block's FSDP2 unit in order (as ``block_params``; empty: every block ``block_params``)
    block_units: tuple[float, ...] = ()


def all_to_all_time(payload: float, moe: Moe, hw: Hardware) -> float:
    """One all-to-all of ``payload`` bytes per rank over the EP group: the (ep - 1) / ep share that
    leaves the rank, to the node's ranks and the other nodes' at once (see the module's docstring)."""
    ep = moe.ep
    if ep <= 1:
        return 0.0
    local = max(1, min(ep, moe.ep_per_node))
    on_node = payload * (local - 1) / ep / hw.allreduce_bus_bandwidth
    off_node = payload * (ep - local) / ep / (hw.internode_bus_bandwidth or hw.allreduce_bus_bandwidth)
    return hw.collective_latency + max(on_node, off_node)


def moe_layer_time(moe: Moe, system: str, shape: sm.Shape, tokens: int, tp: int, hw: Hardware,
                   wl: sm.Workload) -> tuple[float, float]:
    """Seconds one MoE block adds to the scale model's dense block for one micro-batch of ``tokens``
    on one rank, forward and backward: (compute: router, experts x imbalance, shared experts, their
    element passes, less the dense MLP priced; the four all-to-alls)."""
    e, d, f, r = wl.dtype_bytes, moe.dim, moe.expert_ffn, moe.expert_rank
    imbalance = moe.imbalance if moe.ep > 1 else 1.0
    rows = max(1, math.ceil(tokens * moe.top_k * imbalance))
    if r is None:
        experts = [(rows, d, 2 * f), (rows, f, d)]
    else:
        experts = [(rows, d, 2 * r), (rows, r, f), (rows, r, f), (rows, f, r), (rows, r, d)]
    gemms = experts + [(tokens, d, moe.n_experts)]
    sl = -(-moe.shared_ffn // tp) if system != "vanilla" else moe.shared_ffn
    if moe.shared_ffn:
        gemms += [(tokens, d, 2 * sl), (tokens, sl, d)]
    gemm_s = 3 * sum(sm.gemm_time(m, k, n, hw, e) for m, k, n in gemms)
    swiglu = sum(sm.PASSES["swiglu"])
    ew = (swiglu * (rows * f + tokens * sl) + DISPATCH_PASSES * rows * d + 4 * tokens * moe.n_experts) * e
    dense = sm.layer_gemms(system, shape, tokens, tp)
    dense_s = 3 * sum(sm.gemm_time(g.m, g.k, g.n, hw, e) for i, g in enumerate(dense) if i in DENSE_MLP_GEMMS[system])
    ffl = shape.d_ff if system == "vanilla" else -(-shape.d_ff // tp)
    dense_s += sm.elementwise_time(swiglu * tokens * ffl * e, hw)
    compute = gemm_s + sm.elementwise_time(ew, hw) - dense_s
    a2a = 4 * all_to_all_time(tokens * moe.top_k * d * e * imbalance, moe, hw)
    return compute, a2a


def attention_delta(moe: Moe, system: str, shape: sm.Shape, batch: int, seq: int, tp: int, hw: Hardware,
                    wl: sm.Workload) -> float:
    """Seconds per block and micro-batch that the attention priced by parameters (:class:`Moe`'s
    ``attn_*``) differs from the scale model's, forward and backward (0 when not given)."""
    if not moe.attn_params or system != "full-rank":
        return 0.0
    tokens, e = batch * seq, wl.dtype_bytes
    gemms = sm.layer_gemms(system, shape, tokens, tp)[:2]
    dense_s = 3 * sum(sm.gemm_time(g.m, g.k, g.n, hw, e) for g in gemms)
    dense_params = sum(g.k * g.n for g in gemms)
    width = sm.attention_heads(system, shape, tp) * shape.head_dim
    factor = 1 + wl.attention_bwd_factor
    core = (sm.attention_time(sm.attention_flops(batch, seq, moe.attn_width, wl.causal_fraction) * factor,
                              moe.attn_head_dim, hw)
            - sm.attention_time(sm.attention_flops(batch, seq, width, wl.causal_fraction) * factor, shape.head_dim, hw))
    return dense_s * (moe.attn_params / dense_params - 1) + core


#: element passes (read + write) of the replicas' flattened expert gradients: the concatenation, the
#: division by the replicas and the copy back
REPLICA_PASSES = 6


def expert_replicas_time(moe: Moe, dp: int, hw: Hardware, wl: sm.Workload) -> float:
    """``ep`` below the ``dp`` data ranks (``dp * dp_shard`` under FSDP2): the ring all-reduce of the
    rank's expert gradients over the ``dp / ep`` ranks that hold the same experts (one flattened
    tensor after the backward: exposed), over the network between nodes when those ranks are on
    other nodes, and the flattening's copies (:data:`REPLICA_PASSES`)."""
    replicas = dp // moe.ep if moe.ep > 1 else 1
    if replicas <= 1 or not moe.expert_params:
        return 0.0
    size = moe.expert_params * wl.grad_bytes
    ring = replace(hw, allreduce_bus_bandwidth=hw.internode_bus_bandwidth) \
        if moe.replicas_across_nodes and hw.internode_bus_bandwidth else hw
    return sm.allreduce_time(1, size, replicas, ring) + sm.elementwise_time(REPLICA_PASSES * size, hw)


def with_moe(pred: sm.Prediction, moe: Moe | None, system: str, shape: sm.Shape, *, batch: int, seq: int, tp: int,
             pp: int, dp: int, hw: Hardware, wl: sm.Workload) -> tuple[sm.Prediction, float, float]:
    """The scale model's ``pred`` (micro-batches of ``batch`` sequences) with an MoE model's blocks,
    parameters and all-to-alls (see the module's docstring): the prediction, the seconds of
    all-to-all on the critical path, and the compute one MoE block adds per micro-batch."""
    if moe is None:
        return pred, 0.0, 0.0
    m = pred.micro_batches
    compute, a2a = moe_layer_time(moe, system, shape, batch * seq, tp, hw, wl)
    moe_path = moe.layers + (m - 1) * moe.stage_layers if pp > 1 else moe.layers
    layers_path = shape.layers + (m - 1) * max(sm.stage_layers(shape.layers, pp)) if pp > 1 else shape.layers
    extra = compute * moe_path + attention_delta(moe, system, shape, batch, seq, tp, hw, wl) * layers_path
    a2a_s = a2a * moe_path
    optimizer_s = sm.elementwise_time(wl.optimizer_bytes_per_param * moe.params, hw)
    dp_comm, _, dp_copy = sm.dp_cost(moe.reduced, dp, hw, wl)
    dp_s = dp_comm + dp_copy + expert_replicas_time(moe, dp, hw, wl)
    iteration = pred.iteration_s + extra + a2a_s + optimizer_s - pred.optimizer_s + dp_s - pred.dp_s
    return replace(pred, iteration_s=iteration, gemm_s=pred.gemm_s + extra, comm_s=pred.comm_s + a2a_s,
                   optimizer_s=optimizer_s, dp_s=dp_s), a2a_s, compute


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
    fsdp_s: float = 0.0  # FSDP2's exposed all-gathers, reduce-scatters and their copies
    #: what a step does once however many micro-steps it accumulates: the optimizer, the exposed
    #: data-parallel reduction (DDP's all-reduce, ZeRO-1's gather, FSDP2's reduce-scatters)
    once_s: float = 0.0
    #: expert parallelism's all-to-alls on the critical path (exposed)
    a2a_s: float = 0.0


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
              p2p_across_nodes: bool = False, tensors: int = 1, dp_shard: int = 1,
              reshard_after_forward: bool = True, shard_across_nodes: bool = False, moe: Moe | None = None) -> StepTime:
    """The step of one layout: :func:`scale_model.predict` and the terms above.

    ``dp_shard > 1``: FSDP2 (:func:`fsdp_pipeline_time` with ``pp > 1``); ``dp_across_nodes`` then says whether HSDP's replica
    all-reduce, and ``shard_across_nodes`` whether the shard group's ring, crosses nodes. ``moe``: a
    mixture of experts' blocks, parameters and all-to-alls (:func:`with_moe`)."""
    if dp_shard > 1:
        if pp > 1:
            return fsdp_pipeline_time(shape, plan, tp=tp, pp=pp, dp=dp, dp_shard=dp_shard, microbatches=microbatches,
                                      schedule=schedule, stages_per_rank=stages_per_rank, checkpoint=checkpoint, hw=hw,
                                      wl=wl, param_bytes=param_bytes, head=head, reshard_after_forward=reshard_after_forward,
                                      shard_across_nodes=shard_across_nodes, replica_across_nodes=dp_across_nodes,
                                      p2p_across_nodes=p2p_across_nodes, moe=moe)
        return fsdp_step_time(shape, plan, tp=tp, dp=dp, dp_shard=dp_shard, checkpoint=checkpoint, hw=hw, wl=wl,
                              param_bytes=param_bytes, head=head, reshard_after_forward=reshard_after_forward,
                              shard_across_nodes=shard_across_nodes, replica_across_nodes=dp_across_nodes, moe=moe)
    system = SYSTEMS[plan]
    m = microbatches if pp > 1 else 1
    pred = sm.predict(shape, system, tp, pp, hw, replace(wl, micro_batches=m), head=head, dp=dp)
    mb = wl.batch // dp // m
    pred, a2a_s, _ = with_moe(pred, moe, system, shape, batch=mb, seq=wl.seq, tp=tp, pp=pp, dp=dp, hw=hw, wl=wl)
    layers = max(sm.stage_layers(shape.layers, pp))
    # the busiest stage recomputes its layers for each micro-batch (on the critical path m + pp - 1 times)
    per_mb = recompute_cost(system, shape, mb, wl.seq, tp, checkpoint, hw, wl) * layers
    recompute_s = per_mb * (m + pp - 1)
    zero_s = 0.0
    if zero and dp > 1:
        params = moe.params if moe else max(sm.stage_params(system, shape, tp, pp, head))
        # one broadcast per parameter tensor from its owner, queued behind the first
        queued = hw.queued_collective_latency or hw.collective_latency
        zero_s = (sm.allgather_time(1, params * param_bytes, dp, hw) + (max(1, tensors) - 1) * queued
                  - pred.optimizer_s * (1 - 1 / dp))
    internode_s = dp_internode_s = 0.0
    if dp_across_nodes and dp > 1 and hw.internode_bus_bandwidth:
        # the gradient all-reduce's ring crosses the nodes: it runs at the slower links' rate
        params = moe.reduced if moe else max(sm.stage_params(system, shape, tp, pp, head))
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
    once_s = pred.optimizer_s + pred.dp_s + overlap_s + zero_s
    return StepTime(total, pred.iteration_s, recompute_s, zero_s, schedule_s, internode_s, pred, overlap_s, once_s=once_s,
                    a2a_s=a2a_s)


def fsdp_unit_params(system: str, shape: sm.Shape, tp: int, head: str = sm.DEFAULT_HEAD) -> tuple[float, float, float]:
    """Parameters one TP rank holds in each kind of FSDP2 unit, as the scale model counts them
    (:func:`scale_model.stage_params`): the embedding, one block, the final norm with the head."""
    vocab_local = shape.vocab if head == "replicated" else -(-shape.vocab // tp)
    embed = shape.vocab * -(-shape.d // tp) if system == "btp" else vocab_local * shape.d
    return embed, sm.layer_params(system, shape, tp), vocab_local * shape.d + shape.d


def exposed(comm: list[float], compute: list[float], share: float) -> float:
    """Seconds of ``comm[k]`` not hidden behind ``compute[k]``: ``share`` of the shorter of the two is."""
    return sum(c - share * min(c, w) for c, w in zip(comm, compute, strict=True))


def fsdp_pass(gathers: list[float], reduces: list[float], compute: list[float], share: float) -> float:
    """Exposed seconds of one pass (forward or backward) over units in their order: unit k's
    ``gathers[k]`` runs while unit k - 1 computes, ``reduces[k]`` while unit k + 1 does; the
    first gather and the last reduce have nothing to hide behind."""
    nxt = gathers[1:] + [0.0]
    prev = [0.0] + reduces[:-1]
    return gathers[0] + exposed([g + r for g, r in zip(nxt, prev, strict=True)], compute, share) + reduces[-1]


def fsdp_step_time(shape: sm.Shape, plan: str, *, tp: int, dp: int, dp_shard: int, checkpoint: str, hw: Hardware,
                   wl: sm.Workload, param_bytes: int, head: str = sm.DEFAULT_HEAD, reshard_after_forward: bool = True,
                   shard_across_nodes: bool = False, replica_across_nodes: bool = False, moe: Moe | None = None) -> StepTime:
    """The step of an FSDP2 or HSDP layout without pipeline stages (see the module's docstring); an
    MoE model's blocks gathered whole, experts included (``moe``), or under expert parallelism
    (``moe.ep > 1``) without them: FSDP2 ignores the experts, each rank steps its n_experts / ep
    whole, their all-to-alls as under DDP and their replicas' all-reduce after the backward."""
    system, n = SYSTEMS[plan], dp_shard
    pred = sm.predict(shape, system, tp, 1, hw, replace(wl, micro_batches=1), head=head, dp=dp * n)
    mb, layers = wl.batch // (dp * n), shape.layers
    pred, a2a_s, moe_c = with_moe(pred, moe, system, shape, batch=mb, seq=wl.seq, tp=tp, pp=1, dp=dp * n, hw=hw, wl=wl)
    per_layer_recompute = recompute_cost(system, shape, mb, wl.seq, tp, checkpoint, hw, wl)
    layer = sm.layer_cost(system, shape, mb, wl.seq, tp, hw, wl)
    top = sm.head_cost(system, shape, mb * wl.seq, tp, hw, wl, head)
    layer_c, head_c = layer.gemm_s + layer.attention_s + layer.elementwise_s, top.gemm_s + top.elementwise_s
    if moe is not None:  # the MoE blocks' compute spread over the blocks
        layer_c += moe_c * moe.layers / layers
    shard_hw, replica_hw = _fsdp_links(hw, shard_across_nodes, replica_across_nodes)
    e_p, b_p, h_p = fsdp_unit_params(system, shape, tp, head)
    blocks = [b_p] * layers if moe is None else list(moe.block_units) or [moe.block_params] * layers
    order = [e_p] + blocks + [h_p]  # the forward's units
    ag = [sm.allgather_time(1, p * wl.dtype_bytes, n, shard_hw) for p in order]
    rs = [sm.allgather_time(1, p * param_bytes, n, shard_hw) + sm.allreduce_time(1, p * param_bytes / n, dp, replica_hw)
          for p in order]
    forward = fsdp_pass(ag, [0.0] * len(order), [0.0] + [layer_c / 3] * layers + [head_c / 3], hw.dp_overlap)
    resharded = [reshard_after_forward] * (layers + 1) + [False]  # the embedding and the blocks; the head is kept
    regather = [g if r else 0.0 for g, r in zip(ag, resharded, strict=True)]
    back_compute = [0.0] + [2 / 3 * layer_c + per_layer_recompute] * layers + [2 / 3 * head_c]
    backward = fsdp_pass(regather[::-1], rs[::-1], back_compute[::-1], hw.dp_overlap)
    keep = fsdp_pass(regather[::-1], [0.0] * len(order), back_compute[::-1], hw.dp_overlap)  # no reduce
    gathered = sum(order) + sum(p for p, r in zip(order, resharded, strict=True) if r)
    copy_gather = sm.elementwise_time(2 * wl.dtype_bytes * gathered, hw)
    copy_reduce = sm.elementwise_time((wl.dtype_bytes + param_bytes) * sum(order), hw)
    fsdp_s = forward + backward + copy_gather + copy_reduce
    optimizer_s = pred.optimizer_s / n
    replicas_s = 0.0
    if moe is not None and moe.expert_params:  # EP: FSDP2 slices all but the experts, which a rank steps whole
        sliced = (moe.params - moe.expert_params) / n + moe.expert_params
        optimizer_s = sm.elementwise_time(wl.optimizer_bytes_per_param * sliced, hw)
        replicas_s = expert_replicas_time(moe, dp * n, hw, wl)
    recompute_s = per_layer_recompute * layers
    total = pred.iteration_s - pred.dp_s - pred.optimizer_s + optimizer_s + recompute_s + fsdp_s + replicas_s
    once_s = optimizer_s + backward - keep + copy_reduce + replicas_s
    return StepTime(total, pred.iteration_s, recompute_s, 0.0, 0.0, 0.0, pred, 0.0, fsdp_s, once_s, a2a_s=a2a_s)


def _fsdp_links(hw: Hardware, shard_across_nodes: bool, replica_across_nodes: bool) -> tuple[Hardware, Hardware]:
    """The hardware of the shard group's ring and of HSDP's replica all-reduce: internode links where they cross nodes."""
    slow = replace(hw, allreduce_bus_bandwidth=hw.internode_bus_bandwidth) if hw.internode_bus_bandwidth else hw
    return (slow if shard_across_nodes else hw), (slow if replica_across_nodes else hw)


def fsdp_pipeline_time(shape: sm.Shape, plan: str, *, tp: int, pp: int, dp: int, dp_shard: int, microbatches: int,
                       schedule: str, stages_per_rank: int, checkpoint: str, hw: Hardware, wl: sm.Workload,
                       param_bytes: int, head: str = sm.DEFAULT_HEAD, reshard_after_forward: bool = False,
                       shard_across_nodes: bool = False, replica_across_nodes: bool = False,
                       p2p_across_nodes: bool = False, moe: Moe | None = None) -> StepTime:
    """The step of pipeline stages under FSDP2 or HSDP (see the module's docstring): the gathers
    prefetched behind a micro-batch's forward, the stage's reduce-scatters at the step's end unhidden."""
    system, n, m = SYSTEMS[plan], dp_shard, microbatches
    base = step_time(shape, plan, tp=tp, pp=pp, dp=dp * n, microbatches=m, schedule=schedule,
                     stages_per_rank=stages_per_rank, checkpoint=checkpoint, zero=0, hw=hw, wl=wl,
                     param_bytes=param_bytes, head=head, p2p_across_nodes=p2p_across_nodes, moe=moe)
    pred = base.prediction
    shard_hw, replica_hw = _fsdp_links(hw, shard_across_nodes, replica_across_nodes)
    e_p, b_p, h_p = fsdp_unit_params(system, shape, tp, head)
    b_p = moe.block_params if moe is not None else b_p
    layers = max(sm.stage_layers(shape.layers, pp))
    units = [max(e_p, h_p)] + [b_p] * layers  # the busiest rank's, in its forward's order
    layer = sm.layer_cost(system, shape, wl.batch // (dp * n) // m, wl.seq, tp, hw, wl)
    forward_c = [0.0] + [(layer.gemm_s + layer.attention_s + layer.elementwise_s) / 3] * layers
    ag = [sm.allgather_time(1, p * wl.dtype_bytes, n, shard_hw) for p in units]
    rs = [sm.allgather_time(1, p * param_bytes, n, shard_hw) + sm.allreduce_time(1, p * param_bytes / n, dp, replica_hw)
          for p in units]
    gathers = 2 * m if reshard_after_forward else 1
    gather_s = gathers * fsdp_pass(ag, [0.0] * len(units), forward_c, hw.dp_overlap)
    reduce_s = sum(rs)
    copy_gather = sm.elementwise_time(2 * wl.dtype_bytes * sum(units) * gathers, hw)
    copy_reduce = sm.elementwise_time((wl.dtype_bytes + param_bytes) * sum(units), hw)
    fsdp_s = gather_s + reduce_s + copy_gather + copy_reduce
    optimizer_s = pred.optimizer_s / n
    total = base.step_s - pred.dp_s - base.overlap_s - (pred.optimizer_s - optimizer_s) + fsdp_s
    return replace(base, step_s=total, overlap_s=0.0, fsdp_s=fsdp_s, once_s=optimizer_s + reduce_s + copy_reduce)


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
