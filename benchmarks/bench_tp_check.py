"""What the sharding-consistency check costs: tp_localize against the compile it is part of.

Usage:
    python benchmarks/bench_tp_check.py [--size 60m] [--seq 256] [--batch 1] [--inner inductor]

Two gloo processes shard a CoLA model of the given paper shapes with btp and
compile it with the boost backend. Rank 0 prints, per stage, the wall time and
its ratio to the baseline, the first compiled step (Dynamo capture, the boost
passes, the inner compiler, one forward and backward):

    parallelize_         analysis capture, sharding, and the check's own dry-run capture
    tp_localize          the pass inside the first compile (placement, rewrites, shape check)
    first compiled step  the baseline
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from boost_compile.process_exit import exit_without_finalizing


def _worker(rank: int, store: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    import boost_compile as bc
    from boost_compile.backend import compile_graph
    from boost_compile.config import BoostConfig
    from boost_compile.models import Llama, LlamaConfig
    from boost_compile.passes import tp_localize

    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset(f"cola-{args.size}", max_seq_len=args.seq))
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    times: dict[str, float] = {}

    start = time.perf_counter()
    report = bc.parallelize_(model, (tokens,), dist.group.WORLD, plan="btp")
    times["parallelize_"] = time.perf_counter() - start

    run = tp_localize.TPLocalizePass.run

    def timed_run(self, ctx):
        t0 = time.perf_counter()
        try:
            return run(self, ctx)
        finally:
            times["tp_localize"] = time.perf_counter() - t0

    tp_localize.TPLocalizePass.run = timed_run
    config = BoostConfig.from_options({"inner": args.inner})
    step = torch.compile(model, backend=functools.partial(compile_graph, config=config))
    start = time.perf_counter()
    step(tokens, tokens).backward()
    times["first compiled step"] = time.perf_counter() - start
    tp_localize.TPLocalizePass.run = run
    if rank == 0:
        base = times["first compiled step"]
        print(f"cola-{args.size}, seq {args.seq}, batch {args.batch}, TP=2 gloo, inner={args.inner}; "
              f"{report.check.details['summary']}")
        print("| stage | seconds | / first compiled step |")
        print("|---|---:|---:|")
        for name in ("parallelize_", "tp_localize", "first compiled step"):
            print(f"| {name} | {times[name]:.2f} | {times[name] / base:.3f} |")
        sys.stdout.flush()
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="60m")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(os.path.join(folder, "store"), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
