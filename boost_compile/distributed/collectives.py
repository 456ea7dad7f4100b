"""Differentiable tensor-parallel collectives, built on functional collectives.

Each is an ``autograd.Function`` whose forward and backward call the
``_c10d_functional`` ops, so a graph that calls them traces into plain ATen
collectives that Inductor schedules like any other op:

- ``reduce_from_tp``: forward sum all-reduce, backward identity (after a
  row-parallel GEMM: each rank holds a partial sum of the output);
- ``copy_to_tp``: forward identity, backward sum all-reduce (before a
  column-parallel GEMM: each rank's input gradient is partial);
- ``gather_from_tp``: forward all-gather on the last dim, backward the rank's own
  slice (before a replicated consumer of a d-sharded stream);
- ``scatter_to_tp``: forward this rank's slice of the last dim, backward
  all-gather (where a replicated tensor meets a d-sharded one: a tied
  embedding's output entering the sharded stream).

``tp_sentinel`` marks the input of a parallelized model: the boost backend
removes it; anywhere else (eager, another backend) it raises, so a sharded model
never silently computes partial sums.

``tp_full_view`` is how a parallelized model's code sees a sharded parameter:
with its whole (unsharded) shape. Under tracing the op's output has the full
shape, so everything the model derives from shapes (``B, T, C = x.size()``,
``split(n_embd)``, ``view(B, T, n_head, C // n_head)``) is the unsharded
model's; the boost backend's ``tp_localize`` pass removes the op and rewrites
the graph to this rank's shapes. Run anywhere else it raises.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    def forward(ctx, x: torch.Tensor, group_name: str, world: int, rank: int, dim: int = -1) -> torch.Tensor:
        ctx.world, ctx.rank, ctx.dim = world, rank, dim
        stacked = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), world, group_name))
        # [world * a, ...] -> the ranks' slices side by side on ``dim``
        parts = stacked.view(world, *x.shape)
        return torch.cat(parts.unbind(0), dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.world, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def reduce_from_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over the TP group in forward; pass the gradient through in backward."""
    return _ReduceFromTP.apply(x, group_name)


def copy_to_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Identity in forward; sum the gradient over the TP group in backward."""
    return _CopyToTP.apply(x, group_name)


def gather_from_tp(x: torch.Tensor, group_name: str, world: int, rank: int, dim: int = -1) -> torch.Tensor:
    """All-gather ``dim`` in forward; keep this rank's slice of the gradient in backward."""
    return _GatherFromTP.apply(x, group_name, world, rank, dim)


def group_name_of(group: dist.ProcessGroup) -> str:
    return group.group_name


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, world: int, rank: int) -> torch.Tensor:
        ctx.group_name, ctx.world, ctx.rank = group_name, world, rank
        return x.chunk(world, dim=-1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherFromTP.apply(grad, ctx.group_name, ctx.world, ctx.rank), None, None, None


def scatter_to_tp(x: torch.Tensor, group_name: str, world: int, rank: int) -> torch.Tensor:
    """This rank's slice of the last dim in forward; all-gather the gradient in backward."""
    return _ScatterToTP.apply(x, group_name, world, rank)


def full_shape(local: Sequence[int], dim: int, world: int) -> list[int]:
    """The unsharded shape of a shard cut on ``dim`` over ``world`` ranks."""
    shape = list(local)
    shape[dim] *= world
    return shape


@torch.library.custom_op("boost::tp_full_view", mutates_args=())
def tp_full_view(x: torch.Tensor, dim: int, world: int, plan: str) -> torch.Tensor:
    raise RuntimeError(
        f"this model was parallelized with plan {plan!r}: its parameters are shards, and "
        "only the boost backend turns the model's code into the per-rank program that "
        "makes the result right. Run it as torch.compile(model, backend='boost')."
    )


@tp_full_view.register_fake
def _(x: torch.Tensor, dim: int, world: int, plan: str) -> torch.Tensor:
    return x.new_empty(full_shape(x.shape, dim, world))


def _full_view_backward(ctx, grad: torch.Tensor):
    # never runs: tp_localize removes the op before autograd sees the graph; this
    # lets another backend trace it, so that it reaches the runtime error above
    return grad.narrow(ctx.dim, 0, grad.shape[ctx.dim] // ctx.world), None, None, None


def _full_view_setup(ctx, inputs, output) -> None:
    ctx.dim, ctx.world = inputs[1], inputs[2]


tp_full_view.register_autograd(_full_view_backward, setup_context=_full_view_setup)


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
