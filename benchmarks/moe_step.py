"""A training step of the reference mixture of experts: eager, Inductor and boost side by side.

Usage:
    python benchmarks/moe_step.py [--dim 256] [--layers 4] [--experts 8] [--top-k 2] [--expert-ffn 352]
                                  [--rank 64] [--batch 4] [--seq 256] [--steps 12] [--dtype fp32] [--threads 1]

The model is the reference Llama with ``n_experts`` (CoLA experts at ``--rank``; ``--rank 0``: dense
experts), vocabulary 32000. Each backend runs ``--steps`` forward+backward steps on the same batch
(one compile first, timed apart); the table gives the median of the steps after the third, the
tokens per second and the ratio to eager in the same run. The experts' grouped GEMMs are the custom
op ``boost::grouped_mm`` in every backend (torch's grouped kernel inside, in float32 and bfloat16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from boost_compile import _torch_compat as compat
from boost_compile.models import Llama, LlamaConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def step_times(model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> tuple[float, list[float]]:
    """Seconds of the first step (the compile) and of each later one."""
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model(tokens, tokens).backward()
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=352)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = LlamaConfig(vocab_size=32000, dim=args.dim, n_layers=args.layers, n_heads=max(1, args.dim // 64),
                         n_kv_heads=max(1, args.dim // 64), ffn_dim=4 * args.dim, max_seq_len=args.seq,
                         projection="cola" if args.rank else "dense", rank_attn=args.rank or None,
                         rank_mlp=args.rank or None, n_experts=args.experts, experts_top_k=args.top_k,
                         expert_ffn_dim=args.expert_ffn)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    print(f"reference MoE: d {args.dim} x {args.layers} layers, {args.experts} experts top-{args.top_k} of width "
          f"{args.expert_ffn}, {'CoLA rank ' + str(args.rank) if args.rank else 'dense'}; batch {args.batch} x seq "
          f"{args.seq}, {args.dtype}, {args.threads} thread(s), {torch.get_num_threads()} intra-op")
    print("\n| backend | first step (s) | step (s) | tokens/s | vs eager |\n|---|---:|---:|---:|---:|", flush=True)
    eager_s = None
    for backend in ("eager", "inductor", "boost"):
        torch.manual_seed(0)
        compat.reset_dynamo()
        model = Llama(config).to(DTYPES[args.dtype])
        run = model if backend == "eager" else torch.compile(model, backend=backend)
        first, later = step_times(run, tokens, args.steps)
        step = statistics.median(later[2:] if len(later) > 3 else later)
        eager_s = step if backend == "eager" else eager_s
        print(f"| {backend} | {first:.2f} | {step:.4f} | {args.batch * args.seq / step:,.0f} | {eager_s / step:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
