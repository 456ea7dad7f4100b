"""One benchmark result: its table, its data, and where it was measured.

Every subcommand of ``boost-bench`` returns a :class:`Result`; ``save`` writes
``<folder>/<name>.json`` (everything the report needs, so ``RESULTS.md`` can be
rebuilt without rerunning) and ``<folder>/<name>.png`` (a chart of the ratios).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Target:
    """A figure an issue asks for, and whether this run met it."""

    what: str
    value: float
    bound: float
    at_least: bool  # True: value >= bound passes; False: value <= bound passes

    @property
    def met(self) -> bool:
        return self.value >= self.bound if self.at_least else self.value <= self.bound

    def line(self) -> str:
        op = ">=" if self.at_least else "<="
        return f"{self.what}: {self.value:.3f} (target {op} {self.bound:g}): {'met' if self.met else '**not met**'}"


@dataclass
class Result:
    name: str
    title: str
    #: markdown: what was run and how it was timed, then the table(s)
    table: str
    data: dict[str, Any]
    targets: list[Target] = field(default_factory=list)
    notes: str = ""
    command: str = ""
    commit: str = ""
    machine: str = ""
    date: str = ""
    seconds: float = 0.0

    def markdown(self) -> str:
        lines = [self.table.rstrip()]
        if self.targets:
            lines += ["", *[f"- {t.line()}" for t in self.targets]]
        if self.notes:
            lines += ["", self.notes.strip()]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Result:
        obj = dict(obj)
        obj["targets"] = [Target(**t) for t in obj.get("targets", [])]
        return cls(**obj)


def stamp(result: Result, argv: list[str], seconds: float) -> Result:
    """Fill in the command, commit, machine and date of a finished run."""
    result.command = "boost-bench " + " ".join(shlex.quote(a) for a in argv)
    result.commit = git_commit()
    result.machine = machine()
    result.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result.seconds = round(seconds, 1)
    return result


def git_commit() -> str:
    """The checkout's commit (with ``+dirty`` when files differ), or ``unknown`` outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def cpu_model() -> str:
    """The CPU's model name and widest vector unit, from /proc/cpuinfo (``""`` where it cannot be read).

    Two 2-core machines of the same kind can differ 3x in GEMM speed (AVX-512 or
    AVX2): a result names which one it ran on.
    """
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return ", ".join(part for part in (name, vector) if part)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    model = cpu_model()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return (
        f"{platform.system()} {cpu}{f' ({model})' if model else ''}, {os.cpu_count()} cores{gpu}, "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}"
    )


def save(result: Result, folder: str, chart: Callable[[Result, str], None] | None) -> list[str]:
    """Write ``<name>.json`` and, given a chart function, ``<name>.png``; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"{result.name}.json")]
    with open(paths[0], "w") as f:
        json.dump(result.to_json(), f, indent=1)
        f.write("\n")
    if chart is not None:
        png = os.path.join(folder, f"{result.name}.png")
        chart(result, png)
        paths.append(png)
    return paths


def load(folder: str, name: str) -> Result | None:
    path = os.path.join(folder, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return Result.from_json(json.load(f))


def bar_chart(path: str, title: str, labels: list[str], series: dict[str, list[float]], ylabel: str, ref: float | None = None) -> None:
    """Grouped bars, one group per label, one bar per series; an optional reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(labels) * max(1, len(series)) ** 0.5), 4.0))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    if ref is not None:
        ax.axhline(ref, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
