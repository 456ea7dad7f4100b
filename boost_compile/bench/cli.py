"""``boost-bench``: side-by-side benchmarks and the report that collects them.

    boost-bench single | tp | pp | ep | memory | scale | plan [options]  one benchmark: prints its table,
                                                               writes <out>/<name>.json and .png
    boost-bench scale --hardware cpu                           the scale model beside tp's and pp's
                                                               steps: <out>/scale-cpu.json and .png
    boost-bench tp-analytic                                    the bytes-per-layer table only
    boost-bench calibrate [--out FILE] [--quick]               measure this CPU's constants: the
                                                               cpu hardware file
    boost-bench all [--out DIR] [--report FILE]                every benchmark of ALL in turn,
                                                               then the report
    boost-bench report [--out DIR] [--report FILE]             rebuild the report from the JSON files

The report is the generated part of ``benchmarks/RESULTS.md``: each table with
the exact command, commit, machine and date of its run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from boost_compile.bench import calibrate, ep, memory, plan, pp, report, scale, single, tp
from boost_compile.bench.results import Result, save, stamp
from boost_compile.costmodel.formulas import analytic_table

#: name -> (help, add_arguments, run, chart)
BENCHMARKS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Result], Any]] = {
    "single": ("one device: dense eager / dense Inductor / CoLA Inductor / CoLA boost", single.add_arguments, single.run, single.chart),
    "tp": ("TP=2 on CPU: dense megatron / CoLA vanilla (DTensor) / CoLA btp", tp.add_arguments, tp.run, tp.chart),
    "pp": ("CoLA on two CPU processes: 1 process / TP2 btp / PP2 (1F1B) / DP2", pp.add_arguments, pp.run, pp.chart),
    "memory": ("activation checkpointing: none / lowrank / full / budget", memory.add_arguments, memory.run, memory.chart),
    "scale": ("analytic model of GPU clusters beside BOOST.md's published figures", scale.add_arguments, scale.run_result, scale.chart),
    "ep": ("a mixture of experts on two CPU processes: EP2 / TP2 (experts whole) / FSDP2 2 (experts gathered)",
           ep.add_arguments, ep.run, ep.chart),
    "plan": ("the layout planner's memory and time beside 18 layouts run here (about 20 minutes; --only fsdp: "
             "the 6 FSDP2 ones, about 5)", plan.add_arguments, plan.run,
             plan.chart),
}
#: what ``all`` runs, in order, each with its defaults (``{out}``: the results folder); the last one
#: puts the scale model beside the steps of tp and of pp (if ``<out>/pp.json`` exists: ``pp`` takes
#: about 4 minutes at 60m and runs on its own) with the bundled cpu hardware file
ALL = [["scale"], ["single"], ["memory"], ["tp"], ["scale", "--hardware", "cpu", "--results", "{out}"]]


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=report.RESULTS_DIR, help="folder of the JSON and PNG results (default: %(default)s)")


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", default=report.REPORT_PATH, help="the Markdown file to regenerate (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="boost-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, add_arguments, _run, _chart) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_)
        add_arguments(p)
        _add_output(p)
    sub.add_parser("tp-analytic", help="only the analytic bytes-per-layer table")
    p = sub.add_parser("calibrate", help="measure this CPU's constants for the scale model: write the cpu hardware file")
    calibrate.add_arguments(p)
    p = sub.add_parser("all", help=f"run {', '.join(' '.join(a) for a in ALL)} in turn, then regenerate the report")
    _add_output(p)
    _add_report(p)
    p = sub.add_parser("report", help="regenerate the report from the saved JSON results")
    _add_output(p)
    _add_report(p)
    return parser


def run_one(name: str, argv: list[str], out: str) -> Result:
    """Run one benchmark from its command-line arguments; print, save and return its result."""
    parser = argparse.ArgumentParser(prog=f"boost-bench {name}")
    BENCHMARKS[name][1](parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = BENCHMARKS[name][2](args)
    stamp(result, [name, *argv], time.perf_counter() - start)
    print(result.markdown(), flush=True)
    for path in save(result, out, BENCHMARKS[name][3]):
        print(f"wrote {path}")
    return result


def _without_out(argv: list[str]) -> list[str]:
    """The benchmark's own arguments: ``--out`` belongs to the CLI, not to the benchmark."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            rest.append(a)
    return rest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "tp-analytic":
        print(analytic_table())
    elif args.command == "calibrate":
        start = time.perf_counter()
        print(calibrate.summary(calibrate.run(args, argv)))
        print(f"wrote {args.out} ({time.perf_counter() - start:.0f} s)")
    elif args.command in BENCHMARKS:
        run_one(args.command, _without_out(argv[1:]), args.out)
    elif args.command == "all":
        start = time.perf_counter()
        for name, *rest in ALL:
            options = [a.format(out=args.out) for a in rest]
            print(f"== boost-bench {' '.join([name, *options])}", flush=True)
            run_one(name, options, args.out)
        print(f"all benchmarks took {time.perf_counter() - start:.0f} s")
        print(f"wrote {report.write(args.out, args.report)}")
    else:
        print(f"wrote {report.write(args.out, args.report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
