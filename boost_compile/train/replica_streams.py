"""Each data-parallel replica and pipeline stage draws its own random numbers.

Every rank seeds its default generators with ``trainer.seed`` before building the model, so
every replica starts from the same weights. After that, a shared stream would give every
replica the same dropout mask (on other sequences) and every pipeline stage the masks of the
stage before it: in one process each sequence and each layer draws its own. So once the model
is built, each ``(pp_rank, dp_rank)`` reseeds the torch and Python generators with a seed
derived from ``(seed, dp_rank, pp_rank)``. The tensor-parallel ranks of one replica keep one
stream between them: a replicated activation gets one mask on all of them, and a sharded one
its own per rank from that stream (``boost_compile.distributed.tp_random``).

Rank ``(0, 0)`` keeps the stream it has, so a one-process run draws what it always drew. A
checkpoint keeps each rank's generator state, and a resumed run restores it over this. A run
resumed where the saved state does not apply (another layout) reseeds every replica and stage
from ``(seed, dp_rank, pp_rank, step)``: its stream from the seed alone would draw again what
the first steps drew (rank ``(0, 0)`` would replay the run's first masks).
"""

from __future__ import annotations

import hashlib
import random

import torch


def _derived(key: str) -> int:
    """A 63-bit seed from ``key`` (the same on every rank and machine)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def _reseed(derived: int) -> int:
    """Seed torch's default generators (every device) and Python's ``random`` with ``derived``."""
    torch.manual_seed(derived)
    random.seed(derived)
    return derived


def replica_seed(seed: int, dp_rank: int, pp_rank: int) -> int | None:
    """The seed of replica ``dp_rank``'s stage ``pp_rank`` (None for ``(0, 0)``: its stream goes on)."""
    if dp_rank == 0 and pp_rank == 0:
        return None
    return _derived(f"boost-train/{seed}/dp{dp_rank}/pp{pp_rank}")


def seed_replica(seed: int, dp_rank: int, pp_rank: int) -> int | None:
    """Reseed the generators for this replica and stage; the seed used, or None where the
    stream is left as it is."""
    derived = replica_seed(seed, dp_rank, pp_rank)
    return None if derived is None else _reseed(derived)


def resumed_seed(seed: int, dp_rank: int, pp_rank: int, step: int) -> int:
    """The seed of replica ``dp_rank``'s stage ``pp_rank`` resumed after ``step`` without its saved
    random state: one per replica and stage (the TP ranks of one share it) and per step."""
    return _derived(f"boost-train/{seed}/dp{dp_rank}/pp{pp_rank}/resumed{step}")


def seed_resumed_replica(seed: int, dp_rank: int, pp_rank: int, step: int) -> int:
    """Reseed the generators with :func:`resumed_seed`; the seed used."""
    return _reseed(resumed_seed(seed, dp_rank, pp_rank, step))
