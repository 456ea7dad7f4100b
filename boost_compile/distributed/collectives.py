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
- ``scatter_to_tp``: forward this rank's slice of a dim (the last by default),
  backward all-gather (where a replicated tensor meets a sharded one: a tied
  embedding's output entering the d-sharded stream, gpt-oss's per-head sinks
  next to this rank's heads);
- ``vocab_parallel_cross_entropy``: the cross-entropy of logits sharded on the
  vocabulary (each rank holds [N, V/p]): the row maximum and the sum of
  exponentials are all-reduced over [N], the target's logit comes from the rank
  that owns it; the [N, V] logits never exist on one rank, and the gradient is
  each rank's own [N, V/p] slice (no collective in backward).

A dim the TP degree does not divide (a vocabulary of 50,257 over 2 ranks) is
padded to the next multiple: each rank holds ceil(V / p) columns, the last
rank's tail is padding, which the cross-entropy masks out and a gather drops.

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

from boost_compile import _torch_compat as compat

_funcol = compat.functional_collectives()


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
    def forward(ctx, x: torch.Tensor, group_name: str, world: int, rank: int, dim: int = -1, size: int = -1) -> torch.Tensor:
        ctx.world, ctx.rank, ctx.dim, ctx.local = world, rank, dim, x.shape[dim]
        stacked = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), world, group_name))
        # [world * a, ...] -> the ranks' slices side by side on ``dim``
        parts = stacked.view(world, *x.shape)
        out = torch.cat(parts.unbind(0), dim=dim)
        if 0 <= size < out.shape[dim]:  # drop the padding of a dim the TP degree does not divide
            out = out.narrow(dim, 0, size)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.rank * ctx.local
        real = max(0, min(ctx.local, grad.shape[ctx.dim] - start))
        mine = grad.narrow(ctx.dim, start, real)
        if real < ctx.local:  # this rank's padding gets no gradient
            pad = list(grad.shape)
            pad[ctx.dim] = ctx.local - real
            mine = torch.cat([mine, grad.new_zeros(pad)], dim=ctx.dim)
        return mine.contiguous(), None, None, None, None, None


def reduce_from_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over the TP group in forward; pass the gradient through in backward."""
    return _ReduceFromTP.apply(x, group_name)


def copy_to_tp(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Identity in forward; sum the gradient over the TP group in backward."""
    return _CopyToTP.apply(x, group_name)


def gather_from_tp(x: torch.Tensor, group_name: str, world: int, rank: int, dim: int = -1, size: int = -1) -> torch.Tensor:
    """All-gather ``dim`` in forward; keep this rank's slice of the gradient in backward.

    ``size``: the whole size of ``dim`` when the shards are padded (the gathered
    tensor is cut to it); -1 when the TP degree divides it.
    """
    return _GatherFromTP.apply(x, group_name, world, rank, dim, size)


def group_name_of(group: dist.ProcessGroup) -> str:
    return group.group_name


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, world: int, rank: int, dim: int = -1) -> torch.Tensor:
        ctx.group_name, ctx.world, ctx.rank, ctx.dim = group_name, world, rank, dim
        return x.chunk(world, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherFromTP.apply(grad, ctx.group_name, ctx.world, ctx.rank, ctx.dim), None, None, None, None


def scatter_to_tp(x: torch.Tensor, group_name: str, world: int, rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's slice of ``dim`` (the last by default) in forward; all-gather the gradient in backward."""
    return _ScatterToTP.apply(x, group_name, world, rank, dim)


def _all_reduce_op(x: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return _funcol.wait_tensor(_funcol.all_reduce(x.contiguous(), op, group_name))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of [N, V/p] logit shards against [N] targets over the whole vocabulary.

    Forward: the global row maximum (all-reduce max of [N]), then one all-reduce of
    [N, 2]: each rank's sum of exponentials and the target's shifted logit (zero on
    the ranks that do not own it). Backward: softmax minus the one-hot target, on
    each rank's own columns, from the forward's exponentials (fp32 or float64 logits) or recomputed
    (bf16 logits, so that no fp32 copy of them is kept); it needs no collective.
    """

    @staticmethod
    def forward(ctx, logits, target, group_name, world, rank, vocab, ignore_index, reduction):
        local = logits.shape[-1]
        start = rank * local
        x = _masked_logits(logits, start, vocab)
        row_max = _all_reduce_op(x.amax(-1), "max", group_name)
        owned = (target >= start) & (target < start + local)
        index = (target - start).clamp(0, local - 1)
        picked = torch.where(owned, x.gather(-1, index.unsqueeze(-1)).squeeze(-1) - row_max, 0.0)
        exps = (x - row_max.unsqueeze(-1)).exp_()  # one [N, V/p] fp32 tensor
        summed = _all_reduce_op(torch.stack([exps.sum(-1), picked], -1), "sum", group_name)
        sum_exp, target_logit = summed.unbind(-1)
        valid = target != ignore_index
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)
        # backward reads the exponentials when they take no more memory than the logits (fp32
        # logits), else recomputes them from the logits; either way the collectives' own outputs:
        # a partitioner that finds the forward recomputable has no reason to repeat a collective
        ctx.saved_exps, ctx.dtype = logits.dtype == _wide(logits.dtype), logits.dtype
        ctx.save_for_backward(exps if ctx.saved_exps else logits, target, row_max, summed)
        ctx.reduction, ctx.start, ctx.vocab, ctx.ignore_index = reduction, start, vocab, ignore_index
        if reduction == "none":
            return loss.to(logits.dtype)
        total = loss.sum()
        if reduction == "mean":
            total = total / valid.sum()
        return total.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        saved, target, row_max, summed = ctx.saved_tensors
        local = saved.shape[-1]
        valid = target != ctx.ignore_index
        hit = valid & (target >= ctx.start) & (target < ctx.start + local)
        index = (target - ctx.start).clamp(0, local - 1)
        grad = grad.to(_wide(ctx.dtype))
        if ctx.reduction == "none":
            per_row = grad
        elif ctx.reduction == "mean":
            per_row = (grad / valid.sum()).expand(valid.shape)
        else:
            per_row = grad.expand(valid.shape)
        per_row = torch.where(valid, per_row, 0.0)
        # (softmax - one-hot(target)) * per_row, in one [N, V/p] tensor
        scale = (per_row / summed[..., 0]).unsqueeze(-1)
        if ctx.saved_exps:
            grad_logits = saved * scale
        else:
            grad_logits = (_masked_logits(saved, ctx.start, ctx.vocab) - row_max.unsqueeze(-1)).exp_().mul_(scale)
        grad_logits.scatter_add_(-1, index.unsqueeze(-1), torch.where(hit, -per_row, 0.0).unsqueeze(-1))
        return grad_logits.to(ctx.dtype), None, None, None, None, None, None, None


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the cross-entropy's exponentials run in: fp32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


def _masked_logits(logits: torch.Tensor, start: int, vocab: int) -> torch.Tensor:
    """fp32 logits (float64 ones stay float64) with the padded columns (global index >= vocab) at -inf."""
    x = logits.to(_wide(logits.dtype))
    if start + logits.shape[-1] > vocab:
        cols = torch.arange(start, start + logits.shape[-1], device=x.device)
        x = x.masked_fill(cols >= vocab, float("-inf"))
    return x


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group_name: str,
    world: int,
    rank: int,
    vocab: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(whole_logits, target)`` from this rank's [N, ceil(V/p)] slice of the logits.

    ``vocab``: the whole vocabulary size (columns past it are padding).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}")
    return _VocabParallelCrossEntropy.apply(logits, target, group_name, world, rank, vocab, ignore_index, reduction)


def full_shape(local: Sequence[int], dim: int, world: int, size: int = -1) -> list[int]:
    """The unsharded shape of a shard cut on ``dim`` over ``world`` ranks (``size``: a padded dim's whole size)."""
    shape = list(local)
    shape[dim] = size if size >= 0 else shape[dim] * world
    return shape


def local_size(size: int, world: int) -> int:
    """A rank's share of a dim of ``size``: ceil(size / world), the last rank's tail padded."""
    return -(-size // world)


@torch.library.custom_op("boost::tp_full_view", mutates_args=())
def tp_full_view(x: torch.Tensor, dim: int, world: int, plan: str, size: int = -1) -> torch.Tensor:
    raise RuntimeError(
        f"this model was parallelized with plan {plan!r}: its parameters are shards, and "
        "only the boost backend turns the model's code into the per-rank program that "
        "makes the result right. Run it as torch.compile(model, backend='boost')."
    )


@tp_full_view.register_fake
def _(x: torch.Tensor, dim: int, world: int, plan: str, size: int = -1) -> torch.Tensor:
    return x.new_empty(full_shape(x.shape, dim, world, size))


def _full_view_backward(ctx, grad: torch.Tensor):
    # never runs: tp_localize removes the op before autograd sees the graph; this
    # lets another backend trace it, so that it reaches the runtime error above
    return grad.narrow(ctx.dim, 0, ctx.local), None, None, None, None


def _full_view_setup(ctx, inputs, output) -> None:
    ctx.dim, ctx.local = inputs[1], inputs[0].shape[inputs[1]]


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


@torch.library.custom_op("boost::tp_stream_in", mutates_args=())
def tp_stream_in(x: torch.Tensor, world: int, plan: str) -> torch.Tensor:
    """A pipeline stage's input that is this rank's d-slice of the residual stream, seen whole."""
    raise RuntimeError(
        f"this pipeline stage was parallelized with plan {plan!r}: its input is this rank's slice of the "
        "residual stream, and only the boost backend turns its code into the per-rank program. "
        "Run it as torch.compile(stage, backend='boost')."
    )


@tp_stream_in.register_fake
def _(x: torch.Tensor, world: int, plan: str) -> torch.Tensor:
    return x.new_empty(full_shape(x.shape, x.dim() - 1, world))


@torch.library.custom_op("boost::tp_stream_out", mutates_args=())
def tp_stream_out(x: torch.Tensor, world: int, plan: str) -> torch.Tensor:
    """What a pipeline stage returns: this rank's d-slice of the (whole-shape) residual stream."""
    raise RuntimeError(
        f"this pipeline stage was parallelized with plan {plan!r}: it returns this rank's slice of the "
        "residual stream, which only the boost backend's program computes. "
        "Run it as torch.compile(stage, backend='boost')."
    )


@tp_stream_out.register_fake
def _(x: torch.Tensor, world: int, plan: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[-1] //= world
    return x.new_empty(shape)


@torch.library.custom_op("boost::tp_vocab_out", mutates_args=())
def tp_vocab_out(x: torch.Tensor, world: int, plan: str) -> torch.Tensor:
    """What a pipeline's last stage returns with ``shard_logits``: this rank's vocabulary slice of the logits."""
    raise RuntimeError(
        f"this pipeline stage was parallelized with plan {plan!r} and shard_logits: it returns this rank's "
        "vocabulary slice of the logits, which only the boost backend's program computes. "
        "Run it as torch.compile(stage, backend='boost')."
    )


@tp_vocab_out.register_fake
def _(x: torch.Tensor, world: int, plan: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[-1] = local_size(shape[-1], world)
    return x.new_empty(shape)


def _stream_marker_backward(ctx, grad: torch.Tensor):
    # never runs: tp_localize removes both markers before autograd sees the graph
    raise RuntimeError("a pipeline stream marker reached autograd: compile the stage with backend='boost'")


def _no_setup(ctx, inputs, output) -> None:
    pass


tp_stream_in.register_autograd(_stream_marker_backward, setup_context=_no_setup)
tp_stream_out.register_autograd(_stream_marker_backward, setup_context=_no_setup)
tp_vocab_out.register_autograd(_stream_marker_backward, setup_context=_no_setup)

