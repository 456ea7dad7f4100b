"""The scale model beside our own measured steps: ``boost-bench scale --hardware cpu``.

``boost-bench tp`` and ``boost-bench pp`` time training steps on two gloo
processes and save every variant's median step in ``tp.json`` and ``pp.json``,
with the shapes they ran (size, sequence, batch, vocabulary, micro-batches).
Each variant is one configuration of :func:`boost_compile.costmodel.scale_model.predict`:

    tp: dense, megatron             full-rank TP2      dense, 1 process   full-rank TP1
        CoLA, vanilla (DTensor)     vanilla TP2        CoLA, 1 process    btp TP1
        CoLA, btp                   btp TP2
        LaX, btp (--lax)            btp TP2, LaX       LaX, 1 process     btp TP1, LaX
    pp: 1 process                   btp TP1            PP2                btp PP2, 1F1B
        TP2 btp                     btp TP2            DP2                btp DP2

("btp" at TP1 is the CoLA model as boost compiles it: grouped down factors.)
The conventions are the benches': fp32 (4 bytes per element), forward and
backward without an optimizer step (``optimizer_bytes_per_param`` 0), a
vocabulary-parallel head under TP, the presets' shapes with the benches'
vocabulary. The hardware file (``cpu``, written by ``boost-bench calibrate``)
holds constants measured by microbenchmarks only: no constant is fitted to a
measured step time. Each row gets the relative error of the prediction and
whether it is within :data:`TARGET_ERROR`.

The stage boundaries ``boost-bench pp`` measured (the bytes one rank sends and
receives per step between two stages) are put beside :func:`scale_model.p2p_bytes`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from typing import Any

from boost_compile.bench import pp, tp
from boost_compile.bench.results import Result, Target, bar_chart, load
from boost_compile.costmodel import hardware, scale_model

#: the acceptance bound on the relative error of each predicted step
TARGET_ERROR = 0.20
NAME = "scale-cpu"


@dataclass(frozen=True)
class Config:
    """One measured variant as a scale-model configuration."""

    bench: str
    label: str
    family: str  # "dense", "cola" or "lax": which preset of the size (lax: the scale model's arch)
    system: str  # one of scale_model.SYSTEMS
    tp: int = 1
    pp: int = 1
    dp: int = 1


TP_CONFIGS = (
    Config("tp", tp.MEGATRON, "dense", "full-rank", tp=2),
    Config("tp", tp.VANILLA, "cola", "vanilla", tp=2),
    Config("tp", tp.BTP, "cola", "btp", tp=2),
    Config("tp", tp.SINGLE["dense"], "dense", "full-rank"),
    Config("tp", tp.SINGLE["cola"], "cola", "btp"),
)
#: what ``boost-bench tp --lax`` adds
LAX_TP_CONFIGS = (
    Config("tp", tp.LAX_BTP, "lax", "btp", tp=2),
    Config("tp", tp.SINGLE["lax"], "lax", "btp"),
)
PP_CONFIGS = tuple(
    Config("pp", label, "cola", "btp", tp=t, pp=p, dp=d) for label, (t, p, d) in pp.LAYOUTS.items()
)
#: the stage plans of pp's boundary table -> the scale model's system
STAGE_SYSTEMS = {"btp": "btp", "megatron": "full-rank"}


def shape_for(size: str, vocab: int) -> scale_model.Shape:
    """The scale model's shape of a preset size with the benches' vocabulary (0: the preset's).

    The model assumes r = d / 4 in every projection and as many key/value heads
    as heads; a preset that differs is refused.
    """
    from boost_compile.bench.timing import preset_pair
    from boost_compile.models import LlamaConfig

    c = LlamaConfig.preset(preset_pair(size)[1])
    if c.rank_attn != c.dim // 4 or c.rank_mlp != c.dim // 4 or c.n_kv_heads != c.n_heads:
        raise ValueError(
            f"the scale model needs rank d/4 and n_kv_heads == n_heads; size {size!r} has d {c.dim}, "
            f"ranks {c.rank_attn}/{c.rank_mlp}, {c.n_heads} heads, {c.n_kv_heads} key/value heads"
        )
    return scale_model.Shape(size, c.dim, c.ffn_dim, c.n_layers, c.n_heads, vocab or c.vocab_size)


def workload(params: dict[str, Any]) -> scale_model.Workload:
    """What a bench's step computes: fp32, no optimizer step, its sequence, batch and micro-batches."""
    return scale_model.Workload(
        seq=params["seq"],
        batch=params["batch"],
        dtype_bytes=4,
        micro_batches=params.get("microbatches", 1),
        optimizer_bytes_per_param=0.0,
    )


def bench_params(size: str = "60m", seq: int = 1024, batch: int = 4, vocab: int = 256,
                 microbatches: int = pp.DEFAULT_MICROBATCHES) -> dict[str, dict[str, Any]]:
    """The ``params`` both benches record, for the given options (their defaults by default)."""
    common = {"size": size, "seq": seq, "batch": batch, "vocab": vocab}
    return {"tp": common, "pp": {**common, "microbatches": microbatches}}


def configurations(params: dict[str, dict[str, Any]]) -> list[tuple[Config, scale_model.Shape, scale_model.Workload]]:
    """Every configuration of the benches in ``params`` (bench -> its params), with its shape and workload."""
    out = []
    for bench, configs in (("tp", TP_CONFIGS), ("pp", PP_CONFIGS)):
        if bench in params:
            shape, wl = shape_for(params[bench]["size"], params[bench]["vocab"]), workload(params[bench])
            configs += LAX_TP_CONFIGS if params[bench].get("lax") else ()
            out += [(c, replace(shape, arch="lax") if c.family == "lax" else shape, wl) for c in configs]
    return out


def micro_batch(config: Config, wl: scale_model.Workload) -> int:
    """Sequences in one micro-batch of one replica (what each GEMM and attention call sees)."""
    return wl.batch // config.dp // (wl.micro_batches if config.pp > 1 else 1)


def gemms(config: Config, shape: scale_model.Shape, wl: scale_model.Workload) -> list[scale_model.Gemm]:
    """The forward GEMMs of one layer and of the head that :func:`scale_model.predict` times for ``config``."""
    tokens = micro_batch(config, wl) * wl.seq
    head = scale_model.Gemm(tokens, shape.d, -(-shape.vocab // config.tp))
    return [*scale_model.layer_gemms(config.system, shape, tokens, config.tp), head]


def attention_shape(config: Config, shape: scale_model.Shape, wl: scale_model.Workload) -> tuple[int, int, int, int]:
    """(batch, heads, seq, head_dim) of one rank's attention call for ``config``."""
    return micro_batch(config, wl), scale_model.attention_heads(config.system, shape, config.tp), wl.seq, shape.head_dim


def predict(config: Config, shape: scale_model.Shape, wl: scale_model.Workload, hw: hardware.Hardware) -> scale_model.Prediction:
    return scale_model.predict(shape, config.system, config.tp, config.pp, hw, wl, dp=config.dp)


def measured_step(bench: str, label: str, data: dict[str, Any]) -> float:
    """A variant's median step (s) in a bench's saved data."""
    if bench == "tp":
        rows = data["variants"] if label in data["variants"] else data["single"]
        return rows[label]["step_s"]
    return data["rows"][label]["step_s"]


def _measured_params(data: dict[str, Any]) -> dict[str, Any]:
    """A bench's params, with the vocabulary the run actually used."""
    return {**data["params"], "vocab": data["vocab"]}


def compare(results: dict[str, Result], hw: hardware.Hardware) -> list[dict[str, Any]]:
    """Predicted beside measured for every variant of the given bench results (``tp`` and/or ``pp``)."""
    params = {bench: _measured_params(r.data) for bench, r in results.items()}
    rows = []
    for config, shape, wl in configurations(params):
        pred = predict(config, shape, wl, hw)
        measured = measured_step(config.bench, config.label, results[config.bench].data)
        error = scale_model.relative_error(pred.iteration_s, measured)
        rows.append({**asdict(config), "micro_batches": pred.micro_batches, "measured_s": measured,
                     "predicted_s": pred.iteration_s, "error": error, "within": abs(error) <= TARGET_ERROR,
                     "predicted": asdict(pred)})
    return rows


def boundary_comparison(result: Result) -> list[dict[str, Any]]:
    """pp's measured stage-boundary bytes per step and rank beside the scale model's (PP2, and PP2 x TP2)."""
    data = result.data
    params = _measured_params(data)
    shape, wl = shape_for(params["size"], params["vocab"]), workload(params)
    m = wl.micro_batches
    tokens = wl.batch // m * wl.seq

    def model_bytes(system: str, tp_degree: int) -> int:  # one activation and its gradient per micro-batch
        return 2 * m * scale_model.p2p_bytes(tokens, shape, wl.dtype_bytes, system, tp_degree)

    rows = [{"boundary": f"{pp.PP2} ({data['preset']})", "measured": data["rows"][pp.PP2]["comm"]["bytes"],
             "model": model_bytes("btp", 1)}]
    for plan, b in data["boundary"].items():
        rows.append({"boundary": f"PP2 x TP2, {plan} stages ({b['preset']})", "measured": b["step_bytes"],
                     "model": model_bytes(STAGE_SYSTEMS[plan], 2)})
    return rows


def _hardware_lines(hw: hardware.Hardware) -> list[str]:
    m = hw.measured
    origin = (
        f"measured by `{m.get('command', '?')}` on {m.get('machine', '?')}, {m.get('date', '?')}. Its constants "
        "come from microbenchmarks only (GEMMs and attention at the benches' shapes, elementwise bandwidth, gloo "
        "all-reduce and send/recv); none is fitted to a measured step time."
        if m else "not measured by `boost-bench calibrate` (its constants are not this machine's)."
    )
    fields = [*hardware.HARDWARE_FIELDS, *(k for k in hardware.OPTIONAL_HARDWARE_FIELDS if k in hw.notes)]
    return [
        f"Hardware file `{hw.name}`: {origin}",
        "",
        "| constant | value | how |",
        "|---|---:|---|",
        *[f"| {k} | {getattr(hw, k):.4g} | {hw.notes.get(k, '')} |" for k in fields],
    ]


def render(rows: list[dict[str, Any]], boundary: list[dict[str, Any]], hw: hardware.Hardware,
           sources: dict[str, str]) -> str:
    lines = [
        f"Scale model with the `{hw.name}` hardware file beside the steps measured by "
        + " and ".join(f"`{cmd}`" for cmd in sources.values())
        + " (forward + backward, fp32, no optimizer step; the model's configuration of each row from the "
        "saved run's shapes). Error: (predicted - measured) / measured.",
        "",
        "| bench | variant | system | TP | PP | DP | measured (ms) | predicted (ms) | error | within "
        f"{TARGET_ERROR:.0%} | predicted GEMM / attention / elementwise / comm (ms) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        p = r["predicted"]
        parts = " / ".join(f"{p[k] * 1e3:.0f}" for k in ("gemm_s", "attention_s", "elementwise_s", "comm_s"))
        pipe = f" (m={r['micro_batches']})" if r["pp"] > 1 else ""
        lines.append(
            f"| {r['bench']} | {r['label']} | {r['system']} | {r['tp']} | {r['pp']}{pipe} | {r['dp']} | "
            f"{r['measured_s'] * 1e3:.0f} | {r['predicted_s'] * 1e3:.0f} | {r['error'] * 100:+.1f}% | "
            f"{'yes' if r['within'] else '**no**'} | {parts} |"
        )
    inside = sum(r["within"] for r in rows)
    worst = max(abs(r["error"]) for r in rows)
    lines += ["", f"{inside} of {len(rows)} within {TARGET_ERROR:.0%}; largest |error| {worst:.1%}."]
    if boundary:
        lines += [
            "",
            "Pipeline stage boundaries, bytes per step one rank sends and receives (activations forward, "
            "gradients backward): measured from the stage's output tensor by `boost-bench pp`, and the model's "
            "(btp sends its d/TP slice of the stream).",
            "",
            "| boundary | measured (B) | model (B) |",
            "|---|---:|---:|",
            *[f"| {b['boundary']} | {b['measured']:,} | {b['model']:,.0f} |" for b in boundary],
        ]
    return "\n".join(lines + ["", *_hardware_lines(hw)]) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the comparison (on ``boost-bench scale``)."""
    from boost_compile.bench.report import RESULTS_DIR

    parser.add_argument("--results", default=RESULTS_DIR,
                        help="folder of tp.json and pp.json, for --compare measured (default: %(default)s)")


def run_result(args: argparse.Namespace, hw: hardware.Hardware) -> Result:
    """The comparison as a ``boost-bench`` result (``scale-cpu``), one target per measured variant."""
    results = {b: r for b in ("tp", "pp") if (r := load(args.results, b)) is not None}
    if not results:
        raise SystemExit(f"no tp.json or pp.json in {args.results}: run boost-bench tp and boost-bench pp first")
    rows = compare(results, hw)
    boundary = boundary_comparison(results["pp"]) if "pp" in results else []
    sources = {b: r.command for b, r in results.items()}
    text = render(rows, boundary, hw, sources)
    targets = [Target(f"{r['bench']} {r['label']}: |predicted - measured| / measured", abs(r["error"]), TARGET_ERROR, False)
               for r in rows]
    data = {
        "hardware": {"name": hw.name, **{k: getattr(hw, k) for k in hardware.HARDWARE_FIELDS},
                     "p2p_latency": hw.p2p_latency, "notes": dict(hw.notes), "measured": dict(hw.measured)},
        "target_error": TARGET_ERROR,
        "sources": {b: {"command": r.command, "commit": r.commit, "date": r.date} for b, r in results.items()},
        "rows": rows,
        "boundary": boundary,
    }
    return Result(NAME, f"Scale model ({hw.name}) beside boost-bench tp and pp", text, data, targets)


def chart(result: Result, path: str) -> None:
    rows = result.data["rows"]
    bar_chart(
        path,
        f"Scale model ({result.data['hardware']['name']}) vs measured steps",
        [f"{r['bench']}: {r['label']}" for r in rows],
        {"measured": [r["measured_s"] for r in rows], "predicted": [r["predicted_s"] for r in rows]},
        "step (s)",
    )
