"""The layout search: every (tp, pp, dp, dp_shard, ep, zero, micro-batches, schedule, checkpoint, plan) a job can run, ranked.

:func:`search` enumerates the layouts boost-train accepts for a model on ``devices``
(tp within a node and dividing heads, kv-heads, d and d_ff; pp dividing the rest
and at most the blocks; dp the remainder, dividing the batch; or FSDP2 and HSDP: the
remainder cut into dp replicas of dp_shard ranks, with or without pipeline stages; for a mixture of
experts, expert parallelism over the data ranks as boost-train runs it, under DDP or FSDP2 / HSDP:
:func:`ep_layouts`), prices each with
the time model (:mod:`boost_compile.plan.timing`) and the memory model
(:mod:`boost_compile.plan.memory`), drops what does not fit and sorts the rest,
fastest first (then the least memory). :func:`refusal` says why nothing fits and
what would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

from boost_compile.costmodel import scale_model as sm
from boost_compile.costmodel.hardware import Hardware
from boost_compile.plan.memory import GIB, PRECISIONS, memory, start_memory
from boost_compile.plan.model import MOE_IMBALANCE, PLANS, ModelSpec, expert_share, local_numel, stage_blocks
from boost_compile.plan.timing import Moe, cold_compile, step_time

CHECKPOINTS = ("none", "lowrank", "full")
#: the schedules a compiled pipeline can run (zero_bubble splits the backward, which a compiled stage cannot)
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


class PlanError(ValueError):
    """No layout can run the job; the message says what would."""


@dataclass(frozen=True)
class Layout:
    """What boost-train's ``parallel.*`` and ``passes.options.checkpoint`` say."""

    tp: int
    pp: int
    dp: int
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    checkpoint: str = "none"
    plan: str = "btp"
    stages_per_rank: int = 1
    #: ``trainer.local_batch``: sequences per forward and backward on a rank (None: the rank's
    #: whole share of the batch; fewer: gradient accumulation over ``batch / (dp * dp_shard * local_batch)``)
    local_batch: int | None = None
    #: FSDP2's ranks in each replica (``parallel.dp_shard``; dp > 1 with it: HSDP); 1: DDP
    dp_shard: int = 1
    #: ``parallel.reshard_after_forward`` (FSDP2): free a block's gathered weights after its forward
    reshard_after_forward: bool = True
    #: ``parallel.ep``: the experts sharded by expert over groups of ep consecutive data ranks (ep divides
    #: dp * dp_shard; under FSDP2 the experts are left whole to each rank, not sliced by dp_shard); 1: none
    ep: int = 1

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data: ``dp * dp_shard``."""
        return self.dp * self.dp_shard

    def label(self) -> str:
        pipe = f" pp{self.pp} {self.schedule} m{self.microbatches}" + (f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else "")
        if self.dp_shard == 1:
            data = f" dp{self.dp}"
        else:
            data = (f" fsdp{self.dp_shard}" if self.dp == 1 else f" hsdp{self.dp}x{self.dp_shard}") + (
                "" if self.reshard_after_forward else " noreshard")
        return (f"tp{self.tp}" + (f" {self.plan}" if self.tp > 1 else "") + (pipe if self.pp > 1 else "")
                + data + (f" ep{self.ep}" if self.ep > 1 else "") + (" zero1" if self.zero else "") + f" ckpt={self.checkpoint}"
                + (f" local{self.local_batch}" if self.local_batch is not None else ""))

    def micro_steps(self, batch: int) -> int:
        """Forward-and-backward passes per optimizer step for a global ``batch`` (1: no accumulation)."""
        return 1 if self.local_batch is None else batch // self.data_ranks // self.local_batch

    def overrides(self) -> list[str]:
        """boost-train's overrides for this layout."""
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}", f"parallel.zero={self.zero}"]
        if self.dp_shard > 1:
            out.append(f"parallel.dp_shard={self.dp_shard}")
            out.append(f"parallel.reshard_after_forward={str(self.reshard_after_forward).lower()}")
        if self.ep > 1:
            out.append(f"parallel.ep={self.ep}")
        if self.tp > 1:
            out.append(f"parallel.plan={self.plan}")
        if self.pp > 1:
            out += [f"parallel.microbatches={self.microbatches}", f"parallel.pp_schedule={self.schedule}"]
            if self.stages_per_rank > 1:
                out.append(f"parallel.stages_per_rank={self.stages_per_rank}")
        out.append(f"++passes.options.checkpoint={self.checkpoint}")
        if self.local_batch is not None:
            out.append(f"trainer.local_batch={self.local_batch}")
        return out


@dataclass(frozen=True)
class Job:
    """The question: a model, a global batch of ``batch`` x ``seq`` tokens, on ``devices`` devices."""

    spec: ModelSpec
    batch: int
    seq: int
    devices: int
    per_node: int
    hardware: Hardware
    memory_bytes: float  # usable memory per device
    precision: str = "fp32"
    #: the boost-train model override that names the model (model=..., model.hf_path=...)
    model_args: tuple[str, ...] = ()
    #: the model is built on the meta device, each rank materialising its part (boost-train's
    #: ``model.init=per_parameter``); False: built whole on every rank first
    on_meta: bool = True
    #: elements of the largest dense weight a rank reads whole to factorize it by SVD (0: none)
    svd_elements: int = 0
    #: a mixture of experts under EP: the busiest rank's routed rows over the mean (boost-plan's
    #: ``--moe-imbalance``), charged to its expert compute, all-to-alls and activations
    moe_imbalance: float = MOE_IMBALANCE


@dataclass(frozen=True)
class Row:
    """One priced layout."""

    layout: Layout
    step_s: float
    tokens_per_s: float
    memory_gib: float
    terms_gib: dict[str, float]
    peak_at: str
    fits: bool
    command: str
    recompute_s: float = 0.0
    #: the data-parallel all-reduce hidden behind the backward (<= 0; plan.timing)
    overlap_s: float = 0.0
    #: one rank's cold compile before the first step (None: not measured for the hardware)
    compile_s: float | None = None
    #: FSDP2's exposed all-gathers, reduce-scatters and copies (plan.timing)
    fsdp_s: float = 0.0
    #: the start's peak per device (build, materialise, shard, cast: plan.memory.start_memory);
    #: ``fits`` needs it and ``memory_gib`` (the step's) within the memory
    start_gib: float = 0.0
    #: expert parallelism's all-to-alls on the critical path (plan.timing; exposed)
    a2a_s: float = 0.0

    def as_json(self) -> dict:
        """The ``--json`` row: the layout's keys, ``step_s``, ``memory_gib``, ``fits``, ``command`` and the terms."""
        return {**asdict(self.layout), "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
                "memory_gib": self.memory_gib, "fits": self.fits, "command": self.command,
                "memory_terms_gib": self.terms_gib, "peak_at": self.peak_at, "recompute_s": self.recompute_s,
                "fsdp_s": self.fsdp_s, "start_gib": self.start_gib, "a2a_s": self.a2a_s}


#: the share of a device's memory a layout may plan to use (the rest: CUDA context, allocator fragmentation)
USABLE = 0.9


def usable_memory(hw: Hardware, memory_gib: float | None) -> float:
    """Bytes a layout may use per device: ``memory_gib`` if given, else 90% of the hardware file's.

    ValueError naming the fix when neither is known.
    """
    if memory_gib is not None:
        return memory_gib * 2**30
    if hw.memory_gib:
        return USABLE * hw.memory_gib * 2**30
    raise ValueError(f"the hardware file {hw.name!r} gives no memory_gib; give the memory per device")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tp_degrees(spec: ModelSpec, devices: int, per_node: int) -> list[int]:
    """TP degrees inside one node that divide the heads, kv-heads, d and the d_ff of the MLPs TP splits
    (the dense ones and the shared experts; never the routed experts, whole on every TP rank). A
    low-rank mixture of experts has none above 1: boost-train refuses btp on it (its routers and
    experts read the stream whole)."""
    if spec.moe and not spec.dense:
        return [1]
    dense_mlp = not spec.moe or len(spec.dense_layers) > 0
    widths = (spec.n_heads, spec.n_kv_heads, spec.dim) + ((spec.ffn_dim,) if dense_mlp else ()) + (
        (spec.shared_ffn_dim,) if spec.shared_ffn_dim else ())
    return [t for t in divisors(min(devices, per_node)) if devices % t == 0 and all(w % t == 0 for w in widths)]


def layouts(job: Job, *, plans: tuple[str, ...] | None = None, checkpoints: tuple[str, ...] = CHECKPOINTS,
            fsdp: bool = True, ep: bool = True) -> Iterator[Layout]:
    """Every layout of ``job`` that boost-train's validation accepts; ``fsdp``: FSDP2 and HSDP ones too;
    ``ep``: expert parallelism for a mixture of experts (:func:`ep_layouts`)."""
    spec = job.spec
    plans = plans or PLANS[spec.kind]
    for tp in tp_degrees(spec, job.devices, job.per_node):
        for pp in divisors(job.devices // tp):
            dp = job.devices // tp // pp
            if pp > spec.n_layers or job.batch % dp:
                continue
            if pp > 1 and (spec.tie_embeddings or spec.projection == "lax" or not spec.pipeline):
                continue  # boost-train refuses these pipelines (see train/validate.py)
            replica = job.batch // dp
            for plan in plans if tp > 1 else plans[:1]:
                if plan == "vanilla" and (dp > 1 or pp > 1):
                    continue  # vanilla's DTensor parameters: dp = 1 and pp = 1 only
                for zero in (0, 1) if dp > 1 else (0,):
                    for ck in checkpoints:
                        yield from _pipelines(Layout(tp, pp, dp, zero, 1, "1f1b", ck, plan), replica, spec.n_layers)
                if ep and pp > 1:  # each stage's experts over its dp ranks (DDP; ZeRO-1 refused with ep)
                    for e in _ep_degrees(spec, dp):
                        for ck in checkpoints:
                            yield from _pipelines(Layout(tp, pp, dp, 0, 1, "1f1b", ck, plan, ep=e), replica,
                                                  spec.n_layers)
            if fsdp and pp > 1:
                yield from _piped_sharded(job, tp, pp, plans, checkpoints)
        if fsdp:
            yield from _sharded(job, tp, plans, checkpoints)
        if ep:
            yield from ep_layouts(job, tp, plans, checkpoints, fsdp=fsdp)


def ep_layouts(job: Job, tp: int, plans: tuple[str, ...], checkpoints: tuple[str, ...],
               fsdp: bool = True) -> Iterator[Layout]:
    """Expert parallelism as boost-train runs it (``train/validate.py``'s ``check_ep``): the experts
    sharded over groups of ``ep`` consecutive data-parallel ranks (ep > 1 dividing the data ranks and
    n_experts; the data_ranks / ep groups replicas of each other), under DDP or (``fsdp``) FSDP2 /
    HSDP (every dp x dp_shard of :func:`_sharded`, FSDP2 ignoring the experts), with TP or without.
    Never ZeRO-1 (refused); with pipeline stages: :func:`layouts` (under DDP; not yet under FSDP2);
    none for a model without experts."""
    spec = job.spec
    data = job.devices // tp
    if not spec.moe or data < 2 or job.batch % data:
        return
    degrees = _ep_degrees(spec, data)
    for ep in degrees:
        for plan in [p for p in plans if p != "vanilla"] if tp > 1 else plans[:1]:  # vanilla: dp = 1 only
            for ck in checkpoints:
                yield Layout(tp, 1, data, 0, 1, "1f1b", ck, plan, ep=ep)
    if fsdp:  # FSDP2 ignores the experts, whole on each TP rank
        for lo in _sharded(job, tp, plans, checkpoints):
            yield from (replace(lo, ep=ep) for ep in degrees)


def _ep_degrees(spec: ModelSpec, data_ranks: int) -> list[int]:
    """The expert-parallel degrees boost-train accepts: above 1, dividing the data ranks and the experts."""
    if not spec.moe:
        return []
    return [e for e in divisors(data_ranks) if e > 1 and spec.n_experts % e == 0]


@functools.lru_cache(maxsize=256)
def _moe_params(spec: ModelSpec, plan: str, tp: int, stages: int, pp: int,
                ep: int) -> tuple[float, float, tuple[float, ...], int, float]:
    """The busiest pipeline rank's parameters (its experts' share under ``ep``), those DDP all-reduces
    (all but the experts under EP), the largest block's FSDP2 unit on one TP rank (experts whole; under
    EP without them: FSDP2 ignores them), the MoE blocks of the busiest stage, and its experts'
    parameters under EP (averaged over their replicas). The blocks' units come in block order."""
    cut = stage_blocks(spec, stages)
    per_rank = []
    for rank in range(pp):
        mine = range(rank, len(cut), pp)
        blocks = {b for i in mine for b in cut[i]}
        first, last = 0 in mine, len(cut) - 1 in mine
        held = reduced = experts = 0
        for t in spec.tensors():
            if t.block in blocks or (t.block < 0 and (first if t.role == "embed" else last)):
                k = local_numel(t, plan, tp)
                if t.role == "expert":
                    held += expert_share(k, ep)
                    reduced += 0 if ep > 1 else k
                    experts += expert_share(k, ep) if ep > 1 else 0
                else:
                    held, reduced = held + k, reduced + k
        per_rank.append((held, reduced, sum(spec.moe_block(b) for b in blocks), experts))
    blocks_numel: dict[int, int] = {}
    for t in spec.tensors():
        if t.block >= 0 and not (ep > 1 and t.role == "expert"):
            blocks_numel[t.block] = blocks_numel.get(t.block, 0) + local_numel(t, plan, tp)
    held, reduced, moe_stage, experts = max(per_rank)
    return float(held), float(reduced), tuple(float(blocks_numel[b]) for b in sorted(blocks_numel)), moe_stage, float(experts)


def moe_of(job: Job, layout: Layout) -> Moe | None:
    """The time model's view of ``job``'s mixture of experts (or latent attention) under ``layout``."""
    spec, lo = job.spec, layout
    if not spec.moe and spec.mla is None and spec.attn_head_dim is None:
        return None
    params, reduced, blocks, moe_stage, experts = _moe_params(spec, lo.plan, lo.tp, lo.pp * lo.stages_per_rank, lo.pp, lo.ep)
    attn = {}
    if spec.mla is not None or spec.attn_head_dim is not None:
        names = (".self_attn.", ".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.")  # a block's attention matrices
        attn_params = sum(local_numel(t, lo.plan, lo.tp) for t in spec.tensors()
                          if t.block == 0 and len(t.shape) == 2 and any(n in t.name for n in names))
        heads = -(-spec.n_heads // lo.tp)
        qk, v = (spec.mla.qk_head_dim, spec.mla.v_head_dim) if spec.mla else (spec.head_dim, spec.head_dim)
        attn = {"attn_params": float(attn_params), "attn_width": heads * (qk + v) / 2, "attn_head_dim": qk}
    return Moe(spec.dim, spec.n_experts, spec.top_k, spec.expert_width, spec.expert_rank, spec.shared_ffn_dim,
               spec.moe_layers, moe_stage, params, reduced, max(blocks), ep=lo.ep, imbalance=job.moe_imbalance,
               ep_per_node=max(1, job.per_node // lo.tp), expert_params=experts,
               replicas_across_nodes=lo.data_ranks * lo.tp > job.per_node, block_units=blocks, **attn)


def _sharded(job: Job, tp: int, plans: tuple[str, ...], checkpoints: tuple[str, ...]) -> Iterator[Layout]:
    """FSDP2 (dp = 1) and HSDP layouts of ``tp``: every dp x dp_shard = devices / tp with dp_shard > 1.

    Without pipeline stages, ZeRO (FSDP2 shards the optimizer state itself) and vanilla's
    DTensor parameters, as boost-train's ``check_fsdp`` requires; under TP, FSDP2 cuts each
    rank's TP shard."""
    data = job.devices // tp
    if job.batch % data:
        return
    for dp_shard in divisors(data)[1:]:
        for plan in [p for p in plans if p != "vanilla"] if tp > 1 else plans[:1]:
            for reshard in (True, False):
                for ck in checkpoints:
                    yield Layout(tp, 1, data // dp_shard, 0, 1, "1f1b", ck, plan, dp_shard=dp_shard,
                                 reshard_after_forward=reshard)


def _piped_sharded(job: Job, tp: int, pp: int, plans: tuple[str, ...], checkpoints: tuple[str, ...]) -> Iterator[Layout]:
    """Pipeline stages under FSDP2 and HSDP: the ``pp`` stages' ranks cut into dp replicas of dp_shard > 1.

    The pipelines' schedules (zero_bubble, which boost-train refuses with FSDP2, is not among
    them), ``reshard_after_forward`` false only: boost-train's default with pp, and since the
    ``PipelineStage`` keeps every unit gathered from its first backward on, true would gather
    each micro-batch again to save memory only in the warm-up's forwards, which the planner
    does not price (plan.memory)."""
    data = job.devices // tp // pp
    for dp_shard in divisors(data)[1:]:
        for plan in [p for p in plans if p != "vanilla"] if tp > 1 else plans[:1]:
            for ck in checkpoints:
                base = Layout(tp, pp, data // dp_shard, 0, 1, "1f1b", ck, plan, dp_shard=dp_shard, reshard_after_forward=False)
                yield from _pipelines(base, job.batch // data, job.spec.n_layers)


def _pipelines(base: Layout, replica: int, n_layers: int) -> Iterator[Layout]:
    if base.pp == 1:
        yield base
        return
    pp = base.pp
    for m in divisors(replica):
        if m < pp:
            continue
        yield replace(base, microbatches=m, schedule="1f1b")
        yield replace(base, microbatches=m, schedule="gpipe")
        if m % pp == 0 and n_layers >= 2 * pp:
            yield replace(base, microbatches=m, schedule="interleaved_1f1b", stages_per_rank=2)


def price(job: Job, layout: Layout) -> Row:
    """Time and memory of one layout.

    With gradient accumulation (``layout.local_batch``) memory is that of one micro-step's batch
    (the gradients live through the backward, as under a pipeline; FSDP2's unsharded), and the
    step is that many micro-steps of that batch less, for all but one of them, what a step does
    once: the optimizer, the exposed data-parallel reduction, ZeRO-1's gather and FSDP2's
    reduce-scatters. A pipeline's fill and drain come with every micro-step (each runs the whole schedule)."""
    spec, prec = job.spec, PRECISIONS[job.precision]
    shape = spec.scale_shape()
    lo = layout
    a = lo.micro_steps(job.batch)
    batch = job.batch // a  # the global batch of one micro-step
    wl = sm.Workload(seq=job.seq, batch=batch, dtype_bytes=prec.activations)
    t = step_time(shape, lo.plan, tp=lo.tp, pp=lo.pp, dp=lo.dp, microbatches=lo.microbatches, schedule=lo.schedule,
                  stages_per_rank=lo.stages_per_rank, checkpoint=lo.checkpoint, zero=lo.zero, hw=job.hardware, wl=wl,
                  param_bytes=prec.weights, dp_across_nodes=lo.tp * lo.data_ranks > job.per_node,
                  p2p_across_nodes=job.devices > job.per_node, tensors=-(-len(spec.tensors()) // lo.pp),
                  dp_shard=lo.dp_shard, reshard_after_forward=lo.reshard_after_forward,
                  shard_across_nodes=lo.tp * lo.dp_shard > job.per_node, moe=moe_of(job, lo))
    mem = memory(spec, lo.plan, tp=lo.tp, pp=lo.pp, dp=lo.dp, zero=lo.zero, microbatches=lo.microbatches,
                 schedule=lo.schedule, checkpoint=lo.checkpoint, batch=batch, seq=job.seq, precision=job.precision,
                 stages_per_rank=lo.stages_per_rank, accumulating=a > 1, dp_shard=lo.dp_shard,
                 reshard_after_forward=lo.reshard_after_forward, ep=lo.ep, moe_imbalance=job.moe_imbalance)
    start = start_memory(spec, lo.plan, tp=lo.tp, pp=lo.pp, dp_shard=lo.dp_shard, precision=job.precision,
                         stages_per_rank=lo.stages_per_rank, on_meta=job.on_meta, svd_elements=job.svd_elements, ep=lo.ep)
    step_s = a * t.step_s - (a - 1) * t.once_s
    return Row(lo, step_s, job.batch * job.seq / step_s, mem.gib, {k: v / GIB for k, v in mem.terms.items()},
               mem.peak_at, max(mem.peak, start) <= job.memory_bytes, command(job, lo), t.recompute_s, t.overlap_s,
               cold_compile(spec.n_layers, lo.tp, lo.pp, job.hardware), fsdp_s=t.fsdp_s, start_gib=start / GIB,
               a2a_s=a * t.a2a_s)


def command(job: Job, layout: Layout) -> str:
    """The launch line of one layout: torchrun over the nodes, boost-train with the layout's overrides."""
    nodes = max(1, -(-job.devices // job.per_node))
    per_node = min(job.devices, job.per_node)
    multi_node = f" --nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint $HEAD:29500" if nodes > 1 else ""
    launch = "boost-train" if job.devices == 1 else f"torchrun --nproc-per-node {per_node}{multi_node} -m boost_compile.train"
    args = [*job.model_args, f"trainer.batch={job.batch}", f"trainer.seq={job.seq}", *layout.overrides()]
    if job.precision != "fp32":
        args.append(f"trainer.precision={job.precision}")
    return " ".join([launch, *args])


def local_batches(job: Job, layout: Layout) -> list[int]:
    """The ``trainer.local_batch`` values below a rank's share that boost-train accepts, largest first."""
    replica = job.batch // layout.data_ranks
    m = layout.microbatches if layout.pp > 1 else 1
    return [b for b in reversed(divisors(replica)[:-1]) if b % m == 0]


def accumulate_to_fit(job: Job, layout: Layout, local_batch: int | None = None) -> Row:
    """``layout`` priced; when it does not fit, with the least gradient accumulation that fits (the
    largest local batch), else as it is. ``local_batch``: the user's, priced as given (a layout
    whose share it does not divide gets the whole share, and a row that says it does not fit)."""
    if local_batch is not None:
        share = job.batch // layout.data_ranks
        accepted = local_batch in local_batches(job, layout) or (local_batch == share and share % layout.microbatches == 0)
        return price(job, replace(layout, local_batch=local_batch)) if accepted else replace(price(job, layout), fits=False)
    row = price(job, layout)
    if row.fits:
        return row
    for b in local_batches(job, layout):
        accumulated = price(job, replace(layout, local_batch=b))
        if accumulated.fits:
            return accumulated
    return row


def search(job: Job, *, plans: tuple[str, ...] | None = None, checkpoints: tuple[str, ...] = CHECKPOINTS,
           progress: Callable[[int, int], None] | None = None, local_batch: int | None = None,
           fsdp: bool = True, ep: bool = True) -> list[Row]:
    """Every layout of ``job`` priced, best first: those that fit by step time (then memory), then the rest.

    A layout whose memory binds is priced with gradient accumulation when that makes it fit
    (:func:`accumulate_to_fit`); ``local_batch`` fixes it instead (the user's ``trainer.local_batch``).
    ``fsdp``: FSDP2 and HSDP layouts beside DDP, ZeRO-1 and the pipelines; ``ep``: expert parallelism
    for a mixture of experts."""
    candidates = list(layouts(job, plans=plans, checkpoints=checkpoints, fsdp=fsdp, ep=ep))
    rows = []
    for i, lo in enumerate(candidates):
        rows.append(accumulate_to_fit(job, lo, local_batch))
        if progress is not None:
            progress(i + 1, len(candidates))
    rows.sort(key=lambda r: (not r.fits, r.step_s, r.memory_gib))
    return rows


def best(rows: list[Row], job: Job) -> Row:
    """The first row that fits; :class:`PlanError` (with :func:`refusal`'s reason) when none does."""
    for row in rows:
        if row.fits:
            return row
    raise PlanError(refusal(rows, job))


def refusal(rows: list[Row], job: Job) -> str:
    """Why no layout fits ``job`` and what would: the smallest layout's memory against the cap."""
    cap = job.memory_bytes / GIB
    if not rows:
        return (f"no layout of {job.spec.name} runs on {job.devices} device(s) ({job.per_node} per node) with batch "
                f"{job.batch}: tp must divide heads {job.spec.n_heads}, kv-heads {job.spec.n_kv_heads}, d {job.spec.dim} "
                f"and d_ff {job.spec.ffn_dim}, and dp the batch")
    small = min(rows, key=lambda r: max(r.memory_gib, r.start_gib))
    need = max(small.memory_gib, small.start_gib)
    if small.start_gib > small.memory_gib:
        most = f"its start, the model built and sharded: {small.start_gib:.2f} GiB"
    else:
        largest_term = max(small.terms_gib, key=small.terms_gib.get)
        most = f"most of it {largest_term}: {small.terms_gib[largest_term]:.2f} GiB"
    return (f"no layout of {job.spec.name} fits in {cap:.2f} GiB per device on {job.devices} device(s): the smallest, "
            f"{small.layout.label()}, needs {need:.2f} GiB ({most}); it would fit with {need:.2f} GiB per device "
            f"(--memory-gib), or with more devices, a smaller batch ({job.batch}) or sequence ({job.seq})")
