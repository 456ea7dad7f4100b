"""The planner's memory model: bytes per device of a layout, term by term.

Per rank (the busiest one: the pipeline stage and data-parallel rank that hold the most):

- ``params``, ``grads``: the rank's shards (:func:`boost_compile.plan.model.local_numel`)
  of its stage's tensors, in the weights' dtype;
- ``optimizer``: AdamW's two moments per local parameter (its ``step`` counters are
  a few bytes); with ``zero=1`` the share PyTorch's ZeroRedundancyOptimizer gives the
  busiest dp rank (whole tensors, largest first, each to the emptiest rank);
- ``dp_buckets``: DDP's gradient buckets when dp > 1, a second copy of the gradients;
- ``activations``: what the forward saves for the backward in the blocks, per
  micro-batch (:func:`block_saved_elements`, what the partitioned graphs hold: see
  the function) times the micro-batches the schedule keeps in flight on the stage
  (:func:`in_flight`);
- ``head``: the head's saved tensors and its loss buffers, on the last stage (the
  logits and their log-softmax in fp32 on the local vocabulary, the final norm's
  input and output);
- ``temporary``: the largest transient of a step: the logits' gradient at the
  start of the backward with, under checkpointing, the block being recomputed (what
  it saves without checkpointing, less what it keeps), or the optimizer's update (one
  tensor of the size of the local parameters, AdamW's ``sqrt`` of the second moment).

The peak is the persistent part (params, optimizer, buckets) plus the larger of the
backward's start (activations in flight, the head, the logits' gradient, the block
being recomputed; under a pipeline also the gradients, which the micro-batches
accumulate into from the first backward on) and the optimizer step (gradients and the update's temporary): the sum of the terms live
then (:attr:`Memory.live`). ``temporary`` is the transient of that phase.

FSDP2 (``dp_shard > 1``, HSDP with ``dp > 1``; pipeline stages below): boost-train's units
(:func:`boost_compile.plan.model.fsdp_units`: the embedding, each block, the final norm
with the head, the root) are cut over the ``dp_shard`` ranks, each rank holding a
``1 / dp_shard`` slice of every TP shard (rounded up), so that ``params``, ``grads`` and
``optimizer`` are the sliced sums and there are no DDP buckets. Gathered for compute,
in FSDP2's ``param_dtype`` (bf16 under bf16-mixed, else the weights'):

- ``fsdp_gathered``: the block units alive at once, each its whole TP shard: the largest
  two in a row (the one computing and the one prefetched), or with
  ``reshard_after_forward=false`` every block (each stays gathered from its forward to
  its backward);
- ``fsdp_kept``: the units that stay gathered from their forward to their backward: the
  root, the final norm with the head (boost-train never reshards it after the forward)
  and, with ``reshard_after_forward=false``, the embedding;
- ``fsdp_accum``: under gradient accumulation, the unsharded gradients the micro-steps
  before the last keep (``set_requires_gradient_sync(False)``), in the reduce dtype;
- and in ``temporary`` at the backward, the reduce-scatter's input of the largest unit beyond
  what it frees: FSDP2 frees a unit's gathered weights after its backward, before it copies the
  unit's unsharded gradient into the reduce-scatter's input (in the reduce dtype), so the gradient
  takes the weights' place and the copy is the transient; or under checkpointing the block being
  recomputed when that is larger: a unit's gradients are reduce-scattered after its backward,
  once what it recomputed is freed, so the two are never live together (summed, they put
  cola-60m's FSDP2 2 lowrank peak 6% over the measured one; ``boost-bench plan --only fsdp``).
  A llama-350m (vocabulary 32,000) rank of FSDP2 8 peaks as its head's gradients are reduced:
  counting the head's weights as well put the prediction 10% over the measured peak.

All four live at the backward; the optimizer step holds only the slices.

FSDP2 under pipeline stages (``pp > 1``): each pipeline rank's stages are sharded on their own
(``train/pipeline.py``), so the terms count that rank's units: its blocks, the embedding on the
first stage, the final norm with the head on the last. PyTorch's ``PipelineStage`` runs every
micro-batch's backward with ``reshard_after_backward`` and gradient sync off and reduce-scatters
the stage once after the last, so at the backward's peak:

- ``fsdp_gathered``: every block of the rank (gathered from their forward, and from their
  backward on); with ``reshard_after_forward`` each micro-batch's forward frees them again, so
  that a backward starts with two (the block computing and the one prefetched) and ends with
  all, one micro-batch's activations freed: the larger of two blocks and all less those;
- ``fsdp_kept``: the rank's embedding and norm with head;
- ``fsdp_accum``: every unit's unsharded gradient, live from the first backward on (in place of
  a pipeline's early gradients: the sharded ones of the step before were freed at ``zero_grad``);
- ``temporary``: the backward's as for any pipeline (no reduce-scatter runs in it).

The stage's reduce-scatters after its last backward are a phase of their own (``"reduce"``):
the FSDP2 terms, the sharded gradients being made and one unit's gradient copy (the largest),
the activations freed.

Mixtures of experts: the experts (role ``"expert"``) are whole on every TP rank; expert
parallelism (``ep > 1``, boost-train's ``parallel.ep``, over the dp ranks) leaves each rank
``n_experts / ep`` of them, so that their ``params``, ``grads`` and ``optimizer`` are divided by
ep, and DDP's buckets hold the other gradients only (the experts' are not all-reduced). An MoE
block saves, per token, what a dense block saves less its MLP's three d_ff tensors, plus
(:func:`moe_saved_elements`) the router's logits and probabilities (2 n_experts), the routed rows
into and out of the experts (2 top_k d; under EP also the rows each all-to-all received, 2 top_k d),
the experts' hidden SwiGLU tensors per routed row (3 expert_ffn, and 3 r before and after the
activation when the experts are low-rank), and the shared experts' three hidden tensors (split by
TP). Under EP the busiest rank receives ``imbalance`` times the mean routed rows (a Job's
``moe_imbalance``). With checkpointing a block compiled whole recomputes its experts; under EP the
dispatch and the experts run eagerly between graphs (boost-train's dispatch is not compiled), so
what they save is kept whatever the mode.

EP under FSDP2 / HSDP (``ep > 1``, ``dp_shard > 1``; ep divides dp x dp_shard): ``fully_shard``
ignores the experts, so a rank holds its ``n_experts / ep`` of them whole (params, grads, AdamW),
whatever dp_shard, beside its ``1 / dp_shard`` slice of every other tensor; FSDP2's units are the
blocks less their experts (``fsdp_gathered``, ``fsdp_kept``, the reduce-scatter input), and under
gradient accumulation ``fsdp_accum`` holds the experts' whole gradients as well. After the
backward, with ep below the data ranks, the replicas' all-reduce flattens the experts' gradients
into one tensor (phase ``"replicas"``: the gradients and that copy); AdamW's update temporary at
the optimizer step, the size of all the rank's parameters, is larger, so as modelled that phase
never sets the peak.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from boost_compile.plan.model import MOE_IMBALANCE, ModelSpec, Tensor, expert_share, fsdp_units, local_numel, stage_blocks

GIB = 2**30


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor under ``trainer.precision``."""

    name: str
    weights: int
    activations: int
    optimizer: int  # one AdamW moment (torch keeps them in the parameter's dtype)

    @property
    def gathered(self) -> int:
        """Bytes per element of the weights FSDP2 gathers: its ``param_dtype``, bf16 under bf16-mixed
        (the activations' dtype in every precision)."""
        return self.activations


PRECISIONS = {
    "fp32": Precision("fp32", 4, 4, 4),
    "bf16-mixed": Precision("bf16-mixed", 4, 2, 4),  # autocast: fp32 weights, bf16 GEMM outputs
    "bf16-true": Precision("bf16-true", 2, 2, 2),
    "fp64": Precision("fp64", 8, 8, 8),
}
#: bytes per logit of the loss (cross-entropy runs in fp32)
LOSS_BYTES = 4
#: a recomputed attention's generator state, saved per block (the CPU generator's; CUDA's is 16 bytes)
RNG_STATE_BYTES = 5056
TERMS = ("params", "grads", "optimizer", "dp_buckets", "activations", "head", "temporary")
#: FSDP2's terms (dp_shard > 1), live at the backward
FSDP_TERMS = ("fsdp_gathered", "fsdp_kept", "fsdp_accum")


@dataclass(frozen=True)
class Memory:
    """Bytes per device of one layout, each term named; ``peak`` is the predicted high-water mark."""

    terms: dict[str, int]
    peak: int
    #: "backward", "optimizer", (FSDP2 under pipeline stages) "reduce" or (expert parallelism's replicas'
    #: all-reduce) "replicas": the phase that sets the peak
    peak_at: str
    #: the terms live at the peak (they sum to it): the backward's start holds the activations
    #: and the head, the optimizer step the gradients
    live: tuple[str, ...] = ()
    #: saved bytes of one micro-batch in the stage's blocks, and the micro-batches in flight
    saved_per_microbatch: int = 0
    in_flight: int = 1
    details: dict[str, float] = field(default_factory=dict)

    @property
    def gib(self) -> float:
        return self.peak / GIB


def block_saved_elements(spec: ModelSpec, plan: str, tp: int, checkpoint: str) -> float:
    """Elements one block saves per token for the backward, on one TP rank.

    Read off the partitioned graphs of the reference model (``boost-explain``'s saved
    tensors; tests/unit/test_activation_checkpoint.py checks them): with no
    checkpointing the partitioner keeps, per token, four stream-wide tensors (the
    normed inputs of attention and MLP, the two projections' outputs), q, k, v (k and v
    repeated to every query head, as attention reads them) and attention's output with
    its log-sum-exp per head, each bottleneck's down output
    before and after its activation (7 r each; plain low-rank has no activation), the
    three [d_ff] MLP tensors, and the two norms' statistics. ``lowrank`` keeps 7 r of
    down outputs (dense: q/k/v as one tensor) and two stream tensors; ``full`` the
    block's input and, under TP, the outputs of its collectives (never recomputed).
    Widths are per rank: btp splits the stream, heads and d_ff; megatron the heads and
    d_ff; vanilla only the bottleneck's r.
    """
    d, ff, heads, kv = spec.dim, spec.ffn_dim, spec.n_heads, spec.kv_dim
    r = 0 if spec.dense else (4 * spec.rank_attn + 3 * spec.rank_mlp) / 7
    stats = 2 * (2 if spec.norm == "layernorm" else 1)
    p = tp
    stream = d / p if plan == "btp" else d
    head_w = 1 / p if plan in ("btp", "megatron") else 1.0
    ff_w = ff / p if plan in ("btp", "megatron") else ff
    latent = 7 * r / p if plan == "vanilla" else 7 * r
    activation = 1 if spec.projection == "lowrank" else 2
    online = plan == "btp" and p > 1 and not spec.dense  # online norms: grouped outputs rescaled by the global rms
    attn, attn_whole = attention_saved_widths(spec)
    if checkpoint == "none":
        rescaled = 5 * r if online else 0  # the all-reduced q/k/v and gate/up down outputs before their rescale
        return 4 * stream + (attn + heads) * head_w + attn_whole + activation * latent + 3 * ff_w + stats + rescaled
    if checkpoint == "lowrank":
        if spec.dense:
            qkv = spec.n_heads * spec.head_dim + 2 * kv if spec.mla is None else attn - spec.n_heads * spec.mla.v_head_dim
            return 2 * stream + qkv * head_w
        if plan == "vanilla" and p > 1:  # the all-reduced outputs the recompute reads: q, k, v, gate, up
            return latent + 2 * d + d + 2 * kv + 2 * ff
        return latent + 2 * stream + (stats if online else 0)  # btp: the norms' global statistics
    if checkpoint == "full":
        if p == 1:
            return stream
        if plan == "btp":
            return stream + latent  # the [T, r] all-reduces of q/k/v, o, gate/up and down
        if plan == "megatron":
            return 2 * d  # the block's input and the attention's all-reduced output
        return d + d + 2 * kv + 2 * ff  # vanilla: q, k, v, gate, up after their all-reduces
    raise ValueError(f"the memory model knows checkpoint none, lowrank and full, not {checkpoint!r}")


def moe_saved_elements(spec: ModelSpec, plan: str, tp: int, checkpoint: str, ep: int = 1,
                       imbalance: float = MOE_IMBALANCE) -> float:
    """Elements an MoE block saves per token beyond :func:`block_saved_elements` (which counts a dense
    MLP's three d_ff tensors, taken off here), on one TP rank (see the module's docstring)."""
    split = tp if plan in ("btp", "megatron") else 1
    rows = spec.top_k * (imbalance if ep > 1 else 1.0)  # routed rows per token on the busiest rank
    activation = 1 if spec.projection == "lowrank" else 2
    hidden = (3 * spec.expert_width + activation * 3 * (spec.expert_rank or 0)) * rows
    routed = 2 * spec.dim * rows * (2 if ep > 1 else 1)  # rows in and out (and the all-to-alls' received)
    if checkpoint != "none":
        return routed + hidden if ep > 1 else 0.0  # eager under EP: kept whatever the mode
    return 2 * spec.n_experts + routed + hidden + 3 * spec.shared_ffn_dim / split - 3 * spec.ffn_dim / split


def attention_saved_widths(spec: ModelSpec) -> tuple[float, float]:
    """Attention's saved widths per token: (split by heads under TP, whole). q, k, v (k and v repeated
    to every head) and the output, 4 d for a Llama block; MLA's q and k of qk_head_dim and v and
    output of v_head_dim per head, and its latents (q's, kv's with the rope key) before and after
    their norms, whole."""
    mla = spec.mla
    if mla is None:
        return 4 * spec.n_heads * spec.head_dim, 0.0
    latents = 2 * ((mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim)
    return 2 * spec.n_heads * (mla.qk_head_dim + mla.v_head_dim), float(latents)


def in_flight(schedule: str, pp: int, microbatches: int, stage: int = 0, stages_per_rank: int = 1) -> float:
    """Micro-batches of a stage's blocks whose activations are live at once (rank ``stage``).

    Without a pipeline, one (the whole batch of the rank). GPipe runs every forward
    first: all m. 1F1B: ``min(m, pp - stage)``, the first stage the most. Interleaved
    (and zero-bubble) with v stages per rank: PyTorch's warm-up of
    ``(v - 1) pp + 2 (pp - 1 - stage) + 1`` chunks (at most m v), each a 1/v share of
    the rank's blocks.
    """
    if pp == 1:
        return 1.0
    m, v = microbatches, stages_per_rank
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or v == 1:
        return float(min(m, pp - stage))
    chunks = min(m * v, (v - 1) * pp + 2 * (pp - 1 - stage) + 1)
    return chunks / v


def zero_share(numels: list[int], dp: int) -> int:
    """Elements of the busiest rank's share: whole tensors, largest first, each to the emptiest rank."""
    loads = [0] * dp
    for n in sorted(numels, reverse=True):
        loads[loads.index(min(loads))] += n
    return max(loads)


def fsdp_shard(numel: int, dp_shard: int) -> int:
    """Elements of one rank's FSDP2 slice of a tensor of ``numel`` (the TP shard): the largest of ``dp_shard``."""
    return -(-numel // dp_shard)


def fsdp_memory(spec: ModelSpec, plan: str, tp: int, prec: Precision, *, reshard_after_forward: bool = True,
                accumulating: bool = False, vocab_parallel: bool = True,
                stage: tuple[set[int], bool, bool] | None = None, one_microbatch: int = 0,
                ep: int = 1) -> tuple[dict[str, int], int]:
    """FSDP2's :data:`FSDP_TERMS` in bytes, and its backward transient (the largest unit's reduce-scatter input).

    Every unit is a TP shard gathered whole over the dp_shard ranks, so that none of these
    depends on dp_shard (see the module's docstring). ``stage``: a pipeline rank's (its blocks,
    whether it holds the embedding, the head), whose units are all gathered at the backward with
    their unsharded gradients, and whose reduce-scatter input is a unit's gradient copy alone;
    ``one_microbatch``: the bytes one micro-batch saves in the stage (see the module's docstring);
    ``ep > 1``: the units less their experts, which FSDP2 ignores (expert parallelism's own)."""
    units = _unit_sizes(spec, plan, tp, vocab_parallel, ep)
    if stage is not None:
        blocks_held, first, last = stage
        held = [(kind, size) for kind, block, size in units if (kind == "block" and block in blocks_held)
                or (kind == "embed" and first) or (kind == "head" and last)]
        sizes = [size for _, size in held]
        blocks = sum(size for kind, size in held if kind == "block")
        gathered = blocks * prec.gathered
        if reshard_after_forward:
            largest = max((size for kind, size in held if kind == "block"), default=0)
            gathered = max(2 * largest * prec.gathered, gathered - one_microbatch)
        terms = {
            "fsdp_gathered": gathered,
            "fsdp_kept": (sum(sizes) - blocks) * prec.gathered,
            "fsdp_accum": sum(sizes) * prec.weights,
        }
        return terms, max(sizes, default=0) * prec.weights
    blocks = [size for kind, _, size in units if kind == "block"]
    # every block gathered (noreshard), or the largest two in a row: the one computing and the one prefetched
    alive = sum(blocks) if not reshard_after_forward else max(map(sum, zip(blocks, blocks[1:], strict=False)),
                                                              default=max(blocks, default=0))
    kept = [size for kind, _, size in units if kind in ("root", "head") or (kind == "embed" and not reshard_after_forward)]
    sizes = [size for _, _, size in units]
    terms = {
        "fsdp_gathered": alive * prec.gathered,
        "fsdp_kept": sum(kept) * prec.gathered,
        "fsdp_accum": sum(sizes) * prec.weights if accumulating else 0,
    }
    # the unit's unsharded gradient replaces its gathered weights (freed first); its reduce-dtype copy is new
    return terms, max(sizes) * prec.weights


#: elements a rank computes at once while it materialises its part of a model built on meta: a row
#: group and a random block, in fp32 (``boost_compile.meta_init``'s CHUNK and BLOCK), each at most
#: the largest tensor's elements
MATERIALISE_ELEMENTS = (1 << 22, 1 << 16)
#: the build's dtype: a model is built in fp32, then cast to the weights' dtype
BUILD_BYTES = 4
#: fp32 copies of a dense weight alive while its SVD is factorized (``factorize.FactorSource``):
#: the weight, its U, S, Vh (about the weight again) and the two factors kept for the second read
SVD_COPIES = 3


def start_memory(spec: ModelSpec, plan: str, *, tp: int, pp: int, dp_shard: int, precision: str = "fp32",
                 stages_per_rank: int = 1, on_meta: bool = True, vocab_parallel: bool = True,
                 svd_elements: int = 0, ep: int = 1) -> int:
    """Peak bytes per rank while boost-train builds, shards and casts the model, before the first step
    (the busiest pipeline rank's).

    ``on_meta`` (``model.init=per_parameter``, random or pretrained weights): the model is built on
    the meta device and each rank computes only what it holds: its stages' tensors, its TP shard of
    each, and under FSDP2 its slice of that, stored in the weights' dtype, plus the values computed
    at once (:data:`MATERIALISE_ELEMENTS`) and, for ``factorize`` by SVD, one dense weight of
    ``svd_elements`` and its decomposition (:data:`SVD_COPIES`).
    Otherwise every rank builds the whole model in fp32 first, and sharding or splitting it holds the
    rank's part (in the weights' dtype) beside it until the whole goes.
    """
    prec = PRECISIONS[precision]
    tensors = spec.tensors()
    stages = _stage_blocks(spec, pp * stages_per_rank)
    busiest = max(sum(_rank_share(spec, tensors, plan, tp, vocab_parallel, stages, pp, rank, dp_shard, ep)[0])
                  for rank in range(pp))
    if on_meta:
        largest = max(t.numel for t in tensors)
        at_once = sum(min(n, largest) for n in MATERIALISE_ELEMENTS) * BUILD_BYTES + svd_elements * BUILD_BYTES * SVD_COPIES
        if dp_shard > 1:  # FSDP2 shards on meta (of the model or its stages): each rank's slices, cast
            return busiest * prec.weights + at_once
        # one process, DDP, TP shards, a pipeline's stages: materialised in fp32 (then cast)
        return busiest * BUILD_BYTES + at_once
    whole = sum(t.numel for t in tensors)
    return whole * BUILD_BYTES + busiest * prec.weights


@functools.lru_cache(maxsize=256)
def _local_numels(spec: ModelSpec, plan: str, tp: int, vocab_parallel: bool, ep: int = 1) -> tuple[int, ...]:
    """Each tensor's local elements on one TP (and EP) rank, in :meth:`ModelSpec.tensors`' order (the
    search prices thousands of layouts of one spec)."""
    return tuple(expert_share(local_numel(t, plan, tp, vocab_parallel=vocab_parallel), ep) if t.role == "expert"
                 else local_numel(t, plan, tp, vocab_parallel=vocab_parallel) for t in spec.tensors())


@functools.lru_cache(maxsize=256)
def _unit_sizes(spec: ModelSpec, plan: str, tp: int, vocab_parallel: bool,
                ep: int = 1) -> tuple[tuple[str, int, int], ...]:
    """Each FSDP2 unit's kind, block (-1 outside the blocks) and local elements on one TP rank; under
    ``ep > 1`` a block less its experts (``fully_shard``'s ``ignored_params``: never gathered)."""
    def local(tensors: tuple[Tensor, ...]) -> int:
        return sum(local_numel(t, plan, tp, vocab_parallel=vocab_parallel) for t in tensors
                   if not (ep > 1 and t.role == "expert"))

    return tuple((u.kind, u.tensors[0].block if u.kind == "block" else -1, local(u.tensors)) for u in fsdp_units(spec))


def _rank_share(spec: ModelSpec, tensors: tuple[Tensor, ...], plan: str, tp: int, vocab_parallel: bool,
                stages: tuple[range, ...], pp: int, rank: int, dp_shard: int, ep: int = 1,
                replicas: int = 1) -> tuple[list[int], set[int], bool, bool]:
    """Pipeline rank ``rank``'s tensors (it holds stages rank, rank + pp, ...): each one's local elements
    (its FSDP2 slice when ``dp_shard > 1``, its experts' share under ``ep``: whole where FSDP2 ignores
    them, its slice over their ``replicas`` where FSDP2 shards them over those), its blocks, and whether
    it holds the first and the last stage.
    ``tensors``: ``spec.tensors()``, made once by the caller (the search prices thousands of layouts)."""
    mine = range(rank, len(stages), pp)
    blocks = {b for i in mine for b in stages[i]}
    first, last = 0 in mine, len(stages) - 1 in mine
    held = [(t, k) for t, k in zip(tensors, _local_numels(spec, plan, tp, vocab_parallel, ep), strict=True)
             if t.block in blocks or (t.block < 0 and _outside_on(t, first, last))]
    def share(t: Tensor, k: int) -> int:
        if dp_shard == 1:
            return k
        if ep > 1 and t.role == "expert":
            return fsdp_shard(k, replicas) if replicas > 1 else k
        return fsdp_shard(k, dp_shard)

    numels = [share(t, k) for t, k in held]
    return numels, blocks, first, last


@functools.lru_cache(maxsize=64)
def _stage_blocks(spec: ModelSpec, stages: int) -> tuple[range, ...]:
    return tuple(stage_blocks(spec, stages))


def memory(
    spec: ModelSpec, plan: str, *, tp: int, pp: int, dp: int, zero: int, microbatches: int, schedule: str,
    checkpoint: str, batch: int, seq: int, precision: str = "fp32", stages_per_rank: int = 1,
    vocab_parallel: bool = True, pp_rank: int | None = None, accumulating: bool = False,
    dp_shard: int = 1, reshard_after_forward: bool = True, ep: int = 1, moe_imbalance: float = MOE_IMBALANCE,
) -> Memory:
    """Predicted bytes per device of one layout, for a global ``batch`` of ``seq``-token sequences.

    The busiest pipeline rank's (the highest peak), or ``pp_rank``'s. ``accumulating``: ``batch``
    is one micro-step of gradient accumulation, whose backward adds to gradients already live.
    ``dp_shard > 1``: FSDP2 over that many ranks in each of the ``dp`` replicas, each pipeline rank's
    stages sharded on their own (see the module's docstring). ``ep > 1``: each rank holds
    ``n_experts / ep`` experts of every MoE block, whose gradients DDP does not all-reduce, whole
    under FSDP2 (which ignores them).
    """
    prec = PRECISIONS[precision]
    stages = _stage_blocks(spec, pp * stages_per_rank)
    replica = batch // (dp * dp_shard)
    m = microbatches if pp > 1 else 1
    tokens = replica // m * seq
    tensors = spec.tensors()
    # FSDP2 with expert replicas: each experts module sharded over the ranks holding the same experts
    replicas = dp * dp_shard // ep if ep > 1 and dp_shard > 1 else 1
    best: Memory | None = None
    for rank in range(pp) if pp_rank is None else (pp_rank,):  # pipeline rank r holds stages r, r + pp, ...
        numels, blocks, first, last = _rank_share(spec, tensors, plan, tp, vocab_parallel, stages, pp, rank, dp_shard, ep,
                                                  replicas)
        n = sum(numels)
        experts = sum(expert_share(t.numel, ep) for t in tensors if t.role == "expert" and t.block in blocks) if ep > 1 else 0
        opt = 2 * (zero_share(numels, dp) if zero and dp > 1 and dp_shard == 1 else n)
        per_block = block_saved_elements(spec, plan, tp, checkpoint) * tokens * prec.activations
        per_block += RNG_STATE_BYTES if checkpoint != "none" else 0
        flight = in_flight(schedule, pp, m, rank, stages_per_rank)
        moe_blocks = sum(spec.moe_block(b) for b in blocks)
        saved_mb = per_block * len(blocks) + moe_blocks * tokens * prec.activations * moe_saved_elements(
            spec, plan, tp, checkpoint, ep, moe_imbalance)
        head_mb = loss_mb = head_temp = 0.0
        vocab = -(-spec.vocab_size // tp) if vocab_parallel else spec.vocab_size
        if last:
            # the final norm's input (whole d: the last block's output, all-gathered under btp) and its
            # statistic (its output is recomputed), and the log-softmax of the local logits
            loss_mb = tokens * vocab * LOSS_BYTES
            # btp: the all-gathered stream and the final norm's output, both whole d
            widths = spec.dim + 1 + (spec.dim if plan == "btp" and tp > 1 else 0)
            head_mb = tokens * widths * prec.activations + loss_mb
            head_temp = 2 * tokens * vocab * LOSS_BYTES  # the logits and their gradient at the backward's start
        head = head_mb * flight
        stream_src = tokens * (spec.dim / tp if plan == "btp" else spec.dim) * prec.activations if first else 0.0
        activations = (saved_mb + stream_src) * flight
        update = (opt // 2) * prec.optimizer  # AdamW's temporary: one tensor the size of the share it steps
        terms = {
            "params": n * prec.weights,
            "grads": n * prec.weights,
            "optimizer": opt * prec.optimizer,
            "dp_buckets": (n - experts) * prec.weights if dp > 1 and dp_shard == 1 else 0,
            "activations": int(activations),
            "head": int(head),
        }
        fsdp, reduce_input = (dict.fromkeys(FSDP_TERMS, 0), 0) if dp_shard == 1 else fsdp_memory(
            spec, plan, tp, prec, reshard_after_forward=reshard_after_forward, accumulating=accumulating,
            vocab_parallel=vocab_parallel, stage=(blocks, first, last) if pp > 1 else None,
            one_microbatch=int(saved_mb + stream_src), ep=ep)
        if dp_shard > 1 and accumulating:  # EP's experts keep their whole gradients too
            fsdp["fsdp_accum"] += experts * prec.weights
        if replicas > 1:  # FSDP2 gathers each experts module for its block: one at a time, or all (noreshard)
            by_block = [sum(expert_share(t.numel, ep) for t in tensors if t.role == "expert" and t.block == b)
                        for b in blocks]
            fsdp["fsdp_gathered"] += (max(by_block, default=0) if reshard_after_forward else sum(by_block)) * prec.gathered
        # the backward recomputes one block at a time: its tensors that checkpointing did not keep
        recompute = 0.0
        if checkpoint != "none" and blocks:
            recompute = (block_saved_elements(spec, plan, tp, "none") * tokens * prec.activations - per_block)
            if moe_blocks:  # an MoE block recomputes its experts' tensors, save what EP's eager dispatch kept
                recompute += tokens * prec.activations * (moe_saved_elements(spec, plan, tp, "none", ep, moe_imbalance)
                                                          - moe_saved_elements(spec, plan, tp, checkpoint, ep, moe_imbalance))
        # a pipeline accumulates every micro-batch's gradients into the stage's: they are live from the
        # first backward on, beside the micro-batches still in flight
        # (so do the micro-steps of gradient accumulation)
        # (FSDP2 keeps them unsharded instead, the sharded ones freed at zero_grad: fsdp_accum)
        early_grads = terms["grads"] if dp_shard == 1 and (pp > 1 or accumulating) else 0
        # FSDP2 reduce-scatters a unit's gradients once its backward has ended, when the tensors it
        # recomputed are freed: the larger of the two, not both (0 reduce input without FSDP2); under
        # a pipeline the stage reduce-scatters at the step's end, after every backward (phase "reduce")
        piped_fsdp = dp_shard > 1 and pp > 1
        block_temp = recompute if piped_fsdp else max(recompute, reduce_input)
        backward = (terms["activations"] + terms["head"] + head_temp + block_temp + early_grads + sum(fsdp.values()))
        at_reduce = terms["grads"] + reduce_input + sum(fsdp.values()) if piped_fsdp else 0
        at_optimizer = terms["grads"] + update
        # ep below the data ranks: the experts' gradients flattened into one tensor for the replicas' all-reduce
        flat = experts * prec.weights if ep > 1 and dp * dp_shard > ep and dp_shard == 1 else 0
        at_replicas = terms["grads"] + flat if flat else 0
        phase = max((backward, "backward"), (at_reduce, "reduce"), (at_replicas, "replicas"), (at_optimizer, "optimizer"),
                    key=lambda x: x[0])[1]
        terms["temporary"] = int({"backward": head_temp + block_temp, "reduce": reduce_input, "replicas": flat,
                                  "optimizer": update}[phase])
        terms.update(fsdp)
        live = ("params", "optimizer", "dp_buckets", "temporary") + {
            "backward": ("activations", "head") + (("grads",) if early_grads else ()) + (FSDP_TERMS if dp_shard > 1 else ()),
            "reduce": ("grads", *FSDP_TERMS), "replicas": ("grads",), "optimizer": ("grads",)}[phase]
        mem = Memory(terms, sum(terms[t] for t in live), phase, live, int(saved_mb), flight,
                     {"tokens_per_microbatch": tokens, "pp_rank": rank, "loss_per_microbatch": loss_mb,
                      "saved_per_microbatch": saved_mb + stream_src + head_mb})
        if best is None or mem.peak > best.peak:
            best = mem
    assert best is not None
    return best


def _outside_on(t: Tensor, first: bool, last: bool) -> bool:
    """The embedding lives on the first stage, the final norm and head on the last."""
    return first if t.role == "embed" else last
