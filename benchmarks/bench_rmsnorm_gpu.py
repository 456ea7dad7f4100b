"""RMSNorm forward+backward on the GPU: the fused ``boost`` op against Inductor and eager.

Usage:
    python benchmarks/bench_rmsnorm_gpu.py [--rows 16384] [--widths 512 1024 2048 4096 8192]
                                           [--dtype bfloat16] [--json PATH]

Variants, each timed as one forward + backward (``y = norm(x); y.backward(g)``,
gradients of x and w reset to None between runs) with ``triton.testing.do_bench``
(median, L2 flushed between runs):

    boost            boost_compile.kernels.rms_norm called eagerly (the Triton kernels)
    boost-compiled   the same op inside torch.compile(fullgraph=True) (inductor)
    inductor         torch.compile(nn.RMSNorm) -- Inductor-generated forward and backward
    eager            nn.RMSNorm in eager mode

"kernel ms" is the device time of the kernels one call launches (torch.profiler, 20 calls)
and their number: what the GPU spent, without the host-side gaps between launches that
``do_bench``'s wall time includes.

Bandwidth counts the minimal traffic of forward+backward: read x, g, w and write
y, dx, dw (``4 * rows * width + 2 * width`` elements; the kernels really read x
twice, once per pass, and move rstd and the fp32 partial weight gradients, which
this count leaves out). The copy baseline is ``y = x.clone(); dx = g.clone()``
-- the same bytes as that count, less w and dw -- and "% copy" is each variant's
GB/s as a share of the copy's. ``x.clone()`` alone is reported as well.

Without CUDA it prints "no CUDA device, skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from boost_compile import _torch_compat as compat

WIDTHS = (512, 1024, 2048, 4096, 8192)
EPS = 1e-6


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    parser.add_argument("--json", metavar="PATH", help="write the results here as JSON")
    return parser.parse_args(argv)


def _bench(fn, grad_to_none, args) -> float:
    import triton.testing

    return triton.testing.do_bench(
        fn, warmup=args.warmup, rep=args.rep, grad_to_none=grad_to_none, return_mode="median"
    )


def _kernel_ms(fn, grad_to_none, steps: int = 20) -> tuple[float, float]:
    """Device time of the kernels one call launches (ms) and their number, from torch.profiler:
    the work on the GPU alone, without the host's launch gaps that ``do_bench`` counts."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            for t in grad_to_none or ():
                t.grad = None
            fn()
        torch.cuda.synchronize()
    total_us, count = 0.0, 0
    for item in prof.key_averages():
        us = getattr(item, "self_device_time_total", None)
        us = getattr(item, "self_cuda_time_total", 0.0) if us is None else us
        if us > 0:
            total_us += us
            count += item.count
    return total_us / steps / 1e3, count / steps


def _check(rms_norm, rms_norm_reference, x, w, g) -> float:
    """Max abs difference of y, dx, dw between the fused op and the ATen reference."""
    errs = []
    grads = []
    for fn in (rms_norm, rms_norm_reference):
        xs = x.detach().clone().requires_grad_()
        ws = w.detach().clone().requires_grad_()
        y = fn(xs, ws, EPS)
        y.backward(g)
        grads.append((y.detach(), xs.grad, ws.grad))
    for a, b in zip(*grads, strict=True):
        errs.append(
            (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)
        )
    return max(errs)


def run_width(width: int, args: argparse.Namespace) -> dict:
    from torch import nn

    from boost_compile.kernels import rms_norm, rms_norm_reference

    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    rows = args.rows
    x = torch.randn(rows, width, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(rows, width, device=dev, dtype=dtype)
    norm = nn.RMSNorm(width, eps=EPS, device=dev, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    w = norm.weight

    rel_err = _check(rms_norm, rms_norm_reference, x.detach(), w.detach(), g)

    def boost_step():
        rms_norm(x, w, EPS).backward(g)

    boost_compiled = torch.compile(lambda t: rms_norm(t, w, EPS), fullgraph=True, dynamic=False)

    def boost_compiled_step():
        boost_compiled(x).backward(g)

    inductor_norm = torch.compile(norm, fullgraph=True, dynamic=False)

    def inductor_step():
        inductor_norm(x).backward(g)

    def eager_step():
        norm(x).backward(g)

    def copy_step():  # the bytes of y (fwd) and dx (bwd) without any arithmetic
        x.detach().clone()
        g.clone()

    def clone_step():
        x.detach().clone()

    steps = {
        "boost": boost_step,
        "boost-compiled": boost_compiled_step,
        "inductor": inductor_step,
        "eager": eager_step,
    }
    ms = {name: _bench(fn, [x, w], args) for name, fn in steps.items()}
    kernel = {name: _kernel_ms(fn, [x, w]) for name, fn in steps.items()}
    ms["copy"] = _bench(copy_step, None, args)
    ms["clone"] = _bench(clone_step, None, args)

    elem = x.element_size()
    ideal_bytes = (4 * rows * width + 2 * width) * elem
    copy_bytes = 4 * rows * width * elem
    gbps = {name: ideal_bytes / (ms[name] * 1e-3) / 1e9 for name in steps}
    gbps["copy"] = copy_bytes / (ms["copy"] * 1e-3) / 1e9
    gbps["clone"] = 2 * rows * width * elem / (ms["clone"] * 1e-3) / 1e9
    return {
        "width": width,
        "rows": rows,
        "dtype": args.dtype,
        "ms": ms,
        "kernel_ms": {name: k[0] for name, k in kernel.items()},
        "kernels": {name: k[1] for name, k in kernel.items()},
        "gbps": gbps,
        "pct_copy": {name: 100.0 * gbps[name] / gbps["copy"] for name in steps},
        "speedup_vs_inductor": ms["inductor"] / ms["boost"],
        "speedup_vs_eager": ms["eager"] / ms["boost"],
        "compiled_speedup_vs_inductor": ms["inductor"] / ms["boost-compiled"],
        "max_rel_err_vs_reference": rel_err,
    }


def _table(results: list[dict]) -> str:
    head = (
        "| width | boost ms | boost GB/s | % copy | boost-compiled ms | inductor ms | eager ms "
        "| vs inductor | vs eager | copy GB/s | clone GB/s | max rel err "
        "| kernel ms (launches): boost | boost-compiled | inductor | eager |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        ms, gb = r["ms"], r["gbps"]
        lines.append(
            f"| {r['width']} | {ms['boost']:.4f} | {gb['boost']:.0f} | {r['pct_copy']['boost']:.0f}% "
            f"| {ms['boost-compiled']:.4f} | {ms['inductor']:.4f} | {ms['eager']:.4f} "
            f"| {r['speedup_vs_inductor']:.2f}x | {r['speedup_vs_eager']:.2f}x "
            f"| {gb['copy']:.0f} | {gb['clone']:.0f} | {r['max_rel_err_vs_reference']:.1e} | "
            + " | ".join(f"{r['kernel_ms'][n]:.4f} ({r['kernels'][n]:.0f})"
                         for n in ("boost", "boost-compiled", "inductor", "eager")) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("no CUDA device, skipped")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed, skipped")
        return 0
    from boost_compile.kernels import HAS_TRITON

    if not HAS_TRITON:
        print("boost_compile.kernels has no Triton kernels, skipped")
        return 0
    with compat.compile_settings(dynamo={"cache_size_limit": max(64, compat.dynamo_recompile_limit_value())}):
        print(f"# {torch.cuda.get_device_name()}, rows={args.rows}, dtype={args.dtype}")
        results = []
        for width in args.widths:
            results.append(run_width(width, args))
            r = results[-1]
            print(
                f"width {width}: boost {r['ms']['boost']:.4f} ms, inductor {r['ms']['inductor']:.4f} ms, "
                f"eager {r['ms']['eager']:.4f} ms",
                file=sys.stderr,
            )
        print(_table(results))
        if args.json:
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=2)
            print(f"wrote {args.json}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
