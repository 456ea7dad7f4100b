"""``boost-train``, the Hydra app: :func:`main`, the run it starts (:func:`run`,
which validates the config before anything else exists) and the summary a sweep
ends with (:class:`SweepSummary`: ``summary.csv`` and ``summary.md``).
"""

from __future__ import annotations

import csv
import io
import logging
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from boost_compile.config import ConfigError
from boost_compile.process_exit import exit_without_finalizing
from boost_compile.train.checkpoint import resume_candidates
from boost_compile.train.config import config_dir, register_configs
from boost_compile.train.launchers import adopt_submitit_environment, check_plugins, quiet_worker_logging
from boost_compile.train.loop import Trainer
from boost_compile.train.memory_check import check_memory
from boost_compile.train.metrics import SUMMARY_FILE, read_summary, write_summary
from boost_compile.train.parallel import setup_distributed
from boost_compile.train.validate import env_world_size, to_train_config, validate

log = logging.getLogger("boost_compile.train")

SUMMARY_COLUMNS = (
    "job",
    "config",
    "status",
    "steps",
    "final_loss",
    "val_loss",
    "tokens_per_s",
    "peak_mem_mib",
    "total_s",
    "error",
)


# ----------------------------------------------------------------------------- a run


def run(cfg: Any, run_dir: str | Path, *, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train as ``cfg`` says, writing into ``run_dir``; returns the summary (every rank).

    Everything is validated first (:func:`validate`), before the process group,
    the data or the model exists.
    """
    tc = to_train_config(cfg)
    if tc.parallel.layout == "auto":
        from boost_compile.train.auto_layout import choose_layout

        tc, _ = choose_layout(tc)
    tc, shape = validate(tc)
    run_dir = Path(run_dir).resolve()
    candidates = resume_candidates(tc, run_dir)  # a bad explicit checkpoint stops here, before any process group
    dev = setup_distributed(tc)
    check_memory(tc, dev)  # a layout this rank cannot hold stops here, before the model exists
    candidates = dev.broadcast(candidates)  # rank 0's choice on every rank
    own_dir = run_dir
    run_dir = Path(dev.broadcast(str(run_dir)))  # all ranks write where rank 0 does
    if own_dir != run_dir and own_dir.is_dir() and not any(own_dir.iterdir()):
        own_dir.rmdir()  # a worker's Hydra folder that got a later timestamp
    if dev.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if tc.trainer.threads is not None:
        torch.set_num_threads(tc.trainer.threads)
    try:
        return Trainer(tc, shape, dev, run_dir, list(overrides), candidates).fit()
    finally:
        torch.set_num_threads(threads)  # a multirun's next job (or the caller) gets its own


# ----------------------------------------------------------------------------- sweeps


def summary_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder of a sweep that wrote ``summary.json``, in job order."""
    rows = []
    for path in sweep_dir.glob(f"*/{SUMMARY_FILE}"):
        data = read_summary(path)
        job = path.parent.name
        rows.append({"job": job, **{k: data.get(k) for k in SUMMARY_COLUMNS if k != "job"}})

    def order(row: dict[str, Any]) -> tuple[int, str]:
        return (int(row["job"]) if str(row["job"]).isdigit() else 1 << 30, str(row["job"]))

    return sorted(rows, key=order)


_FORMATS = {"final_loss": "{:.4f}", "val_loss": "{:.4f}", "tokens_per_s": "{:,.0f}", "peak_mem_mib": "{:,.0f}", "total_s": "{:.1f}"}


def _cell(key: str, value: Any) -> str:
    if value is None:
        return ""
    if key in _FORMATS and isinstance(value, (int, float)):
        return _FORMATS[key].format(value)
    return str(value).replace("|", "\\|")


def best_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The completed job with the lowest validation loss (what a search minimises), if any has one."""
    scored = [r for r in rows if r.get("status") == "completed" and isinstance(r.get("val_loss"), (int, float))]
    return min(scored, key=lambda r: r["val_loss"]) if scored else None


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` at once: a reader never sees half a table."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def write_sweep_summary(sweep_dir: str | Path) -> str:
    """Write ``summary.csv`` and ``summary.md`` for a sweep; returns the markdown table (and the best job)."""
    sweep_dir = Path(sweep_dir)
    rows = summary_rows(sweep_dir)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=SUMMARY_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    _replace(sweep_dir / "summary.csv", buffer.getvalue())
    header = ["job", "config", "status", "steps", "final loss", "val loss", "tokens/s", "peak mem (MiB)", "time (s)", "error"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row[k]) for k in SUMMARY_COLUMNS) + " |")
    table = "\n".join(lines) + "\n"
    best = best_row(rows)
    if best is not None:
        table += f"\nbest val loss: {best['val_loss']:.4f}, job {best['job']} ({best['config']})\n"
    _replace(sweep_dir / "summary.md", f"# sweep {sweep_dir}\n\n{table}")
    return table


def update_sweep_summary(sweep_dir: str | Path) -> None:
    """Rewrite the sweep's summary after one job, under a lock: jobs a launcher runs side by side
    (submitit) each add their row, and a sweep that fails at its end still has every job's."""
    import fcntl

    sweep_dir = Path(sweep_dir)
    with open(sweep_dir / ".summary.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        write_sweep_summary(sweep_dir)


def write_failed_summary(run_dir: Path, overrides: Sequence[str], exc: BaseException) -> None:
    """A job that raised gets a ``summary.json`` too (status ``failed`` and its error), so that its
    sweep's table lists it; a run that wrote its own summary keeps it."""
    path = run_dir / SUMMARY_FILE
    if path.exists() or not run_dir.is_dir():
        return
    message = " ".join(str(exc).split()) or "(no message)"
    write_summary(path, {"config": " ".join(overrides), "status": "failed", "error": f"{type(exc).__name__}: {message[:300]}"})


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra-core is a dependency
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepSummary(_HydraCallback):
    """Hydra callback: a ``-m`` sweep's table of every job (CSV and markdown), rewritten as each
    job ends (in the job's own process under submitit) and logged when the sweep ends."""

    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0 or str(config.hydra.mode) != "RunMode.MULTIRUN":
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            update_sweep_summary(sweep_dir)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        table = write_sweep_summary(sweep_dir)
        log.info("sweep summary (%s):\n%s", sweep_dir / "summary.md", table)


# ----------------------------------------------------------------------------- entry point


def _task(cfg: Any) -> float | None:
    """The Hydra task: one run; returns its validation loss (what ``hydra/sweeper=optuna`` minimises),
    None when it evaluated nothing.

    A job of a sweep that fails raises, so that Hydra marks it failed and runs the others;
    its ``summary.json`` says why. A single run refused by validation exits 2 with the reason.
    """
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    multirun = str(hydra_cfg.mode) == "RunMode.MULTIRUN"
    rank = adopt_submitit_environment()
    if rank:
        quiet_worker_logging(rank)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    try:
        _check_rerun_finds_the_run(cfg, HydraConfig.instance().cfg.hydra)
        result = run(cfg, run_dir, overrides=overrides)
    except Exception as exc:
        if multirun and int(os.environ.get("RANK", "0")) == 0:
            write_failed_summary(run_dir, overrides, exc)
        if isinstance(exc, ConfigError) and not multirun:
            print(f"boost-train: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        raise
    finally:
        if rank is not None and dist.is_initialized():
            dist.destroy_process_group()  # submitit: this process may run another job
    if result["status"] == "stopped":
        raise SystemExit(128 + int(signal.Signals[result["signal"]]))
    return result.get("val_loss")


def _check_rerun_finds_the_run(cfg: Any, hydra_node: Any) -> None:
    """``trainer.resume=auto`` resumes from the run folder of the same command run again: a folder
    named after the start time (Hydra's default ``runs/<date>/<time>``) is a new one each time."""
    from omegaconf import OmegaConf

    if cfg.trainer.resume != "auto" or cfg.checkpoint.dir or cfg.checkpoint.resume_from:
        return
    multirun = str(hydra_node.mode) == "RunMode.MULTIRUN"
    key = "sweep" if multirun else "run"
    raw = str(OmegaConf.to_container(hydra_node[key], resolve=False)["dir"])
    if "${now:" in raw:
        raise ConfigError(
            f"trainer.resume=auto resumes from the run folder, but hydra.{key}.dir={raw} is named after the start "
            f"time and a restarted command would get a new one; set hydra.{key}.dir=runs/<name> "
            "(or checkpoint.dir=<folder>)"
        )


def main(argv: Sequence[str] | None = None) -> None:
    """``boost-train [overrides] [-m]``: the Hydra app (argv defaults to ``sys.argv[1:]``)."""
    import hydra

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        check_plugins(sys.argv[1:])
    except ConfigError as exc:
        print(f"boost-train: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    # our hydra/launcher/submitit_*.yaml carry the plugin's keys and are checked against its schema
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_\w+' is validated against ConfigStore schema")
    register_configs()
    if env_world_size() > 1 and int(os.environ.get("RANK", "0")) > 0:
        # only rank 0 writes the run folder's config and log; the others print warnings
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=boost_worker"]
    app = hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(_task)
    torchrun_worker = env_world_size() > 1
    code: object = 0
    try:
        app()
    except SystemExit as exc:  # hydra's exit after an error it reported, ours after a refusal or a stop
        if not torchrun_worker:
            raise
        code = exc.code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if torchrun_worker:
        exit_without_finalizing(code)  # gloo's threads outlive the process group (boost_compile/process_exit.py)
