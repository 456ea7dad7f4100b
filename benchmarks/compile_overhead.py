"""Compile-time overhead of backend="boost" against plain backend="inductor".

Usage:
    python benchmarks/compile_overhead.py [--preset tiny] [--repeats 3] [--batch 2] [--seq 64]

Three variants compile the same reference model:

    inductor        torch.compile(model, backend="inductor")
    boost (off)     torch.compile(model, backend="boost", options=all_passes_off())
    boost           torch.compile(model, backend="boost")          (default passes)

Each measurement runs in a fresh subprocess with a fresh, empty
TORCHINDUCTOR_CACHE_DIR, so no cache helps either side. It times the first
forward call (Dynamo capture + compile + run) and the first backward (backward
compile + run). The variants alternate within each repeat (order reversed every
other repeat); the table reports medians and boost / inductor ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

RESULT_TAG = "COMPILE_OVERHEAD_RESULT "
VARIANTS = ("inductor", "boost-off", "boost")
LABELS = {
    "inductor": "inductor",
    "boost-off": "boost, all passes off",
    "boost": "boost, default passes",
}


def all_passes_off() -> dict[str, Any]:
    """``options=`` for backend="boost" with every pass disabled.

    Walks ``BoostConfig``: a section whose default is a config with an ``enabled``
    field gets ``{"enabled": False}``; an optional section that defaults to None
    (an opt-in pass such as ``factorize``) is left unset, which is off. Checks the
    result with the pass registries, so a future pass this misses fails loudly.
    """
    from boost_compile import passes
    from boost_compile.config import BoostConfig

    defaults = BoostConfig()
    options: dict[str, Any] = {}
    for f in dataclasses.fields(BoostConfig):
        value = getattr(defaults, f.name)
        if dataclasses.is_dataclass(value) and "enabled" in {
            g.name for g in dataclasses.fields(value)
        }:
            options[f.name] = {"enabled": False}
    config = BoostConfig.from_options(options)
    still_on = [
        p.name for p in (*passes.graph_passes(config), *passes.aten_passes(config)) if p.enabled()
    ]
    if still_on:
        raise RuntimeError(f"all_passes_off() left pass(es) enabled: {still_on}")
    return options


# --- child: one measurement ---------------------------------------------------------


def _child(variant: str, preset: str, batch: int, seq: int) -> None:
    import torch

    from boost_compile.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset(preset))
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    targets = torch.randint(0, model.config.vocab_size, (batch, seq))
    if variant == "inductor":
        compiled = torch.compile(model, backend="inductor")
    elif variant == "boost-off":
        compiled = torch.compile(model, backend="boost", options=all_passes_off())
    elif variant == "boost":
        compiled = torch.compile(model, backend="boost")
    else:
        raise ValueError(f"unknown variant {variant!r}")

    own = _time_boost_owned_work() if variant != "inductor" else None
    t0 = time.perf_counter()
    loss = compiled(tokens, targets)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    result = {"forward_s": t1 - t0, "backward_s": t2 - t1}
    if own is not None:
        result["boost_own_s"] = own["pipeline"] - own["inner"]
    print(RESULT_TAG + json.dumps(result), flush=True)


def _time_boost_owned_work() -> dict[str, float]:
    """Wrap the backend's entry and its hand-off to time what boost itself adds.

    ``pipeline - inner`` is the config, the analysis and the Torch-IR passes: the
    part of the compile that is boost's own, free of Inductor's run-to-run noise.
    """
    from boost_compile import backend

    spent = {"pipeline": 0.0, "inner": 0.0}

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return wrapper

    backend.compile_graph = timed("pipeline", backend.compile_graph)
    backend._inner_compile = timed("inner", backend._inner_compile)
    return spent


def _measure(variant: str, args: argparse.Namespace) -> dict[str, float]:
    cache_dir = tempfile.mkdtemp(prefix="boost_bench_inductor_")
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": cache_dir,
        "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
    }
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--preset",
        args.preset,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} run failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_TAG) :])
    result["total_s"] = result["forward_s"] + result["backward_s"]
    return result


# --- parent: schedule, aggregate, print -------------------------------------------


def _table(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[variant])

    base = med("inductor", "total_s")
    rows = [
        f"Compile overhead, preset `{args.preset}`, batch {args.batch}x{args.seq}, "
        f"median of {args.repeats} fresh processes (empty Inductor cache each)",
        "",
        "| backend | first forward (s) | first backward (s) | total (s) | vs inductor | overhead |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for variant in VARIANTS:
        total = med(variant, "total_s")
        ratio = total / base
        rows.append(
            f"| {LABELS[variant]} | {med(variant, 'forward_s'):.2f} | "
            f"{med(variant, 'backward_s'):.2f} | {total:.2f} | {ratio:.3f}x | "
            f"{(ratio - 1) * 100:+.1f}% |"
        )
    for variant in VARIANTS[1:]:
        own = med(variant, "boost_own_s")
        rows.append(
            f"| {LABELS[variant]}: boost's own work (config, analysis, passes) | "
            f"{own * 1000:.2f} ms | | | | {own / base * 100:+.3f}% |"
        )
    spread = {
        v: f"{min(r['total_s'] for r in results[v]):.2f}-{max(r['total_s'] for r in results[v]):.2f}"
        for v in VARIANTS
    }
    rows += [
        "",
        "total range (min-max): " + ", ".join(f"{LABELS[v]} {s}" for v, s in spread.items()),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="LlamaConfig preset (tiny, cola-60m, ...)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.preset, args.batch, args.seq)
        return
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    print(f"options for 'all passes off': {all_passes_off()}", file=sys.stderr)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        order = VARIANTS if rep % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            r = _measure(variant, args)
            results[variant].append(r)
            print(
                f"[{rep + 1}/{args.repeats}] {variant:9s} forward {r['forward_s']:.2f}s "
                f"backward {r['backward_s']:.2f}s",
                file=sys.stderr,
                flush=True,
            )
    print(_table(results, args))


if __name__ == "__main__":
    main()
