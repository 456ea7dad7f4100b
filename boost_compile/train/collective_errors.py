"""A failed collective, said in the run's terms: which rank, in which phase, waiting on which
groups.

A hung or lost peer shows up on the other ranks as a bare RuntimeError from the
process group ("Timed out waiting 600000ms for recv operation", "Connection
closed by peer") once ``parallel.timeout_s`` has passed or the peer's socket
closed. :func:`reported_collectives` turns it into a :class:`CollectiveError`
naming the rank, its place in the mesh, the phase of the loop and the
collectives that phase runs, so the log says where to look; the run then ends
and a launcher with restarts starts it again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch.distributed as dist

from boost_compile.train.parallel import Dist

log = logging.getLogger("boost_compile.train")

# what the process groups of torch say when a peer is hung (timeout) or gone (closed socket)
_COMM_FAILURES = ("timed out", "connection closed by peer", "connection reset", "pair closure", "broken pipe")


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer is hung (``parallel.timeout_s`` passed) or gone."""


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a process group's report of a peer that did not answer."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _COMM_FAILURES)


def step_collectives(dev: Dist) -> str:
    """The collectives a training step runs in this layout, with the ranks of each group."""
    parts = []
    if dev.tp > 1:
        parts.append(f"tensor-parallel all-reduces and all-gathers over tp ranks {_ranks(dev, 'tp')}")
    if dev.pp > 1:
        parts.append(f"pipeline sends and receives between pp ranks {_ranks(dev, 'pp')}")
    if dev.dp > 1:
        parts.append(f"the gradient all-reduce over dp ranks {_ranks(dev, 'dp')}")
    parts.append("the gradient-norm and loss all-reduces")
    return ", ".join(parts)


def _ranks(dev: Dist, dim: str) -> list[int]:
    return dist.get_process_group_ranks(dev.group(dim))


@contextlib.contextmanager
def reported_collectives(dev: Dist, what: str, step: int, timeout_s: float) -> Iterator[None]:
    """Raise a failed collective inside the block as a :class:`CollectiveError` about ``what``
    (the phase and its collectives) at ``step``; other errors pass unchanged."""
    try:
        yield
    except Exception as exc:
        if dev.world == 1 or isinstance(exc, CollectiveError) or not is_comm_failure(exc):
            raise
        where = f"rank {dev.rank} of {dev.world} (pp {dev.pp_rank}, dp {dev.dp_rank}, tp {dev.tp_rank})"
        message = (
            f"{where}: {what} at step {step} did not complete: a peer is hung (parallel.timeout_s={timeout_s:g} "
            f"passed) or gone; the process group said: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
        )
        log.error("%s", message)
        raise CollectiveError(message) from exc
