"""Building the benchmark models and timing their training steps fairly.

Variants are timed round-robin (one step each, in turn, ``repeats`` times), so
load from other jobs on a shared machine hits them alike. On CPU the default is
one intra-op thread timed by that thread's CPU clock: the step's own compute,
which other processes barely disturb; wall time (``--clock wall``) is for a
quiet machine or a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from boost_compile.models import Llama, LlamaConfig

#: wall: elapsed time; thread: CPU time of the calling thread (with one thread, the step's own compute)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


def preset_pair(size: str) -> tuple[str, str]:
    """(dense preset, CoLA preset) of one size: ``tiny`` or a suffix such as ``60m``."""
    if size == "tiny":
        return "tiny-dense", "tiny"
    return f"llama-{size}", f"cola-{size}"


def lax_preset(size: str) -> str:
    """The LaX preset of one size (the CoLA preset's shape, its latents crossing between blocks)."""
    return "tiny-lax" if size == "tiny" else f"lax-{size}"


def build_model(preset: str, seq: int, vocab: int | None, device: str = "cpu", dtype: torch.dtype = torch.float32,
                **overrides: Any) -> Llama:
    """The preset's model, seeded, with room for ``seq`` tokens and an optional smaller vocabulary."""
    fields: dict[str, Any] = {"max_seq_len": max(seq, LlamaConfig.preset(preset).max_seq_len), **overrides}
    if vocab:
        fields["vocab_size"] = vocab
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset(preset, **fields)).to(device=device, dtype=dtype)


def tokens_for(model: Llama, batch: int, seq: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)


def train_step(model: torch.nn.Module, run: Callable[..., Any], tokens: torch.Tensor, clock: str,
               device: str = "cpu") -> Callable[[], float]:
    """One forward+backward of ``run`` (the model, compiled or not); returns its time."""
    now = CLOCKS[clock]

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        start = now()
        run(tokens, tokens).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return now() - start

    return step


def round_robin(steps: dict[str, Callable[[], float]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Warm each step up, then time them in turn ``repeats`` times."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(step())
    return times


def set_threads(threads: int, clock: str) -> None:
    """Apply ``--threads`` (0 keeps the default) and refuse a thread clock over several threads."""
    if threads:
        torch.set_num_threads(threads)
    if clock == "thread" and torch.get_num_threads() != 1:
        raise SystemExit("--clock thread measures one thread: add --threads 1 (or use --clock wall)")
