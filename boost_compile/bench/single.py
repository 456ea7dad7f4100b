"""``boost-bench single``: one device, the dense model against the CoLA model with and without boost.

    boost-bench single [--size 60m] [--batch 4] [--seq 256] [--repeats 5] [--device cpu]

Variants (same seed, same tokens; forward+backward of the training loss):

- ``dense eager``: the dense Llama in plain PyTorch, what a user starts from;
- ``dense inductor``: the same model under ``torch.compile`` (Inductor);
- ``CoLA inductor``: the CoLA model of the same width under plain Inductor;
- ``CoLA boost``: the CoLA model under ``backend="boost"`` with its defaults.

``--variants`` adds pass-by-pass CoLA variants (all passes off, group only,
rmsnorm only, group + rmsnorm) and ``cola-boost-autotune``: CoLA boost under
torch.compile's ``mode="max-autotune"`` (needs ``--inner inductor``). Ratios are
``baseline time / variant time`` (above 1: faster than the baseline), against
dense eager, dense inductor and, for CoLA rows, CoLA inductor.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from typing import Any

import torch

from boost_compile import _torch_compat as compat
from boost_compile.backend import Recorder, boost_backend, compile_graph
from boost_compile.bench import timing
from boost_compile.bench.results import Result, bar_chart
from boost_compile.config import BoostConfig

GEMMS = ("linear", "matmul", "mm", "addmm")


def variants(device: str) -> dict[str, tuple[str, str, dict[str, Any] | None]]:
    """key -> (label, family, compile options); options None: plain Inductor, "eager": no compile."""
    norm_devices = [device]
    off = {"group": {"enabled": False}, "rmsnorm": {"enabled": False}, "op_census": {"enabled": False}}
    return {
        "dense-eager": ("dense eager", "dense", {"eager": True}),
        "dense-inductor": ("dense inductor", "dense", None),
        "cola-inductor": ("CoLA inductor", "cola", None),
        "cola-boost": ("CoLA boost", "cola", {}),
        "cola-off": ("CoLA boost, all passes off", "cola", off),
        "cola-group": ("CoLA boost, group only", "cola", {"rmsnorm": {"enabled": False}}),
        "cola-rmsnorm": ("CoLA boost, rmsnorm only", "cola", {"group": {"enabled": False}, "rmsnorm": {"devices": norm_devices}}),
        "cola-group-rmsnorm": ("CoLA boost, group + rmsnorm", "cola", {"rmsnorm": {"devices": norm_devices}}),
        "cola-boost-autotune": ("CoLA boost, max-autotune", "cola", {"mode": "max-autotune"}),
    }


DEFAULT_VARIANTS = ["dense-eager", "dense-inductor", "cola-inductor", "cola-boost"]
BASELINES = [("dense-eager", "dense"), ("dense-inductor", "dense"), ("cola-inductor", "cola")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="60m", help="tiny, or the suffix of the llama-/cola- presets (60m, 130m, ...)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256, help="override the presets' vocabulary (0 keeps it)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0 keeps the default)")
    p.add_argument("--clock", default=None, choices=list(timing.CLOCKS), help="default: thread on CPU, wall on CUDA")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(variants("cpu")))
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"), help="the boost variants' inner compiler")


def _compile(model: torch.nn.Module, options: dict[str, Any] | None, inner: str) -> Any:
    if options is not None and options.get("eager"):
        return model
    if options is None:
        return torch.compile(model, backend="inductor")
    return torch.compile(model, backend=boost_backend, options={"inner": inner, **options})


def gemms_per_block(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, float]:
    """GEMMs per decoder block in the captured graph, before and after grouping."""
    rec = Recorder()
    torch.compile(model, backend=functools.partial(compile_graph, config=BoostConfig(inner="eager"), recorder=rec))(tokens)
    (graph,) = rec.graphs
    count = {s.name: sum(v for k, v in s.op_counts.items() if k in GEMMS) for s in graph.stages}
    head = 1
    n = model.config.n_layers
    return (count["captured"] - head) / n, (count.get("group_linears", count["captured"]) - head) / n


def run(args: argparse.Namespace) -> Result:
    with compat.compile_settings(dynamo={"cache_size_limit": 64}):  # room for every variant's graphs
        return _run(args)


def _run(args: argparse.Namespace) -> Result:
    clock = args.clock or ("wall" if args.device == "cuda" else "thread")
    timing.set_threads(args.threads, clock)
    dtype = getattr(torch, args.dtype)
    table = variants(args.device)
    keys = [k for k, _b in BASELINES if k in args.variants] + [k for k in args.variants if k not in dict(BASELINES)]
    for key in keys:  # a bad combination (a mode with --inner aot_eager) stops here, before any model is built
        options = table[key][2]
        if options is not None and not options.get("eager"):
            BoostConfig.from_options({"inner": args.inner, **options})
    presets = dict(zip(("dense", "cola"), timing.preset_pair(args.size), strict=True))
    models = {fam: timing.build_model(p, args.seq, args.vocab, args.device, dtype) for fam, p in presets.items()}
    tokens = timing.tokens_for(models["cola"], args.batch, args.seq, args.device)
    steps = {}
    for key in keys:
        _label, family, options = table[key]
        model = copy.deepcopy(models[family])
        steps[key] = timing.train_step(model, _compile(model, options, args.inner), tokens, clock, args.device)
    times = timing.round_robin(steps, args.repeats, args.warmup)
    med = {k: statistics.median(t) for k, t in times.items()}
    before, after = gemms_per_block(models["cola"], tokens)

    cfg = {fam: m.config for fam, m in models.items()}
    ntok = args.batch * args.seq
    base_cols = [(b, fam) for b, fam in BASELINES if b in med]
    lines = [
        f"Single device: {presets['dense']} (dense) and {presets['cola']} (CoLA, rank {cfg['cola'].rank_attn}), "
        f"d {cfg['cola'].dim}, {cfg['cola'].n_layers} layers, vocab {cfg['cola'].vocab_size}; batch {args.batch} x seq {args.seq}, "
        f"{args.device} {args.dtype}, boost with inner {args.inner}, {torch.get_num_threads()} thread(s), {clock} clock; forward+backward, "
        f"variants round-robin, median of {args.repeats} after {args.warmup} warm-up steps.",
        "",
        "| variant | step (ms) | min-max (ms) | tokens/s | " + " | ".join(f"vs {table[b][0]}" for b, _f in base_cols) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(base_cols),
    ]
    rows = []
    for key in keys:
        label, family, _o = table[key]
        t = med[key]
        ratios = {table[b][0]: (med[b] / t if fam == "dense" or family == fam else None) for b, fam in base_cols}
        cells = [f"{r:.2f}x" if r is not None else "-" for r in ratios.values()]
        lines.append(
            f"| {label} | {t * 1e3:.1f} | {min(times[key]) * 1e3:.1f}-{max(times[key]) * 1e3:.1f} | {ntok / t:,.0f} | "
            + " | ".join(cells) + " |"
        )
        rows.append({"key": key, "label": label, "family": family, "step_s": t, "times_s": times[key], "tokens_per_s": ntok / t,
                     "ratios": ratios})
    lines += ["", f"GEMMs per CoLA block: {before:g} as captured, {after:g} after grouping."]
    data = {"params": {k: v for k, v in vars(args).items() if k != "func"}, "clock": clock, "rows": rows,
            "gemms_per_block": [before, after]}
    return Result("single", "Single device: dense and CoLA, eager, Inductor and boost", "\n".join(lines), data)


def chart(result: Result, path: str) -> None:
    rows = result.data["rows"]
    base = next(r for r in rows if r["key"] == rows[0]["key"])
    bar_chart(
        path,
        f"Single device: speed-up vs {base['label']} (higher is faster)",
        [r["label"] for r in rows],
        {"speed-up": [base["step_s"] / r["step_s"] for r in rows]},
        f"{base['label']} time / variant time",
        ref=1.0,
    )
