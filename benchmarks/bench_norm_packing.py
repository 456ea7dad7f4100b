"""What packing the online-RMSNorm statistic costs a bf16 model, measured and modelled.

    python benchmarks/bench_norm_packing.py [--repeats 30]

Under btp the norms before q/k/v and gate/up need a global statistic. boost
sends it in the same all-reduce as the down factors' partial output, so the
payload is fp32: [T, 3r + 1] and [T, 2r + 1] per layer. For a bf16 model the
alternative keeps the [T, r] payload in bf16 and sends the fp32 statistic in
a second, small all-reduce. Per layer and direction of forward:

    packed    2 all-reduces of fp32 T (5r + 2) * 4 bytes
    separate  2 of bf16 T 5r * 2 bytes + 2 of fp32 T * 4 bytes
    none      2 of bf16 T 5r * 2 bytes (no statistic: the lower bound)

Part 1 prices them with the alpha-beta model of ``boost-bench scale`` on the
A100 and H200 files for the BOOST.md shapes (seq 4096 x batch 4). Part 2 times
them for real: two gloo processes on this machine, the 60m shapes at
T = 4 x 1024, median of ``--repeats`` all-reduces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from boost_compile.costmodel.hardware import load_hardware
from boost_compile.costmodel.scale_model import SHAPES, allreduce_time
from boost_compile.process_exit import exit_without_finalizing

#: the ranks that the two normed groups carry per layer: q/k/v and gate/up, rank r each
GROUP_WIDTHS = (3, 2)


def variants(tokens: int, rank: int) -> dict[str, list[tuple[int, torch.dtype]]]:
    """variant -> the all-reduces of one layer's forward, as (elements, dtype)."""
    return {
        "packed (fp32, one collective per norm)": [(tokens * (w * rank + 1), torch.float32) for w in GROUP_WIDTHS],
        "separate (bf16 + fp32 statistic)": [
            *[(tokens * w * rank, torch.bfloat16) for w in GROUP_WIDTHS],
            *[(tokens, torch.float32) for _ in GROUP_WIDTHS],
        ],
        "no statistic (bf16, lower bound)": [(tokens * w * rank, torch.bfloat16) for w in GROUP_WIDTHS],
    }


def modelled(tp: int) -> str:
    lines = [
        f"Modelled (alpha-beta, `boost-bench scale` hardware files), forward, per layer, TP={tp}, seq 4096 x batch 4, bf16 model:",
        "",
        "| hardware | model | packed (us) | separate (us) | no statistic (us) | packed / separate |",
        "|---|---|---:|---:|---:|---:|",
    ]
    tokens = 4096 * 4
    for name in ("a100-80gb-nvlink", "h200"):
        hw = load_hardware(name)
        for shape in SHAPES:
            cost = {}
            for label, colls in variants(tokens, shape.rank).items():
                cost[label] = sum(allreduce_time(1, n * torch.empty(0, dtype=dt).element_size(), tp, hw) for n, dt in colls)
            packed, separate, bound = cost.values()
            lines.append(f"| {name} | {shape.name} | {packed * 1e6:.0f} | {separate * 1e6:.0f} | "
                         f"{bound * 1e6:.0f} | {packed / separate:.2f} |")
    return "\n".join(lines)


def _worker(rank: int, store: str, tokens: int, r: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    for label, colls in variants(tokens, r).items():
        tensors = [torch.randn(n, dtype=dt) for n, dt in colls]
        samples = []
        for i in range(repeats + 3):
            dist.barrier()
            start = time.perf_counter()
            for t in tensors:
                dist.all_reduce(t)
            if i >= 3:
                samples.append(time.perf_counter() - start)
        results[label] = statistics.median(samples)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


def measured(tokens: int, r: int, repeats: int) -> str:
    folder = tempfile.mkdtemp()
    out = os.path.join(folder, "out")
    mp.spawn(_worker, args=(os.path.join(folder, "store"), tokens, r, repeats, out), nprocs=2, join=True)
    with open(out) as f:
        results = json.load(f)
    base = results["packed (fp32, one collective per norm)"]
    lines = [
        f"Measured (gloo, 2 processes on this machine), forward, per layer, T = {tokens}, r = {r}, median of {repeats}:",
        "",
        "| variant | time (us) | vs packed |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {v * 1e6:.0f} | {v / base:.2f} |" for k, v in results.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tp", type=int, default=4, help="TP degree of the modelled table")
    args = parser.parse_args()
    print(modelled(args.tp))
    print()
    print(measured(4 * 1024, 128, args.repeats))


if __name__ == "__main__":
    main()
