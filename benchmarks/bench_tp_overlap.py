"""btp with and without ``tp.overlap`` (passes/tp_overlap.py): TP=2 on CPU, two gloo processes.

    python benchmarks/bench_tp_overlap.py [--size 60m] [--seq 1024] [--batch 4] [--vocab 256] [--repeats 5]

Both variants are the CoLA model under btp with the boost backend (Inductor),
compiled first, then timed round-robin with a barrier around every step (one
intra-op thread per process, wall clock). Prints the median step of each, the
ratio against the baseline "btp" and what the pass moved per graph.
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
import torch.multiprocessing as mp

from boost_compile import _torch_compat as compat
from boost_compile.process_exit import exit_without_finalizing

VARIANTS = {"btp": False, "btp, tp.overlap": True}


def _worker(rank: int, store: str, args: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    import boost_compile as bc
    from boost_compile.backend import Recorder, compile_graph
    from boost_compile.bench import timing
    from boost_compile.config import BoostConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    with compat.compile_settings(dynamo={"cache_size_limit": 64}, **compat.NO_COMPILE_CACHES):  # the reports come from the compile
        _dense, preset = timing.preset_pair(args["size"])
        steps, records = {}, {}
        for label, overlap in VARIANTS.items():
            model = timing.build_model(preset, args["seq"], args["vocab"])
            tokens = timing.tokens_for(model, args["batch"], args["seq"])
            bc.parallelize_(model, (tokens,), dist.group.WORLD, plan="btp")
            records[label] = Recorder(keep_view=False)
            config = BoostConfig.from_options({"tp": {"overlap": overlap}})
            compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=records[label]), dynamic=False)
            step = timing.train_step(model, compiled, tokens, "wall")

            def synced(step=step) -> float:
                dist.barrier()
                t = step()
                dist.barrier()
                return t

            steps[label] = synced
        times = timing.round_robin(steps, args["repeats"], 2)
        if rank == 0:
            moved = [r.line() for g in records["btp, tp.overlap"].graphs for r in g.aten_reports if r.name == "tp_overlap"]
            with open(out, "w") as f:
                json.dump({"times": times, "moved": moved}, f)
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="60m")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = vars(p.parse_args())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    folder = tempfile.mkdtemp(prefix="bench_tp_overlap_")
    out = os.path.join(folder, "out.json")
    mp.spawn(_worker, args=(os.path.join(folder, "store"), args, out), nprocs=2, join=True)
    with open(out) as f:
        result = json.load(f)
    base = statistics.median(result["times"]["btp"])
    print(f"TP=2 on CPU (gloo, 1 thread per process), cola-{args['size']}, batch {args['batch']} x seq {args['seq']}, "
          f"vocab {args['vocab']}; median of {args['repeats']} round-robin steps after 2 warm-up steps")
    print()
    print("| variant | step (ms) | min-max (ms) | btp step / variant step |")
    print("|---|---:|---:|---:|")
    for label, ts in result["times"].items():
        med = statistics.median(ts)
        print(f"| {label} | {med * 1e3:.0f} | {min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f} | {base / med:.3f} |")
    print()
    for line in result["moved"]:
        print(f"- {line}")


if __name__ == "__main__":
    main()
