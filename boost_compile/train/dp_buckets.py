"""The data-parallel gradient average of pipeline stages, issued bucket by bucket during the backward.

    step 1:  schedule (every micro-batch's backward)  ->  all-reduce every bucket, wait
             (each parameter's gradient accumulations counted)
    step 2+: schedule ... a bucket's last gradient final -> its all-reduce issued (async)
             ... -> wait for them all, average, clip, optimizer

DDP cannot wrap pipeline stages (``train/pipeline.py``), so without this the stages' gradients
were averaged only after the schedule's last backward, the whole reduction exposed. Here a
post-accumulate-grad hook on every parameter counts its accumulations; once a parameter has had
as many as in the first step (one per micro-batch and micro-step), its gradient is final, and a
bucket whose gradients are all final is all-reduced at once, while the schedule runs the rest of
its backward (the stages' earlier blocks, the other stages' micro-batches). Buckets are cut in
reverse parameter order (the order the backward produces them), one dtype each, of
``parallel.bucket_mb``, and issued strictly in order, so every dp rank issues the same collectives
in the same order. A parameter accumulated more often than in the first step would have been
reduced without its last part: the step fails naming it rather than train on a partial average.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("boost_compile.train")


def cut_buckets(params: Sequence[torch.Tensor], bucket_mb: float) -> list[list[torch.Tensor]]:
    """``params`` in reverse order, cut into buckets of at most ``bucket_mb`` MiB (one dtype each;
    a parameter larger than that is a bucket of its own)."""
    cap = bucket_mb * 2**20
    buckets: list[list[torch.Tensor]] = []
    filling: dict[torch.dtype, tuple[list[torch.Tensor], float]] = {}  # the open bucket of each dtype, its bytes
    for p in reversed(params):
        size = p.numel() * p.element_size()
        bucket, used = filling.get(p.dtype, (None, 0.0))
        if bucket is None or used + size > cap:
            bucket, used = [], 0.0
            buckets.append(bucket)
        bucket.append(p)
        filling[p.dtype] = (bucket, used + size)
    return buckets


class BucketedDpAverage:
    """Average the gradients of ``params`` over ``group`` (``world`` ranks), each bucket's
    all-reduce issued during the backward as soon as its gradients are final (module docstring).

    ``named_params``: (name, parameter) pairs, the names for the error about a late gradient.
    Per step: :meth:`begin` before the schedule, :meth:`finish` after it."""

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], group: Any, world: int, bucket_mb: float) -> None:
        self.group, self.world = group, world
        self.params = [p for _, p in named_params]
        self.buckets, self.bucket_mb = cut_buckets(self.params, bucket_mb), bucket_mb
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._names = {id(p): name for name, p in named_params}
        self._reported = False
        #: accumulations per parameter and step, learnt from the first step (None before it ends)
        self.expected: dict[int, int] | None = None
        self._counts: dict[int, int] = {}
        self._pending: list[int] = []
        self._issued: list[tuple[list[torch.Tensor], torch.Tensor | None, Any]] = []
        self._next = 0
        self._late: list[int] = []
        self._running = False
        #: buckets issued before :meth:`finish` in the last step (inside the backward)
        self.issued_in_backward = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params]

    def begin(self) -> None:
        self._counts = {id(p): 0 for p in self.params}
        expected = self.expected or {}
        self._pending = [sum(1 for p in bucket if expected.get(id(p), 0) > 0) for bucket in self.buckets]
        self._issued, self._next, self._late, self._running = [], 0, [], True

    def _accumulated(self, p: torch.Tensor) -> None:
        if not self._running:
            return
        key = id(p)
        self._counts[key] += 1
        if self.expected is None:
            return
        want = self.expected.get(key, 0)
        if self._counts[key] > want:
            self._late.append(key)
        elif self._counts[key] == want:
            self._pending[self._bucket_of[key]] -= 1
            while self._next < len(self.buckets) and self._pending[self._next] == 0:
                self._issue(self._next)

    def _issue(self, index: int) -> None:
        grads = [p.grad for p in self.buckets[index] if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else None
        work = dist.all_reduce(flat, group=self.group, async_op=True) if flat is not None else None
        self._issued.append((grads, flat, work))
        self._next = index + 1

    def finish(self, divide_by: int = 1) -> None:
        """Issue the buckets not issued yet, wait for every one, and leave each gradient averaged
        over the dp ranks and divided by ``divide_by`` (the micro-batches it summed)."""
        self._running = False
        self.issued_in_backward = len(self._issued)
        if self._late:
            names = sorted({self._names[k] for k in self._late})
            raise RuntimeError(
                f"data-parallel gradient average: {', '.join(names[:5])} accumulated a gradient more times this step "
                f"than in the first ({self.expected[self._late[0]] if self.expected else 0}), after its bucket's "
                "all-reduce was issued; a model whose parameters are used a varying number of times per step "
                "cannot have its pipeline stages' reduction overlapped")
        while self._next < len(self.buckets):
            self._issue(self._next)
        scale = 1.0 / (self.world * divide_by)
        for grads, flat, work in self._issued:
            if flat is None:
                continue
            work.wait()
            flat.mul_(scale)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if self.expected is not None and not self._reported:
            self._reported = True
            log.info("pipeline stages' gradient average over dp: %d of %d buckets issued during the backward",
                     self.issued_in_backward, len(self.buckets))
        if self.expected is None:
            self.expected = dict(self._counts)
            log.info("pipeline stages' gradient average over dp: %d bucket%s (parallel.bucket_mb=%g), issued from "
                     "the next step on as their gradients are final", len(self.buckets),
                     "" if len(self.buckets) == 1 else "s", self.bucket_mb)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


__all__ = ["BucketedDpAverage", "cut_buckets"]
