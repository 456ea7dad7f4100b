"""Checkpoints (DCP), resuming, and stopping cleanly on a signal.

A checkpoint is a folder ``step_000123`` holding one DCP save of the model,
optimizer, schedule, data position and every rank's RNG state; it is complete
once DCP has written its ``.metadata``. :func:`resume_source` finds the one
``trainer.resume=true`` loads; :class:`StopOnSignal` turns SIGTERM/SIGINT into a
stop after the current step (and a checkpoint, with ``checkpoint.on_signal``).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import random
import shutil
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from boost_compile.config import ConfigError
from boost_compile.train.checkpoint_shards import to_local, to_saved
from boost_compile.train.config import CheckpointConfig, TrainConfig
from boost_compile.train.data import PackedTokens
from boost_compile.train.optim import local_optimizer
from boost_compile.train.parallel import Dist

log = logging.getLogger("boost_compile.train")


def checkpoint_dir(cfg: CheckpointConfig, run_dir: Path) -> Path:
    """Where a run saves its checkpoints: ``checkpoint.dir``, else ``<run folder>/checkpoints``."""
    return Path(cfg.dir).expanduser() if cfg.dir else run_dir / "checkpoints"


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint folder ``step_000123`` (None if not one)."""
    if not path.name.startswith("step_") or not (path / ".metadata").is_file():
        return None
    try:
        return int(path.name[len("step_") :])
    except ValueError:
        return None


def find_checkpoint(path: Path) -> Path | None:
    """``path`` if it is a complete checkpoint, else the newest complete one inside it."""
    if (path / ".metadata").is_file():
        return path
    if not path.is_dir():
        return None
    found = [(s, p) for p in path.iterdir() if (s := checkpoint_step(p)) is not None]
    return max(found)[1] if found else None


class Checkpointer:
    """Model, optimizer, schedule, data position and RNG in one DCP checkpoint per step."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: Path,
        dev: Dist,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        data: PackedTokens,
    ) -> None:
        self.cfg = cfg
        self.dir = directory
        self.dev = dev
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.last_saved: int | None = None

    # state -------------------------------------------------------------------------

    def _state(self, step: int, flatten: bool = True) -> dict[str, Any]:
        """What a checkpoint holds. ``flatten``: the optimizer's param groups keyed by parameter
        name (``optim.param_groups.layers.1....lr``) instead of by group index, as every run saves
        them: with pipeline parallelism each stage saves the groups of its own parameters, with
        ``parallel.zero=1`` each dp rank the state of its share (keyed by index, DCP would keep one
        rank's groups for all). ``flatten=False`` reads a checkpoint saved the older way."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        model_sd, optim_sd = get_state_dict(self.model, local_optimizer(self.optimizer), options=options)
        if self.dev.tp > 1:
            model_sd, optim_sd = to_saved(self.model, self.dev.mesh["tp"], model_sd, optim_sd)
        rng = {"torch": torch.get_rng_state(), "python": _pickled(random.getstate())}
        if self.dev.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.dev.device)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "meta": {
                "step": step,
                "scheduler": self.scheduler.state_dict(),
                "data": self.data.state_dict(),
            },
            "rng": {f"rank{self.dev.rank}": rng},
        }

    # save / load -------------------------------------------------------------------

    def save(self, step: int) -> Path:
        import torch.distributed.checkpoint as dcp

        path = self.dir / f"step_{step:06d}"
        with _quiet_dcp():
            dcp.save(self._state(step), checkpoint_id=str(path), no_dist=self.dev.world == 1)
        self.last_saved = step
        if self.dev.is_main:
            self._prune()
        return path

    def _prune(self) -> None:
        found = sorted((s, p) for p in self.dir.iterdir() if (s := checkpoint_step(p)) is not None)
        for _, path in found[: -self.cfg.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path) -> int:
        """Restore everything from ``path``; returns the step it was saved after."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        # a pipeline run's checkpoint keys the param groups by parameter name (see _state)
        flat = any(k.startswith("optim.param_groups.") for k in saved) and "optim.param_groups.0.lr" not in saved
        if not flat and local_optimizer(self.optimizer) is not self.optimizer:
            raise ConfigError(
                f"checkpoint {path} keys its optimizer's parameter groups by index (an older save): "
                "parallel.zero=1 cannot split it over the dp ranks; resume it with parallel.zero=0"
            )
        state = self._state(0, flatten=flat)
        key = f"rng.rank{self.dev.rank}."
        if not any(k.startswith(key) for k in saved):
            log.warning("checkpoint %s has no RNG state for rank %d; keeping this run's", path, self.dev.rank)
            del state["rng"]
        with _quiet_dcp():
            dcp.load(state, checkpoint_id=str(path), no_dist=self.dev.world == 1)
        model_sd, optim_sd = to_local(self.model, state["model"], state["optim"])
        set_state_dict(self.model, local_optimizer(self.optimizer), model_state_dict=model_sd, optim_state_dict=optim_sd)
        meta = state["meta"]
        self.scheduler.load_state_dict(meta["scheduler"])
        # the learning rate of the next step, on the optimizer that steps: ZeroRedundancyOptimizer
        # copies its own groups' lr onto its local AdamW at every step, and loading set only the latter's
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        self.data.load_state_dict(meta["data"])
        if "rng" in state:
            rng = state["rng"][f"rank{self.dev.rank}"]
            torch.set_rng_state(rng["torch"])
            random.setstate(pickle.loads(rng["python"].numpy().tobytes()))
            if "cuda" in rng and self.dev.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.dev.device)
        return int(meta["step"])


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
        yield


class StopOnSignal:
    """SIGTERM/SIGINT ask the loop to stop after the current step (a second one stops now)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("received %s: stopping after this step", signal.Signals(signum).name)


def resume_source(tc: TrainConfig, run_dir: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` loads; ConfigError when there is none."""
    if not tc.trainer.resume:
        return None
    resume_from = tc.checkpoint.resume_from
    where = Path(resume_from).expanduser() if resume_from else checkpoint_dir(tc.checkpoint, run_dir)
    found = find_checkpoint(where)
    if found is None:
        raise ConfigError(
            f"trainer.resume=true but there is no complete checkpoint in {where}; point at the earlier run "
            "with hydra.run.dir=<its folder> or checkpoint.resume_from=<its checkpoints folder>"
        )
    return found
