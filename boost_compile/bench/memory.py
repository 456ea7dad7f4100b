"""``boost-bench memory``: activation checkpointing, saved bytes against step time, per mode.

    boost-bench memory [--size 60m] [--batch 2] [--seq 256] [--repeats 7] [--modes none lowrank full budget]

The CoLA model is compiled once per ``checkpoint`` mode with ``backend="boost"``
(``--inner``, Inductor by default). The saved bytes come from the partitioned
graphs themselves (the tensors the forward hands to the backward, parameters
and inputs excluded, each storage counted once), so they are exact and do not
depend on the machine; "per layer" is the mean over the decoder blocks,
"total" adds what the embedding, head and loss keep. Step times are taken
round-robin over the modes. "MB saved per ms" is (saved total of none - of
mode) / (step of mode - step of none), "inf" when the mode is not measurably
slower. The baseline is ``none`` (no recompute).
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from collections.abc import Callable

import torch

from boost_compile import _torch_compat as compat
from boost_compile.backend import Recorder, compile_graph
from boost_compile.bench import timing
from boost_compile.bench.results import Result, Target, bar_chart
from boost_compile.config import BoostConfig
from boost_compile.models import Llama
from boost_compile.passes.saved_tensors import activation_bytes

MODES = ("none", "lowrank", "full", "budget")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="60m", help="tiny, or the suffix of the cola- presets")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256, help="override the preset's vocabulary (0 keeps it)")
    p.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--budget", type=float, default=0.5, help='checkpoint_budget of mode "budget"')
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0 keeps the default)")
    p.add_argument("--clock", default="thread", choices=list(timing.CLOCKS), help="thread: CPU time, needs --threads 1")


def compile_mode(model: Llama, mode: str, args: argparse.Namespace, tokens: torch.Tensor) -> tuple[Callable[[], float], dict[str, int]]:
    """Compile ``model`` with ``checkpoint=mode``; returns a timed step and the saved bytes per block."""
    rec = Recorder(keep_view=False)
    config = BoostConfig.from_options({"inner": args.inner, "checkpoint": mode, "checkpoint_budget": args.budget})
    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=rec), fullgraph=True)
    step = timing.train_step(model, compiled, tokens, args.clock)
    # the first step compiles; without the caches the partitioner runs and reports
    with compat.compile_settings(**compat.NO_COMPILE_CACHES):
        step()
    (graph,) = rec.graphs
    (report,) = graph.partition_reports
    return step, activation_bytes(report)


def run(args: argparse.Namespace) -> Result:
    timing.set_threads(args.threads, args.clock)
    modes = ["none"] + [m for m in args.modes if m != "none"]
    preset = timing.preset_pair(args.size)[1]
    base = timing.build_model(preset, args.seq, args.vocab)
    cfg = base.config
    tokens = timing.tokens_for(base, args.batch, args.seq)
    steps, saved = {}, {}
    for mode in modes:
        steps[mode], saved[mode] = compile_mode(copy.deepcopy(base), mode, args, tokens)
    times = timing.round_robin(steps, args.repeats, args.warmup)
    best = {m: min(t) for m, t in times.items()}
    med = {m: statistics.median(t) for m, t in times.items()}

    def layer_bytes(mode: str) -> float:
        blocks = [b for b in saved[mode] if b != "-"]
        return sum(saved[mode][b] for b in blocks) / max(1, len(blocks))

    total = {m: sum(saved[m].values()) for m in modes}
    per_layer = {m: layer_bytes(m) for m in modes}
    mb = 2**20
    lines = [
        f"Activation checkpointing: {preset} (d {cfg.dim}, {cfg.n_layers} layers, r {cfg.rank_attn}, d_ff {cfg.ffn_dim}, "
        f"vocab {cfg.vocab_size}), batch {args.batch} x seq {args.seq}, fp32, boost with inner {args.inner}, "
        f"{torch.get_num_threads()} thread(s), {args.clock} clock; forward+backward, modes round-robin, {args.repeats} repeats. "
        "Saved bytes are read from the partitioned graphs (exact).",
        "",
        ("| mode | saved / layer (MB) | vs none | saved total (MB) | vs none | step, fastest (ms) | median (ms) | vs none "
         "| MB saved per ms extra |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for m in modes:
        extra_ms = (best[m] - best["none"]) * 1e3
        freed = (total["none"] - total[m]) / mb
        rate = None if m == "none" else (float("inf") if extra_ms <= 0 else freed / extra_ms)
        rate_cell = "-" if rate is None else ("inf" if rate == float("inf") else f"{rate:.3f}")
        label = m if m != "budget" else f"budget {args.budget:g}"
        lines.append(
            f"| {label} | {per_layer[m] / mb:.2f} | {per_layer[m] / per_layer['none']:.3f} | {total[m] / mb:.2f} | "
            f"{total[m] / total['none']:.3f} | {best[m] * 1e3:.1f} | {med[m] * 1e3:.1f} | "
            f"{best[m] / best['none']:.3f} | {rate_cell} |"
        )
        rows.append({"mode": m, "label": label, "saved_per_layer": per_layer[m], "saved_total": total[m], "step_best_s": best[m],
                     "step_median_s": med[m], "times_s": times[m], "mb_per_ms": rate, "saved_per_block": saved[m]})
    targets = []
    # the targets are for the CoLA-60m shapes
    if "lowrank" in best and args.size == "60m":
        targets += [
            Target("lowrank: activation bytes per layer vs none", per_layer["lowrank"] / per_layer["none"], 0.40, False),
            Target("lowrank: step time vs none", best["lowrank"] / best["none"], 1.20, False),
        ]
        rates = {r["mode"]: r["mb_per_ms"] for r in rows}
        if "full" in rates and rates["full"] and rates["lowrank"] is not None:
            targets.append(Target("lowrank MB saved per ms / full's", rates["lowrank"] / rates["full"], 1.0, True))
    data = {"params": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows,
            "layer_shapes": {"d": cfg.dim, "r": cfg.rank_attn, "tokens": args.batch * args.seq}}
    return Result("memory", "Activation checkpointing modes", "\n".join(lines), data, targets)


def chart(result: Result, path: str) -> None:
    rows = result.data["rows"]
    none = rows[0]
    bar_chart(
        path,
        "Checkpoint modes against none (lower is less)",
        [r["label"] for r in rows],
        {
            "saved bytes / none": [r["saved_total"] / none["saved_total"] for r in rows],
            "step time / none": [r["step_best_s"] / none["step_best_s"] for r in rows],
        },
        "ratio to none",
        ref=1.0,
    )
