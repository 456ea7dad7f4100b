"""Measure what a layout planner predicts: one ``boost-train`` job per layout, its memory by term.

    python -m boost_compile.bench.plan_measure --out runs/plan \\
        --layout tp=1,pp=1,dp=1,zero=0,microbatches=1,schedule=1f1b,checkpoint=none,plan=auto \\
        -- model.preset=cola-60m trainer.batch=8 trainer.seq=128

:func:`measure` runs each layout (a dict of ``tp, pp, dp, zero, microbatches,
schedule, checkpoint, plan, stages_per_rank, dp_shard, reshard_after_forward``: FSDP2 with ``dp_shard > 1``)
as a subprocess, ``tp * pp * dp * dp_shard`` processes (torchrun
``--standalone`` when more than one, one intra-op thread each), with
``trainer.memory_report=true`` (:mod:`boost_compile.train.memory_report`: every rank's
measured params, grads, optimizer state, DDP buckets, saved activations per
micro-batch and step peak), and returns one row per layout: the per-rank reports,
their maximum per term, the steady step time, the command line; a job that fails
gives a row with its error instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: A layout's keys and the value a missing one takes (microbatches None: pp).
LAYOUT_DEFAULTS: dict[str, Any] = {
    "tp": 1, "pp": 1, "dp": 1, "zero": 0, "microbatches": None, "schedule": "1f1b", "checkpoint": "none", "plan": "auto",
    "stages_per_rank": 1, "dp_shard": 1, "reshard_after_forward": True,
}

#: The fixed settings of every job: one thread, no progress output, plot or checkpoint, a short final evaluation.
JOB_OVERRIDES = (
    "trainer.memory_report=true",
    "trainer.threads=1",
    "trainer.progress=none",
    "trainer.plot=false",
    "trainer.eval_every=0",
    "trainer.eval_batches=1",
    "trainer.save_every=0",
    "checkpoint.enabled=false",
)

#: The terms whose maximum over the ranks a row reports.
TERMS = ("params", "grads", "optimizer", "dp_buckets", "saved_activations", "peak", "peak_above_start", "baseline")


def _full(layout: dict[str, Any]) -> dict[str, Any]:
    unknown = set(layout) - set(LAYOUT_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown layout key(s) {sorted(unknown)}; the keys are {', '.join(LAYOUT_DEFAULTS)}")
    full = {**LAYOUT_DEFAULTS, **layout}
    if full["microbatches"] is None:
        full["microbatches"] = full["pp"]
    if isinstance(full["reshard_after_forward"], str):  # from --layout's text
        full["reshard_after_forward"] = full["reshard_after_forward"].lower() in ("1", "true", "yes")
    return full


def label(layout: dict[str, Any]) -> str:
    """The layout's folder name, e.g. ``tp2-pp1-dp1-z0-mb1-1f1b-none-btp``; FSDP2's ends in ``-fsdp2``
    (``dp_shard``) and ``-noreshard`` without ``reshard_after_forward``."""
    f = _full(layout)
    virtual = f"-v{f['stages_per_rank']}" if f["stages_per_rank"] > 1 else ""
    fsdp = (f"-fsdp{f['dp_shard']}" + ("" if f["reshard_after_forward"] else "-noreshard")) if f["dp_shard"] > 1 else ""
    return (f"tp{f['tp']}-pp{f['pp']}-dp{f['dp']}-z{f['zero']}-mb{f['microbatches']}-"
            f"{f['schedule']}{virtual}-{f['checkpoint']}-{f['plan']}{fsdp}")


def processes(layout: dict[str, Any]) -> int:
    f = _full(layout)
    return int(f["tp"]) * int(f["pp"]) * int(f["dp"]) * int(f["dp_shard"])


def command(layout: dict[str, Any], run_dir: Path, model_overrides: Sequence[str], steps: int = 3) -> list[str]:
    """The boost-train command line of one layout's job, writing into ``run_dir``."""
    f = _full(layout)
    n = processes(layout)
    # parallel.microbatches configures pipelines only (validate refuses it with pp=1)
    microbatches = f["microbatches"] if int(f["pp"]) > 1 else "null"
    overrides = [
        f"parallel.tp={f['tp']}", f"parallel.pp={f['pp']}", f"parallel.dp={f['dp']}", f"parallel.zero={f['zero']}",
        f"parallel.microbatches={microbatches}", f"parallel.pp_schedule={f['schedule']}", f"parallel.plan={f['plan']}",
        f"parallel.stages_per_rank={f['stages_per_rank']}",
        *([f"parallel.dp_shard={f['dp_shard']}", f"parallel.reshard_after_forward={str(f['reshard_after_forward']).lower()}"]
          if int(f["dp_shard"]) > 1 else []),
        # ++: add the key to passes.options, or override it when the passes group already sets it
        f"++passes.options.checkpoint={f['checkpoint']}",
        *JOB_OVERRIDES, f"trainer.steps={steps}", f"hydra.run.dir={run_dir}", *model_overrides,
    ]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)] if n > 1 else []
    return [sys.executable, *launcher, "-m", "boost_compile.train", *overrides]


def _step_s(run_dir: Path, summary: dict[str, Any], profiled: int | None, warmup: int = 0) -> tuple[float | None, list[float]]:
    """(steady step time from summary.json, the steady steps not profiled, from metrics.jsonl).

    A layout's step is the median of the second: on a shared 2-core machine one
    step in a few runs long (a gloo wait behind a burst of other work), and the
    layouts' order should not hang on which job met it. ``warmup`` steps after the
    compiling first are left out too: while the heap grows to a step's peak, glibc
    maps and unmaps the largest buffers and the first steps after compiling run up
    to 1.35x the later ones (cola-60m on one process: 6.5, 5.4, 5.5, 5.2, 4.9, 4.8 s;
    with ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 GiB the same job ran 4.7-5.0 s from
    its second step).
    """
    from omegaconf import OmegaConf

    from boost_compile.train.metrics import METRICS_FILE, read_metrics

    config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    tokens = int(config.trainer.batch) * int(config.trainer.seq)
    rate = summary.get("tokens_per_s") or 0.0
    steady = tokens / rate if rate > 0 else None
    rows = [r for r in read_metrics(run_dir / METRICS_FILE) if "step_s" in r]
    clean = [r["step_s"] for r in rows[1 + warmup:] if r["step"] != profiled]
    return steady, clean


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def measure_one(layout: dict[str, Any], *, out_dir: Path, model_overrides: Sequence[str], steps: int = 3,
                warmup: int = 0, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run one layout's job; its row (see :func:`measure`)."""
    name = label(layout)
    run_dir = (Path(out_dir) / name).resolve()
    cmd = command(layout, run_dir, model_overrides, steps)
    row: dict[str, Any] = {"label": name, "layout": _full(layout), "command": shlex.join(cmd), "run_dir": str(run_dir),
                           "error": None}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {**row, "error": f"timed out after {timeout_s:.0f} s\n{_tail(stderr)}"}
    if proc.returncode != 0:
        return {**row, "error": f"exit status {proc.returncode}\n{_tail(proc.stderr or proc.stdout)}"}
    reports = [json.loads(p.read_text()) for p in sorted(run_dir.glob("memory_rank*.json"),
                                                          key=lambda p: int(p.stem.removeprefix("memory_rank")))]
    if len(reports) != processes(layout):
        return {**row, "error": f"{len(reports)} memory reports for {processes(layout)} ranks in {run_dir}"}
    summary = json.loads((run_dir / "summary.json").read_text())
    step_s, clean = _step_s(run_dir, summary, reports[0].get("profiled_step"), warmup)
    memory = {t: max((r[t] for r in reports if r.get(t) is not None), default=None) for t in TERMS}
    return {**row, "memory": memory, "ranks": reports, "step_s": step_s,
            "step_s_unprofiled": statistics.median(clean) if clean else None, "steady_steps_s": clean,
            "first_step_s": summary.get("first_step_s"), "tokens_per_s": summary.get("tokens_per_s")}


def measure(layouts: Sequence[dict[str, Any]], *, out_dir: Path, model_overrides: list[str], steps: int = 3,
            warmup: int = 0) -> list[dict[str, Any]]:
    """One boost-train job per layout (one after the other), its measured memory; one row per layout.

    A row: ``label``, ``layout`` (every key filled in), ``command`` (the shell line), ``run_dir``,
    ``error`` (None, or the failure and the last lines of stderr, then nothing else), ``memory`` (each
    term's maximum over the ranks), ``ranks`` (every rank's ``memory_rank{R}.json``), ``step_s`` (the
    steady step from summary.json: batch * seq / tokens_per_s over the steps after the first, the
    profiled last one among them), ``step_s_unprofiled`` (the median of those steps without the profiled
    one and the ``warmup`` steps after the first, from metrics.jsonl; None when none is left),
    ``steady_steps_s`` (those steps), ``first_step_s`` (the compiling step), ``tokens_per_s``.
    """
    return [measure_one(layout, out_dir=out_dir, model_overrides=model_overrides, steps=steps, warmup=warmup) for layout in layouts]


def parse_layout(text: str) -> dict[str, Any]:
    """``tp=2,pp=1,checkpoint=full`` as a layout dict (integers where they are)."""
    layout: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        layout[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    _full(layout)  # unknown keys fail here
    return layout


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m boost_compile.bench.plan_measure", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="a folder per layout goes here")
    p.add_argument("--layout", action="append", required=True, type=parse_layout, help="tp=..,pp=..,... (repeatable)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="boost-train overrides of the model and batch (after --)")
    args = p.parse_args(argv)
    rows = measure(args.layout, out_dir=args.out, model_overrides=args.overrides, steps=args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "measured.json").write_text(json.dumps(rows, indent=1) + "\n")
    for row in rows:
        if row["error"]:
            print(f"{row['label']}: FAILED {row['error']}")
            continue
        mib = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in row["memory"].items() if v is not None)
        print(f"{row['label']}: MiB (max over ranks) {mib}; step {row['step_s']:.3f} s")
    print(f"rows: {args.out / 'measured.json'}")


if __name__ == "__main__":
    main()
