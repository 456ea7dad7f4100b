"""``boost-bench tp``: TP=2 on CPU (two gloo processes), one run, three variants side by side.

    boost-bench tp [--size 60m] [--seq 1024] [--batch 4] [--repeats 5] [--inner inductor]

The dense model under the megatron plan, the CoLA model under PyTorch's DTensor
plan ("vanilla", what ``parallelize_module`` with Colwise/RowwiseParallel on each
factor gives) and the CoLA model under btp, all compiled with the boost backend.
The three are compiled first, then timed round-robin (one step each, in turn,
with a barrier around every step), so load on the machine hits them alike.
Collectives and bytes per step are read from the compiled graphs. The baseline
of the ratios is each other variant against btp. The default batch of 4
sequences is BOOST.md's (section 6); at batch 1 the per-collective latency of
gloo weighs more (btp issues about twice as many, smaller, collectives as
megatron).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
from typing import Any

import torch

from boost_compile.bench.formulas import analytic_table
from boost_compile.bench.results import Result, Target, bar_chart

VARIANTS = [
    ("dense, megatron", "dense", "megatron"),
    ("CoLA, vanilla (DTensor)", "cola", "vanilla"),
    ("CoLA, btp", "cola", "btp"),
]
BTP = "CoLA, btp"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="60m", help="tiny, or the suffix of the llama-/cola- presets")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256, help="override the presets' vocabulary (0 keeps it)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))


def _worker(rank: int, world: int, store: str, args: dict[str, Any], out_path: str) -> None:
    import torch.distributed as dist

    import boost_compile as bc
    from boost_compile.backend import Recorder, compile_graph
    from boost_compile.bench import timing
    from boost_compile.config import BoostConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch._dynamo.config.cache_size_limit = 64
    # the collective census runs inside the compile: a cache hit would skip it
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    presets = dict(zip(("dense", "cola"), timing.preset_pair(args["size"]), strict=True))
    steps, records, layers = {}, {}, {}
    for label, family, plan in VARIANTS:
        model = timing.build_model(presets[family], args["seq"], args["vocab"])
        tokens = timing.tokens_for(model, args["batch"], args["seq"])
        bc.parallelize_(model, (tokens,), dist.group.WORLD, plan=plan)
        rec = Recorder(keep_view=False)
        config = BoostConfig.from_options({"inner": args["inner"]})
        compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec), dynamic=False)
        step = timing.train_step(model, compiled, tokens, "wall")

        def synced(step=step) -> float:
            dist.barrier()
            t = step()
            dist.barrier()
            return t

        steps[label], records[label], layers[label] = synced, rec, model.config.n_layers
    times = timing.round_robin(steps, args["repeats"], args["warmup"])
    results = {}
    for label, family, plan in VARIANTS:
        census = [r for g in records[label].graphs for r in g.aten_reports if r.name == "collective_census"]
        colls = {k: [c for r in census if r.details["graph"] == k for c in r.details["collectives"]] for k in ("forward", "backward")}
        results[label] = {
            "plan": plan,
            "preset": presets[family],
            "step_s": statistics.median(times[label]),
            "times_s": times[label],
            "tokens": args["batch"] * args["seq"],
            "layers": layers[label],
            "collectives": {k: len(v) for k, v in colls.items()},
            "bytes": {k: sum(c["bytes"] or 0 for c in v) for k, v in colls.items()},
        }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> Result:
    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="boost_bench_tp_")
    store, out = os.path.join(folder, "store"), os.path.join(folder, "results.json")
    params = {k: getattr(args, k) for k in ("size", "seq", "batch", "vocab", "repeats", "warmup", "inner")}
    mp.spawn(_worker, args=(2, store, params, out), nprocs=2, join=True)
    with open(out) as f:
        results = json.load(f)
    btp = results[BTP]
    btp_total = btp["bytes"]["forward"] + btp["bytes"]["backward"]
    if not all(r["bytes"]["forward"] for r in results.values()):
        raise RuntimeError("a variant's compiled graphs recorded no collective: the census did not run")
    lines = [
        f"TP=2 on CPU (gloo, one thread per process), {results['dense, megatron']['preset']} vs {btp['preset']}, "
        f"batch {args.batch} x seq {args.seq}, vocab {args.vocab}, boost with inner {args.inner}; forward+backward, "
        f"variants round-robin, wall clock, median of {args.repeats} steps after {args.warmup} warm-up steps.",
        "",
        "| variant | step (ms) | min-max (ms) | tokens/s | collectives fwd/bwd | bytes/step fwd | bytes/step bwd | btp speed-up | btp bytes / variant |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        total = r["bytes"]["forward"] + r["bytes"]["backward"]
        r["btp_speedup"] = r["step_s"] / btp["step_s"]
        r["btp_bytes_ratio"] = btp_total / total
        lo, hi = min(r["times_s"]) * 1e3, max(r["times_s"]) * 1e3
        lines.append(
            f"| {label} | {r['step_s'] * 1e3:.0f} | {lo:.0f}-{hi:.0f} | {r['tokens'] / r['step_s']:,.0f} | "
            f"{r['collectives']['forward']}/{r['collectives']['backward']} | {r['bytes']['forward']:,} | "
            f"{r['bytes']['backward']:,} | {r['btp_speedup']:.2f}x | {r['btp_bytes_ratio']:.3f} |"
        )
    dense, vanilla = results["dense, megatron"], results["CoLA, vanilla (DTensor)"]
    # the targets are for the 60m shapes at sequence length 1024
    targets = [] if (args.size, args.seq) != ("60m", 1024) else [
        Target("btp speed-up over CoLA vanilla", vanilla["btp_speedup"], 1.4, True),
        Target("btp speed-up over dense megatron", dense["btp_speedup"], 1.5, True),
        Target("btp bytes / dense megatron bytes", dense["btp_bytes_ratio"], 0.9, False),
        Target("btp bytes / vanilla bytes", vanilla["btp_bytes_ratio"], 0.2, False),
    ]
    table = "\n".join(lines) + "\n\n" + analytic_table() + "\n"
    return Result("tp", "Tensor parallelism, TP=2 on CPU (gloo)", table, {"params": params, "variants": results}, targets)


def chart(result: Result, path: str) -> None:
    variants = result.data["variants"]
    labels = list(variants)
    bar_chart(
        path,
        "TP=2 on CPU: variant / btp (above 1: btp is faster, or sends less)",
        labels,
        {
            "step time / btp": [v["btp_speedup"] for v in variants.values()],
            "bytes / btp": [1 / v["btp_bytes_ratio"] for v in variants.values()],
        },
        "ratio to btp",
        ref=1.0,
    )
