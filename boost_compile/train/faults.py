"""Faults injected on purpose, to test that a run survives them.

``BOOST_COMPILE_FAULT="<kind>:<rank>:<step>"`` (several, comma-separated) makes
global rank ``rank`` fail at step ``step`` of the first attempt of a run only
(:func:`attempt` is 0: torchrun's ``TORCHELASTIC_RESTART_COUNT`` and SLURM's
``SLURM_RESTART_COUNT`` are 0 or unset), so that the restarted run goes on:

- ``kill``: SIGKILL itself once the step's update is done (before its checkpoint);
- ``kill-in-save``: SIGKILL itself in the middle of the step's checkpoint, after
  the shard files and before ``.metadata`` (rank 0 only: DCP's coordinator);
- ``hang``: stop answering before the step (its peers' collectives time out after
  ``parallel.timeout_s``); SIGTERM still ends it, as it ends a stuck process.

Unset, nothing happens: :func:`faults_from_env` returns no faults.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from boost_compile.config import ConfigError
from boost_compile.train.parallel import attempt

ENV = "BOOST_COMPILE_FAULT"
KINDS = ("kill", "kill-in-save", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


@dataclass(frozen=True)
class Faults:
    """The faults of this rank and attempt; its methods are where the loop and the save call them."""

    faults: tuple[Fault, ...] = ()

    def _at(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.step == step for f in self.faults)

    def before_step(self, step: int) -> None:
        if self._at("hang", step):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(3600)

    def after_step(self, step: int) -> None:
        if self._at("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def in_save(self, step: int) -> None:
        if self._at("kill-in-save", step):
            os.kill(os.getpid(), signal.SIGKILL)

    @property
    def in_saves(self) -> bool:
        return any(f.kind == "kill-in-save" for f in self.faults)


def parse_faults(text: str) -> tuple[Fault, ...]:
    """``"kill:1:4,hang:0:2"`` as faults; ConfigError on anything else."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in KINDS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ConfigError(f"{ENV}={text!r}: expected <kind>:<rank>:<step>, kind one of {', '.join(KINDS)}")
        out.append(Fault(parts[0], int(parts[1]), int(parts[2])))
    return tuple(out)


def faults_from_env(rank: int) -> Faults:
    """The faults ``BOOST_COMPILE_FAULT`` asks of ``rank`` in this attempt (none after a restart)."""
    text = os.environ.get(ENV, "")
    if not text or attempt() > 0:
        return Faults()
    return Faults(tuple(f for f in parse_faults(text) if f.rank == rank))
