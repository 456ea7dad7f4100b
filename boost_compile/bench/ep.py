"""``boost-bench ep``: a mixture of experts on two CPU processes three ways, one run each of boost-train.

    boost-bench ep [--experts 8] [--top-k 2] [--hidden 256] [--moe-ffn 256] [--layers 4]
                   [--batch 8] [--seq 128] [--steps 12] [--passes boost_aot_eager]

A randomly initialised Qwen3-MoE of the given shape (byte vocabulary, ``model.hf_config``), the
same global batch and steps, launched by torchrun on 127.0.0.1 (gloo, one thread a rank):

- ``EP2`` (``parallel=ep2``): each rank its 1/2 of every layer's experts and half the batch, the
  tokens sent to their experts' rank by all-to-all and back; DDP for the rest;
- ``TP2`` (``parallel=tp2``, megatron): every expert whole on both ranks, both ranks running the
  whole batch (attention and the router sharded, the experts not);
- ``FSDP2 2`` (``parallel=fsdp2``): each rank half the batch, every block's weights, its experts
  included, all-gathered for its forward and backward.

Per layout (its ``summary.json``): tokens/s over the steps after the first (boost-train's own
figure), a rank's parameter, gradient and AdamW bytes (``state_mib``: the largest rank's), and its
peak RSS; ratios against TP2, the experts kept whole. The losses are printed too: the three
layouts compute the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from boost_compile.bench.results import Result, bar_chart

#: label -> boost-train overrides of the layout
LAYOUTS = {
    "EP2": ("parallel=ep2",),
    "TP2": ("parallel=tp2", "parallel.plan=megatron"),
    "FSDP2 2": ("parallel=fsdp2",),
}
BASELINE = "TP2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-ffn", type=int, default=256, help="each expert's intermediate size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--passes", default="boost_aot_eager", help="boost-train's passes= (the same for every layout)")


def _model(args: argparse.Namespace) -> list[str]:
    heads = max(1, args.hidden // 64)
    return ["model=hf-tiny", "model.hf_config.model_type=qwen3_moe", f"model.hf_config.hidden_size={args.hidden}",
            f"model.hf_config.num_hidden_layers={args.layers}", f"model.hf_config.num_attention_heads={heads}",
            f"model.hf_config.num_key_value_heads={heads}", f"+model.hf_config.num_experts={args.experts}",
            f"+model.hf_config.num_experts_per_tok={args.top_k}", f"+model.hf_config.moe_intermediate_size={args.moe_ffn}",
            f"model.hf_config.intermediate_size={args.moe_ffn}"]


def _train(overrides: list[str], out: Path) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), "-m", "boost_compile.train", *overrides, f"hydra.run.dir={out}"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"boost-train {' '.join(overrides)} failed: {(proc.stdout + proc.stderr)[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def run(args: argparse.Namespace) -> Result:
    common = [*_model(args), "trainer=quick", f"trainer.steps={args.steps}", f"trainer.batch={args.batch}",
              f"trainer.seq={args.seq}", "trainer.eval_every=0", "trainer.plot=false", "trainer.progress=none",
              "trainer.threads=1", "checkpoint.enabled=false", "data.max_bytes=400000", f"passes={args.passes}"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, layout in LAYOUTS.items():
            summary = _train([*common, *layout], Path(tmp) / label.replace(" ", "_"))
            rows.append({"label": label, "tokens_per_s": summary["tokens_per_s"], "state": summary["state_mib"],
                         "peak_mib": summary["peak_mem_mib"], "losses": summary["losses"]})
    base = next(r for r in rows if r["label"] == BASELINE)
    lines = [
        f"A Qwen3-MoE of {args.layers} layers, d {args.hidden}, {args.experts} experts of {args.moe_ffn} (top "
        f"{args.top_k}), bytes, batch {args.batch} x seq {args.seq}, {args.steps} AdamW steps, passes={args.passes}, "
        "2 gloo processes of one thread. tokens/s: boost-train's, the steps after the first; state: the largest "
        f"rank's parameters + gradients + AdamW state; ratios against {BASELINE} (every expert whole on both ranks).",
        "",
        "| layout | tokens/s | vs TP2 | params (MiB) | grads (MiB) | AdamW (MiB) | state (MiB) | vs TP2 | peak RSS (MiB) | last loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["state"]
        lines.append(f"| {r['label']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
                     f"{s['params']:.2f} | {s['grads']:.2f} | {s['optimizer']:.2f} | {s['total']:.2f} | "
                     f"{s['total'] / base['state']['total']:.2f} | {r['peak_mib']:,.0f} | {r['losses'][-1]:.5f} |")
    return Result("ep", "Expert parallelism: EP2 against experts kept whole (TP2) and gathered (FSDP2 2)",
                  "\n".join(lines), {"rows": rows, "args": vars(args)})


def chart(result: Result, path: str) -> None:
    rows = result.data["rows"]
    base = next(r for r in rows if r["label"] == BASELINE)
    bar_chart(path, f"Expert parallelism against {BASELINE} (higher tokens/s is faster, lower state is less)",
              [r["label"] for r in rows],
              {"tokens/s / TP2": [r["tokens_per_s"] / base["tokens_per_s"] for r in rows],
               "state / TP2": [r["state"]["total"] / base["state"]["total"] for r in rows]},
              "ratio to TP2", ref=1.0)
