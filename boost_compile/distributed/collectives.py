"""Differentiable tensor-parallel collectives, built on functional collectives.

Each is an ``autograd.Function`` whose forward and backward call the
``_c10d_functional`` ops, so a graph that calls them traces into plain ATen
collectives that Inductor schedules like any other op:

- ``reduce_from_tp``: forward sum all-reduce, backward identity (after a
  row-parallel GEMM: each rank holds a partial sum of the output);
- ``copy_to_tp``: forward identity, backward sum all-reduce (before a
  column-parallel GEMM: each rank's input gradient is partial);
- ``gather_from_tp``: forward all-gather on the last dim, backward the rank's own
  slice (before a replicated consumer of a d-sharded stream).

``tp_sentinel`` marks the input of a parallelized model: the boost backend
removes it; anywhere else (eager, another backend) it raises, so a sharded model
never silently computes partial sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_funcol = torch.ops._c10d_functional


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _funcol.wait_tensor(_funcol.all_reduce(x.contiguous(), "sum", group_name))


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        return _all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group_name), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, world: int, rank: int) -> torch.Tensor:
        ctx.world, ctx.rank = world, rank
        stacked = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), world, group_name))
        # [world * a, ..., d/p] -> [a, ..., world * d/p]
        parts = stacked.view(world, *x.shape)
        return torch.cat(parts.unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.world, dim=-1)[ctx.rank].contiguous(), None, None, None


def reduce_from_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over the TP group in forward; pass the gradient through in backward."""
    return _ReduceFromTP.apply(x, group_name)


def copy_to_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Identity in forward; sum the gradient over the TP group in backward."""
    return _CopyToTP.apply(x, group_name)


def gather_from_tp(x: torch.Tensor, group_name: str, world: int, rank: int) -> torch.Tensor:
    """All-gather the last dim in forward; keep this rank's slice of the gradient in backward."""
    return _GatherFromTP.apply(x, group_name, world, rank)


def group_name_of(group: dist.ProcessGroup) -> str:
    return group.group_name


@torch.library.custom_op("boost::tp_sentinel", mutates_args=())
def tp_sentinel(x: torch.Tensor, plan: str) -> torch.Tensor:
    raise RuntimeError(
        f"this model was parallelized with plan {plan!r}: its parameters are shards, and "
        "only the boost backend inserts the collectives that make the result right. Run it "
        "as torch.compile(model, backend='boost')."
    )


@tp_sentinel.register_fake
def _(x: torch.Tensor, plan: str) -> torch.Tensor:
    return torch.empty_like(x)
