"""Grouped GEMM for stacked experts: rows sorted by expert times each expert's own matrix.

    grouped_mm(x [N, d_in], w [E, d_in, d_out], offsets [E]) -> [N, d_out]
    rows offsets[e-1]:offsets[e] times w[e]; rows past offsets[-1] (dropped assignments) give 0

It is one custom op, ``boost::grouped_mm``, opaque to the compiler (its output shape known from its
inputs, so a model compiles as one graph in any dtype) and its own backward. Inside, it runs
``torch._grouped_mm`` where that kernel runs (bfloat16 on a CPU or a GPU of sm90 and later, float32
and float16 on a CPU; every width a multiple of 16 bytes), else a loop over the experts' rows
(float64 included). torch's op is not put in the graph itself: its meta function accepts only
bfloat16, and it has no float64 kernel, so a graph holding it could not be run again in float64,
which is how ``verify`` checks every rewrite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from boost_compile import _torch_compat as compat

#: the kernel's rule: every stride a multiple of this many bytes
ALIGN_BYTES = 16


def _kernel_runs(x: Tensor, w: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` multiplies ``x`` by ``w`` here (eagerly)."""
    if not compat.has_grouped_mm() or x.dtype != w.dtype:
        return False
    if any(n * x.dtype.itemsize % ALIGN_BYTES for n in (x.shape[-1], w.shape[-1])):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.device.type != "cpu":
        return False
    return x.dtype in (torch.bfloat16, torch.float32, torch.float16)


def _looped(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _looped_weight_grad(x: Tensor, grad: Tensor, offsets: Tensor, experts: int) -> Tensor:
    out = x.new_zeros(experts, x.shape[1], grad.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[e] = x[start:end].T @ grad[start:end]
        start = end
    return out


def _tail_zeroed(out: Tensor, offsets: Tensor) -> Tensor:
    """The kernel leaves rows past the last offset unwritten: zero them (dropped assignments)."""
    if offsets.numel() and int(offsets[-1]) < out.shape[0]:
        out[int(offsets[-1]):] = 0
    return out


@torch.library.custom_op("boost::grouped_mm", mutates_args=())
def _grouped_mm_op(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    if _kernel_runs(x, w):
        return _tail_zeroed(compat.grouped_mm(x, w, offsets), offsets)
    return _looped(x, w, offsets)


@_grouped_mm_op.register_fake
def _(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("boost::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_op(x: Tensor, grad: Tensor, offsets: Tensor, experts: int) -> Tensor:
    """``[E, d_in, d_out]``: for each expert, its rows of ``x`` transposed times their ``grad``."""
    if _kernel_runs(x, grad) and x.shape[0] % (ALIGN_BYTES // x.dtype.itemsize) == 0:
        return compat.grouped_mm(x.t(), grad, offsets)
    return _looped_weight_grad(x, grad, offsets, experts)


@_weight_grad_op.register_fake
def _(x: Tensor, grad: Tensor, offsets: Tensor, experts: int) -> Tensor:
    return x.new_empty(experts, x.shape[1], grad.shape[1])


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202 - torch.library's signature
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    dx = _grouped_mm_op(grad, w.transpose(1, 2).contiguous(), offsets) if ctx.needs_input_grad[0] else None
    dw = _weight_grad_op(x, grad, offsets, w.shape[0]) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup)


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``x`` [N, d_in] (rows sorted by expert, expert e's ending at ``offsets[e]``, int32) times ``w``
    [E, d_in, d_out], each row by its expert's matrix: [N, d_out] (rows past the last offset: 0).
    Both are cast to autocast's dtype where it is on, else computed in ``x``'s."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):  # "meta" has no autocast
        dtype = torch.get_autocast_dtype(kind)
    else:
        dtype = x.dtype
    return _grouped_mm_op(x.to(dtype).contiguous(), w.to(dtype).contiguous(), offsets)
