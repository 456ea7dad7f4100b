"""What a checkpoint costs the step loop, saved synchronously and with ``checkpoint.async_save``.

    python benchmarks/bench_async_checkpoint.py [--model lowrank-60m] [--steps 13] [--save-every 3]

Runs boost-train twice in this process, the same config but for the save mode
(eager PyTorch, one process, checkpoints every ``--save-every`` steps into a
temporary folder), and reads each run's ``metrics.jsonl``. Per run:

- **step**: the median wall time of a step that no save touches;
- **save + next step**: the median wall time from the end of a saving step to the
  end of the next one: a synchronous save blocks there for the whole write, an
  asynchronous one only for the copy of the state into memory, the write going
  on in a background thread while the next steps run;
- **run**: the wall time of the whole loop;
- **save overhead**: save + next step minus a step, what the save cost the loop.

The two modes alternate for ``--rounds`` rounds (each figure: the round with the
shortest run). Ratios are against the synchronous run (the baseline, same process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from boost_compile.train import run
from boost_compile.train.config import config_dir, register_configs


def cfg_of(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def measure(overrides: list[str], folder: Path) -> dict[str, float]:
    """One run; its step, save + next step and run wall times (s)."""
    result = run(cfg_of(*overrides), folder)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    ends = {r["step"]: r["time_s"] for r in rows if "time_s" in r}
    save_every = next(int(o.split("=")[1]) for o in overrides if o.startswith("trainer.save_every="))
    saved = {s for s in ends if s % save_every == 0}
    plain = [ends[s] - ends[s - 1] for s in ends if s - 1 in ends and s - 1 not in saved and s > 2]
    after_save = [ends[s + 1] - ends[s] for s in saved if s + 1 in ends]
    size = sum(f.stat().st_size for f in Path(result["checkpoint"]).iterdir())
    return {
        "step": statistics.median(plain),
        "save_next": statistics.median(after_save),
        "run": max(ends.values()),
        "mib": size / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="lowrank-60m", help="a hydra_conf/model option (default lowrank-60m)")
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="training threads (default 1: on a 2-core machine the writer thread gets the other core)")
    args = parser.parse_args()
    base = [
        f"model={args.model}", "passes=none", "trainer=quick", f"trainer.steps={args.steps}", "trainer.batch=4",
        f"trainer.seq={args.seq}", f"trainer.save_every={args.save_every}", "trainer.eval_every=0",
        "trainer.eval_batches=1", "trainer.plot=false", "trainer.progress=none", "checkpoint.keep=1",
        "checkpoint.at_end=false", "data.max_bytes=400000", f"trainer.threads={args.threads}",
    ]
    rounds: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for mode in rounds:
                overrides = [*base, f"checkpoint.async_save={str(mode == 'async').lower()}"]
                rounds[mode].append(measure(overrides, Path(tmp) / f"{mode}{i}"))
    results = {mode: min(runs, key=lambda r: r["run"]) for mode, runs in rounds.items()}
    sync = results["sync"]
    print(f"\n{args.model}, batch 4 x seq {args.seq}, eager, 1 process, {args.threads} training thread(s) "
          f"of {os.cpu_count()} cores; "
          f"a checkpoint every {args.save_every} steps ({sync['mib']:.0f} MiB); best of {args.rounds} rounds; "
          f"{platform.machine()}, torch {torch.__version__}\n")
    print("| save | step (s) | save + next step (s) | save overhead (s) | run (s) | save overhead vs sync | run vs sync |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, r in results.items():
        overhead = r["save_next"] - r["step"]
        print(f"| {mode} | {r['step']:.3f} | {r['save_next']:.3f} | {overhead:.3f} | {r['run']:.2f} | "
              f"{overhead / (sync['save_next'] - sync['step']):.2f}x | {r['run'] / sync['run']:.2f}x |")


if __name__ == "__main__":
    main()
