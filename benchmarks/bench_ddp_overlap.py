"""When DDP's gradient all-reduces start, against the backward: the whole model as one graph
beside per-block compilation, both with low-rank checkpointing (DP2 on gloo).

Usage:
    python benchmarks/bench_ddp_overlap.py [--layers 4] [--batch 2] [--seq 256] [--bucket-mb 4]
                                           [--checkpoint lowrank] [--inner inductor]

Two processes (gloo, one thread each) train the cola-60m-width reference model as boost-train
does: ``backend="boost"`` with ``checkpoint``, wrapped in DDP (``bucket_cap_mb``), Dynamo's
DDP optimizer off (``optimize_ddp=False``: no graph cut at a bucket). ``model``: the whole model
compiled as one graph; ``block``: ``compile_blocks``. Rank 0 profiles its third step
(``torch.profiler``, CPU) and reports, in ms from the step's start: the backward's span, each
compiled backward (``CompiledFunctionBackward``: one per block graph run, the top block first),
and when each gradient all-reduce was issued. The first all-reduce issued before the backward
of the bottom block (``layers.0``) starts is the overlap; after the whole backward, none.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    from boost_compile import _torch_compat as compat
    from boost_compile.blocks import compile_blocks
    from boost_compile.models import Llama, LlamaConfig
    from boost_compile.process_exit import exit_without_finalizing

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("cola-60m", n_layers=args.layers))
    options = {"inner": args.inner, "checkpoint": args.checkpoint}
    if args.unit == "block":
        compile_blocks(model, options)
        compiled = model
    else:
        compiled = torch.compile(model, backend="boost", options=options)
    ddp = DDP(compiled, bucket_cap_mb=args.bucket_mb, broadcast_buffers=False)
    gen = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
    rows = None
    with compat.compile_settings(dynamo={"optimize_ddp": False}):
        for step in range(3):
            if step == 2 and rank == 0:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    with torch.profiler.record_function("## step"):
                        ddp(tokens, targets).backward()
                rows = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
            else:
                ddp(tokens, targets).backward()
            ddp.zero_grad(set_to_none=True)
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()
    exit_without_finalizing(0)


def _summary(rows: list, unit: str) -> dict:
    start = min(s for name, s, _e in rows if name == "## step")
    ms = lambda t: (t - start) / 1e3  # noqa: E731  (profiler times are in us)
    backward = [(ms(s), ms(e)) for name, s, e in rows if name.startswith("CompiledFunctionBackward")]
    backward.sort()
    autograd = [(ms(s), ms(e)) for name, s, e in rows if name.startswith("autograd::engine::evaluate_function")]
    reduces = sorted({round(ms(s), 3) for name, s, _e in rows
                      if name in ("c10d::allreduce_", "gloo:all_reduce") or name.startswith("record_param_comms")})
    bottom = backward[-1][0] if backward else None  # the last compiled backward to start: layers.0 (or the whole)
    return {
        "unit": unit,
        "backward_ms": [min(s for s, _e in autograd), max(e for _s, e in autograd)] if autograd else None,
        "compiled_backwards_ms": backward,
        "allreduce_issued_ms": reduces,
        "bottom_block_backward_starts_ms": bottom,
        "first_allreduce_before_bottom_block": bool(reduces and bottom is not None and reduces[0] < bottom),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--checkpoint", default="lowrank", choices=["none", "lowrank", "full"])
    parser.add_argument("--inner", default="inductor")
    parser.add_argument("--units", nargs="+", default=["model", "block"], choices=["model", "block"])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["OMP_NUM_THREADS"] = "1"
    results = []
    for unit in args.units:
        args.unit = unit
        out = tempfile.mktemp(suffix=".json")
        mp.spawn(_worker, args=(args, _free_port(), out), nprocs=2, join=True)
        results.append(_summary(json.loads(Path(out).read_text()), unit))
    print(f"DP2 on gloo, cola-60m width, {args.layers} layers, batch {args.batch} x {args.seq} per rank, "
          f"checkpoint={args.checkpoint}, inner {args.inner}, bucket {args.bucket_mb:g} MB; rank 0's third step, "
          "ms from its start\n")
    print("| compile | backward | compiled backwards (start-end) | gradient all-reduces issued at "
          "| bottom block's backward starts | first all-reduce before it |")
    print("|---|---|---|---|---:|---|")
    for r in results:
        bw = r["backward_ms"]
        pieces = ", ".join(f"{s:.0f}-{e:.0f}" for s, e in r["compiled_backwards_ms"])
        issued = ", ".join(f"{t:.0f}" for t in r["allreduce_issued_ms"])
        print(f"| {r['unit']} | {bw[0]:.0f} -> {bw[1]:.0f} | {pieces} | {issued} | "
              f"{r['bottom_block_backward_starts_ms']:.0f} | {'yes' if r['first_allreduce_before_bottom_block'] else 'no'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
