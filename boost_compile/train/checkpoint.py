"""Checkpoints (DCP), resuming, and stopping cleanly on a signal.

A checkpoint is a folder ``step_000123`` holding one DCP save of the model,
optimizer, schedule, data position and every rank's RNG state. It is complete
once rank 0 has written its :data:`COMPLETE_FILE` (the size and :data:`CHECKSUM`
digest of every file), which it does last, after every rank's shard files and
DCP's ``.metadata`` are on disk: a save cut short (a SIGKILL, a lost node) leaves
no record and is never resumed from. Each rank digests the shard files it wrote
(:class:`ChecksumWriter`, in the thread that wrote them) and DCP's gather of the
write results brings the digests to rank 0. :func:`resume_candidates` finds what
``trainer.resume`` loads (``true``: the newest complete checkpoint, or an error;
``auto``: the complete ones newest first, a damaged one skipped, none: a fresh
start); :meth:`Checkpointer.resume` checks each one's files against their
digests before loading it (a flipped bit keeps a file's size), so a damaged one
is skipped under ``auto`` and named otherwise;
:class:`StopOnSignal` turns SIGTERM/SIGINT into a stop after the current step
(and a checkpoint, with ``checkpoint.on_signal``). With ``checkpoint.async_save``
the files are written by a background thread while training goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from boost_compile.config import ConfigError
from boost_compile.train.checkpoint_shards import experts_saved, over_fsdp, to_local, to_saved
from boost_compile.train.config import CheckpointConfig, TrainConfig
from boost_compile.train.data import PackedTokens
from boost_compile.train.optim import local_optimizer
from boost_compile.train.parallel import Dist

log = logging.getLogger("boost_compile.train")

#: written by rank 0 into a checkpoint folder once the whole save is on disk
COMPLETE_FILE = "complete.json"
#: the hashlib digest of each file recorded in :data:`COMPLETE_FILE` (its name is recorded
#: too, so a later version may change it): sha256 hashes about twice as fast as blake2b on
#: CPUs with SHA extensions (benchmarks/bench_checkpoint_checksum.py, benchmarks/RESULTS.md)
CHECKSUM = "sha256"
#: bytes read at a time when digesting a file (a file is never read into memory whole)
CHECKSUM_CHUNK = 1 << 20
# DCP's note that a save without a process group is a one-process save: so it is (no_dist=True)
_NO_DIST_WARNING = ".*torch.distributed is disabled.*"


def checkpoint_dir(cfg: CheckpointConfig, run_dir: Path) -> Path:
    """Where a run saves its checkpoints: ``checkpoint.dir``, else ``<run folder>/checkpoints``."""
    return Path(cfg.dir).expanduser() if cfg.dir else run_dir / "checkpoints"


def folder_step(path: Path) -> int | None:
    """The step in the name of a checkpoint folder ``step_000123`` (None if not one)."""
    if not path.name.startswith("step_") or not path.is_dir():
        return None
    try:
        return int(path.name[len("step_") :])
    except ValueError:
        return None


def checkpoint_step(path: Path) -> int | None:
    """The step of a complete checkpoint folder ``step_000123`` (None if not one)."""
    step = folder_step(path)
    return step if step is not None and (path / COMPLETE_FILE).is_file() else None


def checkpoint_problem(path: Path, read_metadata: bool = True, verify_checksums: bool = False) -> str | None:
    """Why ``path`` is not a checkpoint to resume from, in a few words; None when it is one.

    Complete (its record), every file of the record there with its recorded
    size (a truncated or missing shard), with ``read_metadata`` DCP's
    ``.metadata`` readable (damaged bytes of the same size), and with
    ``verify_checksums`` every file's digest the recorded one (:func:`checksum_problem`:
    it reads every byte, so resuming does it only for the checkpoint it loads).
    """
    if not path.is_dir():
        return "not a folder"
    record_path = path / COMPLETE_FILE
    if not record_path.is_file():
        if not (path / ".metadata").is_file():
            return "incomplete: the save was interrupted before DCP wrote .metadata"
        return f"incomplete: no {COMPLETE_FILE} (the save was interrupted, or it was not written by boost-train)"
    try:
        record = json.loads(record_path.read_text())
        files = dict(record["files"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"its {COMPLETE_FILE} cannot be read ({type(exc).__name__})"
    for name, size in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} holds {file.stat().st_size} bytes, {size} were saved (truncated or overwritten)"
    if read_metadata:
        import torch.distributed.checkpoint as dcp

        try:
            dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - any unpickling error means damaged metadata
            return f"its .metadata cannot be read ({type(exc).__name__}: {exc})"
    if verify_checksums:
        return checksum_problem(path)
    return None


def file_checksum(path: Path, algorithm: str = CHECKSUM, chunk: int = CHECKSUM_CHUNK) -> str:
    """The hex ``algorithm`` digest of the bytes of ``path``, read ``chunk`` bytes at a time into
    one buffer (a shard of many GB never sits in memory)."""
    digest = hashlib.new(algorithm)
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def recorded_checksums(path: Path) -> tuple[str | None, dict[str, str]]:
    """The digest name and per-file digests in the record of checkpoint ``path``; ``(None, {})`` for
    a record of sizes only (saved before checksums were), or none."""
    try:
        record = json.loads((path / COMPLETE_FILE).read_text())
    except (OSError, ValueError):
        return None, {}
    sums = record.get("checksums") if isinstance(record, dict) else None
    if not isinstance(sums, dict) or not sums:
        return None, {}
    return str(record.get("checksum_algorithm", CHECKSUM)), {str(k): str(v) for k, v in sums.items()}


def checksum_problem(path: Path, names: list[str] | None = None) -> str | None:
    """The first of ``names`` (default: every file of the record) in checkpoint ``path`` whose
    digest is not the recorded one, in a few words naming it; None when they all match, or
    when the record has no checksums (or ones of a digest this Python's hashlib lacks)."""
    algorithm, sums = recorded_checksums(path)
    if algorithm is None or algorithm not in hashlib.algorithms_available:
        return None
    if names is None:
        record = json.loads((path / COMPLETE_FILE).read_text())
        names = sorted(set(record.get("files", {})) | set(sums))
    for name in names:
        if name not in sums:
            return f"{name}: no checksum recorded for it in {COMPLETE_FILE} (the record was edited)"
        try:
            digest = file_checksum(path / name, algorithm)
        except OSError as exc:
            return f"{name} cannot be read ({type(exc).__name__}: {exc})"
        if digest != sums[name]:
            return (f"{name}: checksum mismatch (its {algorithm} is {digest[:16]}..., it was {sums[name][:16]}... "
                    "when saved): its bytes changed after the save")
    return None


def step_folders(path: Path) -> list[tuple[int, Path]]:
    """Every ``step_*`` folder in ``path`` (complete or not), newest first."""
    if not path.is_dir():
        return []
    return sorted(((s, p) for p in path.iterdir() if (s := folder_step(p)) is not None), reverse=True)


def find_checkpoint(path: Path) -> Path | None:
    """``path`` if it is a complete checkpoint, else the newest complete one inside it."""
    if (path / COMPLETE_FILE).is_file():
        return path
    found = [p for s, p in step_folders(path) if checkpoint_step(p) is not None]
    return found[0] if found else None


def write_record(path: Path, step: int, checksums: dict[str, str] | None = None,
                 algorithm: str | None = CHECKSUM) -> None:
    """Mark ``path`` complete: the size and ``algorithm`` digest of every file in it, written to a
    temporary name and renamed (a reader sees the whole record or none).

    ``checksums``: the ``algorithm`` digests already taken (by the rank that wrote each shard); the other files
    (``.metadata``) are digested here. ``algorithm=None``: sizes only, as saves before checksums.
    """
    files = {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file() and f.name != COMPLETE_FILE}
    record: dict[str, Any] = {"step": step, "files": files}
    if algorithm is not None:
        known = checksums or {}
        record["checksum_algorithm"] = algorithm
        record["checksums"] = {name: known.get(name) or file_checksum(path / name, algorithm) for name in files}
    tmp = path / f".{COMPLETE_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path / COMPLETE_FILE)


def rng_restorable(saved_layout: tuple[int, ...] | None, layout: tuple[int, ...], own: bool) -> str | None:
    """Why a rank must not restore the generator state a checkpoint holds for its rank number
    (None: restore it). The TP ranks of a replica must share one stream and the replicas must
    not (replica_streams.py): a state saved by another ``(pp, dp, tp)`` layout under the same
    rank number may break both, so every rank then draws from a stream seeded for its replica
    and the resumed step (``replica_streams.resumed_seed``). An older checkpoint does not
    record its layout: its state is restored where it has one."""
    if not own:
        return "no random state saved for this rank"
    if saved_layout is not None and tuple(saved_layout) != tuple(layout):
        pp, dp, tp = saved_layout
        return f"saved by pp={pp} dp={dp} tp={tp}, not this layout"
    return None


class Checkpointer:
    """Model, optimizer, schedule, data position and RNG in one DCP checkpoint per step.

    ``before_metadata(step)``: called on rank 0 between the shard files and
    ``.metadata`` of a save (:mod:`~boost_compile.train.faults` kills a save there).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: Path,
        dev: Dist,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        data: PackedTokens,
        before_metadata: Callable[[int], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.dir = directory
        self.dev = dev
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.before_metadata = before_metadata
        self.last_saved: int | None = None
        self.rng_restored = False  # whether the last load put this rank's saved random state back
        # an asynchronous save: step, folder, future, its writer (the shards' digests)
        self.pending: tuple[int, Path, Any, ChecksumWriter] | None = None
        self._group: Any = None  # the process group of asynchronous saves (not the training one)
        if cfg.async_save and dev.world > 1:
            import torch.distributed as dist

            # a background save's collectives must not interleave with the training step's
            self._group = dist.new_group(backend="gloo")

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
            if self.dev.dp_shard > 1:  # FSDP2's slices of the TP shards, over (dp_shard, tp)
                model_sd, optim_sd = over_fsdp(self.model, self.dev.mesh, model_sd, optim_sd)
            model_sd, optim_sd = to_saved(self.model, self.dev.mesh["tp"], model_sd, optim_sd)
        if self.dev.ep > 1:  # each rank of an expert group its own experts: shards of the whole
            model_sd, optim_sd = experts_saved(self.model, self.dev.experts_mesh, model_sd, optim_sd,
                                               self.dev.ep_edp_mesh)
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
            # each rank's generators, and the layout that saved them (rng_restorable)
            "rng": {f"rank{self.dev.rank}": rng, "layout": torch.tensor(self._layout())},
        }

    def _layout(self) -> tuple[int, int, int]:
        return (self.dev.pp, self.dev.dp, self.dev.tp)

    def _saved_layout(self, path: Path, saved: Mapping[str, Any]) -> tuple[int, ...] | None:
        """The (pp, dp, tp) that saved ``path`` (None: an older checkpoint, which did not say)."""
        import torch.distributed.checkpoint as dcp

        if "rng.layout" not in saved:
            return None
        holder = {"rng": {"layout": torch.zeros(3, dtype=torch.long)}}
        with _quiet_dcp():
            dcp.load(holder, checkpoint_id=str(path), no_dist=self.dev.world == 1)
        return tuple(int(v) for v in holder["rng"]["layout"])

    # save ------------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Save step ``step`` (every rank). Synchronous: complete on return. With
        ``checkpoint.async_save`` the state is copied and written in the background; the
        previous asynchronous save is finished first."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = self.dir / f"step_{step:06d}"
        self._clear(path)
        hook = self.before_metadata
        writer = ChecksumWriter(str(path), (lambda: hook(step)) if hook else None)
        target = {"checkpoint_id": str(path), "storage_writer": writer}
        fresh = not local_optimizer(self.optimizer).state  # before the first step (checkpoint.at_start)
        state = self._state(step)
        if fresh:
            _as_fresh(self.optimizer, state["optim"])
        with _quiet_dcp():
            if self.cfg.async_save:
                if self.dev.world == 1:  # the background thread repeats the warning _quiet_dcp hides here
                    warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
                future = dcp.async_save(state, **target, process_group=self._group,
                                        no_dist=self.dev.world == 1)
                self.pending = (step, path, future, writer)
                return path
            dcp.save(state, **target, no_dist=self.dev.world == 1)
        self._complete(step, path, writer.checksums)
        return path

    def poll(self) -> None:
        """Finish an asynchronous save whose files are written (no wait)."""
        if self.pending is not None and self.pending[2].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any, and mark it complete."""
        if self.pending is None:
            return
        step, path, future, writer = self.pending
        self.pending = None
        future.result()  # raises what the background save raised
        self._complete(step, path, writer.checksums)

    def _clear(self, path: Path) -> None:
        """Remove what an interrupted save of the same step left (rank 0), before anyone writes."""
        if self.dev.is_main and path.exists():
            log.warning("removing %s, an incomplete save of the same step", path)
            shutil.rmtree(path)
        self.dev.barrier()

    def _complete(self, step: int, path: Path, checksums: dict[str, str]) -> None:
        # every rank's files are on disk: DCP's coordinator (rank 0) wrote .metadata after all of them,
        # and its writer holds every rank's digests of its shards (rank 0 digests .metadata here)
        self.last_saved = step
        if self.dev.is_main:
            write_record(path, step, checksums)
            self._prune()

    def _prune(self) -> None:
        """Keep the newest ``checkpoint.keep`` complete checkpoints; drop what interrupted saves
        older than the newest complete one left."""
        found = step_folders(self.dir)
        complete = [(s, p) for s, p in found if checkpoint_step(p) is not None]
        if not complete:
            return
        newest = complete[0][0]
        for _, path in complete[self.cfg.keep :]:
            shutil.rmtree(path, ignore_errors=True)
        for s, path in found:
            if s < newest and checkpoint_step(path) is None:
                shutil.rmtree(path, ignore_errors=True)

    # load ------------------------------------------------------------------------

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
        del state["rng"]["layout"]
        own = any(k.startswith(f"rng.rank{self.dev.rank}.") for k in saved)
        why_not = rng_restorable(self._saved_layout(path, saved), self._layout(), own)
        if why_not is not None:
            log.warning("checkpoint %s: %s; rank %d draws from a stream seeded for the resumed step", path, why_not,
                        self.dev.rank)
            del state["rng"]
        self.rng_restored = why_not is None
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

    def _checksum_problem(self, path: Path) -> str | None:
        """The first file of checkpoint ``path`` whose digest is not the recorded one (the same
        words on every rank), None when all match. The files are shared out over the ranks,
        each reading ``1 / world`` of the bytes. A record of sizes only (an older save) is logged."""
        algorithm, sums = recorded_checksums(path)
        if not sums:
            if self.dev.is_main:
                log.info("checkpoint %s: no checksums recorded (an older save): only its files' sizes are checked", path)
            return None
        if algorithm not in hashlib.algorithms_available:
            if self.dev.is_main:
                log.warning("checkpoint %s: its checksums are %s, which this Python's hashlib lacks: only its files' "
                            "sizes are checked", path, algorithm)
            return None
        mine = sorted(sums)[self.dev.rank :: self.dev.world]
        problem = checksum_problem(path, mine)
        if self.dev.world == 1:
            return problem
        import torch.distributed as dist

        found: list[str | None] = [None] * self.dev.world
        dist.all_gather_object(found, problem)
        return next((p for p in found if p is not None), None)

    def resume(self, candidates: list[Path], auto: bool) -> tuple[int, Path | None]:
        """Load the first of ``candidates`` whose files match their recorded checksums and that
        loads on every rank: (its step, its folder); (0, None) when there are none.

        ``auto`` (``trainer.resume=auto``): one that is damaged or fails is reported and the next
        (older) one tried. Otherwise, or when none loads, a ConfigError names the folder (and
        the damaged file).
        """
        for path in candidates:
            damaged = self._checksum_problem(path)
            if damaged is not None:
                if not auto:
                    raise ConfigError(
                        f"checkpoint {path}: {damaged}; resume from an earlier checkpoint "
                        "(checkpoint.resume_from=<its step_* folder>) or with trainer.resume=auto"
                    )
                log.warning("trainer.resume=auto: skipping %s: %s", path, damaged)
                continue
            error = None
            try:
                step = self.load(path)
            except ConfigError:
                raise
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises many kinds
                error = _cause(exc)
            if not self.dev.any(error is not None):
                return step, path
            error = error or "it failed to load on another rank"
            if not auto:
                raise ConfigError(f"checkpoint {path} cannot be loaded: {error}")
            log.warning("trainer.resume=auto: skipping checkpoint %s, which cannot be loaded (%s)", path, error)
        if candidates:
            raise ConfigError(
                f"trainer.resume=auto: none of the checkpoints in {candidates[0].parent} can be loaded "
                "(see the warnings above); move them away to start afresh"
            )
        return 0, None


def _as_fresh(optimizer: torch.optim.Optimizer, optim_sd: dict[str, Any]) -> None:
    """An optimizer that has not stepped yet, saved as one: DCP's state dict makes AdamW's state
    by a step with zero gradients and lr 0 (the weights stay as they are, its step counts become
    1); the saved counts are put back to 0, so that resuming equals a fresh optimizer's first step
    (zero moments, count 0), and the live optimizer loses the state again, for the same reason."""
    for key, value in optim_sd.items():
        if key.rsplit(".", 1)[-1] == "step" and isinstance(value, torch.Tensor):
            optim_sd[key] = torch.zeros_like(value)
    local_optimizer(optimizer).state.clear()


class _Written(list):
    """One rank's DCP write results (a list, as DCP expects) with the digests of the files it
    wrote: DCP gathers every rank's results on the coordinator, and so the digests."""

    def __init__(self, results: list[Any], checksums: dict[str, str]) -> None:
        super().__init__(results)
        self.checksums = checksums


class ChecksumWriter(FileSystemWriter):
    """DCP's FileSystemWriter that digests each shard file right after writing it, on the rank
    (and in the thread: an asynchronous save's background one) that wrote it, and gathers the
    digests on rank 0 with DCP's own gather of the write results: ``checksums`` on rank 0 once the
    save is done. ``before_metadata``: a call between the shard files and ``.metadata`` (``finish``
    runs on the coordinator, rank 0, once every rank's files are written)."""

    def __init__(self, path: str, before_metadata: Callable[[], None] | None = None,
                 algorithm: str = CHECKSUM) -> None:
        super().__init__(path)
        self._before_metadata = before_metadata
        self.algorithm = algorithm
        self.checksums: dict[str, str] = {}

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        results = super().write_data(plan, planner).wait()
        names = sorted({r.storage_data.relative_path for r in results})
        written = _Written(results, {n: file_checksum(Path(self.path) / n, self.algorithm) for n in names})
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(written)
        return future

    def finish(self, metadata: Any, results: Any) -> None:
        self.checksums = {n: d for rank in results for n, d in getattr(rank, "checksums", {}).items()}
        if self._before_metadata is not None:
            self._before_metadata()
        super().finish(metadata, results)


def _cause(exc: BaseException) -> str:
    """One line for why a load failed (DCP's CheckpointException holds each failed rank's
    (exception, traceback): the first rank's exception)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # load_state_dict's "Error(s) in loading ...:", then what
        lines[0] = f"{lines[0]} {lines[1]}"
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
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


def resume_candidates(tc: TrainConfig, run_dir: Path) -> list[Path]:
    """The checkpoints ``trainer.resume`` may load, the one to try first first; checked before any
    process group exists.

    ``false``: none. ``true``: the newest complete checkpoint of
    ``checkpoint.resume_from`` (a ``step_*`` folder, or a folder of them; default
    the run's checkpoint folder); a ConfigError names the folder when there is none
    or it is damaged. ``auto``: every complete one, newest first, those that are
    damaged reported and left out; none is a fresh start.
    """
    resume = tc.trainer.resume
    if resume is False:
        return []
    resume_from = tc.checkpoint.resume_from
    where = Path(resume_from).expanduser() if resume_from else checkpoint_dir(tc.checkpoint, run_dir)
    if folder_step(where) is not None or (where / ".metadata").is_file() or (where / COMPLETE_FILE).is_file():
        folders = [where]  # one checkpoint named
    else:
        folders = [p for _, p in step_folders(where)]
    if resume != "auto":
        found = [p for p in folders if checkpoint_step(p) is not None or p == where]
        if not found:
            raise ConfigError(
                f"trainer.resume=true but there is no complete checkpoint in {where}; point at the earlier run "
                "with hydra.run.dir=<its folder> or checkpoint.resume_from=<its checkpoints folder>"
            )
        problem = checkpoint_problem(found[0])
        if problem is not None:
            raise ConfigError(f"checkpoint {found[0]}: {problem}")
        return found[:1]
    usable = []
    for path in folders:
        problem = checkpoint_problem(path)
        if problem is None:
            usable.append(path)
        else:
            log.warning("trainer.resume=auto: skipping %s: %s", path, problem)
    if not usable:
        log.info("trainer.resume=auto: no complete checkpoint in %s: starting at step 1", where)
    return usable
