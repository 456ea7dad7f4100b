"""The largest model that starts under each layout, when each rank is given the same memory.

Each process gets RLIMIT_AS = an assumed baseline (Python, torch, the process group: ``--baseline-mib``)
+ ``--budget-mib``, as if each rank were a device of that size. For each layout the planner
(``boost_compile.plan``: the start and the step priced, what ``parallel.check_memory`` asks) names
the deepest Llama of ``--preset``'s widths that fits; boost-train then runs that depth under the
cap, one AdamW step (``model.init=per_parameter``: built on meta, each rank its part), and one
layer deeper each time it starts, until a depth is refused in one line before the build (or one
layer shallower each time the planner's depth is refused); each row printed as it lands.

    python benchmarks/largest_start.py [--budget-mib 768] [--layouts one fsdp8 tp2 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from start_memory import MIB, train  # noqa: E402

#: name -> (processes, boost-train overrides)
LAYOUTS = {
    "one": (1, []),
    "ddp2": (2, ["parallel.dp=2"]),
    "fsdp8": (8, ["parallel.dp_shard=8"]),
    "tp2": (2, ["parallel.tp=2", "parallel.plan=megatron", "passes=boost_aot_eager"]),
    "tp2xfsdp4": (8, ["parallel.tp=2", "parallel.dp_shard=4", "parallel.plan=megatron", "passes=boost_aot_eager"]),
    "pp2": (2, ["parallel.pp=2", "parallel.microbatches=2"]),
}


def planned_layers(preset: str, vocab: int, layout: list[str], nproc: int, budget: float, batch: int, seq: int) -> int:
    """The most layers the planner says fit ``budget`` bytes a rank (with check_memory's headroom)."""
    from dataclasses import replace

    from boost_compile.costmodel.hardware import load_hardware
    from boost_compile.plan.model import from_preset
    from boost_compile.plan.search import Job, price
    from boost_compile.train.memory_check import HEADROOM, layout_of
    from boost_compile.train.validate import validate

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import cfg_of

    tc, _ = validate(cfg_of(f"model.preset={preset}", f"trainer.batch={batch}", f"trainer.seq={seq}", *layout),
                     world_size=nproc)
    base = from_preset(preset).with_vocab(vocab)
    best = 0
    for layers in range(1, 400):
        spec = replace(base, n_layers=layers)
        lo = layout_of(tc, spec.projection)
        if lo.pp > layers:
            continue
        row = price(Job(spec, batch, seq, nproc, nproc, load_hardware("cpu"), budget, tc.trainer.precision), lo)
        if max(row.memory_gib, row.start_gib) * 2**30 * (1 + HEADROOM) > budget:
            break
        best = layers
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-350m")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--budget-mib", type=float, default=768)
    p.add_argument("--baseline-mib", type=float, default=1024, help="the address space a process maps before the build")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = p.parse_args()
    from dataclasses import replace

    from boost_compile.plan.model import from_preset

    batch, seq = 8, 64
    base = from_preset(args.preset).with_vocab(args.vocab)
    cap = args.baseline_mib + args.budget_mib
    print(f"{args.preset}'s widths, vocab {args.vocab}; RLIMIT_AS {cap:,.0f} MiB a process "
          f"({args.baseline_mib:,.0f} + {args.budget_mib:,.0f}); batch {batch} x seq {seq}, 1 AdamW step")
    print("| layout | processes | layers | parameters | fp32 weights (MiB) | result | VmPeak - baseline (MiB) |")
    print("|---|---:|---:|---:|---:|---|---:|")
    common = [f"model.preset={args.preset}", f"+model.overrides.vocab_size={args.vocab}", "trainer.steps=1",
              f"trainer.batch={batch}", f"trainer.seq={seq}", "trainer.eval_every=0", "trainer.eval_batches=1",
              "checkpoint.enabled=false", "trainer.plot=false", "trainer.progress=none", "trainer.threads=1"]
    with tempfile.TemporaryDirectory() as folder:
        for name in args.layouts:
            nproc, layout = LAYOUTS[name]
            layers = planned_layers(args.preset, args.vocab, layout, nproc, args.budget_mib * MIB, batch, seq)
            depth, started, tried = max(1, layers), False, set()
            while depth not in tried and depth >= 1:  # up from the planner's depth until refused, or down
                tried.add(depth)
                params = replace(base, n_layers=depth).num_params()
                s, line = train(nproc, [*common, *layout, f"+model.overrides.n_layers={depth}"],
                                Path(folder) / f"{name}-{depth}", cap)
                if s is None:
                    refused = "does not fit" in line
                    result, grew = ("refused: " + line.split("error: ")[-1][:160]) if refused else f"failed: {line[:200]}", ""
                else:
                    st = s["start"]
                    result, grew = f"started, loss {s['losses'][0]:.4f}", f"{st['vm_peak_mib'] - st['baseline_vm_mib']:,.0f}"
                print(f"| {name} | {nproc} | {depth} {'(planned)' if depth == layers else ''} | {params / 1e6:,.1f}M | "
                      f"{params * 4 / MIB:,.0f} | {result} | {grew} |", flush=True)
                if s is not None:
                    started = True
                    depth += 1
                elif started or not refused:
                    break
                else:
                    depth -= 1


if __name__ == "__main__":
    main()
