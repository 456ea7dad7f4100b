"""Single-device step time: plain Inductor against boost, pass by pass (CPU or GPU).

    python benchmarks/bench_single.py [--presets tiny cola-60m] [--repeats 5] [--device cpu]

For each preset, every variant compiles its own copy of one model (same seed),
then the variants are timed round-robin (one forward+backward step each, in
turn, ``--repeats`` times) so that load on the machine hits them alike; the
table shows medians and the ratio ``inductor / variant`` (above 1.0: faster
than plain Inductor). It also prints the GEMMs per block before and after
grouping, and what concatenating a group's weights in the graph costs next to
its grouped GEMM.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from boost_compile.backend import Recorder, boost_backend, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.models import Llama, LlamaConfig

GEMMS = ("linear", "matmul", "mm", "addmm")


def variants(device: str) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """short name -> (label, boost options); None options: plain Inductor."""
    norm_devices = [device]
    return {
        "inductor": ("inductor", None),
        "off": ("boost, all passes off", {"group": {"enabled": False}, "rmsnorm": {"enabled": False}, "op_census": {"enabled": False}}),
        "group": ("boost, group only", {"rmsnorm": {"enabled": False}}),
        "rmsnorm": ("boost, rmsnorm only", {"group": {"enabled": False}, "rmsnorm": {"devices": norm_devices}}),
        "group+rmsnorm": ("boost, group + rmsnorm", {"rmsnorm": {"devices": norm_devices}}),
        "defaults": ("boost, defaults", {}),
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(preset: str, device: str, dtype: torch.dtype, vocab: int | None, seq: int) -> Llama:
    overrides: dict[str, Any] = {"max_seq_len": max(seq, LlamaConfig.preset(preset).max_seq_len)}
    if vocab:
        overrides["vocab_size"] = vocab
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset(preset, **overrides)).to(device=device, dtype=dtype)


def compile_variant(model: Llama, options: dict[str, Any] | None) -> Callable[..., Any]:
    if options is None:
        return torch.compile(model, backend="inductor")
    # the function, not the name: works from a source tree without the entry point
    return torch.compile(model, backend=boost_backend, options=options)


def step_fn(model: Llama, compiled: Callable[..., Any], tokens: torch.Tensor, device: str) -> Callable[[], float]:
    def step() -> float:
        for p in model.parameters():
            p.grad = None
        _sync(device)
        start = time.perf_counter()
        compiled(tokens, tokens).backward()
        _sync(device)
        return time.perf_counter() - start

    return step


def gemms_per_block(model: Llama, tokens: torch.Tensor) -> tuple[float, float]:
    rec = Recorder()
    backend = functools.partial(compile_graph, config=BoostConfig(inner="eager"), recorder=rec)
    torch.compile(model, backend=backend)(tokens)
    (graph,) = rec.graphs
    count = {s.name: sum(v for k, v in s.op_counts.items() if k in GEMMS) for s in graph.stages}
    n = model.config.n_layers
    head = 1
    return (count["captured"] - head) / n, (count["group_linears"] - head) / n


def concat_cost(model: Llama, tokens_per_step: int, device: str, dtype: torch.dtype, repeats: int = 50) -> list[tuple[str, float, float]]:
    """(group, cat time, grouped GEMM time) in microseconds for the first block's groups."""
    block = model.layers[0]
    groups = {
        "q/k/v": [block.attention.q_proj, block.attention.k_proj, block.attention.v_proj],
        "gate/up": [block.mlp.gate_proj, block.mlp.up_proj],
    }
    rows = []
    x = torch.randn(tokens_per_step, model.config.dim, device=device, dtype=dtype)
    for name, mods in groups.items():
        weights = [(m.down.weight if hasattr(m, "down") else m.weight).detach() for m in mods]
        w = torch.cat(weights)
        cat_t = _time(lambda weights=weights: torch.cat(weights), device, repeats)
        gemm_t = _time(lambda w=w: torch.nn.functional.linear(x, w), device, repeats)
        rows.append((name, cat_t * 1e6, gemm_t * 1e6))
    return rows


def _time(fn: Callable[[], Any], device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_preset(preset: str, args: argparse.Namespace) -> str:
    dtype = getattr(torch, args.dtype)
    base = build(preset, args.device, dtype, args.vocab, args.seq)
    cfg = base.config
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=args.device)
    steps = {}
    table = variants(args.device)
    for key in args.variants:
        name, options = table[key]
        model = copy.deepcopy(base)
        compiled = compile_variant(model, options)
        step = step_fn(model, compiled, tokens, args.device)
        for _ in range(args.warmup):
            step()
        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(step())
    med = {name: statistics.median(t) for name, t in times.items()}
    before, after = gemms_per_block(copy.deepcopy(base), tokens)
    lines = [
        f"### {preset} (d {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}), batch {args.batch} x seq {args.seq}, "
        f"{args.device} {args.dtype}, forward+backward, median of {args.repeats}",
        "",
        "| variant | step (ms) | min-max (ms) | inductor / variant |",
        "|---|---:|---:|---:|",
    ]
    for name, t in med.items():
        lo, hi = min(times[name]) * 1e3, max(times[name]) * 1e3
        lines.append(f"| {name} | {t * 1e3:.1f} | {lo:.1f}-{hi:.1f} | {med['inductor'] / t:.3f}x |")
    lines += ["", f"GEMMs per block: {before:g} before grouping, {after:g} after.", ""]
    lines += ["| group (block 0) | cat of weights (us) | grouped GEMM fwd (us) | cat / GEMM |", "|---|---:|---:|---:|"]
    for name, cat_us, gemm_us in concat_cost(base, args.batch * args.seq, args.device, dtype):
        lines.append(f"| {name} | {cat_us:.1f} | {gemm_us:.1f} | {cat_us / gemm_us:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "cola-60m"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256, help="override the preset's vocabulary (0 keeps it)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--variants", nargs="+", default=list(variants("cpu")), choices=list(variants("cpu")),
        help="which variants to run (inductor is the baseline and always runs first)",
    )
    args = parser.parse_args(argv)
    args.variants = ["inductor"] + [v for v in args.variants if v != "inductor"]
    torch._dynamo.config.cache_size_limit = 64
    for preset in args.presets:
        print(run_preset(preset, args), flush=True)


if __name__ == "__main__":
    main()
