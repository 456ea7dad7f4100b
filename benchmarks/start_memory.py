"""A model's start and first steps under a per-process address-space cap (RLIMIT_AS, ``ulimit -v``).

The issue "Models larger than one device" asks: under a cap of each process's own baseline (Python,
torch, the process group: boost-train's ``start.baseline_vm_mib``, the address space before the
build) plus 0.8 of the model's whole fp32 weights, does a ~350M dense Llama train 2 steps with AdamW
under FSDP2 8, with the losses of the same run without the cap, and does one process refuse in one line?

    python benchmarks/start_memory.py [--preset llama-350m] [--nproc 8] [--passes none boost_aot_eager]

Runs, each printed as it lands: for each ``--passes``, FSDP2 ``--nproc`` uncapped (``model.init=
per_parameter``: built on meta, each rank its shards), the same with ``model.init=global_rng`` (every
rank builds the whole model first: the start this replaces), then FSDP2 under the cap, then one
process under the cap. Per run: the largest rank's address space before the build, its peak RSS
during the build (``start.peak_mib``) and over the run, its address-space high-water mark
(``VmPeak``) against the cap, and the losses. glibc's allocator is told to hand large blocks back
(``MALLOC_MMAP_THRESHOLD_``) and to keep two arenas (``MALLOC_ARENA_MAX``): without it its retained
heap and per-thread arenas take the address space (measured in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(nproc: int, args: list[str], out: Path, cap_mib: float | None) -> tuple[dict | None, str]:
    """boost-train under torchrun (or alone for one process), capped; (summary or None, last output line)."""
    launch = [sys.executable, "-m", "boost_compile.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(_port()), "-m", "boost_compile.train"]

    def limit() -> None:
        if cap_mib is not None:
            cap = int(cap_mib * MIB)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    proc = subprocess.run([*launch, *args, f"hydra.run.dir={out}"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **ENV}, preexec_fn=limit, timeout=1800)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line.lower() or "done:" in line]
    refused = [line for line in lines if "boost-train: error" in line]  # before torchrun's own last words
    summary = out / "summary.json"
    return (json.loads(summary.read_text()) if proc.returncode == 0 and summary.exists() else None,
            (refused or lines or [f"exit {proc.returncode}"])[-1 if not refused else 0][:400])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-350m")
    p.add_argument("--vocab", type=int, default=32000, help="the preset's vocabulary (fixed: model.overrides.vocab_size)")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--passes", nargs="+", default=["none", "boost_aot_eager"])
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from boost_compile.plan.model import from_preset

    weights_mib = from_preset(args.preset).with_vocab(args.vocab).num_params() * 4 / MIB
    common = [f"model.preset={args.preset}", f"+model.overrides.vocab_size={args.vocab}", "trainer.steps=2",
              "trainer.batch=8", "trainer.seq=64", "trainer.eval_every=0", "trainer.eval_batches=1",
              "checkpoint.enabled=false", "trainer.plot=false", "trainer.progress=none", "trainer.threads=1"]
    print(f"{args.preset}, vocab {args.vocab}: {weights_mib:,.0f} MiB of fp32 weights; 0.8 of them: {0.8 * weights_mib:,.0f} MiB")
    print("| passes | run | cap (MiB) | baseline VM | start peak RSS | run peak RSS | VmPeak | VmPeak - baseline (x W) | losses |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as folder:
        for passes in args.passes:
            fsdp = [*common, f"passes={passes}", f"parallel.dp_shard={args.nproc}"]
            free, _ = train(args.nproc, fsdp, Path(folder) / f"{passes}-free", None)
            runs = [(f"FSDP2 {args.nproc}", free, "", None)]
            whole, line = train(args.nproc, [*fsdp, "model.init=global_rng"], Path(folder) / f"{passes}-whole", None)
            runs.append((f"FSDP2 {args.nproc}, model.init=global_rng", whole, line, None))
            if free is not None:
                cap = free["start"]["baseline_vm_mib"] + 0.8 * weights_mib
                capped, line = train(args.nproc, fsdp, Path(folder) / f"{passes}-capped", cap)
                runs.append((f"FSDP2 {args.nproc} capped", capped, line, cap))
                alone, line = train(1, [*common, f"passes={passes}"], Path(folder) / f"{passes}-one", cap)
                runs.append(("one process capped", alone, line, cap))
            for label, s, line, cap in runs:
                capped = f"{cap:,.0f}" if cap else "none"
                if s is None:
                    print(f"| {passes} | {label} | {capped} | | | | | | failed: {line} |", flush=True)
                    continue
                st = s["start"]
                over = st["vm_peak_mib"] - st["baseline_vm_mib"]
                same = "" if free is None or s is free else (" (equal)" if s["losses"] == free["losses"] else " (DIFFER)")
                print(f"| {passes} | {label} | {capped} | {st['baseline_vm_mib']:,.0f} | {st['peak_mib']:,.0f} | "
                      f"{s['peak_mem_mib']:,.0f} | {st['vm_peak_mib']:,.0f} | {over:,.0f} ({over / weights_mib:.2f}) | "
                      f"{[round(x, 4) for x in s['losses']]}{same} |", flush=True)


if __name__ == "__main__":
    main()
