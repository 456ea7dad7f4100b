"""``boost-bench pp``: the CoLA model on two CPU processes four ways, one run: 1 process, TP2, PP2, DP2.

    boost-bench pp [--size 60m] [--seq 1024] [--batch 4] [--vocab 256] [--microbatches 4]
                   [--repeats 5] [--warmup 2] [--inner inductor]

One training step (forward + backward, no optimizer step) of the cola preset on
``batch`` sequences of ``seq`` tokens, compiled with the boost backend, run by
two gloo processes (one intra-op thread each, as ``boost-bench tp`` runs them):

- ``1 process``: the unparallelized model, each rank running the whole step at
  once (both cores busy; rank 0's time); the baseline of every ratio;
- ``TP2 btp``: ``parallelize_(plan="btp")`` over both ranks, vocabulary-parallel
  head, as the btp variant of ``boost-bench tp``;
- ``PP2``: ``split_model`` into two stages of blocks, one per rank, each compiled
  and run by the 1F1B schedule (``build_schedule`` / ``pipeline_step``) over
  ``--microbatches`` micro-batches;
- ``DP2``: each rank the whole model on its half of the batch; after the
  backward the gradients are flattened into one buffer, all-reduced (one gloo
  all-reduce, issued by hand: no DDP, no overlap with the backward), divided by
  two and copied back.

All four are built and compiled first, then timed round-robin (one step each,
in turn, with a barrier around every step), wall clock, median of
``--repeats``. Ratios: the 1-process step over each step (speed-up) and each
step over half the 1-process step (x of perfect scaling over two processes).

Communication per step and rank: TP2's collectives from its compiled graphs,
PP2's send/recv from its first stage's output tensor (one micro-batch's
activation out, its gradient back, per micro-batch), DP2's gradient buffer.

The stage boundary of a PP2 x TP2 job: the first of two stages, split from the
CoLA model (btp, ``parallelize_(..., stream_io=True)``) and from the dense
model of the same size (megatron), is parallelized over the two ranks,
compiled (inner ``aot_eager``: only its output is read) and run forward on one
micro-batch. Its output is what each rank of that stage sends per micro-batch;
the gradient it receives back has the output's shape (``PipelineStage`` derives
the gradient's metadata from the output's).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from boost_compile.bench.results import Result, Target, bar_chart
from boost_compile.bench.tp import _census, _compiled_step, _setup, _synced
from boost_compile.process_exit import exit_without_finalizing

SINGLE = "1 process"
TP2 = "TP2 btp"
PP2 = "PP2"
DP2 = "DP2"
#: row label -> (TP, PP, DP) degrees
LAYOUTS = {SINGLE: (1, 1, 1), TP2: (2, 1, 1), PP2: (1, 2, 1), DP2: (1, 1, 2)}
#: the stage plans compared at a PP2 x TP2 boundary -> their model family
STAGE_PLANS = {"btp": "cola", "megatron": "dense"}
DEFAULT_MICROBATCHES = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="60m", help="tiny, or the suffix of the llama-/cola- presets")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256, help="override the presets' vocabulary (0 keeps it)")
    p.add_argument("--microbatches", type=int, default=DEFAULT_MICROBATCHES, help="PP2's micro-batches per step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The pipeline's loss on the last stage's logits: the model's own cross-entropy."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _compile(module: torch.nn.Module, inner: str) -> torch.nn.Module:
    from boost_compile.backend import Recorder, compile_graph
    from boost_compile.config import BoostConfig

    config = BoostConfig.from_options({"inner": inner})
    backend = functools.partial(compile_graph, config=config, recorder=Recorder(keep_view=False))
    return torch.compile(module, backend=backend, dynamic=False)


def _timed(run: Callable[[], Any], params: list[torch.nn.Parameter]) -> Callable[[], float]:
    """``run`` with the gradients cleared first; returns its wall time."""

    def step() -> float:
        for p in params:
            p.grad = None
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    return step


def _pipeline(preset: str, args: dict[str, Any], rank: int, world: int) -> tuple[Callable[[], float], Callable[[], torch.Tensor]]:
    """PP2: this rank's stage under 1F1B; also a probe that runs the stage on one micro-batch."""
    import torch.distributed as dist

    from boost_compile.bench import timing
    from boost_compile.distributed.pipeline import build_schedule, pipeline_step, split_model

    model = timing.build_model(preset, args["seq"], args["vocab"])
    tokens = timing.tokens_for(model, args["batch"], args["seq"])
    mb = args["batch"] // args["microbatches"]
    stage = split_model(model, rank, world)
    compiled = _compile(stage, args["inner"])
    schedule = build_schedule([compiled], [rank], world, dist.group.WORLD, args["microbatches"], "1f1b", loss_fn,
                              example_microbatch=tokens[:mb], batch_size=args["batch"])
    step = _timed(lambda: pipeline_step(schedule, tokens, tokens), list(stage.parameters()))
    return step, lambda: compiled(tokens[:mb])


def all_reduce_gradients(params: list[torch.nn.Parameter], world: int) -> int:
    """Average the gradients over the ranks with one all-reduce of a flat buffer; returns its bytes."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


def _data_parallel(preset: str, args: dict[str, Any], rank: int, world: int) -> tuple[Callable[[], float], list[int]]:
    """DP2: the whole model on this rank's share of the batch, then the gradient all-reduce."""
    from boost_compile.backend import Recorder
    from boost_compile.bench import timing

    model = timing.build_model(preset, args["seq"], args["vocab"])
    share = args["batch"] // world
    tokens = timing.tokens_for(model, args["batch"], args["seq"])[rank * share:(rank + 1) * share]
    train = _compiled_step(model, tokens, args["inner"], Recorder(keep_view=False))
    params = [p for p in model.parameters() if p.requires_grad]
    sent: list[int] = []

    def step() -> float:
        t = train()
        start = time.perf_counter()
        sent.append(all_reduce_gradients(params, world))
        return t + time.perf_counter() - start

    return step, sent


def stage_output(preset: str, plan: str, args: dict[str, Any], tp_group: Any) -> dict[str, Any]:
    """The first of two pipeline stages, parallelized with ``plan`` over ``tp_group``: one micro-batch's output."""
    import boost_compile as bc
    from boost_compile.bench import timing
    from boost_compile.distributed.pipeline import split_model

    model = timing.build_model(preset, args["seq"], args["vocab"])
    mb = args["batch"] // args["microbatches"]
    tokens = timing.tokens_for(model, mb, args["seq"])
    stage = split_model(model, 0, 2)
    bc.parallelize_(stage, (tokens,), tp_group, plan=plan, stream_io=True)
    with torch.no_grad():
        out = _compile(stage, "aot_eager")(tokens)
    return {
        "preset": preset,
        "shape": list(out.shape),
        "dtype": str(out.dtype).removeprefix("torch."),
        "microbatch_bytes": out.numel() * out.element_size(),
        "stream_shards": getattr(stage, "_boost_stream_shards", 1),
    }


def _tensor_parallel(preset: str, args: dict[str, Any]) -> tuple[Callable[[], float], Any]:
    """TP2: the model under btp over both ranks; also the recorder of its compiled graphs."""
    import torch.distributed as dist

    import boost_compile as bc
    from boost_compile.backend import Recorder
    from boost_compile.bench import timing

    model = timing.build_model(preset, args["seq"], args["vocab"])
    tokens = timing.tokens_for(model, args["batch"], args["seq"])
    bc.parallelize_(model, (tokens,), dist.group.WORLD, plan="btp", vocab_parallel=True)
    record = Recorder(keep_view=False)
    return _compiled_step(model, tokens, args["inner"], record), record


def _communication(tp_record: Any, pp_out: torch.Tensor | None, dp_sent: list[int], microbatches: int) -> dict[str, Any]:
    """What one rank sends per step in each variant (``pp_out``: the first stage's output, on rank 0)."""
    colls = _census(tp_record)
    activation = pp_out.numel() * pp_out.element_size() if pp_out is not None else 0
    return {
        SINGLE: {"kind": "none", "count": 0, "bytes": 0},
        TP2: {"kind": "collectives", "count": sum(len(v) for v in colls.values()),
              "bytes": sum(c["bytes"] or 0 for v in colls.values() for c in v)},
        PP2: {"kind": "send/recv", "count": 2 * microbatches, "bytes": 2 * microbatches * activation,
              "shape": list(pp_out.shape) if pp_out is not None else []},
        DP2: {"kind": "all-reduce", "count": 1, "bytes": dp_sent[-1]},
    }


def _worker(rank: int, world: int, store: str, args: dict[str, Any], out_path: str) -> None:
    import torch.distributed as dist

    from boost_compile.backend import Recorder
    from boost_compile.bench import timing

    threads = _setup(rank, world, store, False)
    presets = dict(zip(("dense", "cola"), timing.preset_pair(args["size"]), strict=True))
    model = timing.build_model(presets["cola"], args["seq"], args["vocab"])
    tokens = timing.tokens_for(model, args["batch"], args["seq"])
    tp_step, tp_record = _tensor_parallel(presets["cola"], args)
    pp_step, pp_probe = _pipeline(presets["cola"], args, rank, world)
    dp_step, dp_sent = _data_parallel(presets["cola"], args, rank, world)
    steps = {
        SINGLE: _synced(_compiled_step(model, tokens, args["inner"], Recorder(keep_view=False))),
        TP2: _synced(tp_step),
        PP2: _synced(pp_step),
        DP2: _synced(dp_step),
    }
    times = timing.round_robin(steps, args["repeats"], args["warmup"])
    pp_out = pp_probe() if rank == 0 else None  # rank 0 holds the first stage: what it sends per micro-batch
    dist.barrier()
    boundary = {plan: stage_output(presets[family], plan, args, dist.group.WORLD) for plan, family in STAGE_PLANS.items()}
    comm = _communication(tp_record, pp_out, dp_sent, args["microbatches"])
    if rank == 0:
        rows = {label: {"step_s": statistics.median(t), "times_s": t, "comm": comm[label]} for label, t in times.items()}
        with open(out_path, "w") as f:
            json.dump({"threads": threads, "vocab": model.config.vocab_size, "preset": presets["cola"],
                       "layers": model.config.n_layers, "rows": rows, "boundary": boundary}, f)
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo's threads outlive the group (boost_compile/process_exit.py)


def ratios(rows: dict[str, dict[str, Any]], tokens: int, microbatches: int) -> None:
    """Add each row's layout, tokens/s, speed-up over the 1-process step and x of perfect scaling."""
    base = rows[SINGLE]["step_s"]
    for label, r in rows.items():
        tp, pp, dp = LAYOUTS[label]
        r.update(tp=tp, pp=pp, dp=dp, micro_batches=microbatches if pp > 1 else 1, tokens=tokens,
                 tokens_per_s=tokens / r["step_s"], speedup=base / r["step_s"],
                 x_of_perfect=None if label == SINGLE else r["step_s"] / (base / 2))


def boundary_bytes(boundary: dict[str, dict[str, Any]], microbatches: int) -> None:
    """Add the bytes per step one rank sends and receives at the stage boundary, and each plan / megatron."""
    for b in boundary.values():
        b["step_bytes"] = 2 * microbatches * b["microbatch_bytes"]
    for b in boundary.values():
        b["of_megatron"] = b["step_bytes"] / boundary["megatron"]["step_bytes"]


def _rows_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        (f"| variant | TP | PP | DP | step (ms) | min-max (ms) | tokens/s | speed-up over {SINGLE} | x of perfect scaling "
         "| communication per step and rank |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in rows.items():
        c = r["comm"]
        comm = "none" if not c["count"] else f"{c['count']} {c['kind']}, {c['bytes']:,} B"
        perfect = "-" if r["x_of_perfect"] is None else f"{r['x_of_perfect']:.2f}"
        name = f"{label} (1F1B, {r['micro_batches']} micro-batches)" if label == PP2 else label
        lines.append(
            f"| {name} | {r['tp']} | {r['pp']} | {r['dp']} | {r['step_s'] * 1e3:.0f} | "
            f"{min(r['times_s']) * 1e3:.0f}-{max(r['times_s']) * 1e3:.0f} | {r['tokens_per_s']:,.0f} | "
            f"{r['speedup']:.2f}x | {perfect} | {comm} |"
        )
    return lines


def _boundary_table(boundary: dict[str, dict[str, Any]], microbatches: int) -> list[str]:
    lines = [
        f"| stage plan (PP2 x TP2) | first stage's output per micro-batch and rank | bytes per micro-batch | "
        f"p2p bytes per step and rank (activations + gradients, {microbatches} micro-batches) | / megatron |",
        "|---|---|---:|---:|---:|",
    ]
    for plan, b in boundary.items():
        lines.append(
            f"| {plan} ({b['preset']}) | [{', '.join(map(str, b['shape']))}] {b['dtype']} | "
            f"{b['microbatch_bytes']:,} | {b['step_bytes']:,} | {b['of_megatron']:.3f} |"
        )
    return lines


def run(args: argparse.Namespace) -> Result:
    import torch.multiprocessing as mp

    if args.batch % args.microbatches or args.batch % 2:
        raise SystemExit(f"--batch {args.batch} must be even (DP2) and a multiple of --microbatches {args.microbatches}")
    folder = tempfile.mkdtemp(prefix="boost_bench_pp_")
    store, out = os.path.join(folder, "store"), os.path.join(folder, "results.json")
    params = {k: getattr(args, k) for k in ("size", "seq", "batch", "vocab", "microbatches", "repeats", "warmup", "inner")}
    mp.spawn(_worker, args=(2, store, params, out), nprocs=2, join=True)
    with open(out) as f:
        data = json.load(f)
    rows, boundary = data["rows"], data["boundary"]
    ratios(rows, args.batch * args.seq, args.microbatches)
    boundary_bytes(boundary, args.microbatches)
    if not rows[TP2]["comm"]["bytes"]:
        raise RuntimeError("TP2's compiled graphs recorded no collective: the census did not run")
    vocab = f"vocab {data['vocab']}" + (f" (--vocab {args.vocab})" if args.vocab else " (the preset's, --vocab 0)")
    lines = [
        f"{data['preset']} ({data['layers']} layers) on CPU, 2 gloo processes ({data['threads']} thread(s) each), "
        f"batch {args.batch} x seq {args.seq}, {vocab}, boost with inner {args.inner}; forward+backward without "
        f"an optimizer step, variants round-robin, wall clock, median of {args.repeats} steps after {args.warmup} "
        f"warm-up steps. {SINGLE}: the unparallelized model on each rank at once, rank 0's time. PP2: one stage "
        f"of blocks per rank, 1F1B. DP2: half the batch per rank, then one all-reduce of the flattened gradients "
        "(by hand, after the backward; no DDP).",
        "",
        *_rows_table(rows),
        "",
        "The stage boundary of PP2 x TP2: the first of two stages parallelized over the two ranks, run forward on "
        "one micro-batch; its output is what each rank sends to the next stage per micro-batch, and the gradient "
        "it receives back has the same shape.",
        "",
        *_boundary_table(boundary, args.microbatches),
    ]
    btp_over_megatron = boundary["btp"]["of_megatron"]
    targets = [Target("btp / megatron p2p bytes at a PP2 x TP2 stage boundary", btp_over_megatron, 0.5, False)]
    result_data = {"params": params, "vocab": data["vocab"], "threads": data["threads"], "preset": data["preset"],
                   "baseline": SINGLE, "rows": rows, "boundary": boundary}
    return Result("pp", "One process, TP2, PP2 and DP2 on CPU (gloo)", "\n".join(lines) + "\n", result_data, targets)


def chart(result: Result, path: str) -> None:
    rows = result.data["rows"]
    bar_chart(
        path,
        f"CoLA on two CPU processes: speed-up over {SINGLE} (2 = perfect scaling)",
        list(rows),
        {"speed-up": [r["speedup"] for r in rows.values()]},
        f"{SINGLE} step / step",
        ref=2.0,
    )
