"""What a run reports: progress lines or a bar, peak memory, ``metrics.jsonl``,
``summary.json`` and the loss plot.

Files in a run folder: :data:`METRICS_FILE` (one JSON object per step and per
evaluation, rank 0 appends; a run restarted in the same folder first writes a
``restart`` row, :func:`read_metrics` reads the history without the redone steps), :data:`SUMMARY_FILE` (the run's result) and
:data:`PLOT_FILE` (train and val loss); with ``metrics.tensorboard=true`` also
TensorBoard event files in :data:`TENSORBOARD_DIR` (the same rows as scalars,
:data:`TENSORBOARD_TAGS`); with ``metrics.wandb=true`` the same tags logged to a Weights &
Biases run (:class:`WandbWriter`), its files in :data:`WANDB_DIR` (``offline-run-*/`` without an
API key, :func:`wandb_mode`) and its id in :data:`WANDB_ID_FILE`, so that a run restarted in the
folder continues it. :class:`MetricsWriter` writes to all of them.

Each step's row has ``mfu`` beside ``tokens_per_s`` when the device's peak is known
(:func:`utilization`): the model FLOPs per token (forward + backward) times tokens/s,
over the run's devices times the peak FLOP/s of its dtype in the planner's hardware file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import netrc
import os
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from boost_compile.config import ConfigError
from boost_compile.train.config import MetricsConfig, TrainConfig, field_choices

log = logging.getLogger("boost_compile.train")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # wandb.init(dir=<run folder>) writes here
WANDB_ID_FILE = f"{WANDB_DIR}/run_id"  # the wandb run of this folder, continued by a restart
WANDB_HOST = "https://api.wandb.ai"

# metrics.jsonl key -> TensorBoard scalar tag (the step is the row's "step")
TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "grad_norm": "train/grad_norm",
    "experts_max_over_mean": "moe/tokens_max_over_mean",
    "moe_aux_loss": "moe/aux_loss",
    "moe_dropped": "moe/dropped",
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


# ----------------------------------------------------------------------------- Weights & Biases


def wandb_has_credentials(env: Mapping[str, str] | None = None) -> bool:
    """Whether wandb can log in without asking: ``WANDB_API_KEY`` (or an identity token file) set,
    or an entry for wandb's host (``WANDB_BASE_URL``, else api.wandb.ai) in the ``.netrc`` file
    (``NETRC``, else ``~/.netrc``) that ``wandb login`` writes."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(env.get("WANDB_BASE_URL") or WANDB_HOST).netloc
    path = Path(env.get("NETRC") or "~/.netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):  # no file, or one wandb cannot read either
        return False
    return entry is not None and bool(entry[2])


def wandb_mode(configured: str | None, env: Mapping[str, str] | None = None) -> str:
    """The mode of the wandb run: ``metrics.wandb_mode``; when null ``WANDB_MODE`` (wandb's old
    ``dryrun``/``run`` read as offline/online), else ``offline`` without credentials (no network
    and no login prompt needed) and ``online`` with them."""
    env = os.environ if env is None else env
    choices = tuple(c for c in field_choices(MetricsConfig, "wandb_mode") if c is not None)
    if configured is not None:
        if configured not in choices:
            raise ConfigError(f"metrics.wandb_mode={configured!r} is not valid; choose one of {', '.join(choices)} or null")
        return configured
    from_env = env.get("WANDB_MODE")
    if from_env:
        mode = {"dryrun": "offline", "run": "online"}.get(from_env, from_env)
        if mode not in choices:
            raise ConfigError(
                f"WANDB_MODE={from_env!r} is not valid for metrics.wandb; choose one of {', '.join(choices)}, "
                "or set metrics.wandb_mode"
            )
        return mode
    return "online" if wandb_has_credentials(env) else "offline"


@dataclass(frozen=True)
class WandbRun:
    """What :class:`WandbWriter` passes to ``wandb.init``."""

    project: str
    mode: str
    name: str
    config: dict[str, Any]
    entity: str | None = None
    group: str | None = None


def wandb_run(tc: TrainConfig, run_dir: Path, overrides: Sequence[str]) -> WandbRun | None:
    """The wandb run of a boost-train run in ``run_dir`` (None with ``metrics.wandb=false``).

    Its name says what the run changed: Hydra's ``hydra.job.override_dirname`` (the command
    line's overrides, ``key=value,...``), else ``overrides`` joined the same way, else the run
    folder's name. Its config is the whole resolved training config. In a ``-m`` sweep its group
    is the sweep folder unless ``metrics.wandb_group`` names one.
    """
    m = tc.metrics
    if not m.wandb:
        return None
    override_dirname, sweep_dir = _hydra_job(run_dir)
    return WandbRun(
        project=m.wandb_project, mode=wandb_mode(m.wandb_mode), name=override_dirname or ",".join(overrides) or run_dir.name,
        config=dataclasses.asdict(tc), entity=m.wandb_entity, group=m.wandb_group if m.wandb_group is not None else sweep_dir,
    )


def _hydra_job(run_dir: Path) -> tuple[str, str | None]:
    """(``hydra.job.override_dirname``, the sweep folder in a ``-m`` sweep else None) of the Hydra
    job whose output folder is ``run_dir``; ``("", None)`` outside a Hydra app
    (:func:`~boost_compile.train.run` called directly) or for a job of another folder."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return "", None
        hydra = HydraConfig.get()
        if Path(str(hydra.runtime.output_dir)).resolve() != run_dir.resolve():
            return "", None
        sweep_dir = str(hydra.sweep.dir) if str(hydra.mode) == "RunMode.MULTIRUN" else None
        return str(hydra.job.override_dirname), sweep_dir
    except Exception:  # no Hydra, or a config without these keys
        return "", None


def wandb_run_id(run_dir: Path) -> str:
    """The id of ``run_dir``'s wandb run: the one in :data:`WANDB_ID_FILE`, or a new one written
    there, so that the run restarted in the same folder continues the same wandb run."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file() and (run_id := path.read_text().strip()):
        return run_id
    run_id = uuid.uuid4().hex[:12]  # wandb's ids are short lowercase alphanumerics
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


class WandbWriter:
    """The rows of ``metrics.jsonl`` logged to a wandb run (:data:`TENSORBOARD_TAGS` at the row's
    step), its files in ``run_dir/wandb``; nothing when not ``enabled`` (ranks other than 0) or in
    mode ``disabled``.

    A restart in the same folder continues the run (``resume="allow"`` with the folder's id).
    wandb keeps one value per step and cannot take back logged steps: an online run that already
    holds steps past the resumed one keeps their first values (the rows of those redone steps are
    skipped, ``metrics.jsonl`` has both); offline, each start writes its own ``offline-run-*``.
    A failure to log or to finish is a warning: it never stops or hides the training.
    """

    def __init__(self, run_dir: Path, spec: WandbRun, enabled: bool = True) -> None:
        self.run: Any = None
        self.logged_before = 0  # steps below this are in the resumed wandb run already
        self.broken = False
        if not enabled or spec.mode == "disabled":
            return
        import wandb

        try:
            self.run = wandb.init(
                project=spec.project, entity=spec.entity, group=spec.group, name=spec.name, config=spec.config,
                dir=str(run_dir), mode=spec.mode, id=wandb_run_id(run_dir), resume="allow",
                settings=wandb.Settings(console="off"),  # the run folder's train.log has the output
            )
            self.logged_before = int(self.run.step)
        except Exception as exc:
            self.close(failed=True)
            raise RuntimeError(
                f"metrics.wandb: wandb.init failed in mode {spec.mode} ({type(exc).__name__}: {exc}); "
                "metrics.wandb_mode=offline needs no network or login, metrics.wandb=false turns it off"
            ) from exc
        if self.logged_before > 1:
            log.info("wandb: continuing run %s (%s), which has steps up to %d", self.run.id, spec.name, self.logged_before - 1)

    def write(self, row: dict[str, Any]) -> None:
        if self.run is None or self.broken:
            return
        values = {tag: float(row[key]) for key, tag in TENSORBOARD_TAGS.items() if row.get(key) is not None}
        if not values or row["step"] < self.logged_before:
            return
        try:
            self.run.log(values, step=row["step"])
        except Exception as exc:
            self.broken = True
            log.warning("wandb: logging failed (%s: %s); the run goes on without wandb", type(exc).__name__, exc)

    def close(self, failed: bool = False) -> None:
        """Finish the run (marked failed with ``failed``); a wandb error here is only logged.

        ``run.finish`` only tells wandb's service process that the run is done: the service
        writes and closes the run's files afterwards, on its own time. When no other wandb run
        is active in this process, ``wandb.teardown`` waits for the service, so the run folder's
        ``wandb/`` is complete once training returns (ready to read or to ``wandb sync``)."""
        run, self.run = self.run, None
        if run is None:
            return
        import wandb

        try:
            run.finish(exit_code=1 if failed else 0)
        except Exception as exc:
            log.warning("wandb: finishing the run failed (%s: %s)", type(exc).__name__, exc)
        try:  # waited for even when finish failed: what the service holds is still written
            if wandb.run is None:
                wandb.teardown()
        except Exception as exc:
            log.warning("wandb: waiting for wandb's service failed (%s: %s)", type(exc).__name__, exc)


class MetricsWriter:
    """Where a run's metric rows go: ``metrics.jsonl`` in ``run_dir``, TensorBoard event files in
    ``run_dir/tensorboard`` when ``tensorboard``, and the wandb run ``wandb`` (:func:`wandb_run`)
    when given; rank 0 only (``enabled``)."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool = True,
        tensorboard: bool = False,
        purge_step: int | None = None,
        wandb: WandbRun | None = None,
    ) -> None:
        self.jsonl = JsonlWriter(run_dir / METRICS_FILE, enabled)
        self.tensorboard: TensorBoardWriter | None = None
        self.wandb: WandbWriter | None = None
        try:
            if enabled and tensorboard:
                self.tensorboard = TensorBoardWriter(run_dir / TENSORBOARD_DIR, enabled, purge_step)
            if enabled and wandb is not None:
                self.wandb = WandbWriter(run_dir, wandb, enabled)
        except BaseException:
            self.close(failed=True)
            raise

    def write(self, row: dict[str, Any]) -> None:
        self.jsonl.write(row)
        if self.tensorboard is not None:
            self.tensorboard.write(row)
        if self.wandb is not None:
            self.wandb.write(row)

    def close(self, failed: bool = False) -> None:
        """Close every writer; ``failed``: the run ends with an error (its wandb run is marked so)."""
        try:
            self.jsonl.close()
        finally:
            try:
                if self.tensorboard is not None:
                    self.tensorboard.close()
            finally:
                if self.wandb is not None:
                    self.wandb.close(failed)


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


# ----------------------------------------------------------------------------- model FLOPs utilization



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


def address_space_bytes(field: str = "VmSize") -> int | None:
    """This process's address space (``VmSize``: what ``ulimit -v`` / RLIMIT_AS bounds) or its
    high-water mark (``VmPeak``), from ``/proc/self/status``; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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
