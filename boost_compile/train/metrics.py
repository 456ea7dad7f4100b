"""What a run reports: progress lines or a bar, peak memory, ``metrics.jsonl``,
``summary.json`` and the loss plot.

Files in a run folder: :data:`METRICS_FILE` (one JSON object per step and per
evaluation, rank 0 appends; a run restarted in the same folder first writes a
``restart`` row, :func:`read_metrics` reads the history without the redone steps), :data:`SUMMARY_FILE` (the run's result) and
:data:`PLOT_FILE` (train and val loss); with ``metrics.tensorboard=true`` also
TensorBoard event files in :data:`TENSORBOARD_DIR` (the same rows as scalars,
:data:`TENSORBOARD_TAGS`; :class:`MetricsWriter` writes both).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("boost_compile.train")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "tensorboard"

# metrics.jsonl key -> TensorBoard scalar tag (the step is the row's "step")
TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "grad_norm": "train/grad_norm",
    "step_s": "train/step_s",
    "val_loss": "val/loss",
}


class JsonlWriter:
    """One JSON object a line, appended and flushed at once; writes nothing when not ``enabled``
    (ranks other than 0)."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.file = open(path, "a") if enabled else None

    def write(self, row: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class TensorBoardWriter:
    """The rows of ``metrics.jsonl`` as TensorBoard scalars (:data:`TENSORBOARD_TAGS`) in
    ``log_dir``, flushed row by row; writes nothing when not ``enabled`` (ranks other than 0).

    ``purge_step``: a resumed run's first step; events at or after it that an
    earlier, interrupted run wrote into the same folder are hidden.
    """

    def __init__(self, log_dir: Path, enabled: bool = True, purge_step: int | None = None) -> None:
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, row: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, tag in TENSORBOARD_TAGS.items():
            if row.get(key) is not None:
                self.writer.add_scalar(tag, float(row[key]), row["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class MetricsWriter:
    """Where a run's metric rows go: ``metrics.jsonl`` in ``run_dir``, and TensorBoard event
    files in ``run_dir/tensorboard`` when ``tensorboard``; rank 0 only (``enabled``)."""

    def __init__(
        self, run_dir: Path, enabled: bool = True, tensorboard: bool = False, purge_step: int | None = None
    ) -> None:
        self.jsonl = JsonlWriter(run_dir / METRICS_FILE, enabled)
        self.tensorboard = (
            TensorBoardWriter(run_dir / TENSORBOARD_DIR, enabled, purge_step) if enabled and tensorboard else None
        )

    def write(self, row: dict[str, Any]) -> None:
        self.jsonl.write(row)
        if self.tensorboard is not None:
            self.tensorboard.write(row)

    def close(self) -> None:
        try:
            self.jsonl.close()
        finally:
            if self.tensorboard is not None:
                self.tensorboard.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` as the run's history: a ``{"event": "restart", "step": s}``
    row (written when a run starts again in the same folder, resumed from step ``s``) drops the
    earlier rows of the steps after ``s``, which the restarted run does again."""
    rows: list[dict[str, Any]] = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line)
        if row.get("event") == "restart":
            rows = [r for r in rows if r.get("event") == "restart" or r["step"] <= row["step"]]
        rows.append(row)
    return rows


def count_restarts(path: Path) -> tuple[int, int]:
    """(rows of steps, restart rows) in ``metrics.jsonl`` so far: a run that finds rows there
    is a restart of the run that wrote them."""
    rows = read_metrics(path)
    restarts = sum(1 for r in rows if r.get("event") == "restart")
    return len(rows) - restarts, restarts


def write_summary(path: Path, result: dict[str, Any]) -> None:
    """A run's ``summary.json``."""
    path.write_text(json.dumps(result, indent=2) + "\n")


def read_summary(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


class PeakMemory:
    """Peak memory of a run: CUDA max allocated, or the process's RSS sampled every 20 ms."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return max(self.peak, _rss_bytes()) / 2**20


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    """A tqdm bar (loss, tokens/s) on a terminal, periodic log lines otherwise; rank 0 only.

    The tokens/s shown is over the steps since the previous line (the bar: an
    exponential average), so a slow first step (compilation) does not linger.
    """

    def __init__(self, mode: str, total: int, start: int, log_every: int, tokens_per_step: int, enabled: bool) -> None:
        interactive = sys.stderr.isatty()
        self.bar_on = enabled and (mode == "bar" or (mode == "auto" and interactive))
        self.lines_on = enabled and not self.bar_on and mode != "none"
        self.log_every = log_every
        self.total = total
        self.tokens_per_step = tokens_per_step
        self.window_steps = 0
        self.window_s = 0.0
        self.ema_rate: float | None = None
        self.bar = None
        if self.bar_on:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def step(self, step: int, loss: float, lr: float, step_s: float, first: bool) -> None:
        if first:
            if self.lines_on:
                log.info("step %4d/%d loss %.3f (first step incl. compile %.1fs)", step, self.total, loss, step_s)
            elif self.bar is not None:
                self.bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
                self.bar.update(1)
            return
        self.window_steps += 1
        self.window_s += step_s
        rate = self.tokens_per_step / max(step_s, 1e-9)
        self.ema_rate = rate if self.ema_rate is None else 0.9 * self.ema_rate + 0.1 * rate
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f} tokens/s {self.ema_rate:,.0f}", refresh=False)
            self.bar.update(1)
        elif self.lines_on and (step % self.log_every == 0 or step == self.total):
            window = self.window_steps * self.tokens_per_step / max(self.window_s, 1e-9)
            log.info("step %4d/%d loss %.3f lr %.2e tokens/s %s", step, self.total, loss, lr, f"{window:,.0f}")
            self.window_steps, self.window_s = 0, 0.0

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.lines_on:
            log.info("%s", text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_losses(metrics: Path, out: Path, title: str) -> bool:
    """Draw the train (and val) loss of ``metrics.jsonl`` into a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s", out.name)
        return False
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    for row in read_metrics(metrics):
        if "loss" in row:
            train[row["step"]] = row["loss"]
        if "val_loss" in row:
            val[row["step"]] = row["val_loss"]
    if not train:
        return False
    steps = sorted(train)
    losses = [train[s] for s in steps]
    smooth, ema = [], 0.0
    for i, value in enumerate(losses, start=1):
        ema = 0.9 * ema + 0.1 * value
        smooth.append(ema / (1.0 - 0.9**i))  # bias-corrected: no lag at the start
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="train")
    ax.plot(steps, smooth, color="tab:blue", linewidth=2, label="train (EMA 0.9)")
    if val:
        ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", color="tab:orange", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True
