"""The analytic scale model: iteration time and communication of a training job at scale.

It predicts, per GPU of a job with tensor parallelism (degree ``p``) and pipeline
parallelism (``pp`` stages, ``m`` micro-batches), the time of one training
iteration (forward + backward + optimizer step), its all-reduce volume and the
time spent communicating, for three systems:

- ``full-rank``: the dense Llama model under Megatron TP (fused q/k/v and gate/up
  column-parallel, o/down row-parallel; two all-reduces of [T, d] per layer and
  direction; attention on the local heads, SwiGLU on a d_ff/p slice, norms and
  residual adds duplicated on every rank);
- ``vanilla``: the CoLA model (r = d/4, every projection y = silu(x A) B) with each
  factor pair its own Megatron chunk (A column-parallel on r, B row-parallel): one
  all-reduce of the pair's full output (forward) and input gradient (backward);
  attention, RoPE, norms, residual adds and SwiGLU unsharded on every rank; the
  GEMMs have an inner dimension r/p;
- ``btp``: the CoLA model under bottleneck-aware TP (BOOST.md section 2): stream
  sharded on d, all-reduce of [T, r] after the down factors (forward) and before
  them (backward), grouped q/k/v and gate/up down factors and online RMSNorm, so
  4 collectives per layer and direction; GEMMs, attention and elementwise work
  divided by p, except the SiLU on the all-reduced [T, r] (run on every rank).

The low-rank model of vanilla and btp is ``Shape.arch``: CoLA (default), plain low-rank
(no SiLU) or LaX (CoLA whose every latent also adds the same projection's latent of the
block before: one more [T, r] add per projection, under btp on the whole latent; no GEMM,
parameter or collective more, the latent being whole on every rank after its all-reduce).

Equations (per rank; T tokens of a micro-batch, e bytes per element):

    GEMM [M,K] x [K,N]   fwd FLOPs 2 M K N, bwd 2 x fwd (dX and dW: same shape set)
                         time = FLOPs / (peak * eff)
                         eff  = eff_max * I / (I + I_half) * fill(M) * fill(N)
                         I    = 2 M K N / (e (M K + K N + M N))   (FLOP per HBM byte)
                         fill(x) = x / (x rounded up to gemm_tile)
    attention core       fwd FLOPs 4 b s^2 w * 1/2 (causal: fused kernels skip the masked
                         half), bwd 2.5 x fwd (five s x s x hd products against two: the
                         scores are recomputed); w = local heads * head_dim;
                         time = FLOPs * hd_padded / hd / (peak * eff_attn)
    elementwise          time = passes * elements * e / (HBM bandwidth * eff_elem)
                         passes fwd/bwd: RMSNorm 2/3, residual add 3/3, RoPE 2/2 (q, k),
                         SwiGLU 3/5 on [T, d_ff], CoLA SiLU 2/3 on [T, r], LaX's crossing add
                         3/3 on [T, r] (backward: the latent's two gradients summed); vanilla adds the
                         q/k/v and gate/up input gradients (0/3 on 3 x [T, d]); btp rescales
                         the [T, 5r] outputs of the grouped down factors by the global rms
                         (2/3, only when p > 1) and concatenates their gradients (0/2)
    all-reduce (ring)    n * alpha + 2 (p-1)/p * payload / busbw,  0 when p = 1
    all-gather / r-s     n * alpha + (p-1)/p * payload / busbw
    layer payload fwd    full 2 T d e;  vanilla T (5 d + 2 d_ff) e;  btp 7 T r e
                  bwd    full 2 T d e;  vanilla T (6 d + d_ff) e (the input gradient of every
                         pair: q, k, v, o, gate, up have d inputs, down has d_ff);  btp 7 T r e
    head                 final RMSNorm on [T, d], lm_head GEMM [T, d] x [d, V_l], fp32
                         cross-entropy at 28 B per local logit on [T, V_l]; two modes:
      vocab_parallel     (default) V_l = V/p; full and vanilla all-reduce [T, d] once per
                         direction (vocab-parallel embedding output, lm_head input gradient);
                         btp all-gathers the stream before the final norm and reduce-scatters
                         its gradient; parameters: lm_head V/p x d on the last stage
      replicated         V_l = V: every rank computes the whole head and loss; full and vanilla
                         no collective (the embedding is replicated too, as the megatron and
                         vanilla plans leave it: no output all-reduce, V d on the first stage);
                         btp all-gathers the stream before the final norm and keeps its slice
                         of the gradient (no backward collective); lm_head V x d on the last
                         stage; at p = 1 both modes are the same
    optimizer            AdamW over fp32 weights, gradients and moments: 28 B per local
                         parameter (16 read, 12 written), at the elementwise rate
    parameters           per rank: the layers (layer_params); the embedding on the first
                         stage (btp V x d/p; full and vanilla V/p x d, or V x d with the
                         replicated head); the lm_head (V/p x d, or V x d replicated) and the
                         final-norm gain d on the last stage
    pipeline (1F1B)      t_iter = sum_i t_i + (m - 1) max_i t_i + 2 (pp - 1) t_p2p + t_opt
                         t_i: forward + backward of one micro-batch on stage i (layers split
                         evenly, the head on the last stage); t_p2p = alpha_p2p + one activation
                         or gradient / p2p bandwidth: [T, d] for full and vanilla, [T, d/p] for
                         btp (a btp stage sends its d-slice of the stream); per rank, the TP
                         ranks of a stage sending over their own links at once
    data parallelism     ``dp`` replicas, each on batch / dp; after the backward one ring
                         all-reduce of the gradients (the largest stage's parameters at
                         ``grad_bytes`` each) and ``grad_flatten_passes`` element passes over
                         them (flatten into one buffer, scale by 1/dp, copy back)

Communication is not overlapped with compute (TP collectives sit on the critical
path). Not modelled: kernel-launch and framework overheads, activation
recomputation, the vocab-parallel cross-entropy's [T] reductions, the embedding
gather/scatter, the online-RMSNorm statistic ([T] fp32 riding on the [T, 3r] and
[T, 2r] all-reduces, under 0.1% of the payload; online LayerNorm's larger statistics
are priced, see ``layer_collectives``), overlap of the data-parallel
gradient all-reduce with the backward.

Pipeline: ``Workload.micro_batches`` = ``m`` = 1 by default, i.e. the batch of 4
crosses the stages in turn and the 1F1B schedule runs them one after the other
(bubble (pp-1)/pp). BOOST.md's 13B TP4 PP2 times are about twice its 7B TP4 times
while the per-GPU work of the two rows is within 2%, which is what m = 1 gives
(m = 4 would give 1.25x); ``m`` only applies when pp > 1 (without a pipeline the
batch is one micro-batch).

Head: ``predict(..., head=...)`` picks one of :data:`HEADS` (default
vocabulary-parallel). The constants come from a hardware file
(:mod:`boost_compile.costmodel.hardware`); the comparison with BOOST.md and the
command line are :mod:`boost_compile.bench.scale`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import MappingProxyType

from boost_compile.costmodel.formulas import PAPER_SHAPES, ring_bytes_per_rank
from boost_compile.costmodel.hardware import Hardware, load_hardware

SYSTEMS = ("full-rank", "vanilla", "btp")
#: the low-rank model of vanilla and btp (``Shape.arch``): plain low-rank, CoLA, LaX
ARCHITECTURES = ("lowrank", "cola", "lax")
#: how the output head and loss run under TP: sharded on the vocabulary, or whole on every rank
HEADS = ("vocab_parallel", "replicated")
DEFAULT_HEAD = "vocab_parallel"
TP_DEGREES = (1, 2, 4, 8)
GB = 1e9

#: element passes (one read or one write of an element) of each memory-bound op: (forward, backward)
PASSES = MappingProxyType(
    {
        "rmsnorm": (2, 3),
        "residual": (3, 3),
        "rope": (2, 2),
        "swiglu": (3, 5),
        "silu": (2, 3),
        "cross": (3, 3),
        "rms_rescale": (2, 3),
        "grad_sum": (0, 3),
        "concat": (0, 2),
    }
)


def _check_system(system: str) -> None:
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; one of {', '.join(HEADS)}")


def _split(size: int, parts: int) -> int:
    """The largest slice when ``size`` is cut in ``parts`` (an uneven split: the slowest rank's)."""
    return -(-size // parts)


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Shape:
    """A Llama shape; its low-rank variant (``arch``, CoLA by default) puts ``rank`` = d / 4 in every projection."""

    name: str
    d: int
    d_ff: int
    layers: int
    heads: int
    vocab: int = 32000
    #: "rmsnorm" (Llama), or "layernorm": priced as RMSNorm's element passes, and under btp its
    #: statistics ride in the down factors' all-reduces (see ``layer_collectives``)
    norm: str = "rmsnorm"
    arch: str = "cola"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown arch {self.arch!r}; one of {', '.join(ARCHITECTURES)}")

    @property
    def rank(self) -> int:
        return self.d // 4

    @property
    def head_dim(self) -> int:
        return self.d // self.heads


#: BOOST.md section 6 shapes, plus Llama-30B.
SHAPES = tuple(Shape(n, d, ff, layers, heads) for n, d, ff, layers, heads in PAPER_SHAPES) + (
    Shape("30B", 6656, 17920, 60, 52),
)


@dataclass(frozen=True)
class Workload:
    """What one iteration processes, and the model's accounting conventions."""

    seq: int = 4096
    batch: int = 4
    dtype_bytes: int = 2
    micro_batches: int = 1
    causal_fraction: float = 0.5
    attention_bwd_factor: float = 2.5
    optimizer_bytes_per_param: float = 28.0
    cross_entropy_bytes_per_logit: float = 28.0
    #: data parallelism: bytes per gradient element in the all-reduce, element passes around it
    grad_bytes: int = 4
    grad_flatten_passes: float = 6.0


# ----------------------------------------------------------------------------- formulas


def linear_flops(tokens: int, d_in: int, d_out: int) -> float:
    """Forward FLOPs of ``[tokens, d_in] x [d_in, d_out]``; the backward costs twice this."""
    return 2.0 * tokens * d_in * d_out


def attention_flops(batch: int, seq: int, width: int, causal_fraction: float = 0.5) -> float:
    """Forward FLOPs of the attention core (QK^T and PV) over ``width`` = heads * head_dim."""
    return 4.0 * batch * seq * seq * width * causal_fraction


def gemm_intensity(m: int, k: int, n: int, dtype_bytes: int = 2) -> float:
    """Arithmetic intensity (FLOP/B) of ``[m,k] x [k,n]``: both inputs read and the output written once."""
    return 2.0 * m * k * n / (dtype_bytes * (m * k + k * n + m * n))


def tile_fill(size: int, tile: float) -> float:
    """Useful fraction of ``size`` once rounded up to whole tiles (a partial tile costs a full one)."""
    return size / (-(-size // tile) * tile)


def gemm_efficiency(m: int, k: int, n: int, hw: Hardware, dtype_bytes: int = 2) -> float:
    """Fraction of peak a GEMM reaches: ``eff_max * I / (I + I_half) * fill(m) * fill(n)``.

    Saturating in the arithmetic intensity ``I``, always below ``eff_max``, and
    increasing in every dimension over sizes that are whole tiles.
    """
    intensity = gemm_intensity(m, k, n, dtype_bytes)
    fill = tile_fill(m, hw.gemm_tile) * tile_fill(n, hw.gemm_tile)
    return hw.gemm_max_efficiency * intensity / (intensity + hw.gemm_half_intensity) * fill


def gemm_time(m: int, k: int, n: int, hw: Hardware, dtype_bytes: int = 2) -> float:
    """Forward seconds of one GEMM (its backward, dX and dW, takes twice as long)."""
    return linear_flops(m, k, n) / (hw.peak_flops * gemm_efficiency(m, k, n, hw, dtype_bytes))


def attention_time(flops: float, head_dim: int, hw: Hardware) -> float:
    """Seconds of fused attention; the kernel pads ``head_dim`` up to its supported multiple."""
    multiple = hw.attention_head_dim_multiple
    padded = -(-head_dim // multiple) * multiple
    return flops * padded / head_dim / (hw.peak_flops * hw.attention_efficiency)


def elementwise_time(nbytes: float, hw: Hardware) -> float:
    """Seconds of memory-bound work moving ``nbytes`` through HBM."""
    return nbytes / (hw.hbm_bandwidth * hw.elementwise_efficiency)


def allreduce_time(count: int, payload: float, world: int, hw: Hardware) -> float:
    """``count`` ring all-reduces of ``payload`` bytes in all: ``count alpha + 2 (p-1)/p payload / busbw``.

    Zero without a group (``world`` = 1).
    """
    if world <= 1 or count == 0:
        return 0.0
    return (
        count * hw.collective_latency
        + 2.0 * (world - 1) / world * payload / hw.allreduce_bus_bandwidth
    )


def allgather_time(count: int, payload: float, world: int, hw: Hardware) -> float:
    """Ring all-gathers (or reduce-scatters) of ``payload`` bytes of full tensors: half an all-reduce's traffic."""
    if world <= 1 or count == 0:
        return 0.0
    return (
        count * hw.collective_latency + (world - 1) / world * payload / hw.allreduce_bus_bandwidth
    )


# ----------------------------------------------------------------------------- one layer


@dataclass(frozen=True)
class Gemm:
    """``[m, k] x [k, n]``."""

    m: int
    k: int
    n: int


def layer_gemms(system: str, shape: Shape, tokens: int, p: int) -> list[Gemm]:
    """The forward GEMMs of one transformer layer on one rank of a TP group of ``p``."""
    _check_system(system)
    d, ff, r, t = shape.d, shape.d_ff, shape.rank, tokens
    dq = _split(shape.heads, p) * shape.head_dim  # local heads * head_dim
    if system == "full-rank":
        ffl = _split(ff, p)
        return [Gemm(t, d, 3 * dq), Gemm(t, dq, d), Gemm(t, d, 2 * ffl), Gemm(t, ffl, d)]
    if system == "vanilla":
        rl = _split(r, p)
        pairs = [(d, d)] * 4 + [(d, ff)] * 2 + [(ff, d)]  # q, k, v, o, gate, up, down
        return [g for d_in, d_out in pairs for g in (Gemm(t, d_in, rl), Gemm(t, rl, d_out))]
    dl, ffl = _split(d, p), _split(ff, p)
    return [
        Gemm(t, dl, 3 * r),  # q/k/v down factors, grouped, row-parallel on d
        Gemm(t, r, dq),  # q up factor: local heads
        Gemm(t, r, dq),  # k up factor
        Gemm(t, r, dq),  # v up factor
        Gemm(t, dq, r),  # o down factor: local heads in
        Gemm(t, r, dl),  # o up factor: stream slice out
        Gemm(t, dl, 2 * r),  # gate/up down factors, grouped
        Gemm(t, r, ffl),  # gate up factor: d_ff slice
        Gemm(t, r, ffl),  # up up factor
        Gemm(t, ffl, r),  # down's down factor
        Gemm(t, r, dl),  # down's up factor
    ]


def attention_heads(system: str, shape: Shape, p: int) -> int:
    """Heads one rank runs attention on: all of them under vanilla (duplicated), else the local ones."""
    _check_system(system)
    return shape.heads if system == "vanilla" else _split(shape.heads, p)


def layer_elementwise_bytes(
    system: str, shape: Shape, tokens: int, p: int, dtype_bytes: int = 2
) -> float:
    """HBM bytes of one layer's memory-bound ops on one rank, forward + backward.

    Widths per rank: full-rank shards RoPE (local heads) and SwiGLU (d_ff/p), not the
    norms or residual adds; vanilla shards only the SiLU and LaX's add (on [T, r/p]); btp
    shards the stream (d/p), heads and d_ff, but runs them on the all-reduced [T, r].
    """
    _check_system(system)
    d, ff, r = shape.d, shape.d_ff, shape.rank
    silu, cross = shape.arch != "lowrank", shape.arch == "lax"  # per projection: one [T, r] op each
    heads_w = attention_heads(system, shape, p) * shape.head_dim
    if system == "full-rank":
        widths = {"rmsnorm": 2 * d, "residual": 2 * d, "rope": 2 * heads_w, "swiglu": _split(ff, p)}
    elif system == "vanilla":
        widths = {
            "rmsnorm": 2 * d,
            "residual": 2 * d,
            "rope": 2 * d,
            "swiglu": ff,
            "silu": 7 * _split(r, p) * silu,
            "cross": 7 * _split(r, p) * cross,
            # q/k/v and gate/up are separate chunks: their input gradients are added
            "grad_sum": 3 * d,
        }
    else:
        dl = _split(d, p)
        widths = {
            "rmsnorm": 2 * dl,
            "residual": 2 * dl,
            "rope": 2 * heads_w,
            "swiglu": _split(ff, p),
            "silu": 7 * r * silu,
            "cross": 7 * r * cross,
            # online RMSNorm: the all-reduced [T, 3r] and [T, 2r] divided by the global rms
            "rms_rescale": 5 * r if p > 1 else 0,
            # grouped down factors: the [T, 3r] and [T, 2r] gradients are concatenated
            "concat": 5 * r,
        }
    return float(
        sum(sum(PASSES[op]) * width for op, width in widths.items()) * tokens * dtype_bytes
    )


@dataclass(frozen=True)
class Collectives:
    """The TP all-reduces of one layer and one micro-batch: count and summed payload, per direction."""

    fwd_count: int
    fwd_bytes: int
    bwd_count: int
    bwd_bytes: int


def layer_collectives(system: str, shape: Shape, tokens: int, dtype_bytes: int = 2, p: int = 1) -> Collectives:
    """One layer's all-reduces (payload = tensor size, as ``formulas.bytes_per_layer`` counts it).

    btp on a LayerNorm model (``shape.norm``) adds, in each of the two norms' forward
    all-reduces, the fp32 statistics of online LayerNorm: [T, 1 + p] (the sum of squares
    about each rank's mean, and every rank's mean) and the [p + 1, r_group] rows of
    ``g_l @ A_l`` and ``b @ A`` (``layernorm_statistic_bytes``).
    """
    _check_system(system)
    d, ff, r, e = shape.d, shape.d_ff, shape.rank, dtype_bytes
    if system == "full-rank":
        return Collectives(2, 2 * tokens * d * e, 2, 2 * tokens * d * e)
    if system == "vanilla":
        return Collectives(7, tokens * (5 * d + 2 * ff) * e, 7, tokens * (6 * d + ff) * e)
    stats = layernorm_statistic_bytes(tokens, (3 * r, 2 * r), p) if shape.norm == "layernorm" and p > 1 else 0
    return Collectives(4, 7 * tokens * r * e + stats, 4, 7 * tokens * r * e)


def layernorm_statistic_bytes(tokens: int, group_ranks: tuple[int, ...], p: int, bias: bool = True) -> int:
    """fp32 bytes online LayerNorm adds to the all-reduces of the down factors it feeds, one
    norm per entry of ``group_ranks`` (the width r of each grouped down factor): the tokens'
    1 + p statistic columns, and p (+ 1 with a bias) rows of the packed width r + 1 + p."""
    rows = p + (1 if bias else 0)
    return sum(4 * (tokens * (1 + p) + rows * (r + 1 + p)) for r in group_ranks)


def layer_params(system: str, shape: Shape, p: int) -> float:
    """Parameters of one layer held by one rank (the two RMSNorm gains included)."""
    _check_system(system)
    d, ff, r = shape.d, shape.d_ff, shape.rank
    if system == "full-rank":
        return (4 * d * d + 3 * d * ff) / p + 2 * d
    factors = r * (4 * (d + d) + 3 * (d + ff)) / p
    return factors + (2 * d if system == "vanilla" else 2 * d / p)


# ----------------------------------------------------------------------------- assembly


@dataclass(frozen=True)
class Cost:
    """Forward + backward of some layers for one micro-batch on one rank."""

    gemm_flops: float = 0.0
    gemm_s: float = 0.0
    attention_flops: float = 0.0
    attention_s: float = 0.0
    elementwise_bytes: float = 0.0
    elementwise_s: float = 0.0
    collectives: float = 0.0
    comm_bytes: float = 0.0
    ring_bytes: float = 0.0
    comm_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s + self.comm_s

    def scaled(self, k: float) -> Cost:
        return Cost(**{name: value * k for name, value in asdict(self).items()})

    def __add__(self, other: Cost) -> Cost:
        return Cost(**{name: value + getattr(other, name) for name, value in asdict(self).items()})


def layer_cost(
    system: str, shape: Shape, batch: int, seq: int, p: int, hw: Hardware, wl: Workload
) -> Cost:
    """One layer, forward + backward, for a micro-batch of ``batch`` sequences of ``seq`` tokens."""
    tokens, e = batch * seq, wl.dtype_bytes
    gemms = layer_gemms(system, shape, tokens, p)
    width = attention_heads(system, shape, p) * shape.head_dim
    attn = attention_flops(batch, seq, width, wl.causal_fraction) * (1 + wl.attention_bwd_factor)
    ew = layer_elementwise_bytes(system, shape, tokens, p, e)
    coll = layer_collectives(system, shape, tokens, e, p)
    grouped = p > 1
    return Cost(
        gemm_flops=3 * sum(linear_flops(g.m, g.k, g.n) for g in gemms),
        gemm_s=3 * sum(gemm_time(g.m, g.k, g.n, hw, e) for g in gemms),
        attention_flops=attn,
        attention_s=attention_time(attn, shape.head_dim, hw),
        elementwise_bytes=ew,
        elementwise_s=elementwise_time(ew, hw),
        collectives=coll.fwd_count + coll.bwd_count if grouped else 0,
        comm_bytes=coll.fwd_bytes + coll.bwd_bytes if grouped else 0,
        ring_bytes=ring_bytes_per_rank(coll.fwd_bytes, p) + ring_bytes_per_rank(coll.bwd_bytes, p),
        comm_s=allreduce_time(coll.fwd_count, coll.fwd_bytes, p, hw)
        + allreduce_time(coll.bwd_count, coll.bwd_bytes, p, hw),
    )


def head_cost(
    system: str,
    shape: Shape,
    tokens: int,
    p: int,
    hw: Hardware,
    wl: Workload,
    head: str = DEFAULT_HEAD,
) -> Cost:
    """Final RMSNorm, lm_head and cross-entropy, and the stream's [T, d] collectives.

    ``head="vocab_parallel"``: each rank holds V/p of the vocabulary (lm_head GEMM and
    logits); ``"replicated"``: every rank computes the whole [T, V] head and loss.
    """
    _check_system(system)
    _check_head(head)
    replicated = head == "replicated"
    e = wl.dtype_bytes
    vocab_local = shape.vocab if replicated else _split(shape.vocab, p)
    ew = (
        sum(PASSES["rmsnorm"]) * tokens * shape.d * e
        + wl.cross_entropy_bytes_per_logit * tokens * vocab_local
    )
    payload = tokens * shape.d * e
    if system == "btp":
        # all-gather before the final norm; backward: reduce-scatter of its gradient
        # (vocab-parallel: partial sums over the vocabulary), or keep this rank's slice
        count = 1 if replicated else 2
        comm_s = count * allgather_time(1, payload, p, hw)
        ring = count * (p - 1) * payload // p
    elif replicated:  # replicated embedding and head: nothing to reduce
        count, comm_s, ring = 0, 0.0, 0
    else:  # embedding output all-reduce (forward); lm_head input-gradient all-reduce (backward)
        count = 2
        comm_s = 2 * allreduce_time(1, payload, p, hw)
        ring = 2 * ring_bytes_per_rank(payload, p)
    grouped = p > 1
    return Cost(
        gemm_flops=3 * linear_flops(tokens, shape.d, vocab_local),
        gemm_s=3 * gemm_time(tokens, shape.d, vocab_local, hw, e),
        elementwise_bytes=ew,
        elementwise_s=elementwise_time(ew, hw),
        collectives=count if grouped else 0,
        comm_bytes=count * payload if grouped else 0,
        ring_bytes=ring,
        comm_s=comm_s,
    )


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as even as possible (the first stages take the remainder)."""
    return [layers // pp + (1 if i < layers % pp else 0) for i in range(pp)]


def stage_params(
    system: str, shape: Shape, tp: int, pp: int, head: str = DEFAULT_HEAD
) -> list[float]:
    """Parameters one rank of each stage holds: its layers, the embedding (first), the lm_head and norm (last).

    btp shards the embedding's columns (V x d/p) under either head; full-rank and
    vanilla shard its vocabulary with the vocab-parallel head (its output is
    all-reduced) and replicate it with the replicated head. The replicated head
    keeps the whole V x d lm_head on every rank.
    """
    _check_head(head)
    replicated = head == "replicated"
    vocab_local = shape.vocab if replicated else _split(shape.vocab, tp)
    params = [layer_params(system, shape, tp) * n for n in stage_layers(shape.layers, pp)]
    params[0] += vocab_local * shape.d if system != "btp" else shape.vocab * _split(shape.d, tp)
    params[-1] += vocab_local * shape.d + shape.d
    return params


def stream_width(system: str, shape: Shape, tp: int) -> int:
    """Width of the stream one rank sends between pipeline stages: d, or its d/p slice under btp."""
    _check_system(system)
    return _split(shape.d, tp) if system == "btp" else shape.d


def p2p_bytes(tokens: int, shape: Shape, dtype_bytes: int = 2, system: str = "full-rank", tp: int = 1) -> int:
    """Bytes of one activation (or its gradient) one rank sends to the next stage."""
    return tokens * stream_width(system, shape, tp) * dtype_bytes


def p2p_time(
    tokens: int, shape: Shape, hw: Hardware, dtype_bytes: int = 2, system: str = "full-rank", tp: int = 1
) -> float:
    """One pipeline send/recv of an activation (or its gradient): [tokens, d], or [tokens, d/p] under btp."""
    return hw.p2p_latency + p2p_bytes(tokens, shape, dtype_bytes, system, tp) / hw.p2p_bandwidth


def dp_cost(params: float, dp: int, hw: Hardware, wl: Workload) -> tuple[float, float, float]:
    """Data parallelism's gradient reduction of ``params`` parameters over ``dp`` replicas.

    Returns (all-reduce seconds, payload bytes, seconds of the element passes
    that flatten the gradients into one buffer, scale and copy them back); zeros
    without data parallelism.
    """
    if dp <= 1:
        return 0.0, 0.0, 0.0
    payload = params * wl.grad_bytes
    return allreduce_time(1, payload, dp, hw), payload, elementwise_time(wl.grad_flatten_passes * payload, hw)


@dataclass(frozen=True)
class Prediction:
    """One system on one (model, TP, PP) configuration: times in s along the critical path, volumes in GB."""

    system: str
    model: str
    tp: int
    pp: int
    micro_batches: int
    iteration_s: float
    gemm_s: float
    attention_s: float
    elementwise_s: float
    comm_s: float
    p2p_s: float
    optimizer_s: float
    bubble_s: float
    comm_gb: float
    ring_gb_per_rank: float
    collectives: int
    tflops_per_gpu: float
    dp: int = 1
    #: of the times above: the data-parallel gradient all-reduce and its copies
    dp_s: float = 0.0
    #: bytes one rank sends to the next stage and receives back, per iteration
    p2p_bytes: float = 0.0


def predict(
    shape: Shape,
    system: str,
    tp: int,
    pp: int = 1,
    hw: Hardware | None = None,
    wl: Workload | None = None,
    *,
    head: str = DEFAULT_HEAD,
    dp: int = 1,
) -> Prediction:
    """Iteration time and communication of ``system`` for ``shape`` on ``tp * pp * dp`` GPUs.

    ``head``: ``"vocab_parallel"`` (default) or ``"replicated"`` output head and
    loss (see :func:`head_cost`). ``dp`` data-parallel replicas each take
    ``batch / dp`` sequences (cut into ``micro_batches`` when ``pp > 1``) and
    all-reduce their gradients after the backward (:func:`dp_cost`).

    ``iteration_s`` = gemm + attention + elementwise + comm (TP collectives, the
    pipeline's send/recv and the data-parallel all-reduce) + optimizer, each
    summed along the schedule's critical path. ``bubble_s`` (part of those) is
    the time the busiest stage waits. ``comm_gb`` is the summed payload of every
    collective and send/recv of the iteration (of one replica); ``ring_gb_per_rank``
    what one rank of each stage sends in the TP collectives, summed over the stages.
    """
    _check_system(system)
    _check_head(head)
    hw = hw or load_hardware()
    wl = wl or Workload()
    if tp < 1 or pp < 1 or dp < 1 or wl.batch % dp:
        raise ValueError("tp, pp and dp must be >= 1, and dp must divide batch")
    replica_batch = wl.batch // dp
    if wl.micro_batches < 1 or (pp > 1 and replica_batch % wl.micro_batches):
        raise ValueError("micro_batches must be >= 1 and divide the batch of a replica (batch / dp)")
    if pp > shape.layers:
        raise ValueError(f"{shape.name} has {shape.layers} layers, fewer than {pp} stages")
    m = wl.micro_batches if pp > 1 else 1
    mb = replica_batch // m
    tokens = mb * wl.seq
    layer = layer_cost(system, shape, mb, wl.seq, tp, hw, wl)
    stages = [layer.scaled(n) for n in stage_layers(shape.layers, pp)]
    stages[-1] = stages[-1] + head_cost(system, shape, tokens, tp, hw, wl, head)
    slowest = max(stages, key=lambda c: c.total_s)
    path = sum(stages[1:], stages[0]) + slowest.scaled(m - 1)

    p2p_s = 2 * (pp - 1) * p2p_time(tokens, shape, hw, wl.dtype_bytes, system, tp)
    sent = 2 * (pp - 1) * m * p2p_bytes(tokens, shape, wl.dtype_bytes, system, tp)
    params = max(stage_params(system, shape, tp, pp, head))
    optimizer_s = elementwise_time(wl.optimizer_bytes_per_param * params, hw)
    dp_comm_s, dp_bytes, dp_copy_s = dp_cost(params, dp, hw, wl)
    iteration = path.total_s + p2p_s + optimizer_s + dp_comm_s + dp_copy_s
    flops_per_gpu = sum(s.gemm_flops + s.attention_flops for s in stages) * m / pp
    return Prediction(
        system=system,
        model=shape.name,
        tp=tp,
        pp=pp,
        micro_batches=m,
        iteration_s=iteration,
        gemm_s=path.gemm_s,
        attention_s=path.attention_s,
        elementwise_s=path.elementwise_s + dp_copy_s,
        comm_s=path.comm_s + p2p_s + dp_comm_s,
        p2p_s=p2p_s,
        optimizer_s=optimizer_s,
        bubble_s=path.total_s + p2p_s - m * slowest.total_s,
        comm_gb=(sum(s.comm_bytes for s in stages) * m + sent + dp_bytes) / GB,
        ring_gb_per_rank=sum(s.ring_bytes for s in stages) * m / GB,
        collectives=round(sum(s.collectives for s in stages) * m) + (1 if dp > 1 else 0),
        tflops_per_gpu=flops_per_gpu / iteration / 1e12,
        dp=dp,
        dp_s=dp_comm_s + dp_copy_s,
        p2p_bytes=sent,
    )


def predict_all(
    shape: Shape, tp: int, pp: int, hw: Hardware, wl: Workload, *, head: str = DEFAULT_HEAD
) -> dict[str, Prediction]:
    """The three systems on one configuration."""
    return {system: predict(shape, system, tp, pp, hw, wl, head=head) for system in SYSTEMS}


def speedups(times: dict[str, float]) -> dict[str, float]:
    """btp's speed-up over full-rank and over vanilla (ratios of iteration times)."""
    return {
        "vs_full": times["full-rank"] / times["btp"],
        "vs_vanilla": times["vanilla"] / times["btp"],
    }


def relative_error(predicted: float, published: float) -> float:
    return (predicted - published) / published
