"""``boost-bench plan``: the layout planner's predictions beside the same layouts run here.

Each layout of :data:`LAYOUTS` and :data:`FSDP_LAYOUTS` (a cola-60m-shaped model, byte
tokens, fp32) runs as a real boost-train job with ``trainer.memory_report=true``
(:mod:`boost_compile.bench.plan_measure`), and its measured terms stand beside the
planner's (:mod:`boost_compile.plan`):

- states (params, grads, optimizer state, DDP buckets): tensor accounting of the
  rank's local tensors (DDP's buckets from its reducer; FSDP2's shards);
- saved activations per micro-batch: the partitioned graphs of every compiled graph
  of the rank (under a pipeline the loss runs eagerly, outside them, so the
  prediction leaves the log-softmax out there too; under FSDP2 the blocks are compiled
  one by one and the head and loss run eagerly: each block graph's saved tensors and
  kept inputs times its calls, against the planner's blocks alone);
- the peak: a memory profile of the last step (the profiler's allocator records)
  above what was live when it began, plus that;
- the step: the median of the steady steps: not the compiling first, the ``--warmup`` steps after it
  (the heap still growing) or the profiled last.

FSDP2's gathered weights, kept units and reduce-scatter buffers have no tensor of their own to
count: the peak judges them (:func:`fsdp_lines`). ``--only fsdp`` runs the FSDP2 layouts
alone (result ``plan-fsdp``). Memory does not depend on what else runs on the machine; the
steps do.

Then the planner's ranking of the two-process layouts without FSDP2 against the measured one
(Kendall tau), its first choice for two processes (run too, if not among them),
its choice under a memory cap that excludes the fastest, and its choices on
BOOST.md section 6's settings (:mod:`boost_compile.plan.published`).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from itertools import combinations
from pathlib import Path
from typing import Any

from boost_compile.bench import plan_measure
from boost_compile.bench.results import Result, Target, bar_chart
from boost_compile.costmodel.hardware import load_hardware
from boost_compile.plan.memory import GIB, memory
from boost_compile.plan.model import from_preset
from boost_compile.plan.published import cluster_choice, published_choices, why
from boost_compile.plan.search import Job, Layout, best, price, search

MIB = 2**20
#: the issue's layouts: one process in each checkpoint mode, and two processes every way
LAYOUTS = (
    Layout(1, 1, 1, checkpoint="none"),
    Layout(1, 1, 1, checkpoint="lowrank"),
    Layout(1, 1, 1, checkpoint="full"),
    Layout(2, 1, 1, checkpoint="none", plan="btp"),
    Layout(2, 1, 1, checkpoint="lowrank", plan="btp"),
    Layout(1, 2, 1, microbatches=2, schedule="1f1b"),
    Layout(1, 2, 1, microbatches=4, schedule="1f1b"),
    Layout(1, 2, 1, microbatches=4, schedule="gpipe"),
    Layout(1, 1, 2),
    Layout(1, 1, 2, zero=1),
    Layout(1, 1, 2, checkpoint="lowrank"),
)
#: FSDP2 over two processes, resharding after the forward or not, without and with checkpointing; HSDP 2 x 2;
#: two pipeline stages, each sharded over two processes (PP2 x FSDP2 2, 1F1B over 2 micro-batches)
FSDP_LAYOUTS = (
    Layout(1, 1, 1, dp_shard=2, checkpoint="none"),
    Layout(1, 1, 1, dp_shard=2, checkpoint="none", reshard_after_forward=False),
    Layout(1, 1, 1, dp_shard=2, checkpoint="lowrank"),
    Layout(1, 1, 1, dp_shard=2, checkpoint="lowrank", reshard_after_forward=False),
    Layout(1, 1, 1, dp_shard=2, checkpoint="full"),
    Layout(1, 1, 2, dp_shard=2, checkpoint="none"),
    Layout(1, 2, 1, microbatches=2, dp_shard=2, checkpoint="none", reshard_after_forward=False),
    Layout(1, 2, 1, microbatches=2, dp_shard=2, checkpoint="lowrank"),
)
STATE_TERMS = ("params", "grads", "optimizer", "dp_buckets")
#: the planner's FSDP2 terms and transient, and what else is live at its peak, in the FSDP2 table
FSDP_PREDICTED = ("head", "temporary", "fsdp_gathered", "fsdp_kept")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="cola-60m")
    # the shapes the cpu hardware file was calibrated at (boost-bench pp's): smaller steps are overheads
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12,
                   help="steps per job: the first compiles, the last is profiled, the median of the others after --warmup is the step")
    p.add_argument("--warmup", type=int, default=2, help="steps after the compiling first left out of the median (the heap settling)")
    p.add_argument("--runs", default=None, help="folder of the jobs' run folders (default: a temporary one)")
    p.add_argument("--only", choices=("all", "fsdp"), default="all",
                   help="fsdp: the FSDP2 and HSDP layouts' memory alone (result plan-fsdp), without the ranking")


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two orderings of the same items: (concordant - discordant) / pairs."""
    pairs = list(combinations(range(len(a)), 2))
    score = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0) for i, j in pairs)
    return score / len(pairs) if pairs else 1.0


def _as_measure(lo: Layout) -> dict[str, Any]:
    return {"tp": lo.tp, "pp": lo.pp, "dp": lo.dp, "zero": lo.zero, "microbatches": lo.microbatches, "schedule": lo.schedule,
            "checkpoint": lo.checkpoint, "plan": lo.plan if lo.tp > 1 else "auto", "stages_per_rank": lo.stages_per_rank,
            "dp_shard": lo.dp_shard, "reshard_after_forward": lo.reshard_after_forward}


def _processes(lo: Layout) -> int:
    return lo.tp * lo.pp * lo.dp * lo.dp_shard


def _predicted(job: Job, lo: Layout) -> dict[str, Any]:
    """Per pipeline rank: the planner's terms (bytes), its saved bytes per micro-batch and peak.

    The saved bytes are what the measurement reads: under a pipeline the loss runs outside the
    stage graphs; under FSDP2 (blocks compiled one by one) the embedding, the final norm, the head
    and the loss run outside the block graphs, so only the blocks' saved tensors and their inputs."""
    ranks = []
    for r in range(lo.pp):
        m = memory(job.spec, lo.plan, tp=lo.tp, pp=lo.pp, dp=lo.dp, zero=lo.zero, microbatches=lo.microbatches,
                   schedule=lo.schedule, checkpoint=lo.checkpoint, batch=job.batch, seq=job.seq, precision=job.precision,
                   pp_rank=r, dp_shard=lo.dp_shard, reshard_after_forward=lo.reshard_after_forward)
        saved = m.details["saved_per_microbatch"] - (m.details["loss_per_microbatch"] if lo.pp > 1 else 0)
        if lo.dp_shard > 1:
            saved = m.terms["activations"]
        ranks.append({**m.terms, "saved_activations": saved, "peak": m.peak})
    return {"ranks": ranks, "step_s": price(job, lo).step_s}


def _measured_terms(report: dict[str, Any]) -> dict[str, Any]:
    """A rank's measured terms; blocks compiled one by one (FSDP2): the saved bytes are what the block
    graphs make and the inputs they keep (each block's input, made by the block before it)."""
    terms = {k: report.get(k) for k in (*STATE_TERMS, "saved_activations", "peak")}
    if report.get("compile_unit") == "block" and report.get("saved_activations") is not None:
        terms["saved_activations"] += report.get("saved_inputs") or 0
    return terms


def _errors(pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, float]:
    """Relative error of each term, the worst over the pipeline ranks (terms of 0 bytes both sides: 0)."""
    out: dict[str, float] = {}
    for term in (*STATE_TERMS, "saved_activations", "peak"):
        worst = 0.0
        for p, m in zip(pred["ranks"], meas["ranks"], strict=False):  # pipeline rank r: the first dp/tp rank's report
            mv = m.get(term)
            if mv is None or (mv == 0 and p[term] == 0):
                continue
            worst = max(worst, abs(p[term] - mv) / max(mv, 1))
        out[term] = worst
    return out


def _rank_reports(row: dict[str, Any], lo: Layout) -> list[dict[str, Any]]:
    """One measured report per pipeline rank (ranks are pp-major: the first of each stage's group).
    FSDP2: each pipeline rank's rank of the highest peak (the ranks differ by the few collective
    buffers whose free the profile misses, see train/memory_report.py)."""
    group = lo.tp * lo.dp * lo.dp_shard
    if lo.dp_shard > 1:
        return [max(row["ranks"][r * group:(r + 1) * group], key=lambda x: x.get("peak") or 0) for r in range(lo.pp)]
    return [row["ranks"][r * group] for r in range(lo.pp)]


def _measured_rows(layouts: list[Layout], jobs: dict[int, Job], args: argparse.Namespace, runs: Path,
                   overrides: list[str]) -> list[dict[str, Any]]:
    """Each layout run (plan_measure), its measured terms beside the planner's, and their errors."""
    measured = plan_measure.measure([_as_measure(lo) for lo in layouts], out_dir=runs, model_overrides=overrides, steps=args.steps,
                                    warmup=args.warmup)
    rows = []
    for lo, meas in zip(layouts, measured, strict=True):
        n = _processes(lo)
        pred = _predicted(jobs[n], lo)
        row = {"layout": asdict(lo), "label": lo.label(), "processes": n, "predicted": pred, "error": meas["error"],
               "command": meas["command"]}
        if not meas["error"]:
            reports = _rank_reports(meas, lo)
            row["measured"] = {"ranks": [_measured_terms(r) for r in reports], "reports": reports,
                               "step_s": meas["step_s_unprofiled"] or meas["step_s"], "steps_s": meas.get("steady_steps_s") or []}
            row["errors"] = _errors(pred, row["measured"])
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> Result:
    if args.warmup < 0 or args.steps < args.warmup + 3:
        raise SystemExit(f"boost-bench plan: --steps {args.steps} leaves no step to time after the compiling one, "
                         f"--warmup {args.warmup} and the profiled last; give at least --warmup + 3")
    spec = from_preset(args.preset, vocab_size=256)  # byte tokens: boost-train pads the vocabulary to 256
    hw = load_hardware("cpu")
    jobs = {n: Job(spec, args.batch, args.seq, n, n, hw, hw.memory_gib * GIB, "fp32", (f"model={args.preset}",)) for n in (1, 2, 4)}
    runs = Path(args.runs or tempfile.mkdtemp(prefix="boost-plan-"))
    overrides = [f"model={args.preset}", f"trainer.batch={args.batch}", f"trainer.seq={args.seq}"]
    if args.only == "fsdp":
        return _fsdp_result(args, spec, _measured_rows(list(FSDP_LAYOUTS), jobs, args, runs, overrides))
    # the ranking, the first choice and the cap stay over the DDP, ZeRO-1 and pipeline layouts they were set for
    first = best(search(jobs[2], fsdp=False), jobs[2]).layout
    layouts = list(LAYOUTS) + ([first] if first not in LAYOUTS else []) + list(FSDP_LAYOUTS)
    rows = _measured_rows(layouts, jobs, args, runs, overrides)
    ok = [r for r in rows if "measured" in r]
    two = [r for r in ok if r["processes"] == 2 and r["layout"]["dp_shard"] == 1]
    tau = kendall_tau([r["predicted"]["step_s"] for r in two], [r["measured"]["step_s"] for r in two])
    best_measured = min(r["measured"]["step_s"] for r in two) if two else float("nan")
    chosen = next((r for r in two if r["layout"] == asdict(first)), None)
    # a cap under the fastest two-process layout's predicted peak: the planner must move
    fastest = best(search(jobs[2], fsdp=False), jobs[2])
    cap_gib = fastest.memory_gib * 0.8
    capped_job = Job(spec, args.batch, args.seq, 2, 2, hw, cap_gib * GIB, "fp32")
    capped = best(search(capped_job, fsdp=False), capped_job).layout
    if not any(r["layout"] == asdict(capped) for r in ok):
        extra = plan_measure.measure([_as_measure(capped)], out_dir=runs, model_overrides=overrides, steps=args.steps,
                                    warmup=args.warmup)[0]
        if not extra["error"]:
            reports = _rank_reports(extra, capped)
            ok.append({"layout": asdict(capped), "label": capped.label(), "processes": 2, "predicted": _predicted(jobs[2], capped),
                       "measured": {"ranks": reports, "step_s": extra["step_s_unprofiled"] or extra["step_s"]}})
    capped_row = next((r for r in ok if r["layout"] == asdict(capped)), None)
    capped_peak = max(r["peak"] for r in capped_row["measured"]["ranks"]) / GIB if capped_row else float("nan")

    lines = _memory_lines(rows, args, spec) + fsdp_lines(rows)
    lines += [f"Ranking of the {len(two)} two-process layouts without FSDP2: Kendall tau {tau:.2f} (predicted order against measured).",
              f"The planner's first choice for 2 processes: {first.label()}, measured "
              + (f"{chosen['measured']['step_s']:.3f} s against the measured best {best_measured:.3f} s." if chosen else "(failed)."),
              f"Under a cap of {cap_gib * 1024:.0f} MiB (80% of the fastest layout's predicted {fastest.memory_gib * 1024:.0f} MiB) "
              f"it picks {capped.label()}, measured peak {capped_peak * 1024:.0f} MiB.", ""]
    lines += published_lines()
    targets = [
        *_memory_targets(ok),
        Target("time: Kendall tau of the two-process layouts", tau, 0.8, True),
        Target("time: the first choice's measured step / the measured best",
               chosen["measured"]["step_s"] / best_measured if chosen else float("nan"), 1.10, False),
        Target("cap: the capped choice's measured peak / the cap", capped_peak / cap_gib, 1.0, False),
    ]
    data = {"params": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows, "tau": tau,
            "first_choice": asdict(first), "cap_gib": cap_gib, "capped_choice": asdict(capped), "capped_peak_gib": capped_peak}
    return Result("plan", "Layout planner", "\n".join(lines), data, targets)


def _memory_lines(rows: list[dict[str, Any]], args: argparse.Namespace, spec: Any) -> list[str]:
    """The memory table: each term predicted / measured, the peak, the step."""
    lines = [
        f"Layout planner against measured runs: {args.preset} (d {spec.dim}, {spec.n_layers} layers, vocab 256), batch "
        f"{args.batch} x seq {args.seq}, fp32, boost (inductor), one thread per process, {args.steps} steps per job "
        f"(the median of steps {args.warmup + 2}-{args.steps - 1}); the "
        "cpu hardware file. Memory per device in MiB, predicted / measured (error), the worst pipeline rank "
        "(FSDP2: the rank of the highest peak; its saved activations are the block graphs' and their inputs, "
        "the head and loss running eagerly outside them).",
        "",
        "| layout | procs | params | grads | optimizer | DDP buckets | saved activations / micro-batch | peak | "
        "step predicted (s) | step measured (s): median (range) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "measured" not in r:
            lines.append(f"| {r['label']} | {r['processes']} | failed: {r['error'].splitlines()[0]} |")
            continue
        p, m = r["predicted"]["ranks"], r["measured"]["ranks"]
        cells = []
        for term in (*STATE_TERMS, "saved_activations", "peak"):
            pv, mv = max(x[term] for x in p), max(x[term] or 0 for x in m)
            if all(x[term] is None for x in m):  # not measured (saved activations of pipeline stages under FSDP2)
                cells.append(f"{pv / MIB:.2f} / -")
                continue
            cells.append(f"{pv / MIB:.2f} / {mv / MIB:.2f} ({r['errors'][term]:+.1%})" if mv or pv else "0 / 0")
        steps = r["measured"].get("steps_s") or []
        spread = f" ({min(steps):.2f}-{max(steps):.2f})" if len(steps) > 1 else ""
        lines.append(f"| {r['label']} | {r['processes']} | " + " | ".join(cells)
                     + f" | {r['predicted']['step_s']:.3f} | {r['measured']['step_s']:.3f}{spread} |")
    return [*lines, ""]


def fsdp_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The FSDP2 rows' terms that no tensor accounting measures one by one: the planner's, and the
    measured peak less the measured params, optimizer state and saved bytes (what the profile saw
    above those: the gathered weights, the head and loss, gradients and reduce-scatter buffers)."""
    fsdp = [r for r in rows if r["layout"]["dp_shard"] > 1 and "measured" in r]
    if not fsdp:
        return []
    lines = ["FSDP2 rows, MiB: the planner's terms live at its peak besides the states and saved activations, and their "
             "sum (the rest) against the measured peak less the measured params, optimizer state and saved "
             "activations; `end` is the profile's running sum at the step's end (frees it misses).", "",
             "| layout | head | temporary | gathered | kept | rest: predicted / measured | peak error | end |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in fsdp:
        ranks = zip(r["predicted"]["ranks"], r["measured"]["ranks"], r["measured"]["reports"], strict=True)
        for i, (p, m, report) in enumerate(ranks):
            stage = f" (pp rank {i})" if r["layout"]["pp"] > 1 else ""
            rest_p = p["peak"] - p["params"] - p["optimizer"] - p["activations"]
            # pipeline stages under FSDP2: no saved bytes measured, so no measured rest
            rest_m = "-" if m["saved_activations"] is None else \
                f"{(m['peak'] - m['params'] - m['optimizer'] - m['saved_activations']) / MIB:.2f}"
            cells = [f"{p[t] / MIB:.2f}" for t in FSDP_PREDICTED]
            lines.append(f"| {r['label']}{stage} | " + " | ".join(cells) + f" | {rest_p / MIB:.2f} / {rest_m} | "
                         f"{(p['peak'] - m['peak']) / m['peak']:+.1%} | {(report.get('end_above_start') or 0) / MIB:.2f} |")
    return [*lines, ""]


def _memory_targets(ok: list[dict[str, Any]]) -> list[Target]:
    worst_term = max((e for r in ok if "errors" in r for t, e in r["errors"].items() if t != "peak"), default=float("nan"))
    worst_peak = max((r["errors"]["peak"] for r in ok if "errors" in r), default=float("nan"))
    fsdp_peak = max((r["errors"]["peak"] for r in ok if "errors" in r and r["layout"]["dp_shard"] > 1), default=float("nan"))
    return [
        Target("memory: the worst term's relative error (states, saved activations)", worst_term, 0.10, False),
        Target("memory: the worst peak's relative error", worst_peak, 0.15, False),
        Target("memory: the worst FSDP2 peak's relative error", fsdp_peak, 0.10, False),
    ]


def _fsdp_result(args: argparse.Namespace, spec: Any, rows: list[dict[str, Any]]) -> Result:
    """``--only fsdp``: the FSDP2 and HSDP layouts' memory tables and targets (result ``plan-fsdp``)."""
    ok = [r for r in rows if "measured" in r]
    data = {"params": {k: v for k, v in vars(args).items() if k != "func"}, "rows": rows}
    return Result("plan-fsdp", "Layout planner: FSDP2 memory", "\n".join(_memory_lines(rows, args, spec) + fsdp_lines(rows)),
                  data, _memory_targets(ok))


def published_lines() -> list[str]:
    """BOOST.md section 6's settings: the planner's choice beside the published layout, and 64 H200."""
    lines = ["BOOST.md section 6 (A100-80GB, batch 4 x 4096, bf16-mixed memory, 90% of each GPU usable): the published "
             "layout and the planner's choice, both priced by the planner.", "",
             "| model | GPUs | published layout | predicted (published s) | planner's choice | predicted | memory (GiB) | gain | why |",
             "|---|---:|---|---:|---|---:|---:|---:|---|"]
    for c in published_choices():
        pub = c.published_row
        lines.append(f"| {c.model} | {c.devices} | {c.published_layout.label()} | {pub.step_s:.3f} ({c.published_s:.2f}) | "
                     f"{c.chosen.layout.label()} | {c.chosen.step_s:.3f} | {c.chosen.memory_gib:.1f} | {c.gain:.2f}x | {why(c)} |")
    big = cluster_choice()
    lines += ["", f"cola-7B on 64 H200 (8 per node), batch 64 x 4096: {big.chosen.layout.label()}, predicted "
              f"{big.chosen.step_s:.3f} s, {big.chosen.memory_gib:.1f} GiB per GPU (of {big.layouts} layouts priced).",
              f"Its command: `{big.chosen.command}`"]
    return lines


def chart(result: Result, path: str) -> None:
    rows = [r for r in result.data["rows"] if "measured" in r]
    bar_chart(path, "Planner: predicted / measured", [r["label"] for r in rows],
              {"peak": [max(x["peak"] for x in r["predicted"]["ranks"]) / max(x["peak"] for x in r["measured"]["ranks"]) for r in rows],
               "step": [r["predicted"]["step_s"] / r["measured"]["step_s"] for r in rows]}, "predicted / measured", ref=1.0)
