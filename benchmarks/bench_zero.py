"""Memory per rank with the optimizer state sharded over dp (``parallel.zero=1``) against DDP.

    python benchmarks/bench_zero.py [--model cola-60m] [--dp 2] [--steps 2]

Runs ``boost-train`` twice under torchrun on this machine (gloo, CPU), with the
same model, batch and seed: ``parallel.dp=N`` (DDP, every rank keeps the whole
AdamW state) and ``parallel.dp=N parallel.zero=1`` (ZeRO stage 1). Each run
counts, after its first optimizer step, the bytes of the parameters, gradients
and optimizer state on every rank and reports the largest rank's
(``state_mib`` in summary.json); the table gives them with the ratio to DDP.
The losses of the two runs are printed too: sharding must not change them.
DDP's own gradient buckets (a second copy of the gradients) are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(dp: int, overrides: list[str], out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(dp),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "boost_compile.train", *overrides, f"hydra.run.dir={out}",
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cola-60m")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    common = [
        f"model={args.model}", f"parallel.dp={args.dp}", f"trainer.steps={args.steps}", f"trainer.seq={args.seq}",
        f"trainer.batch={2 * args.dp}", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.threads=1",
        "trainer.plot=false", "trainer.progress=none", "checkpoint.enabled=false", "passes=boost_aot_eager",
        "data.max_bytes=400000",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "DDP (zero=0)": train(args.dp, common, Path(tmp) / "ddp"),
            "ZeRO-1 (zero=1)": train(args.dp, [*common, "parallel.zero=1"], Path(tmp) / "zero"),
        }
    base = runs["DDP (zero=0)"]["state_mib"]
    print(f"{args.model}, dp={args.dp}, fp32 AdamW; MiB on the rank holding the most; baseline: DDP (zero=0)\n")
    print("| run | params | grads | optimizer state | total | total vs DDP | optimizer vs DDP |")
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        s = r["state_mib"]
        print(f"| {name} | {s['params']:.1f} | {s['grads']:.1f} | {s['optimizer']:.1f} | {s['total']:.1f} | "
              f"{s['total'] / base['total']:.2f} | {s['optimizer'] / base['optimizer']:.2f} |")
    for name, r in runs.items():
        print(f"{name} losses: {', '.join(f'{x:.6f}' for x in r['losses'])}")


if __name__ == "__main__":
    main()
