"""``boost-generate``: sample a continuation from a boost-train checkpoint, compiled with boost.

    boost-generate runs/exp1 --prompt "def main(" --max-new-tokens 64          # greedy
    boost-generate runs/exp1 --prompt "import " --temperature 0.8 --top-k 40 --seed 0

The model is loaded as ``boost-export`` loads it (:func:`boost_compile.export.load_trained`)
and compiled with ``torch.compile(model, backend="boost", dynamic=False)``. There
is no KV cache: every new token runs the model on one fixed-length window (the
run's ``trainer.seq``, at most the model's positions), the context left-aligned
in it and padded on the right, which a causal model never attends to; the logits
are read at the last real position. One shape, so one compiled graph for the
whole generation. A context longer than the window keeps its last ``window``
tokens. Logits of ids the tokenizer does not have (padding rows of the
embedding) are masked to -inf.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from boost_compile.config import ConfigError

#: the token that fills the window after the context (never attended to: causal attention)
PAD_ID = 0
INNERS = ("inductor", "aot_eager", "eager")


def model_positions(model: nn.Module) -> int | None:
    """The most positions ``model`` takes (None when it does not say)."""
    config = getattr(model, "config", None)
    for name in ("max_seq_len", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def next_token(
    logits: torch.Tensor,
    vocab_size: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """One id from a row of logits: greedy at ``temperature <= 0``, else sampled (top-k)."""
    logits = logits.float().clone()
    logits[vocab_size:] = float("-inf")  # padding rows of the embedding
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, vocab_size)).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _as_ids(encoded: Any) -> list[int]:
    return encoded.flatten().tolist() if isinstance(encoded, torch.Tensor) else [int(i) for i in encoded]


class Generator:
    """A model compiled with the boost backend, a tokenizer, and a fixed window."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        window: int,
        options: dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if window < 1:
            raise ConfigError(f"the window must be >= 1 token, got {window}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.window = window
        self.device = torch.device(device)
        self.vocab_size = int(tokenizer.vocab_size)
        self.options = dict(options or {})
        self.compiled = torch.compile(self.model, backend="boost", options=self.options, dynamic=False)

    @torch.no_grad()
    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> list[int]:
        """The ids that follow ``prompt_ids``."""
        ids = list(prompt_ids)
        if not ids:
            raise ConfigError("the prompt is empty; give at least one token of context")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        buffer = torch.full((1, self.window), PAD_ID, dtype=torch.long, device=self.device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            context = ids[-self.window :]
            buffer.fill_(PAD_ID)
            buffer[0, : len(context)] = torch.tensor(context, dtype=torch.long)
            logits = self.compiled(buffer)
            logits = getattr(logits, "logits", logits)  # a bare Hugging Face model
            token = next_token(logits[0, len(context) - 1], self.vocab_size, temperature, top_k, generator)
            ids.append(token)
            new.append(token)
        return new

    def __call__(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> str:
        """The continuation of ``prompt``, decoded."""
        ids = _as_ids(self.tokenizer.encode(prompt))
        return self.tokenizer.decode(self.generate_ids(ids, max_new_tokens, temperature, top_k, seed))


def load_generator(
    path: str | Path,
    *,
    config: str | Path | None = None,
    device: torch.device | str = "cpu",
    inner: str | None = None,
    window: int | None = None,
) -> Generator:
    """A :class:`Generator` for a run folder or a checkpoint folder.

    The boost options are the run's ``passes.options`` when it trained with
    ``passes.backend=boost`` (without activation checkpointing, which is for
    training), else the defaults; ``inner`` overrides the inner compiler.
    """
    from boost_compile.export import load_trained

    model, source = load_trained(path, config=config, device=device)
    tc = source.config
    options = dict(tc.passes.options) if tc.passes.backend == "boost" else {}
    for key in ("checkpoint", "checkpoint_budget"):
        options.pop(key, None)
    if inner is not None:
        options["inner"] = inner
    limit = model_positions(model)
    size = window if window is not None else tc.trainer.seq
    if limit is not None and size > limit:
        if window is not None:
            raise ConfigError(f"--window {window} exceeds the model's {limit} positions")
        size = limit
    return Generator(model, source.tokenizer(), window=size, options=options, device=device)


def main(argv: Sequence[str] | None = None) -> None:
    """``boost-generate RUN_OR_CHECKPOINT --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]``."""
    parser = argparse.ArgumentParser(
        prog="boost-generate",
        description="Continue a prompt with a boost-train checkpoint, compiled with backend='boost'.",
    )
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run folder (its newest checkpoint) or a checkpoint folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    parser.add_argument("--seed", type=int, default=None, help="the sampling seed")
    parser.add_argument("--window", type=int, default=None, help="tokens per forward (default: the run's trainer.seq)")
    parser.add_argument("--inner", choices=INNERS, default=None, help="the boost backend's inner compiler (default: the run's)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    parser.add_argument("--config", help="the run's .hydra/config.yaml, when the checkpoint is not inside its run folder")
    args = parser.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if args.max_new_tokens < 0:
            raise ConfigError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
        if args.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
        generator = load_generator(args.source, config=args.config, device=device, inner=args.inner, window=args.window)
        text = generator(args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"boost-generate: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(text)


if __name__ == "__main__":
    main()
