"""Activation checkpointing: saved bytes against step time for none / lowrank / full / budget.

    python benchmarks/bench_memory.py [--preset cola-60m] [--batch 2] [--seq 256] [--repeats 7]
                                      [--threads 0 --clock wall]

One model (the preset's shapes, vocabulary overridden to 256 by default so the
head stays small on CPU) is compiled once per mode with backend="boost"
(``--inner``, Inductor by default). The saved bytes come from the partitioned
graphs themselves (the tensors the forward hands to the backward, parameters and
inputs excluded, each storage counted once), so they are exact and do not depend
on the machine; "per layer" is the mean over the decoder blocks, "total" adds
what the embedding, head and loss keep. Step time is one forward+backward,
timed round-robin over the modes (so load on the machine hits them alike),
``--repeats`` times; the table shows the fastest and the median step, and the
ratios use the fastest. By default the step runs on one thread and is timed
with that thread's CPU clock: the step's own compute (all of it runs on the
calling thread), which other jobs on a shared machine barely disturb. Wall
clock with the default thread count (``--threads 0 --clock wall``) is what a
quiet machine should be timed with; on a loaded 2-core machine the same step
spread over 1.2-7.1 s. "MB saved per ms" is (saved total of none - of mode) /
(step of mode - step of none); "inf" when the mode is not measurably slower.
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
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.models import Llama, LlamaConfig
from boost_compile.passes.checkpoint import activation_bytes

MODES = ("none", "lowrank", "full", "budget")
#: wall: elapsed time; thread: CPU time of the calling thread, which with
#: --threads 1 is the step's own compute, unaffected by other jobs on a shared machine
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def build(args: argparse.Namespace) -> Llama:
    overrides: dict[str, Any] = {"max_seq_len": max(args.seq, LlamaConfig.preset(args.preset).max_seq_len)}
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset(args.preset, **overrides))


def compile_mode(model: Llama, mode: str, args: argparse.Namespace, tokens: torch.Tensor) -> tuple[Callable[[], float], dict[str, int]]:
    """Compile ``model`` with ``checkpoint=mode``; returns a timed step and the saved bytes per block."""
    rec = Recorder(keep_view=False)
    config = BoostConfig.from_options({"inner": args.inner, "checkpoint": mode, "checkpoint_budget": args.budget})
    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec), fullgraph=True)

    clock = CLOCKS[args.clock]

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        start = clock()
        compiled(tokens, tokens).backward()
        return clock() - start

    # the first step compiles; no cache, so the partitioner runs and reports
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        step()
    (graph,) = rec.graphs
    (report,) = graph.partition_reports
    return step, activation_bytes(report)


def fmt_mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cola-60m")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256, help="override the preset's vocabulary (0 keeps it)")
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--budget", type=float, default=0.5, help='checkpoint_budget of "budget"')
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0 keeps the default)")
    parser.add_argument("--clock", default="thread", choices=list(CLOCKS), help="thread: CPU time, needs --threads 1")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        parser.error("--clock thread measures one thread: add --threads 1")
    modes = ["none"] + [m for m in args.modes if m != "none"]

    base = build(args)
    cfg = base.config
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    steps, saved, compile_s = {}, {}, {}
    for mode in modes:
        start = time.perf_counter()
        steps[mode], saved[mode] = compile_mode(copy.deepcopy(base), mode, args, tokens)
        compile_s[mode] = time.perf_counter() - start
        for _ in range(args.warmup):
            steps[mode]()
        print(f"compiled {mode} in {compile_s[mode]:.0f} s", flush=True)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            times[mode].append(steps[mode]())
    best = {m: min(t) for m, t in times.items()}
    med = {m: statistics.median(t) for m, t in times.items()}

    def layer_bytes(mode: str) -> float:
        blocks = [b for b in saved[mode] if b != "-"]
        return sum(saved[mode][b] for b in blocks) / max(1, len(blocks))

    total = {m: sum(saved[m].values()) for m in modes}
    per_layer = {m: layer_bytes(m) for m in modes}
    print()
    print(
        f"### {args.preset} shapes (d {cfg.dim}, {cfg.n_layers} layers, r {cfg.rank_attn}, d_ff {cfg.ffn_dim}, "
        f"vocab {cfg.vocab_size}), batch {args.batch} x seq {args.seq}, fp32, {args.inner}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock, forward+backward, {args.repeats} repeats"
    )
    print()
    print(
        "| mode | saved / layer (MB) | vs none | saved total (MB) | vs none "
        "| step, fastest (ms) | median (ms) | vs none | MB saved per ms extra |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in modes:
        extra_ms = (best[m] - best["none"]) * 1e3
        freed = (total["none"] - total[m]) / 2**20
        if m == "none":
            rate = "-"
        elif extra_ms <= 0:
            rate = "inf"
        else:
            rate = f"{freed / extra_ms:.3f}"
        print(
            f"| {m if m != 'budget' else f'budget {args.budget:g}'} | {fmt_mb(per_layer[m])} "
            f"| {per_layer[m] / per_layer['none']:.3f} | {fmt_mb(total[m])} | {total[m] / total['none']:.3f} "
            f"| {best[m] * 1e3:.1f} | {med[m] * 1e3:.1f} | {best[m] / best['none']:.3f} | {rate} |"
        )
    print()
    print("step times (ms), every repeat: " + "; ".join(f"{m} {', '.join(f'{t * 1e3:.0f}' for t in times[m])}" for m in modes))
    print("saved bytes per block: " + "; ".join(f"{m} {saved[m]}" for m in modes))


if __name__ == "__main__":
    main()
