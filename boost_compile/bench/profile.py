"""Where a training step's time goes: one profiled step, its self CPU time by category.

``boost-bench tp --profile`` runs one more step of each TP variant under
``torch.profiler`` (CPU activities, ``record_shapes=True``) on rank 0, while
rank 1 runs the same step unprofiled (the collectives need both). Inductor's
generated C++ kernels appear as named events only when
``torch._inductor.config.cpp.enable_kernel_profile`` was set before compiling.

Only the events of the thread that ran the step are categorised: gloo's worker
threads run the collectives concurrently with the step's own ``wait_tensor``,
so counting both would count the same wall time twice (their total is kept as
``off_thread_ms``). Each event counts its *self* CPU time (its time minus its
children's), so nested events (``aten::linear`` -> ``aten::mm``) are not
counted twice and the categories add up to the time spent inside profiled ops.

Rules, first match wins (``name`` is the event name, e.g. ``aten::mm``):

1. **Inductor kernels** (``cpp_fused`` in the name, e.g.
   ``graph_0_cpp_fused_add_mul_rsqrt_3``): *head+loss* when the name contains a
   loss word (rule 3), or has ``gather`` as a ``_``-separated word, or both
   ``exp`` and ``scatter`` (Inductor names a kernel after the decomposed ops
   it fused: the loss forward is ``..._exp_gather_...``, its backward
   ``..._exp_..._scatter_...``; nothing else in these models gathers, and
   ``slice_scatter`` alone is not the loss; the collectives ``all_gather`` and
   ``reduce_scatter`` a kernel was fused around do not count), else
   *norms+elementwise*. They
   come first because their names can also list ``all_reduce`` or
   ``scaled_dot_product``.
2. **collectives waited on**: ``wait_tensor``, ``c10d`` (``c10d::allreduce_``,
   ``_c10d_functional::all_reduce``), ``gloo``, ``nccl``, ``all_reduce``,
   ``allreduce``, ``all_gather``, ``allgather``, ``reduce_scatter``,
   ``record_param_comms``, ``barrier``. On the step's thread this is mostly
   time blocked until the other rank and gloo's thread are done.
3. **head+loss**: ``log_softmax``, ``nll_loss`` or ``cross_entropy`` in the name.
4. **attention**: ``scaled_dot_product``, ``flash_attention`` or
   ``efficient_attention`` in the name (SDPA forward and backward).
5. **GEMMs**: ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, ``linear``,
   ``matmul``; counted as *head+loss* instead when they are one of the LM
   head's GEMMs. ``vocab`` is this rank's logits width: the vocabulary, or its
   shard under a vocabulary-parallel head (btp, megatron). Given only
   ``vocab``, a head GEMM is one with ``vocab`` among its recorded input
   shapes' dimensions. Given the model width ``dim`` and the tokens per step
   too, it is one whose (m, k, n) are a permutation of (tokens, dim, vocab):
   the head's forward [T, d] x [d, V] and its two backward GEMMs
   [T, V] x [V, d], [V, T] x [T, d]. The bench passes all three, because the
   loose rule miscounts whenever the vocabulary (shard) equals another width
   of a GEMM input: at ``--size tiny --seq 64 --batch 2`` the 128 tokens per
   step equal the 256 / 2 vocabulary shard, so every GEMM would be the head;
   at 60m with ``--vocab 256`` btp's rank r = 128 equals the shard. Shapes
   alone cannot separate a GEMM of exactly the head's (m, k, n).
6. **norms+elementwise**: ATen ops tagged ``pointwise`` or ``reduction``
   (``aten::mul``, ``aten::sum``, ...) and any event with ``norm`` in its
   name (``aten::rms_norm``, ``boost::rms_norm``).
7. **other**: the rest (copies, views, allocation, autograd and compiled-region
   bookkeeping, the Python wrapper code of compiled graphs).

The step's wall time minus the categorised total is time in no profiled op
(Python between ops, the profiler's own overhead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

GEMMS = "GEMMs"
ATTENTION = "attention"
ELEMENTWISE = "norms+elementwise"
COLLECTIVES = "collectives waited on"
HEAD = "head+loss"
OTHER = "other"
#: the categories, in the order the table prints them
CATEGORIES = (GEMMS, ATTENTION, ELEMENTWISE, COLLECTIVES, HEAD, OTHER)

GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "matmul"})
COLLECTIVE_WORDS = ("wait_tensor", "c10d", "gloo", "nccl", "all_reduce", "allreduce", "all_gather",
                    "allgather", "reduce_scatter", "record_param_comms", "barrier")
LOSS_WORDS = ("log_softmax", "nll_loss", "cross_entropy")
ATTENTION_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention")
#: the event wrapped around the profiled step (found to pick its thread, then dropped)
MARKER = "boost_bench::profiled_step"


def _has(name: str, words: Iterable[str]) -> bool:
    return any(w in name for w in words)


def _is_loss_kernel(name: str) -> bool:
    """An Inductor kernel of the loss, by the ops its name lists (rule 1 of the module docstring)."""
    words = set(name.replace("all_gather", "").replace("reduce_scatter", "").split("_"))
    return _has(name, LOSS_WORDS) or "gather" in words or {"exp", "scatter"} <= words


def _aten_op(name: str) -> str | None:
    """``aten::mm`` -> ``mm``; None for events that are not ATen ops."""
    return name[len("aten::"):] if name.startswith("aten::") else None


def _is_pointwise_or_reduction(op: str) -> bool:
    """Whether any overload of ``aten.<op>`` carries the pointwise or reduction tag."""
    try:
        packet = getattr(torch.ops.aten, op)
    except (AttributeError, RuntimeError):
        return False
    tags = {torch.Tag.pointwise, torch.Tag.reduction}
    return any(tags.intersection(getattr(packet, o).tags) for o in packet.overloads())


def _mkn(op: str, shapes: Sequence[Any] | None) -> tuple[int, int, int] | None:
    """(m, k, n) of a GEMM from its recorded input shapes (leading dims of the left operand flattened)."""
    shapes = list(shapes or ())
    if op in ("addmm", "baddbmm"):
        shapes = shapes[1:]  # the bias comes first
    mats = [list(x) for x in shapes if isinstance(x, (list, tuple)) and len(x) >= 2]
    if len(mats) < 2:
        return None
    a, b = mats[0], mats[1]
    m = 1
    for d in a[:-1]:
        m *= d
    return m, a[-1], b[0] if op == "linear" else b[-1]


def _is_head_gemm(op: str, shapes: Sequence[Any] | None, vocab: int, dim: int | None, tokens: int | None) -> bool:
    """The LM head's forward or backward GEMM (rule 5 of the module docstring)."""
    if dim is None or tokens is None:
        return any(vocab in x for x in shapes or () if isinstance(x, (list, tuple)))
    mkn = _mkn(op, shapes)
    return mkn is not None and sorted(mkn) == sorted((tokens, dim, vocab))


def category(name: str, shapes: Sequence[Any] | None, vocab: int, dim: int | None = None, tokens: int | None = None) -> str:
    """The category of one event (rules in the module docstring)."""
    if "cpp_fused" in name:
        return HEAD if _is_loss_kernel(name) else ELEMENTWISE
    if _has(name, COLLECTIVE_WORDS):
        return COLLECTIVES
    if _has(name, LOSS_WORDS):
        return HEAD
    if _has(name, ATTENTION_WORDS):
        return ATTENTION
    op = _aten_op(name)
    if op in GEMM_OPS:
        return HEAD if _is_head_gemm(op, shapes, vocab, dim, tokens) else GEMMS
    if "norm" in name or (op is not None and _is_pointwise_or_reduction(op)):
        return ELEMENTWISE
    return OTHER


def categorize(events: Iterable[Any], vocab: int, dim: int | None = None, tokens: int | None = None) -> dict[str, float]:
    """Self CPU time (ms) per category of profiler events.

    An event needs ``name`` and ``self_cpu_time_total`` (microseconds, as
    ``torch.autograd.profiler_util.FunctionEvent`` has them); ``input_shapes``
    is optional. Every category is present, in :data:`CATEGORIES` order.
    """
    out = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        out[category(e.name, getattr(e, "input_shapes", None), vocab, dim, tokens)] += e.self_cpu_time_total / 1e3
    return out


def profile_step(step: Callable[[], float]) -> tuple[list[Any], list[Any], float]:
    """Run ``step`` once under the CPU profiler.

    Returns the events of the thread that ran it (without the marker event),
    the events of other threads, and the step's own measured time (s).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(MARKER):
            seconds = step()
    events = list(prof.events())
    thread = next(e.thread for e in events if e.name == MARKER)
    mine = [e for e in events if e.thread == thread and e.name != MARKER]
    others = [e for e in events if e.thread != thread]
    return mine, others, seconds


def breakdown(step: Callable[[], float], vocab: int, dim: int | None = None, tokens: int | None = None) -> dict[str, Any]:
    """Profile one step: ms and % of the profiled step per category, their total, the step."""
    mine, others, seconds = profile_step(step)
    ms = categorize(mine, vocab, dim, tokens)
    step_ms = seconds * 1e3
    return {
        "ms": ms,
        "percent": {k: 100 * v / step_ms for k, v in ms.items()},
        "total_ms": sum(ms.values()),
        "step_ms": step_ms,
        "off_thread_ms": sum(e.self_cpu_time_total for e in others) / 1e3,
    }


def markdown(profiles: dict[str, dict[str, Any]], timed_ms: dict[str, float]) -> str:
    """One row per variant: each category as ms (% of the profiled step), total, steps."""
    head = "| variant | " + " | ".join(CATEGORIES) + " | total (self CPU) | profiled step (ms) | timed step, median (ms) |"
    lines = [head, "|---|" + "---:|" * (len(CATEGORIES) + 3)]
    for label, p in profiles.items():
        cells = [f"{p['ms'][c]:.1f} ({p['percent'][c]:.0f}%)" for c in CATEGORIES]
        total = f"{p['total_ms']:.1f} ({100 * p['total_ms'] / p['step_ms']:.0f}%)"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {total} | {p['step_ms']:.1f} | {timed_ms[label]:.1f} |")
    return "\n".join(lines)
