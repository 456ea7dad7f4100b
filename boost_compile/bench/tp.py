"""``boost-bench tp``: TP=2 on CPU (two gloo processes), one run, three TP variants and two 1-process baselines side by side.

    boost-bench tp [--size 60m] [--seq 1024] [--batch 4] [--vocab 256] [--repeats 5] [--inner inductor] [--profile] [--lax]

The dense model under the megatron plan, the CoLA model under PyTorch's DTensor
plan ("vanilla", what ``parallelize_module`` with Colwise/RowwiseParallel on each
factor gives) and the CoLA model under btp, all compiled with the boost backend.
All three cut the output head on the vocabulary: btp and megatron with boost's
vocabulary-parallel cross-entropy, vanilla with PyTorch's own (the head
``ColwiseParallel`` with DTensor logits, the step under ``loss_parallel()``).
Beside them, in the same two processes, the unparallelized dense and CoLA
models ("1 process": same preset, seed and tokens, boost backend, no
``parallelize_``), each rank running the whole step on its own so both cores
are as busy as during the TP steps; rank 0's times are reported. All five are
compiled first, then timed round-robin (one step each, in turn, with a barrier
around every step), so load on the machine hits them alike. Collectives and
bytes per step are read from the compiled graphs. The baseline of the ratios is
each other variant against btp; the scaling table divides each TP step by half
the 1-process step of its family (perfect scaling over two processes).
The default batch of 4 sequences is BOOST.md's (section 6); at batch 1 the
per-collective latency of gloo weighs more (btp issues about twice as many,
smaller, collectives as megatron).

``--lax`` adds the LaX model (``lax-SIZE``, ``tiny-lax`` at tiny: CoLA whose every
latent also receives the same projection's latent of the previous block) under btp
and unparallelized, beside CoLA's, and the ratios LaX / CoLA.

``--profile`` compiles with Inductor's kernel profiling hooks and, after the
timed steps, profiles one more step of each TP variant on rank 0 (rank 1 runs
it unprofiled): self CPU time by category, see :mod:`boost_compile.bench.profile`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from boost_compile import _torch_compat as compat
from boost_compile.analysis.fx_utils import in_blocks
from boost_compile.bench import profile, timing
from boost_compile.bench.results import Result, Target, bar_chart
from boost_compile.costmodel.formulas import analytic_table
from boost_compile.models.llama import NORMS
from boost_compile.process_exit import exit_without_finalizing

VARIANTS = [
    ("dense, megatron", "dense", "megatron"),
    ("CoLA, vanilla (DTensor)", "cola", "vanilla"),
    ("CoLA, btp", "cola", "btp"),
]
BTP = "CoLA, btp"
MEGATRON = "dense, megatron"
VANILLA = "CoLA, vanilla (DTensor)"
LAX_BTP = "LaX, btp"
#: ``--lax``: the LaX model under btp, beside CoLA's
LAX_VARIANTS = [(LAX_BTP, "lax", "btp")]
#: family -> its unparallelized variant, timed beside the TP ones (each rank runs it whole)
SINGLE = {"dense": "dense, 1 process", "cola": "CoLA, 1 process", "lax": "LaX, 1 process"}


def run_variants(lax: bool = False) -> list[tuple[str, str, str]]:
    """(label, family, plan) of the TP variants of one run: :data:`VARIANTS`, and LaX's with ``lax``."""
    return VARIANTS + (LAX_VARIANTS if lax else [])


def run_singles(lax: bool = False) -> dict[str, str]:
    """family -> label of the 1-process variants of one run (LaX's only with ``lax``)."""
    return {family: label for family, label in SINGLE.items() if lax or family != "lax"}


def run_presets(size: str, lax: bool = False) -> dict[str, str]:
    """family -> preset of one run at ``size``."""
    out = dict(zip(("dense", "cola"), timing.preset_pair(size), strict=True))
    return {**out, "lax": timing.lax_preset(size)} if lax else out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="60m", help="tiny, or the suffix of the llama-/cola- presets")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256, help="override the presets' vocabulary (0 keeps it)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    p.add_argument("--profile", action="store_true", help="profile one more step of each TP variant on rank 0: time by category")
    p.add_argument("--norm", default="rmsnorm", choices=NORMS,
                   help="the models' norms: Llama's RMSNorm, or LayerNorm with a bias (btp: online LayerNorm)")
    p.add_argument("--lax", action="store_true",
                   help="also the LaX model (lax-SIZE, tiny-lax at tiny) under btp and in 1 process, beside CoLA")


def _setup(rank: int, world: int, store: str, kernel_profile: bool) -> int:
    """Join the gloo group; returns the threads per process."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    return torch.get_num_threads()


def _compile_settings(kernel_profile: bool) -> Any:
    """Room for every variant's graphs; the collective census runs inside the compile, so no
    cache hit may skip it; Inductor's C++ kernels as named profiler events (before anything compiles)."""
    return compat.compile_settings(
        dynamo={"cache_size_limit": 64},
        inductor={"fx_graph_cache": False, "cpp.enable_kernel_profile": kernel_profile},
        functorch={"enable_autograd_cache": False},
    )


def _compiled_step(model: torch.nn.Module, tokens: torch.Tensor, inner: str, recorder: Any) -> Callable[[], float]:
    """The model under the boost backend (``inner`` as the inner compiler): one timed training step."""
    from boost_compile.backend import compile_graph
    from boost_compile.bench import timing
    from boost_compile.config import BoostConfig

    config = BoostConfig.from_options({"inner": inner})
    compiled = torch.compile(model, backend=functools.partial(compile_graph, config=config, recorder=recorder), dynamic=False)
    return timing.train_step(model, compiled, tokens, "wall")


def _synced(step: Callable[[], float]) -> Callable[[], float]:
    """``step`` between two barriers, so the ranks start and end each step together."""
    import torch.distributed as dist

    def run() -> float:
        dist.barrier()
        t = step()
        dist.barrier()
        return t

    return run


def _under_loss_parallel(step: Callable[[], float]) -> Callable[[], float]:
    """PyTorch's vocabulary-parallel loss on DTensor logits: forward and backward inside ``loss_parallel()``."""
    from torch.distributed.tensor.parallel import loss_parallel

    def run() -> float:
        with loss_parallel():
            return step()

    return run


def _head_width(model: torch.nn.Module, report: Any) -> int:
    """This rank's logits width: the head's vocabulary shard (boost's spec, or a DTensor's local part)."""
    params = dict(model.named_parameters())
    cut = [params[name].shape[s.dim] for name, s in report.specs.items() if s.head and s.dim is not None]
    if cut:
        return cut[0]
    local = [p.to_local().shape[0] for n, p in params.items() if hasattr(p, "to_local") and n.startswith(("output.", "lm_head."))]
    return local[0] if local else model.config.vocab_size


def _census(rec: Any) -> dict[str, list[dict[str, Any]]]:
    """The collectives the compiled forward and backward graphs issue."""
    census = [r for g in rec.graphs for r in g.aten_reports if r.name == "collective_census"]
    return {k: [c for r in census if r.details["graph"] == k for c in r.details["collectives"]] for k in ("forward", "backward")}


def _profile_variants(rank: int, steps: dict[str, Callable[[], float]], heads: dict[str, int], dims: dict[str, int],
                      tokens: int) -> dict[str, Any]:
    """One profiled step of each variant on rank 0; the other rank runs it unprofiled (collectives need both)."""
    import torch.distributed as dist

    out = {}
    for label, step in steps.items():
        dist.barrier()
        if rank == 0:
            out[label] = profile.breakdown(step, heads[label], dims[label], tokens)
        else:
            step()
        dist.barrier()
    return out


def _worker(rank: int, world: int, store: str, args: dict[str, Any], out_path: str) -> None:
    import torch.distributed as dist

    import boost_compile as bc
    from boost_compile.backend import Recorder

    threads = _setup(rank, world, store, args["profile"])
    lax = args["lax"]
    with _compile_settings(args["profile"]):
        family_presets = run_presets(args["size"], lax)
        raw, steps, records, layers, heads, dims = {}, {}, {}, {}, {}, {}
        for label, family, plan in run_variants(lax):
            model = timing.build_model(family_presets[family], args["seq"], args["vocab"], norm=args["norm"])
            tokens = timing.tokens_for(model, args["batch"], args["seq"])
            report = bc.parallelize_(model, (tokens,), dist.group.WORLD, plan=plan, vocab_parallel=True)
            records[label] = Recorder(keep_view=False)
            raw[label] = _compiled_step(model, tokens, args["inner"], records[label])
            if plan == "vanilla":
                raw[label] = _under_loss_parallel(raw[label])
            steps[label], layers[label], heads[label] = _synced(raw[label]), model.config.n_layers, _head_width(model, report)
            dims[label] = model.config.dim
        for family, label in run_singles(lax).items():
            model = timing.build_model(family_presets[family], args["seq"], args["vocab"], norm=args["norm"])
            tokens = timing.tokens_for(model, args["batch"], args["seq"])
            steps[label] = _synced(_compiled_step(model, tokens, args["inner"], Recorder(keep_view=False)))
        times = timing.round_robin(steps, args["repeats"], args["warmup"])
        tokens_per_step = args["batch"] * args["seq"]
        profiles = _profile_variants(rank, raw, heads, dims, tokens_per_step) if args["profile"] else {}
        rows = {}
        for label, family, plan in run_variants(lax):
            colls = _census(records[label])
            rows[label] = {
                "plan": plan,
                "preset": family_presets[family],
                "step_s": statistics.median(times[label]),
                "times_s": times[label],
                "tokens": tokens_per_step,
                "layers": layers[label],
                "head_width": heads[label],
                "collectives": {k: len(v) for k, v in colls.items()},
                "bytes": {k: sum(c["bytes"] or 0 for c in v) for k, v in colls.items()},
                # what the blocks send (the gather before the final norm and the loss's [T] reductions left out)
                "block_bytes": {k: sum(c["bytes"] or 0 for c in v if in_blocks(c.get("module") or "")) for k, v in colls.items()},
            }
        single = {
            label: {"preset": family_presets[family], "step_s": statistics.median(times[label]), "times_s": times[label],
                    "tokens": tokens_per_step}
            for family, label in run_singles(lax).items()
        }
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"threads": threads, "vocab": model.config.vocab_size, "variants": rows, "single": single,
                           "profile": profiles}, f)
        dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


def scaling(variants: dict[str, dict[str, Any]], single: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Add each TP variant's 1-process time, perfect scaling and x of it; return the summary ratios.

    Perfect scaling over two processes is half the 1-process step of the
    variant's family; ``x_of_perfect`` is the TP step over that (1: perfect).
    With LaX's variants (``--lax``), also LaX's steps over CoLA's.
    """
    lax = LAX_BTP in variants
    for label, family, _plan in run_variants(lax):
        r, base = variants[label], single[SINGLE[family]]["step_s"]
        r.update(single=SINGLE[family], single_s=base, perfect_s=base / 2, x_of_perfect=r["step_s"] / (base / 2))
    dense, cola = single[SINGLE["dense"]]["step_s"], single[SINGLE["cola"]]["step_s"]
    btp = variants[BTP]["step_s"]
    over_megatron = variants[MEGATRON]["step_s"] / btp
    summary = {
        "single_cola_over_dense": cola / dense,
        "single_dense_over_cola": dense / cola,
        "btp_speedup_over_megatron": over_megatron,
        "btp_speedup_over_megatron_per_single_ratio": over_megatron / (dense / cola),
        "btp_speedup_over_vanilla": variants[VANILLA]["step_s"] / btp,
        "btp_x_of_perfect": variants[BTP]["x_of_perfect"],
    }
    if lax:
        summary |= {
            "lax_btp_over_cola_btp": variants[LAX_BTP]["step_s"] / btp,
            "single_lax_over_cola": single[SINGLE["lax"]]["step_s"] / cola,
            "lax_btp_x_of_perfect": variants[LAX_BTP]["x_of_perfect"],
        }
    return summary


def _variants_table(variants: dict[str, dict[str, Any]]) -> list[str]:
    """The TP variants: times, collectives, bytes and the ratios against btp (added to the rows)."""
    btp = variants[BTP]
    btp_total = btp["bytes"]["forward"] + btp["bytes"]["backward"]
    lines = [
        ("| variant | step (ms) | min-max (ms) | tokens/s | collectives fwd/bwd | bytes/step fwd | bytes/step bwd | btp speed-up "
         "| btp bytes / variant |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in variants.items():
        total = r["bytes"]["forward"] + r["bytes"]["backward"]
        r["btp_speedup"] = r["step_s"] / btp["step_s"]
        r["btp_bytes_ratio"] = btp_total / total
        lo, hi = min(r["times_s"]) * 1e3, max(r["times_s"]) * 1e3
        lines.append(
            f"| {label} | {r['step_s'] * 1e3:.0f} | {lo:.0f}-{hi:.0f} | {r['tokens'] / r['step_s']:,.0f} | "
            f"{r['collectives']['forward']}/{r['collectives']['backward']} | {r['bytes']['forward']:,} | "
            f"{r['bytes']['backward']:,} | {r['btp_speedup']:.2f}x | {r['btp_bytes_ratio']:.3f} |"
        )
    return lines


def _scaling_table(variants: dict[str, dict[str, Any]], single: dict[str, dict[str, Any]], summary: dict[str, float]) -> list[str]:
    """Each TP variant against half its family's 1-process step, then the cross-family ratios."""
    lines = [
        "| variant | TP=2 step (ms) | 1 process (ms) | perfect scaling (ms) | x of perfect scaling |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, r in variants.items():
        lines.append(f"| {label} | {r['step_s'] * 1e3:.1f} | {r['single']}: {r['single_s'] * 1e3:.1f} | "
                     f"{r['perfect_s'] * 1e3:.1f} | {r['x_of_perfect']:.2f} |")
    lines += ["", "| 1 process | step (ms) | min-max (ms) |", "|---|---:|---:|"]
    for label, r in single.items():
        lines.append(f"| {label} | {r['step_s'] * 1e3:.1f} | {min(r['times_s']) * 1e3:.1f}-{max(r['times_s']) * 1e3:.1f} |")
    s = summary
    lines += [
        "",
        "| ratio | value |",
        "|---|---:|",
        f"| 1 process: CoLA step / dense step | {s['single_cola_over_dense']:.3f} |",
        f"| 1 process: dense step / CoLA step (CoLA's speed-up) | {s['single_dense_over_cola']:.2f}x |",
        f"| btp speed-up over dense megatron | {s['btp_speedup_over_megatron']:.2f}x |",
        (f"| btp speed-up over dense megatron / 1-process dense:CoLA ratio (>= 1: TP keeps the low-rank advantage) "
         f"| {s['btp_speedup_over_megatron_per_single_ratio']:.3f} |"),
        f"| btp speed-up over CoLA vanilla | {s['btp_speedup_over_vanilla']:.2f}x |",
    ]
    if "lax_btp_over_cola_btp" in s:
        lines += [
            f"| LaX btp step / CoLA btp step | {s['lax_btp_over_cola_btp']:.3f} |",
            f"| 1 process: LaX step / CoLA step | {s['single_lax_over_cola']:.3f} |",
            f"| LaX btp x of perfect scaling | {s['lax_btp_x_of_perfect']:.2f} |",
        ]
    return lines


def _profile_section(profiles: dict[str, Any], variants: dict[str, dict[str, Any]]) -> list[str]:
    if not profiles:
        return []
    timed = {label: variants[label]["step_s"] * 1e3 for label in profiles}
    return [
        "",
        "One more step of each TP variant under torch.profiler on rank 0 (rank 1 runs it unprofiled): self CPU time "
        "of the step's thread by category, ms (% of the profiled step); rules in boost_compile/bench/profile.py. "
        "The profiler slows the step; the rest of the profiled step is time in no profiled op.",
        "",
        profile.markdown(profiles, timed),
    ]


def targets(args: argparse.Namespace, variants: dict[str, dict[str, Any]], summary: dict[str, float]) -> list[Target]:
    """The issue's targets, for the 60m shapes at sequence length 1024 (any vocabulary)."""
    if (args.size, args.seq) != ("60m", 1024):
        return []
    dense, vanilla = variants[MEGATRON], variants[VANILLA]
    return [
        Target("btp speed-up over dense megatron", dense["btp_speedup"], 1.5, True),
        Target("btp bytes / dense megatron bytes", dense["btp_bytes_ratio"], 0.9, False),
        Target("btp bytes / vanilla bytes", vanilla["btp_bytes_ratio"], 0.2, False),
        Target("btp x of perfect scaling", summary["btp_x_of_perfect"], 1.3, False),
        Target("btp speed-up over dense megatron / single-process dense:CoLA ratio", summary["btp_speedup_over_megatron_per_single_ratio"],
               1.0, True),
        Target("btp speed-up over CoLA vanilla", summary["btp_speedup_over_vanilla"], 1.8, True),
    ]


def run(args: argparse.Namespace) -> Result:
    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp(prefix="boost_bench_tp_")
    store, out = os.path.join(folder, "store"), os.path.join(folder, "results.json")
    params = {k: getattr(args, k) for k in ("size", "seq", "batch", "vocab", "repeats", "warmup", "inner", "profile", "norm", "lax")}
    mp.spawn(_worker, args=(2, store, params, out), nprocs=2, join=True)
    with open(out) as f:
        data = json.load(f)
    variants, single = data["variants"], data["single"]
    if not all(r["bytes"]["forward"] for r in variants.values()):
        raise RuntimeError("a variant's compiled graphs recorded no collective: the census did not run")
    vocab = f"vocab {data['vocab']}" + (f" (--vocab {args.vocab})" if args.vocab else " (the presets', --vocab 0)")
    lines = [
        f"TP=2 on CPU (gloo, {data['threads']} thread(s) per process), {variants[MEGATRON]['preset']} vs {variants[BTP]['preset']}"
        f"{' and ' + variants[LAX_BTP]['preset'] if LAX_BTP in variants else ''}, "
        f"batch {args.batch} x seq {args.seq}, {vocab}, {args.norm}, boost with inner {args.inner}"
        f"{' (Inductor kernel profiling on, --profile)' if args.profile else ''}; forward+backward, "
        f"variants round-robin, wall clock, median of {args.repeats} steps after {args.warmup} warm-up steps; "
        "1-process rows: the unparallelized model on each rank at once, rank 0's time.",
        "",
        *_variants_table(variants),
    ]
    summary = scaling(variants, single)
    lines += ["", *_scaling_table(variants, single, summary), *_profile_section(data["profile"], variants)]
    table = "\n".join(lines) + "\n\n" + analytic_table() + "\n"
    result_data = {"params": params, "vocab": data["vocab"], "threads": data["threads"], "variants": variants,
                   "single": single, "scaling": summary, "profile": data["profile"]}
    return Result("tp", "Tensor parallelism, TP=2 on CPU (gloo)", table, result_data, targets(args, variants, summary))


def chart(result: Result, path: str) -> None:
    variants = result.data["variants"]
    labels = list(variants)
    bar_chart(
        path,
        "TP=2 on CPU: variant / btp (above 1: btp is faster, or sends less)",
        labels,
        {
            "step time / btp": [v["btp_speedup"] for v in variants.values()],
            "bytes / btp": [1 / v["btp_bytes_ratio"] for v in variants.values()],
        },
        "ratio to btp",
        ref=1.0,
    )
