"""A short single-process training loop on the embedded stdlib corpus.

    python -m boost_compile.train --preset tiny --steps 200 --backend boost

Builds a :class:`~boost_compile.models.Llama` from a preset (byte vocabulary),
optionally wraps it in ``torch.compile(backend=...)``, trains it with AdamW
(linear warmup, cosine decay) and prints the loss curve, throughput and a
closing ``done:`` summary. It is a smoke test that a backend both runs and
learns, not a full trainer.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence

import torch

from boost_compile.data import ByteTokenizer, PackedTokens, split, stdlib_tokens
from boost_compile.models import Llama, LlamaConfig

BACKENDS = ("boost", "inductor", "eager")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m boost_compile.train", description="Train a small Llama on stdlib source."
    )
    parser.add_argument("--preset", default="tiny", choices=LlamaConfig.presets())
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=None, help="default: steps // 10")
    parser.add_argument("--backend", default="boost", choices=BACKENDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--val-batches", type=int, default=None, help="default: the whole val split"
    )
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="corpus size in bytes")
    return parser


def lr_lambda(steps: int, warmup: int) -> Callable[[int], float]:
    """Multiplier for step s: linear warmup to 1, then cosine decay to 0.1."""

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return scale


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: PackedTokens, n_batches: int | None, device: str
) -> float:
    """Mean loss over the first ``n_batches`` batches of ``data`` (all when None)."""
    model.eval()
    losses = []
    for index in range(len(data) if n_batches is None else min(n_batches, len(data))):
        inputs, targets = data.batch(0, index)
        losses.append(model(inputs.to(device), targets.to(device)).item())
    model.train()
    return sum(losses) / len(losses)


def train(args: argparse.Namespace) -> dict:
    """Run the loop described by ``args``; returns losses, throughput and timings."""
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    torch.manual_seed(args.seed)
    device = args.device
    preset = LlamaConfig.preset(args.preset)
    config = LlamaConfig.preset(
        args.preset,
        vocab_size=ByteTokenizer.vocab_size,
        max_seq_len=max(args.seq, preset.max_seq_len),
    )
    model = Llama(config, device=device)
    train_tokens, val_tokens = split(stdlib_tokens(args.max_bytes))
    train_data = PackedTokens(train_tokens, args.batch, args.seq, seed=args.seed)
    val_data = PackedTokens(val_tokens, args.batch, args.seq, shuffle=False)

    step_fn = model if args.backend == "eager" else torch.compile(model, backend=args.backend)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]  # norms and biases: no decay
    optimizer = torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": args.weight_decay},
            {"params": vectors, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps, warmup))

    print(
        f"preset={args.preset} projection={config.projection} params={model.num_params():,} "
        f"backend={args.backend} device={device} batch={args.batch} seq={args.seq} "
        f"steps={args.steps} threads={torch.get_num_threads()}",
        flush=True,
    )
    tokens_per_step = args.batch * args.seq
    losses: list[float] = []
    start = time.perf_counter()
    first_step_s = 0.0
    window_start, window_steps = start, 0
    for step in range(1, args.steps + 1):
        inputs, targets = next(train_data)
        loss = step_fn(inputs.to(device), targets.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        window_steps += 1
        now = time.perf_counter()
        if step == 1:
            first_step_s = now - start
            print(
                f"step {step:4d} loss {losses[-1]:.3f} (first step incl. compile {first_step_s:.1f}s)",
                flush=True,
            )
            window_start, window_steps = now, 0
        elif step % args.log_every == 0 or step == args.steps:
            rate = window_steps * tokens_per_step / max(now - window_start, 1e-9)
            print(
                f"step {step:4d} loss {losses[-1]:.3f} lr {scheduler.get_last_lr()[0]:.2e} tokens/s {rate:,.0f}",
                flush=True,
            )
            window_start, window_steps = now, 0
    total_s = time.perf_counter() - start
    steady_s = total_s - first_step_s
    tokens_per_s = (args.steps - 1) * tokens_per_step / steady_s if args.steps > 1 else 0.0
    val_loss = evaluate(model, val_data, args.val_batches, device)
    result = {
        "steps": args.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "val_loss": val_loss,
        "losses": losses,
        "tokens_per_s": tokens_per_s,
        "first_step_s": first_step_s,
        "total_s": total_s,
    }
    print(
        f"done: steps={args.steps} loss {losses[0]:.2f} -> {losses[-1]:.2f} (val {val_loss:.2f}) "
        f"tokens/s={tokens_per_s:,.0f} first_step={first_step_s:.1f}s total={total_s:.1f}s",
        flush=True,
    )
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    return train(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
