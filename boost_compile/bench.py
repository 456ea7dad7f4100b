"""``boost-bench``: side-by-side benchmarks with ratios against named baselines.

    boost-bench tp [--preset 60m] [--seq 1024] [--steps 5] [--inner inductor]

``tp``: two gloo processes on CPU (TP=2), one run, three variants in turn:
the dense model under the megatron plan, the CoLA model under PyTorch's DTensor
plan ("vanilla"), and the CoLA model under btp. Prints step time, tokens/s,
collectives and bytes per step (read from the compiled graphs), the ratios, and
an analytic table of bytes per layer for the 1B-13B shapes beside BOOST.md's
published figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: (name, d, d_ff, layers, heads): the Llama shapes of BOOST.md section 6; CoLA rank r = d/4.
PAPER_SHAPES = [
    ("1B", 2048, 5461, 24, 32),
    ("3B", 3200, 8640, 26, 32),
    ("7B", 4096, 11008, 32, 32),
    ("13B", 5120, 13824, 40, 40),
]
#: BOOST.md section 6: 7B communication per layer (seq 4096, batch 4, bf16), GB.
PUBLISHED_7B_GB = {"full-rank TP": 0.25, "vanilla low-rank TP": 1.32, "btp": 0.22}


@dataclass
class LayerBytes:
    full_rank: int
    vanilla: int
    btp: int


def bytes_per_layer(tokens: int, d: int, d_ff: int, rank: int, elem: int = 2) -> LayerBytes:
    """Forward all-reduce payload of one layer, per BOOST.md section 2."""
    return LayerBytes(
        full_rank=2 * tokens * d * elem,
        vanilla=tokens * (5 * d + 2 * d_ff) * elem,
        btp=tokens * 7 * rank * elem,
    )


def ring_bytes_per_rank(payload: int, world: int) -> int:
    """What each rank sends in a ring all-reduce of ``payload`` bytes."""
    return 2 * (world - 1) * payload // world


def analytic_table(seq: int = 4096, batch: int = 4) -> str:
    tokens = seq * batch
    lines = [
        f"Forward all-reduce payload per layer, seq {seq} x batch {batch}, bf16 (GiB; per-rank ring traffic in brackets)",
        "",
        "| model | TP | full-rank TP | vanilla low-rank | btp | btp / full | btp / vanilla |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    gib = 1024**3
    for name, d, d_ff, _layers, _heads in PAPER_SHAPES:
        b = bytes_per_layer(tokens, d, d_ff, d // 4)
        for world in (2, 4, 8):
            cells = [f"{x / gib:.3f} [{ring_bytes_per_rank(x, world) / gib:.3f}]" for x in (b.full_rank, b.vanilla, b.btp)]
            lines.append(
                f"| {name} | {world} | {' | '.join(cells)} | {b.btp / b.full_rank:.3f} | {b.btp / b.vanilla:.3f} |"
            )
    b7 = bytes_per_layer(tokens, 4096, 11008, 1024)
    lines += [
        "",
        "7B beside BOOST.md (GiB per layer): "
        + ", ".join(
            f"{k} {v:.3f} (published ~{PUBLISHED_7B_GB[k]})"
            for k, v in zip(PUBLISHED_7B_GB, (b7.full_rank / gib, b7.vanilla / gib, b7.btp / gib), strict=True)
        ),
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- tp: the workers


TP_VARIANTS = [
    ("dense, megatron", "llama", "megatron"),
    ("CoLA, vanilla (DTensor)", "cola", "vanilla"),
    ("CoLA, btp", "cola", "btp"),
]


def _tp_worker(rank: int, world: int, store: str, args: dict[str, Any], out_path: str) -> None:
    import torch.distributed as dist

    import boost_compile as bc
    from boost_compile.backend import Recorder, compile_graph
    from boost_compile.config import BoostConfig
    from boost_compile.models import Llama, LlamaConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch._dynamo.config.cache_size_limit = 64
    # the collective census runs inside the compile: a cache hit would skip it
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    results = {}
    for label, family, plan in TP_VARIANTS:
        torch.manual_seed(0)
        cfg = LlamaConfig.preset(f"{family}-{args['preset']}", vocab_size=args["vocab"], max_seq_len=args["seq"])
        model = Llama(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq"]), generator=torch.Generator().manual_seed(1))
        bc.parallelize_(model, (tokens,), dist.group.WORLD, plan=plan)
        rec = Recorder(keep_view=False)
        config = BoostConfig.from_options({"inner": args["inner"]})
        compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec), dynamic=False)
        times = []
        for step in range(args["warmup"] + args["steps"]):
            for p in model.parameters():
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            compiled(tokens, tokens).backward()
            dist.barrier()
            if step >= args["warmup"]:
                times.append(time.perf_counter() - start)
        census = [r for g in rec.graphs for r in g.aten_reports if r.name == "collective_census"]
        colls = {k: [c for r in census if r.details["graph"] == k for c in r.details["collectives"]] for k in ("forward", "backward")}
        results[label] = {
            "step_s": statistics.median(times),
            "tokens": args["batch"] * args["seq"],
            "layers": cfg.n_layers,
            "collectives": {k: len(v) for k, v in colls.items()},
            "bytes": {k: sum(c["bytes"] or 0 for c in v) for k, v in colls.items()},
        }
        torch._dynamo.reset()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run_tp(args: argparse.Namespace) -> str:
    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="boost_bench_tp_")
    store, out = os.path.join(folder, "store"), os.path.join(folder, "results.json")
    params = {k: getattr(args, k) for k in ("preset", "seq", "batch", "vocab", "steps", "warmup", "inner")}
    mp.spawn(_tp_worker, args=(2, store, params, out), nprocs=2, join=True)
    with open(out) as f:
        results = json.load(f)
    btp = results["CoLA, btp"]
    lines = [
        f"TP=2 on CPU (gloo), preset {args.preset}, batch {args.batch} x seq {args.seq}, vocab {args.vocab}, "
        f"inner {args.inner}, forward+backward, median of {args.steps} steps",
        "",
        "| variant | step (ms) | tokens/s | collectives fwd/bwd | bytes/step fwd | bytes/step bwd | btp speed-up | btp bytes / variant |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        total = r["bytes"]["forward"] + r["bytes"]["backward"]
        btp_total = btp["bytes"]["forward"] + btp["bytes"]["backward"]
        lines.append(
            f"| {label} | {r['step_s'] * 1e3:.0f} | {r['tokens'] / r['step_s']:,.0f} | "
            f"{r['collectives']['forward']}/{r['collectives']['backward']} | {r['bytes']['forward']:,} | "
            f"{r['bytes']['backward']:,} | {r['step_s'] / btp['step_s']:.2f}x | {btp_total / total:.3f} |"
        )
    return "\n".join(lines) + "\n\n" + analytic_table() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="boost-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tp = sub.add_parser("tp", help="TP=2 on CPU: dense megatron vs CoLA vanilla vs CoLA btp")
    tp.add_argument("--preset", default="60m", help="size suffix of the llama-/cola- presets")
    tp.add_argument("--seq", type=int, default=1024)
    tp.add_argument("--batch", type=int, default=1)
    tp.add_argument("--vocab", type=int, default=256)
    tp.add_argument("--steps", type=int, default=5)
    tp.add_argument("--warmup", type=int, default=2)
    tp.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    sub.add_parser("tp-analytic", help="only the analytic bytes-per-layer table")
    args = parser.parse_args(argv)
    if args.command == "tp":
        print(run_tp(args))
    else:
        print(analytic_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
