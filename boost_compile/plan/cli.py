"""``boost-plan``: which layout for this model on these devices, ranked by predicted step time.

    boost-plan --model cola-7b --devices 4 --batch 4 --seq 4096 --hardware a100-80gb-nvlink
    boost-plan --model path/to/config.json --devices 64 --per-node 8 --hardware h200 --json plan.json
    boost-plan --model deepseek-v3-lite --devices 64 --per-node 8 --batch 256 --seq 4096 --hardware h100

The model is a preset (``cola-60m``, or one the planner adds: ``cola-13b``, the DeepSeek-V3-shaped
``deepseek-v3`` and ``deepseek-v3-lite``), a boost-train model config (``hydra_conf/model/*.yaml``
by name or path) or a Hugging Face ``config.json`` (or its folder). The table lists the best
layouts that fit, each with its predicted step, tokens/s and memory per device by term (FSDP2's
columns, and ``ep``, when a row shown has them); below it the launch command of each row.
``--json FILE`` writes every row, best first. ``--no-fsdp`` leaves FSDP2 and HSDP layouts out,
``--no-ep`` expert parallelism; ``--moe-imbalance`` is the busiest EP rank's routed rows over the mean.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from boost_compile.costmodel.hardware import HARDWARE_FILES, load_hardware
from boost_compile.export_folder import export_info
from boost_compile.plan.memory import PRECISIONS
from boost_compile.plan.model import (
    HF_SHAPES,
    MOE_IMBALANCE,
    SHAPE_PRESETS,
    ModelSpec,
    factorized,
    from_hf_config,
    from_preset,
    hf_shape_args,
    largest_block_tensor,
    preset_args,
)
from boost_compile.plan.search import CHECKPOINTS, USABLE, Job, PlanError, Row, best, search, usable_memory

TERM_LABELS = {"params": "params", "grads": "grads", "optimizer": "optim", "dp_buckets": "ddp",
               "activations": "acts", "head": "head", "temporary": "temp"}
#: FSDP2's terms: a column each when a row shown has it
FSDP_LABELS = {"fsdp_gathered": "gathered", "fsdp_kept": "kept", "fsdp_accum": "accum"}


def load_model(model: str, *, vocab_size: int | None = None) -> tuple[ModelSpec, tuple[str, ...]]:
    """A :class:`ModelSpec` and the boost-train arguments that name the same model."""
    from boost_compile.models import LlamaConfig

    path = Path(model).expanduser()
    if model in LlamaConfig.presets():
        overrides = {"vocab_size": vocab_size} if vocab_size else {}
        named = _model_config(model) is not None  # hydra_conf/model/<preset>.yaml
        args = (f"model={model}" if named else f"model.preset={model}",) + (
            (f"+model.overrides.vocab_size={vocab_size}",) if vocab_size else ())
        return from_preset(model, **overrides), args
    if model in HF_SHAPES:
        spec = from_hf_config(HF_SHAPES[model], model)
        vocab = (f"++model.hf_config.vocab_size={vocab_size}",) if vocab_size else ()
        return (spec.with_vocab(vocab_size) if vocab_size else spec), hf_shape_args(model) + vocab
    if model in SHAPE_PRESETS:
        vocab = (f"+model.overrides.vocab_size={vocab_size}",) if vocab_size else ()
        return from_preset(model, **({"vocab_size": vocab_size} if vocab_size else {})), preset_args(model) + vocab
    if path.suffix == ".json" or (path.is_dir() and (path / "config.json").is_file()):
        spec = from_hf_config(path)
        exported = ("model.pretrained=true",) if export_info(path) is not None else ()  # its weights are the point
        return (spec.with_vocab(vocab_size) if vocab_size else spec), ("model=hf", f"model.hf_path={path}", *exported)
    yaml_path = path if path.suffix in (".yaml", ".yml") else _model_config(model)
    if yaml_path is not None:
        from omegaconf import OmegaConf

        group = OmegaConf.to_container(OmegaConf.load(yaml_path), resolve=True)
        assert isinstance(group, dict)
        if group.get("preset"):
            extra = dict(group.get("overrides") or {})
            if vocab_size:
                extra["vocab_size"] = vocab_size
            if _model_config(yaml_path.stem) == yaml_path.resolve():  # one of boost-train's model configs
                args = (f"model={yaml_path.stem}",)
            else:
                given = (group.get("overrides") or {}).items()
                args = (f"model.preset={group['preset']}", *(f"+model.overrides.{k}={v}" for k, v in given))
            if vocab_size:
                args += (f"+model.overrides.vocab_size={vocab_size}",)
            return from_preset(group["preset"], **extra), args
        if group.get("hf_path"):
            return from_hf_config(group["hf_path"]), (f"model.hf_path={group['hf_path']}",)
        if group.get("hf_config"):
            return from_hf_config(dict(group["hf_config"]), yaml_path.stem), (f"model={yaml_path.stem}",)
    raise SystemExit(
        f"boost-plan: --model {model!r} is not a preset ({', '.join(LlamaConfig.presets()[:6])}, ...), a boost-train "
        "model config (hydra_conf/model/<name>.yaml) nor a Hugging Face config.json"
    )


def _model_config(name: str) -> Path | None:
    from boost_compile.train.config import config_dir

    candidate = config_dir() / "model" / f"{name}.yaml"
    return candidate.resolve() if candidate.is_file() else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset, boost-train model config (name or .yaml), or Hugging Face config.json")
    p.add_argument("--devices", type=int, required=True, help="number of devices (processes) of the job")
    p.add_argument("--per-node", type=int, default=8, help="devices per node: tensor parallelism stays inside one (default 8)")
    p.add_argument("--batch", type=int, required=True, help="global batch, sequences per step")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--hardware", default="a100-80gb-nvlink", help=f"{', '.join(HARDWARE_FILES)} or a path to a hardware file")
    p.add_argument("--memory-gib", type=float, default=None,
                   help=f"usable memory per device (default: {USABLE * 100:.0f}%% of the hardware file's memory_gib)")
    p.add_argument("--precision", default=None, choices=list(PRECISIONS), help="trainer.precision (default: fp32 on cpu, bf16-mixed else)")
    p.add_argument("--vocab-size", type=int, default=None, help="the vocabulary the run trains with (default: the model's)")
    p.add_argument("--rank", type=int, default=None, help="plan a dense model factorized at this rank (boost-train's factorize=)")
    p.add_argument("--plans", nargs="+", default=None, choices=["btp", "megatron", "vanilla"],
                   help="TP plans to consider (default: btp and vanilla for low-rank models, megatron for dense)")
    p.add_argument("--checkpoints", nargs="+", default=list(CHECKPOINTS), choices=list(CHECKPOINTS))
    p.add_argument("--init", default="per_parameter", choices=["per_parameter", "global_rng"],
                   help="boost-train's model.init: the start priced built on meta, each rank its part (default), or "
                        "built whole on every rank (--rank: factorized on meta by SVD, one dense weight at a time)")
    p.add_argument("--no-fsdp", action="store_true", help="leave out FSDP2 and HSDP layouts (parallel.dp_shard > 1)")
    p.add_argument("--no-ep", action="store_true", help="leave out expert parallelism (parallel.ep > 1) for a mixture of experts")
    p.add_argument("--ep-only", action="store_true",
                   help="show only the layouts with expert parallelism (their places in the whole ranking in the # column)")
    p.add_argument("--moe-imbalance", type=float, default=MOE_IMBALANCE,
                   help=f"a mixture of experts under EP: the busiest rank's routed rows over the mean (default {MOE_IMBALANCE})")
    p.add_argument("--top", type=int, default=10, help="rows in the table (default 10)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row, best first, as JSON")


def make_job(args: argparse.Namespace) -> Job:
    hw = load_hardware(args.hardware)
    spec, model_args = load_model(args.model, vocab_size=args.vocab_size)
    svd_elements = 0
    if args.rank:
        svd_elements = largest_block_tensor(spec)
        spec = factorized(spec, args.rank)
        model_args = (*model_args, "factorize.enabled=true", f"factorize.rank={args.rank}")
    try:
        memory = usable_memory(hw, args.memory_gib)
    except ValueError as exc:
        raise SystemExit(f"boost-plan: {exc} (--memory-gib)") from exc
    precision = args.precision or ("fp32" if hw.name == "cpu" else "bf16-mixed")
    for name in ("devices", "per_node", "batch", "seq"):
        if getattr(args, name) < 1:
            raise SystemExit(f"boost-plan: --{name.replace('_', '-')} must be positive")
    on_meta = args.init == "per_parameter"
    if args.moe_imbalance < 1:
        raise SystemExit("boost-plan: --moe-imbalance is the busiest rank's rows over the mean: at least 1")
    return Job(spec, args.batch, args.seq, args.devices, args.per_node, hw, memory, precision, model_args, on_meta,
               svd_elements, moe_imbalance=args.moe_imbalance)


def table(rows: Sequence[Row], job: Job, top: int, *, ep_only: bool = False) -> str:
    """The ranked table (markdown) and the commands of its rows; ``ep_only``: the expert-parallel rows
    only, each numbered with its place among all."""
    fitting = [r for r in rows if r.fits]
    shown = (fitting or list(rows))
    place = {id(r): i for i, r in enumerate(shown, 1)}
    shown = [r for r in shown if r.layout.ep > 1][:top] if ep_only else shown[:top]
    labels = {**TERM_LABELS, **{t: k for t, k in FSDP_LABELS.items() if any(r.terms_gib.get(t) for r in shown)}}
    terms = list(labels)
    # under 1 GiB per device (a memory cap on a toy model) the figures are in MiB: 0.00 GiB says nothing
    scale, unit = (1024, "MiB") if job.memory_bytes < 2**30 else (1, "GiB")
    show_ep = any(r.layout.ep > 1 for r in shown)
    head = ["#", "layout", *(["ep"] if show_ep else []), "step (s)", "tokens/s", f"memory ({unit})",
            *(labels[t] for t in terms), "start", "fits"]
    spec = job.spec
    experts = (f", {spec.n_experts} experts top-{spec.top_k} in {spec.moe_layers} blocks" if spec.moe else "")
    lines = [
        f"{job.spec.name} ({job.spec.num_params() / 1e6:,.1f}M params, {job.spec.kind}, d {job.spec.dim} x "
        f"{job.spec.n_layers} layers{experts}, vocab {job.spec.vocab_size:,}) on {job.devices} x {job.hardware.name} "
        f"({job.per_node} per node, {job.memory_bytes / 2**30 * scale:.1f} {unit} usable each), batch {job.batch} x seq {job.seq}, "
        f"{job.precision}; {len(rows)} layouts, {sum(r.fits for r in rows)} fit",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---:", "---"] + ["---:"] * (len(head) - 2)) + "|",
    ]
    for r in shown:
        cells = [str(place[id(r)]), r.layout.label(), *([str(r.layout.ep)] if show_ep else []), f"{r.step_s:.3f}",
                 f"{r.tokens_per_s:,.0f}", f"{r.memory_gib * scale:.2f}",
                 *(f"{r.terms_gib[t] * scale:.2f}" for t in terms), f"{r.start_gib * scale:.2f}", "yes" if r.fits else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Commands:"] + [f"{place[id(r)]}. {r.command}" for r in shown]
    if shown:
        first = shown[0]
        startup = (f"about {first.compile_s:.0f} s per rank, once per start and restart (one block graph: "
                   "the blocks compile one by one)" if first.compile_s is not None else
                   f"not measured for {job.hardware.name} (its file has no cold_compile_s)")
        lines += ["", f"Startup of the first choice, the cold compile (empty Inductor cache): {startup}."]
        if first.overlap_s:
            lines.append(f"Its data-parallel all-reduce hidden behind the backward: {-first.overlap_s:.3f} s a step.")
        if first.fsdp_s:
            lines.append(f"Its FSDP2 all-gathers, reduce-scatters and copies not hidden behind compute: {first.fsdp_s:.3f} s a step.")
        if first.a2a_s:
            lines.append(f"Its expert-parallel all-to-alls (dispatch and combine, forward and backward, exposed): "
                         f"{first.a2a_s:.3f} s a step; the busiest rank routes {job.moe_imbalance:g}x the mean rows.")
    return "\n".join(lines)


def _progress() -> tuple[object, object]:
    """A tqdm bar that shows only once the search has run for a second."""
    from tqdm import tqdm

    bar = tqdm(total=0, delay=1.0, desc="pricing layouts", unit="layout", file=sys.stderr, leave=False)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)  # tqdm draws only once ``delay`` has passed

    return bar, update


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="boost-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        job = make_job(args)
    except ValueError as exc:
        raise SystemExit(f"boost-plan: {exc}") from exc
    bar, update = _progress()
    try:
        rows = search(job, plans=tuple(args.plans) if args.plans else None, checkpoints=tuple(args.checkpoints),
                      progress=update, fsdp=not args.no_fsdp, ep=not args.no_ep)
    finally:
        bar.close()
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_json() for r in rows], indent=1) + "\n")
    try:
        best(rows, job)
    except PlanError as exc:
        print(table(rows, job, args.top, ep_only=args.ep_only))
        print(f"\nboost-plan: {exc}", file=sys.stderr)
        return 1
    print(table(rows, job, args.top, ep_only=args.ep_only))
    return 0
