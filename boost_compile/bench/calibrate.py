"""``boost-bench calibrate``: measure the scale model's constants on this CPU; write the ``cpu`` hardware file.

    boost-bench calibrate [--out boost_compile/hardware/cpu.json] [--quick]
                          [--size 60m] [--seq 1024] [--batch 4] [--vocab 256] [--microbatches 4]

Two gloo processes with one intra-op thread each (what ``boost-bench tp`` and
``pp`` give each process on two cores) run every microbenchmark at the same
time, so each core is measured while the other is busy, as during the benches.
The microbenchmarks run round-robin, one after the other, 12 rounds after a
warm-up round. A compute microbenchmark keeps its best round (its steady state,
the least disturbed by other jobs on the machine). A collective is timed as a
step issues it: after a stretch of compute on both ranks (a [T, d] x [d, d]
GEMM, not timed), so its time holds the ranks' skew as well as the transfer, and
it keeps its median round (a step pays the typical collective, not the best:
an isolated best round priced a TP2 step's all-reduces at a quarter to a half of
what they cost in the step). Times are averaged over the two ranks. Run it on an otherwise idle
machine (about a minute). The shapes are those the scale model evaluates for
the benches' configurations at the given options (the benches' defaults by
default; :mod:`boost_compile.bench.compare`). Nothing here looks at a training
step: every constant comes from these microbenchmarks alone.

=========================== =================================================================
constant                    measurement
=========================== =================================================================
peak_flops                  fp32 GEMM forward + backward at [n, n] x [n, n], n = 2048
gemm_max_efficiency,        fitted to the forward + backward time (X W, dY W^T, X^T dY) of
gemm_half_intensity         every GEMM shape of the configurations: the scale model's curve
                            t = 3 * 2mkn / (peak * eff_max * I / (I + I_half)), least squares
                            on the relative error (gemm_tile 1: no tile rounding is modelled)
attention_efficiency        causal ``scaled_dot_product_attention`` forward + backward at each
                            configuration's (batch, local heads, seq, head dim): the model's
                            FLOPs / time / peak, geometric mean (head-dim multiple 1)
hbm_bandwidth               a copy of a large buffer (256 MiB): bytes read + written / time
elementwise_efficiency      add, mul, SiLU and its backward, RMSNorm at the step's [T, d],
                            [T, d_ff] and [T, r]: their element passes / time, over hbm_bandwidth
collective_latency,         gloo all-reduce as the compiled graphs issue it (functional, out of
allreduce_bus_bandwidth     place, then waited for) of 4 KiB - 24 MiB (the benches' largest TP
                            payload, vanilla's [T, d_ff], is 22.5 MB), each after the compute
                            segment, median round: t = alpha + 2 (p-1)/p S / busbw, least
                            squares on the relative error over nine sizes
p2p_latency, p2p_bandwidth  gloo send/recv ping-pong of the same sizes after the same segment,
                            median round: one way = alpha + S / bw
nvlink_bandwidth            the same send/recv bandwidth (the link between the two processes)
queued_collective_latency   64 gloo broadcasts of 4 KiB from alternating owners, issued
                            asynchronously and waited for together (ZeRO-1's parameter sync
                            after its step), median round: the time / 64
=========================== =================================================================

``--quick`` measures small shapes in one round (seconds, for tests): its file
has the right layout, not useful constants.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from boost_compile import _torch_compat as compat
from boost_compile.bench import compare
from boost_compile.costmodel import hardware, scale_model
from boost_compile.process_exit import exit_without_finalizing

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hardware", "cpu.json")
KIB, MIB = 1024, 1024 * 1024
#: (full run, --quick): the microbenchmarks' sizes and rounds
FULL = {"peak_n": 2048, "copy_bytes": 256 * MIB, "rounds": 12,
        "messages": [4 * KIB, 64 * KIB, 256 * KIB, MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 24 * MIB]}
QUICK = {"peak_n": 256, "copy_bytes": 8 * MIB, "messages": [4 * KIB, 64 * KIB, 256 * KIB], "rounds": 1, "seq": 64}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=DEFAULT_OUT, help="the hardware file to write (default: the package's cpu.json)")
    p.add_argument("--quick", action="store_true", help="small shapes, one round: the file's layout, rough constants")
    p.add_argument("--size", default="60m", help="the benches' preset size (its shapes are measured)")
    p.add_argument("--seq", type=int, default=None, help="the benches' sequence length (default 1024; 64 with --quick)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=compare.pp.DEFAULT_MICROBATCHES)


# ----------------------------------------------------------------------------- what to measure


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The shapes and sizes to measure: those of the benches' configurations at ``args``."""
    sizes = QUICK if args.quick else FULL
    seq = args.seq or sizes.get("seq", 1024)
    params = compare.bench_params(args.size, seq, args.batch, args.vocab, args.microbatches)
    configs = compare.configurations(params)
    gemms = sorted({(g.m, g.k, g.n) for c, s, wl in configs for g in compare.gemms(c, s, wl)})
    attention = sorted({compare.attention_shape(c, s, wl) for c, s, wl in configs})
    shape, wl = configs[0][1], configs[0][2]
    return {
        "options": {"size": args.size, "seq": seq, "batch": args.batch, "vocab": args.vocab,
                    "microbatches": args.microbatches, "quick": args.quick},
        "gemms": [list(g) for g in gemms],
        "attention": [list(a) for a in attention],
        "elementwise": {"tokens": args.batch * seq, "d": shape.d, "d_ff": shape.d_ff, "r": shape.rank},
        "attention_flops": {"causal_fraction": wl.causal_fraction, "bwd_factor": wl.attention_bwd_factor},
        **{k: sizes[k] for k in ("peak_n", "copy_bytes", "messages", "rounds")},
    }


# ----------------------------------------------------------------------------- the microbenchmarks


@dataclass
class Item:
    """One microbenchmark: ``run`` does ``calls`` operations; ``per_op`` scales the time to one of them.

    ``before`` (untimed) runs ahead of each call: the compute a collective follows
    in a step. ``typical`` items keep their median round, the others their best.
    """

    key: str
    run: Callable[[], Any]
    calls: int = 1
    per_op: float = 1.0
    before: Callable[[], Any] | None = None
    typical: bool = False

    def seconds(self) -> float:
        total = 0.0
        for _ in range(self.calls):
            if self.before is not None:
                self.before()
            start = time.perf_counter()
            self.run()
            total += time.perf_counter() - start
        return total / self.calls * self.per_op


def gemm_item(key: str, m: int, k: int, n: int) -> Item:
    """Forward and backward of ``[m, k] x [k, n]``: X W, dY W^T and X^T dY."""
    x, w, g = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
    return Item(key, lambda: (torch.mm(x, w), torch.mm(g, w.t()), torch.mm(x.t(), g)))


def attention_item(key: str, b: int, h: int, s: int, hd: int) -> Item:
    """Causal SDPA forward and backward on [b, h, s, hd]."""
    q, k, v = (torch.randn(b, h, s, hd, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, hd)
    return Item(key, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad))


def elementwise_ops(tokens: int, d: int, d_ff: int, r: int) -> list[tuple[str, int, list[int], Callable[..., Any]]]:
    """(name, element passes, shape, op) of the memory-bound ops of a step at its widths."""
    return [
        ("add [T, d]", 3, [tokens, d], lambda x, y: torch.add(x, y)),
        ("mul [T, d_ff]", 3, [tokens, d_ff], lambda x, y: torch.mul(x, y)),
        ("silu [T, r]", 2, [tokens, r], lambda x, y: torch.nn.functional.silu(x)),
        ("silu_backward [T, r]", 3, [tokens, r], lambda x, y: torch.ops.aten.silu_backward(y, x)),
        ("rms_norm [T, d]", 2, [tokens, d], lambda x, y: torch.rms_norm(x, (x.shape[-1],), y[0], 1e-6)),
    ]


def elementwise_item(key: str, shape: list[int], op: Callable[..., Any]) -> Item:
    x, y = torch.randn(shape), torch.randn(shape)
    return Item(key, lambda: op(x, y), calls=4)


def copy_item(key: str, nbytes: int) -> Item:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return Item(key, lambda: dst.copy_(src))


def compute_segment(tokens: int, d: int) -> Callable[[], Any]:
    """The untimed compute ahead of each collective: a [T, d] x [d, d] GEMM."""
    x, w = torch.randn(tokens, d), torch.randn(d, d)
    return lambda: torch.mm(x, w)


def all_reduce_item(key: str, nbytes: int, before: Callable[[], Any] | None = None) -> Item:
    """A sum all-reduce as the compiled graphs issue it: functional (out of place), then waited for."""
    import torch.distributed as dist

    buf = torch.zeros(nbytes // 4)
    group = dist.group.WORLD.group_name
    ops = compat.functional_collectives()

    return Item(key, lambda: ops.wait_tensor(ops.all_reduce(buf, "sum", group)), before=before, typical=True)


def send_recv_item(key: str, nbytes: int, rank: int, before: Callable[[], Any] | None = None) -> Item:
    """A ping-pong between ranks 0 and 1, timed as one way (half the round trip)."""
    import torch.distributed as dist

    buf = torch.zeros(nbytes // 4)
    peer = 1 - rank

    def ping() -> None:
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    return Item(key, ping, per_op=0.5, before=before, typical=True)


#: tensors and bytes of each of the queued broadcasts
QUEUED = {"count": 64, "bytes": 4 * KIB}


def queued_broadcast_item(key: str, count: int, nbytes: int) -> Item:
    """``count`` asynchronous broadcasts, each from its tensor's owner, then all waited for (ZeRO-1's sync)."""
    import torch.distributed as dist

    bufs = [torch.zeros(nbytes // 4) for _ in range(count)]
    world = dist.get_world_size()

    def sync() -> None:
        for work in [dist.broadcast(b, src=i % world, async_op=True) for i, b in enumerate(bufs)]:
            work.wait()

    return Item(key, sync, per_op=1 / count, typical=True)


def items(todo: dict[str, Any], rank: int) -> list[Item]:
    """Every microbenchmark of ``todo`` (both ranks build the same list, in the same order)."""
    n, ew = todo["peak_n"], todo["elementwise"]
    ops = elementwise_ops(ew["tokens"], ew["d"], ew["d_ff"], ew["r"])
    segment = compute_segment(ew["tokens"], ew["d"])
    return [
        gemm_item("peak", n, n, n),
        *(gemm_item(f"gemm {i}", *g) for i, g in enumerate(todo["gemms"])),
        *(attention_item(f"attention {i}", *a) for i, a in enumerate(todo["attention"])),
        *(elementwise_item(f"elementwise {i}", shape, op) for i, (_n, _p, shape, op) in enumerate(ops)),
        copy_item("copy", todo["copy_bytes"]),
        *(all_reduce_item(f"all_reduce {i}", b, segment) for i, b in enumerate(todo["messages"])),
        *(send_recv_item(f"send_recv {i}", b, rank, segment) for i, b in enumerate(todo["messages"])),
        queued_broadcast_item("queued", QUEUED["count"], QUEUED["bytes"]),
    ]


def round_times(todo: list[Item], rounds: int) -> dict[str, float]:
    """Each item's time over ``rounds`` rounds of all of them in turn (after one warm-up round).

    Round-robin spreads a burst of load from other jobs over every item, and the
    best round of a compute item is its undisturbed time; a ``typical`` item (a
    collective) keeps its median round. A barrier before each item starts the two
    ranks on it together.
    """
    import torch.distributed as dist

    for item in todo:
        item.run()
    seen: dict[str, list[float]] = {item.key: [] for item in todo}
    for _ in range(rounds):
        for item in todo:
            dist.barrier()
            seen[item.key].append(item.seconds())
    return {item.key: (statistics.median if item.typical else min)(seen[item.key]) for item in todo}


def _worker(rank: int, world: int, store: str, todo: dict[str, Any], out_path: str) -> None:
    import torch.distributed as dist

    from boost_compile.bench.tp import _setup

    threads = _setup(rank, world, store, False)
    t = round_times(items(todo, rank), todo["rounds"])
    ew = todo["elementwise"]
    ops = elementwise_ops(ew["tokens"], ew["d"], ew["d_ff"], ew["r"])
    got = {
        "threads": threads,
        "peak": {"n": todo["peak_n"], "seconds": t["peak"]},
        "gemms": [{"m": m, "k": k, "n": n, "seconds": t[f"gemm {i}"]} for i, (m, k, n) in enumerate(todo["gemms"])],
        "attention": [{"shape": a, "seconds": t[f"attention {i}"]} for i, a in enumerate(todo["attention"])],
        "elementwise": [{"op": name, "passes": passes, "bytes": passes * math.prod(shape) * 4, "seconds": t[f"elementwise {i}"]}
                        for i, (name, passes, shape, _op) in enumerate(ops)],
        "copy": {"bytes": 2 * todo["copy_bytes"], "seconds": t["copy"]},
        "all_reduce": [{"bytes": b, "seconds": t[f"all_reduce {i}"]} for i, b in enumerate(todo["messages"])],
        "send_recv": [{"bytes": b, "seconds": t[f"send_recv {i}"]} for i, b in enumerate(todo["messages"])],
        "queued_broadcast": {**QUEUED, "seconds_each": t["queued"]},
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, got)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "ranks": gathered}, f)
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


# ----------------------------------------------------------------------------- the fits


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``y = a + b x`` by least squares on the relative error, with a, b >= 0.

    Minimises ``sum(((a + b x_i) / y_i - 1)^2)``: small and large sizes weigh
    alike (plain least squares would fit the large ones only).
    """
    u = [1.0 / y for y in ys]
    suu = sum(v * v for v in u)
    sxuu = sum(x * v * v for x, v in zip(xs, u, strict=True))
    sxxuu = sum(x * x * v * v for x, v in zip(xs, u, strict=True))
    su = sum(u)
    sxu = sum(x * v for x, v in zip(xs, u, strict=True))
    det = suu * sxxuu - sxuu * sxuu
    a, b = ((su * sxxuu - sxu * sxuu) / det, (suu * sxu - sxuu * su) / det) if det > 0 else (-1.0, -1.0)
    if b < 0:  # no measurable slope: a constant
        return su / suu, 0.0
    if a < 0:  # no measurable intercept: a proportion
        return 0.0, sxu / sxxuu
    return a, b


def _averaged(ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rank 0's rows of ``key``, each time the mean over the ranks."""
    return [{**row, "seconds": statistics.fmean(r[key][i]["seconds"] for r in ranks)} for i, row in enumerate(ranks[0][key])]


def fit_gemm(gemms: list[dict[str, Any]], peak_seconds: float, peak_n: int, dtype_bytes: int = 4) -> dict[str, Any]:
    """peak_flops, gemm_max_efficiency and gemm_half_intensity from the measured GEMMs.

    The scale model's GEMM time (tile 1) is ``3 * 2mkn / (peak * eff_max) * (1 + I_half / I)``:
    a line in ``1 / I``. ``peak`` is the square GEMM's rate, raised to the fitted
    ceiling if the model's shapes run faster.
    """
    flops = [3 * scale_model.linear_flops(g["m"], g["k"], g["n"]) for g in gemms]
    inv_intensity = [1.0 / scale_model.gemm_intensity(g["m"], g["k"], g["n"], dtype_bytes) for g in gemms]
    ys = [g["seconds"] / f for g, f in zip(gemms, flops, strict=True)]
    a, b = fit_line(inv_intensity, ys)
    if a <= 0:  # no measurable ceiling (noise, or memory-bound shapes only): one constant rate
        a, b = fit_line([0.0] * len(ys), ys)
    peak = max(3 * scale_model.linear_flops(peak_n, peak_n, peak_n) / peak_seconds, 1.0 / a)
    rows = [{**g, "flops_per_s": f / g["seconds"], "fitted_flops_per_s": 1.0 / (a + b * x)}
            for g, f, x in zip(gemms, flops, inv_intensity, strict=True)]
    worst = max(abs(r["fitted_flops_per_s"] / r["flops_per_s"] - 1) for r in rows)
    return {"peak_flops": peak, "gemm_max_efficiency": min(1.0, 1.0 / (a * peak)), "gemm_half_intensity": b / a,
            "rows": rows, "worst_fit_error": worst}


def fit_attention(attention: list[dict[str, Any]], peak: float, causal_fraction: float, bwd_factor: float) -> dict[str, Any]:
    """attention_efficiency: the geometric mean over shapes of the model's attention FLOPs / time / peak."""
    rows = []
    for a in attention:
        b, h, s, hd = a["shape"]
        flops = scale_model.attention_flops(b, s, h * hd, causal_fraction) * (1 + bwd_factor)
        rows.append({**a, "model_flops": flops, "efficiency": flops / a["seconds"] / peak})
    eff = math.exp(statistics.fmean(math.log(r["efficiency"]) for r in rows))
    return {"attention_efficiency": min(eff, 1.0), "rows": rows}


def fit_memory(elementwise: list[dict[str, Any]], copy: dict[str, Any]) -> dict[str, Any]:
    """hbm_bandwidth (the large copy's rate) and elementwise_efficiency (the step's ops over it)."""
    rate = sum(e["bytes"] for e in elementwise) / sum(e["seconds"] for e in elementwise)
    bandwidth = max(copy["bytes"] / copy["seconds"], rate)
    return {"hbm_bandwidth": bandwidth, "elementwise_efficiency": rate / bandwidth, "elementwise_rate": rate,
            "rows": [{**e, "bytes_per_s": e["bytes"] / e["seconds"]} for e in elementwise]}


def fit_link(points: list[dict[str, Any]], payload_factor: float) -> dict[str, Any]:
    """Latency and bandwidth of ``t = alpha + payload_factor * S / bandwidth`` (:func:`fit_line`).

    ``worst`` is the line's largest relative error on a measured message. Without
    a measurable slope (small messages only) the bandwidth is the best rate seen;
    without a measurable intercept the latency is the fastest message's time.
    """
    xs = [payload_factor * p["bytes"] for p in points]
    alpha, slope = fit_line(xs, [p["seconds"] for p in points])
    alpha = alpha if alpha > 0 else min(p["seconds"] for p in points)
    bandwidth = 1.0 / slope if slope > 0 else max(x / p["seconds"] for x, p in zip(xs, points, strict=True))
    worst = max(abs((alpha + x / bandwidth) / p["seconds"] - 1) for x, p in zip(xs, points, strict=True))
    return {"latency": alpha, "bandwidth": bandwidth, "worst": worst}


# ----------------------------------------------------------------------------- the file


def _entry(value: float, source: str, stamp: dict[str, str]) -> dict[str, Any]:
    """A measured constant: its value, how it was measured, and by which command, when and where."""
    return {"value": value, "measured": True, "source": source, **{k: stamp[k] for k in ("command", "date", "machine")}}


def hardware_json(raw: dict[str, Any], todo: dict[str, Any], stamp: dict[str, str], threads: int) -> dict[str, Any]:
    """The hardware file (``hardware.hardware_from_dict``'s layout) from the two ranks' measurements."""
    ranks, world = raw["ranks"], raw["world"]
    first = ranks[0]
    gemms, attention = _averaged(ranks, "gemms"), _averaged(ranks, "attention")
    peak_s = statistics.fmean(r["peak"]["seconds"] for r in ranks)
    copy = {"bytes": first["copy"]["bytes"], "seconds": statistics.fmean(r["copy"]["seconds"] for r in ranks)}
    g = fit_gemm(gemms, peak_s, todo["peak_n"])
    att = fit_attention(attention, g["peak_flops"], **todo["attention_flops"])
    mem = fit_memory(_averaged(ranks, "elementwise"), copy)
    effs = [r["efficiency"] for r in att["rows"]]
    all_reduce, send_recv = _averaged(ranks, "all_reduce"), _averaged(ranks, "send_recv")
    ar, p2p = fit_link(all_reduce, 2 * (world - 1) / world), fit_link(send_recv, 1.0)
    queued = {**QUEUED, "seconds_each": statistics.fmean(r["queued_broadcast"]["seconds_each"] for r in ranks)}
    n, o = todo["peak_n"], todo["options"]
    shapes = f"{o['size']} shapes, seq {o['seq']}, batch {o['batch']}, vocab {o['vocab']}, {o['microbatches']} micro-batches"
    messages = f"{todo['messages'][0] // KIB} KiB - {todo['messages'][-1] // KIB:,} KiB"
    per_core = f"{threads} thread(s) per process, both of {world} processes at once"
    return {
        "peak_dtype": "fp32",  # the GEMMs measured: MFU is reported against fp32 runs only
        "name": "cpu",
        "description": f"this machine's CPU, fp32, {per_core}; gloo between the processes",
        "measured": {**stamp, "threads": str(threads), "processes": str(world), "quick": str(o["quick"]).lower()},
        "peak_flops": _entry(g["peak_flops"], f"fp32 GEMM [{n}, {n}] x [{n}, {n}] forward + backward, {per_core}", stamp),
        "hbm_bandwidth": _entry(mem["hbm_bandwidth"], f"copy of a {todo['copy_bytes'] // MIB} MiB buffer: "
                                "bytes read + written / time", stamp),
        "nvlink_bandwidth": _entry(p2p["bandwidth"], "the link between the two processes: the send/recv bandwidth "
                                   "(as p2p_bandwidth)", stamp),
        "allreduce_bus_bandwidth": _entry(ar["bandwidth"], f"gloo all-reduce as the compiled graphs issue it (functional, "
                                          f"out of place) between {world} processes, {len(todo['messages'])} messages of "
                                          f"{messages}, each after a [T, d] x [d, d] GEMM, median round: t = alpha + "
                                          "2 (p-1)/p S / busbw, least squares on the relative "
                                          f"error (largest {ar['worst']:.0%})", stamp),
        "p2p_bandwidth": _entry(p2p["bandwidth"], f"gloo send/recv ping-pong, {len(todo['messages'])} messages of "
                                f"{messages}, each after the same GEMM, median round: one way = alpha + S / bw, "
                                "least squares on the relative error "
                                f"(largest {p2p['worst']:.0%})", stamp),
        "p2p_latency": _entry(p2p["latency"], "alpha of the send/recv fit (one way)", stamp),
        "collective_latency": _entry(ar["latency"], "alpha of the all-reduce fit", stamp),
        "queued_collective_latency": _entry(queued["seconds_each"], f"{queued['count']} gloo broadcasts of "
                                            f"{queued['bytes'] // KIB} KiB from alternating owners, issued asynchronously and "
                                            "waited for together (ZeRO-1's sync after its step), median round: the time / "
                                            f"{queued['count']}", stamp),
        "gemm_max_efficiency": _entry(g["gemm_max_efficiency"], f"fitted to the fp32 forward + backward time of the {len(gemms)} GEMM "
                                      f"shapes of the benches' configurations ({shapes}); largest rate error of the "
                                      f"fitted curve {g['worst_fit_error']:.1%}", stamp),
        "gemm_half_intensity": _entry(g["gemm_half_intensity"], "the same fit: the intensity at half of gemm_max_efficiency", stamp),
        "gemm_tile": {"value": 1, "measured": False, "why": "no tile rounding is modelled for the CPU GEMM kernels"},
        "attention_efficiency": _entry(att["attention_efficiency"], f"causal SDPA forward + backward at {len(attention)} shapes of the "
                                       "configurations: the model's FLOPs / time / peak_flops, geometric mean (per shape "
                                       f"{min(effs):.3f}-{max(effs):.3f})", stamp),
        "attention_head_dim_multiple": {"value": 1, "measured": False, "why": "the CPU flash-attention kernel takes any head dim"},
        "memory_gib": _entry(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30 / world,
                             f"this machine's RAM shared by the {world} processes: the layout planner's memory per device", stamp),
        "elementwise_efficiency": _entry(mem["elementwise_efficiency"], "add, mul, SiLU, SiLU backward and RMSNorm at the step's "
                                         "widths: element passes / time, over hbm_bandwidth", stamp),
        "measurements": {"gemm": g["rows"], "attention": att["rows"], "elementwise": mem["rows"], "copy": copy,
                         "all_reduce": all_reduce, "send_recv": send_recv, "queued_broadcast": queued,
                         "peak_gemm_seconds": peak_s, "options": o},
    }


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Measure, fit and write ``args.out``; returns the file's content."""
    import torch.multiprocessing as mp

    from boost_compile.bench.results import git_commit, machine

    todo = plan(args)
    load_before = os.getloadavg()[0]
    folder = tempfile.mkdtemp(prefix="boost_bench_calibrate_")
    store, out = os.path.join(folder, "store"), os.path.join(folder, "raw.json")
    mp.spawn(_worker, args=(2, store, todo, out), nprocs=2, join=True)
    with open(out) as f:
        raw = json.load(f)
    stamp = {
        "command": "boost-bench " + " ".join(shlex.quote(a) for a in argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "commit": git_commit(),
        # other jobs on the machine: the 1-minute load average before the run (its own 2 processes add 2)
        "load_average_before": f"{load_before:.2f}",
    }
    hw = hardware_json(raw, todo, stamp, raw["ranks"][0]["threads"])
    hardware.hardware_from_dict(hw)  # the file must load
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(hw, f, indent=1)
        f.write("\n")
    return hw


def summary(hw: dict[str, Any]) -> str:
    """The constants, one line each."""
    keys = [*hardware.HARDWARE_FIELDS, *hardware.OPTIONAL_HARDWARE_FIELDS]
    return "\n".join(f"{k}: {hw[k]['value']:.4g}  ({hw[k].get('source') or hw[k].get('why')})" for k in keys if k in hw)
