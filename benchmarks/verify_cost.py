"""What ``verify`` adds to a cold first step: per-block compile of cola-60m-wide models.

Usage:
    python benchmarks/verify_cost.py [--layers 2 32] [--repeats 2] [--inner inductor] [--tp 1] [--json PATH]

Each job is a fresh process with an empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR``, a new
folder per job) and one thread: it builds ``cola-60m`` with N layers, compiles it block by block
(``compile_blocks``, boost-train's ``passes.unit=block``) with ``verify`` off or on, and times the
first forward+backward (batch 2 x 128: capture, passes, verify's runs, Inductor's compile, the
step), then the median of five steady steps. Jobs with verify off and on alternate, so a slower
minute of a shared machine falls on both. Printed: each job, then per depth the median first
step of each and the ratio on / off (the baseline: verify off, the default), and the seconds
spent inside verify itself (its reference runs and the check of each pass, timed as they run;
not the check of the finished compile, whose run of the compiled graph is also where the backward
is compiled, paid by the first step either way) against the first step without it: the steadier
figure where the machine is shared.

``--tp 2``: the same on two gloo processes, the model sharded with btp (``parallelize_``) before
the blocks are compiled; rank 0's times (verify then gathers the shards and checks each rank's
program with both ranks, ``boost_compile/verify_tp.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def job(layers: int, verify: bool, inner: str, tp: int = 1) -> dict:
    """One cold first step in this process (called in a fresh child); with ``tp`` > 1, on that many
    gloo processes, rank 0's figures."""
    if tp > 1:
        import torch.multiprocessing as mp

        folder = tempfile.mkdtemp(prefix="verify-cost-tp-")
        mp.spawn(_tp_job, args=(tp, folder, layers, verify, inner), nprocs=tp, join=True)
        with open(os.path.join(folder, "rank0.json")) as f:
            return json.load(f)
    return _timed_steps(layers, verify, inner, None)


def _tp_job(rank: int, world: int, folder: str, layers: int, verify: bool, inner: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    row = _timed_steps(layers, verify, inner, dist.group.WORLD)
    if rank == 0:
        with open(os.path.join(folder, "rank0.json"), "w") as f:
            json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def _timed_steps(layers: int, verify: bool, inner: str, group) -> dict:
    import torch

    torch.set_num_threads(1)
    import boost_compile as bc

    spent = _time_verifier()
    torch.manual_seed(0)
    model = bc.models.Llama(bc.models.LlamaConfig.preset("cola-60m", n_layers=layers))
    tokens = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    if group is not None:
        bc.parallelize_(model, (tokens,), group, plan="btp")
    bc.compile_blocks(model, {"inner": inner, "verify": verify})
    t0 = time.perf_counter()
    model(tokens, targets=tokens).backward()
    first = time.perf_counter() - t0
    steps = []
    for _ in range(5):
        t0 = time.perf_counter()
        model(tokens, targets=tokens).backward()
        steps.append(time.perf_counter() - t0)
    return {"layers": layers, "verify": verify, "first_step_s": first, "steady_s": statistics.median(steps),
            "verify_s": spent[0]}


def _time_verifier() -> list[float]:
    """Seconds spent in verify's own work (its reference runs and checks), summed as they happen."""
    from boost_compile import verify

    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    # not check_compiled: its run of the compiled graph is where AOT autograd compiles the
    # backward, which the first step pays with or without verify
    for name in ("__init__", "check_pass"):
        setattr(verify.Verifier, name, timed(getattr(verify.Verifier, name)))
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--inner", default="inductor")
    parser.add_argument("--tp", type=int, default=1, help="gloo processes, the model sharded with btp (1: one process)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--job", nargs=2, metavar=("LAYERS", "VERIFY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(job(int(args.job[0]), args.job[1] == "1", args.inner, args.tp)))
        return 0
    rows = []
    for layers in args.layers:
        for _ in range(args.repeats):
            for verify in (False, True):
                env = {**os.environ, "OMP_NUM_THREADS": "1",
                       "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="verify-cost-")}
                out = subprocess.run([sys.executable, __file__, "--inner", args.inner, "--tp", str(args.tp), "--job", str(layers),
                                      "1" if verify else "0"], capture_output=True, text=True, env=env, timeout=1800)
                if out.returncode != 0:
                    raise SystemExit(out.stderr[-3000:])
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"layers {layers:3d}  verify {'on ' if verify else 'off'}  first step {row['first_step_s']:7.2f} s"
                      f"  of which verify {row['verify_s']:6.2f} s  steady {row['steady_s'] * 1e3:7.1f} ms", flush=True)
    where = f", TP{args.tp} btp on gloo (rank 0)" if args.tp > 1 else ""
    print(f"\ncold first step, per-block compile, inner={args.inner}{where} (median of {args.repeats}):")
    print("| layers | verify off (s) | verify on (s) | on / off | verify's own work (s) | its share of off |")
    print("|---:|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        off = statistics.median(r["first_step_s"] for r in rows if r["layers"] == layers and not r["verify"])
        on = statistics.median(r["first_step_s"] for r in rows if r["layers"] == layers and r["verify"])
        own = statistics.median(r["verify_s"] for r in rows if r["layers"] == layers and r["verify"])
        print(f"| {layers} | {off:.2f} | {on:.2f} | {on / off:.3f} | {own:.2f} | {own / off:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
