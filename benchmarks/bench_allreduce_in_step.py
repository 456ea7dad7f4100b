"""What a gloo all-reduce costs inside a training step, against the ``cpu`` hardware file's price.

    python benchmarks/bench_allreduce_in_step.py [--rounds 12]

``boost-bench calibrate`` prices an all-reduce from the best of 12 isolated rounds
(both ranks idle and lined up by a barrier) and a straight-line fit over 4 KiB -
24 MiB. Inside a TP step the ranks arrive from a stretch of compute, each with its
own jitter. Two processes, one thread each, time the functional all-reduce of the
step's btp payloads ([T, r], [T, 2r], [T, 3r] at cola-60m, batch 4 x seq 1024,
fp32) three ways: isolated (best and median round) and after a GEMM segment on
both ranks (median of (segment + all-reduce) - segment). The baseline of every
ratio is the hardware file's fit (``scale_model.allreduce_time``).
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

from boost_compile.process_exit import exit_without_finalizing

WIDTHS = (128, 256, 384)  # r, 2r, 3r of cola-60m
TOKENS = 4096


def _worker(rank: int, store: str, rounds: int, out: str) -> None:
    from torch.distributed import _functional_collectives as fc  # noqa: PLC2701 - what compiled graphs issue

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    a, b = torch.randn(TOKENS, 512), torch.randn(512, 384)
    rows = []
    for width in WIDTHS:
        x = torch.randn(TOKENS, width)

        def all_reduce(x: torch.Tensor = x) -> None:
            fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD))

        def timed(fn, repeat: int = 1) -> float:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(repeat):
                fn()
            return (time.perf_counter() - t) / repeat

        all_reduce()
        iso, seg, both = [], [], []
        for _ in range(rounds):
            iso.append(timed(all_reduce))
            seg.append(timed(lambda: a @ b, 4))
            both.append(timed(lambda: (a @ b, all_reduce()), 4))
        med = statistics.median
        rows.append((width, min(iso), med(iso), med(both) - med(seg)))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()
    from boost_compile.costmodel import scale_model as sm
    from boost_compile.costmodel.hardware import load_hardware

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), args.rounds, out), nprocs=2)
        with open(out) as f:
            rows = json.load(f)
    hw = load_hardware("cpu")
    print("| payload | MB | cpu file's fit (ms) | isolated, best (x fit) | isolated, median (x fit) | after compute, median (x fit) |")
    print("|---|---:|---:|---:|---:|---:|")
    for width, best, median, in_step in rows:
        nbytes = TOKENS * width * 4
        fit = sm.allreduce_time(1, nbytes, 2, hw)
        print(f"| [T, {width}] | {nbytes / 1e6:.1f} | {fit * 1e3:.2f} | {best * 1e3:.2f} ({best / fit:.2f}) | "
              f"{median * 1e3:.2f} ({median / fit:.2f}) | {in_step * 1e3:.2f} ({in_step / fit:.2f}) |")


if __name__ == "__main__":
    main()
