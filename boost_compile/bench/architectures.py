"""The low-rank architectures BOOST trains, side by side in the scale model: plain low-rank, CoLA, LaX.

Besides its table, BOOST.md section 6 publishes the 7B TP4 iteration time of each
architecture (A100, bf16, seq 4096, batch 4): plain low-rank 0.70 s, CoLA 0.72 s,
LaX 0.75 s, full-rank 1.06 s. :func:`architecture_comparison` predicts each with
:func:`scale_model.predict`: the low-rank ones under btp (``Shape.arch``), full-rank
under Megatron TP. The three low-rank models differ only in memory-bound work on
their [T, r] latents: plain low-rank has no SiLU, LaX adds one [T, r] add per
projection; their GEMMs, parameters and btp collectives are the same.

Saved activations (:func:`saved_bytes_per_layer`), under BOOST.md section 5's
low-rank checkpointing with btp: per layer the 7 [T, r] down-factor outputs (after
their all-reduce) and the [T, d/p] residual slice, for LaX too: the latent a block
adds is the block before's SiLU of its saved down output, recomputed from it
(tests/unit/test_activation_checkpoint.py counts what each saves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from boost_compile.costmodel.hardware import Hardware
from boost_compile.costmodel.scale_model import SHAPES, Shape, Workload, predict, relative_error

#: BOOST.md section 6: iteration time (s) of each architecture at 7B, TP 4, PP 1
PUBLISHED_7B_TP4 = {"full-rank": 1.06, "lowrank": 0.70, "cola": 0.72, "lax": 0.75}
LABELS = {"full-rank": "full-rank (Megatron TP)", "lowrank": "plain low-rank", "cola": "CoLA", "lax": "LaX"}
MODEL, TP = "7B", 4


def saved_bytes_per_layer(shape: Shape, tokens: int, p: int, dtype_bytes: int = 2) -> int:
    """Bytes one rank keeps per layer under low-rank checkpointing with btp: 7 [T, r] down
    outputs and the [T, d/p] residual slice, whatever the architecture."""
    return (7 * tokens * shape.rank + tokens * -(-shape.d // p)) * dtype_bytes


def architecture_comparison(hw: Hardware, wl: Workload, model: str = MODEL, tp: int = TP) -> list[dict]:
    """Each architecture of :data:`PUBLISHED_7B_TP4` predicted at ``model``, ``tp`` (PP 1) beside
    the published time: error, time relative to CoLA (model and published), elementwise
    seconds, communication and, for the low-rank ones, the saved bytes per layer."""
    base = next(s for s in SHAPES if s.name == model)
    tokens = wl.batch * wl.seq
    preds = {}
    for arch in PUBLISHED_7B_TP4:
        dense = arch == "full-rank"
        shape = base if dense else replace(base, arch=arch)
        preds[arch] = (shape, predict(shape, "full-rank" if dense else "btp", tp, 1, hw, wl))
    cola = preds["cola"][1].iteration_s
    rows = []
    for arch, (shape, pred) in preds.items():
        published = PUBLISHED_7B_TP4[arch]
        saved = None if arch == "full-rank" else saved_bytes_per_layer(shape, tokens, tp, wl.dtype_bytes)
        rows.append({
            "arch": arch, "system": pred.system, "model": model, "tp": tp, "pp": 1,
            "predicted_s": pred.iteration_s, "published_s": published,
            "error": relative_error(pred.iteration_s, published),
            "x_cola": pred.iteration_s / cola, "published_x_cola": published / PUBLISHED_7B_TP4["cola"],
            "elementwise_s": pred.elementwise_s, "comm_gb": pred.comm_gb, "saved_bytes_per_layer": saved,
        })
    return rows


def render(rows: Sequence[dict], hw_name: str) -> list[str]:
    """The markdown lines of :func:`architecture_comparison`'s table."""
    r0 = rows[0]
    lines = [
        f"The architectures at {r0['model']} TP{r0['tp']} (PP 1), low-rank ones under btp, beside BOOST.md section 6"
        + (" (A100):" if hw_name.startswith("a100") else f" (A100; these predictions are for {hw_name}):"),
        "",
        "| architecture | predicted s | published s | error | x CoLA: model (published) | elementwise s | comm GB "
        "| saved per layer, low-rank checkpointing (MB) |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        saved = "-" if r["saved_bytes_per_layer"] is None else f"{r['saved_bytes_per_layer'] / 1e6:,.0f}"
        lines.append(
            f"| {LABELS[r['arch']]} | {r['predicted_s']:.3f} | {r['published_s']:.2f} | {r['error'] * 100:+.0f}% "
            f"| {r['x_cola']:.3f} ({r['published_x_cola']:.3f}) | {r['elementwise_s']:.3f} | {r['comm_gb']:.1f} | {saved} |"
        )
    return lines
