"""Fused RMSNorm as ``torch.library`` custom ops (Triton on CUDA, ATen elsewhere).

    y = x_hat * (offset + w),   x_hat = x * rstd,   rstd = rsqrt(mean(x^2, -1) + eps)

``offset`` is 0.0 for Llama-style norms and 1.0 for Gemma's ``(1 + w)``; ``w``
may be ``None`` (no affine). With ``residual`` the op first forms
``s = x + residual`` (rounded to ``x``'s dtype, as eager does), normalises ``s``
and returns ``(s, y)``.

Ops (namespace ``boost``)::

    boost::rms_norm(x, weight?, eps, offset, cast_before_weight) -> (y, rstd)
    boost::add_rms_norm(x, residual, weight?, eps, offset, cast_before_weight) -> (s, y, rstd)
    boost::rms_norm_backward(grad_y, x, weight?, rstd, offset, grad_s?) -> (dx, dw)

``rstd`` is fp32 of shape ``x.shape[:-1]``. ``rms_norm_backward`` returns ``dw``
in ``weight``'s dtype, or an empty ``[0]`` tensor (``x``'s dtype) without a weight;
with ``grad_s`` it adds it to ``dx`` (the residual form: ``s`` feeds both the norm
and the next residual). All outputs are freshly allocated and contiguous.

The CUDA kernels are the Triton ones of :mod:`boost_compile.kernels.rmsnorm_triton`;
every other device uses the ATen implementation (same fp32 statistics, same
outputs, ``rstd`` included). ``register_fake`` and ``register_autograd`` make the
ops traceable by ``torch.compile(fullgraph=True)`` without a graph break.

Rounding (and how to match Hugging Face)
----------------------------------------
All arithmetic is fp32; only the outputs are rounded to ``x``'s dtype.

* ``cast_before_weight=False`` (default): ``y = round(x_hat * (offset + w))`` --
  one rounding, as ``torch.nn.functional.rms_norm`` / ``nn.RMSNorm`` compute it
  (bit-for-bit on CPU in bf16 in our checks) and as HF's ``GemmaRMSNorm`` does
  (``(x_hat * (1.0 + w.float())).type_as(x)``, i.e. ``offset=1.0``). For fp32
  inputs this equals ``torch.nn.functional.rms_norm`` to ~1e-7.
* ``cast_before_weight=True``: ``y = round(round(x_hat) * w)`` -- HF's
  ``LlamaRMSNorm`` order (``weight * hidden_states.to(input_dtype)``) when ``w``
  has ``x``'s dtype. The result differs from the default by about one bf16 ulp
  on a fraction of the elements. For fp32 inputs both modes are identical.

HF promotes the output to ``weight``'s dtype when that is wider than ``x``'s
(e.g. an fp32 weight with bf16 activations); these ops always return ``x``'s
dtype, so a caller that needs HF's promotion must cast. The backward treats the
intermediate rounding of ``cast_before_weight`` as the identity (a straight-through
gradient), which is what autograd of HF's code gives up to that same rounding.
"""

from __future__ import annotations

import torch

from boost_compile import _torch_compat as compat

try:  # Triton is optional: without it every device runs the ATen implementation.
    from boost_compile.kernels import rmsnorm_triton as _triton_kernels
except ImportError:  # pragma: no cover - depends on the installation
    _triton_kernels = None

__all__ = [
    "HAS_TRITON",
    "add_rms_norm_op",
    "rms_norm",
    "rms_norm_backward_op",
    "rms_norm_op",
    "rms_norm_reference",
]

HAS_TRITON = _triton_kernels is not None


# --------------------------------------------------------------------------- ATen math


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or the input's dtype where wider: ``.float()`` would round a float64 model to fp32."""
    return torch.promote_types(x.dtype, torch.float32)


def _aten_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` with fp32 statistics (float64 ones for a float64 input), differentiable by
    autograd (the reference)."""
    wide = _stat_dtype(x)
    xf = x.to(wide)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if cast_before_weight:
        y = y.to(x.dtype).to(wide)
    if weight is not None:
        y = y * (weight.to(wide) + offset)
    return y.to(x.dtype), rstd.squeeze(-1)


def _aten_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    grad_s: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    wide = _stat_dtype(x)
    r = rstd.to(wide).unsqueeze(-1)
    xh = x.to(wide) * r
    g = grad_y.to(wide)
    wg = g * (weight.to(wide) + offset) if weight is not None else g
    dx = (wg - xh * (wg * xh).mean(-1, keepdim=True)) * r
    if grad_s is not None:
        dx = dx + grad_s.to(wide)
    dx = dx.to(x.dtype).contiguous()
    if weight is None:
        dw = x.new_empty(0)
    else:
        dw = (g * xh).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("boost::rms_norm", mutates_args=())
def rms_norm_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm forward: ``(y, rstd)``. ATen implementation (every device but CUDA)."""
    y, rstd = _aten_forward(x, weight, eps, offset, cast_before_weight)
    return y.contiguous(), rstd.contiguous()


@torch.library.custom_op("boost::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm forward: ``(s, y, rstd)`` with ``s = x + residual``."""
    _check_residual(x, residual)
    s = (x + residual).contiguous()
    y, rstd = _aten_forward(s, weight, eps, offset, cast_before_weight)
    return s, y.contiguous(), rstd.contiguous()


@torch.library.custom_op("boost::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    grad_s: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm backward: ``(dx, dw)``; ``dw`` is empty without a weight."""
    return _aten_backward(grad_y, x, weight, rstd, offset, grad_s)


if HAS_TRITON:

    @rms_norm_op.register_kernel("cuda")
    def _rms_norm_cuda(x, weight, eps, offset, cast_before_weight):
        if x.dtype == torch.float64:  # the kernels keep fp32 statistics; float64 keeps its own
            y, rstd = _aten_forward(x, weight, eps, offset, cast_before_weight)
            return y.contiguous(), rstd.contiguous()
        y, rstd, _ = _triton_kernels.rmsnorm_fwd_triton(
            x, weight, eps, offset, cast_before_weight=cast_before_weight
        )
        return y, rstd

    @add_rms_norm_op.register_kernel("cuda")
    def _add_rms_norm_cuda(x, residual, weight, eps, offset, cast_before_weight):
        if x.dtype == torch.float64:
            s = (x + residual).contiguous()
            y, rstd = _aten_forward(s, weight, eps, offset, cast_before_weight)
            return s, y.contiguous(), rstd.contiguous()
        y, rstd, s = _triton_kernels.rmsnorm_fwd_triton(
            x, weight, eps, offset, residual=residual, cast_before_weight=cast_before_weight
        )
        return s, y, rstd

    @rms_norm_backward_op.register_kernel("cuda")
    def _rms_norm_backward_cuda(grad_y, x, weight, rstd, offset, grad_s):
        if x.dtype == torch.float64:
            return _aten_backward(grad_y, x, weight, rstd, offset, grad_s)
        dx, dw = _triton_kernels.rmsnorm_bwd_triton(grad_y, x, weight, rstd, offset, grad_s=grad_s)
        return dx, (dw if dw is not None else x.new_empty(0))


# --------------------------------------------------------------------------- fake (meta) impls


def _check_weight(x: torch.Tensor, weight: torch.Tensor | None) -> None:
    compat.check(
        weight is None or (weight.dim() == 1 and weight.shape[0] == x.shape[-1]),
        lambda: f"weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}",
    )


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    compat.check(
        residual.shape == x.shape and residual.dtype == x.dtype,
        lambda: (
            f"residual must match x: got {tuple(residual.shape)} {residual.dtype}, "
            f"x is {tuple(x.shape)} {x.dtype}"
        ),
    )


@rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, offset, cast_before_weight):
    _check_weight(x, weight)
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)),
    )


@add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, residual, weight, eps, offset, cast_before_weight):
    _check_weight(x, weight)
    _check_residual(x, residual)
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape),
        x.new_empty(x.shape[:-1], dtype=_stat_dtype(x)),
    )


@rms_norm_backward_op.register_fake
def _rms_norm_backward_fake(grad_y, x, weight, rstd, offset, grad_s):
    dw = x.new_empty(0) if weight is None else weight.new_empty(weight.shape)
    return x.new_empty(x.shape), dw


# --------------------------------------------------------------------------- autograd


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _eps, offset, _cast = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.offset = offset
    ctx.mark_non_differentiable(rstd)


def _rms_norm_backward(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(grad_y, x, weight, rstd, ctx.offset, None)
    return dx, (dw if weight is not None else None), None, None, None


def _add_rms_norm_setup_context(ctx, inputs, output):
    _x, _residual, weight, _eps, offset, _cast = inputs
    s, _y, rstd = output
    ctx.save_for_backward(s, weight, rstd)
    ctx.offset = offset
    ctx.mark_non_differentiable(rstd)


def _add_rms_norm_backward(ctx, grad_s, grad_y, _grad_rstd):
    s, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(grad_y, s, weight, rstd, ctx.offset, grad_s)
    return dx, dx, (dw if weight is not None else None), None, None, None


rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)
add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup_context)


# --------------------------------------------------------------------------- public API


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    cast_before_weight: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused RMSNorm over the last dim: ``y``, or ``(s, y)`` with ``residual``.

    ``y = rsqrt(mean(s^2) + eps) * s * (offset + weight)`` with ``s = x`` (or
    ``x + residual``), fp32 statistics, ``y`` in ``x``'s dtype. See the module
    docstring for ``cast_before_weight`` (Hugging Face Llama rounding).
    """
    if residual is None:
        y, _ = rms_norm_op(x, weight, float(eps), float(offset), bool(cast_before_weight))
        return y
    s, y, _ = add_rms_norm_op(
        x, residual, weight, float(eps), float(offset), bool(cast_before_weight)
    )
    return s, y


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    residual: torch.Tensor | None = None,
    cast_before_weight: bool = False,
    return_rstd: bool = False,
):
    """Pure-ATen RMSNorm with :func:`rms_norm`'s semantics (differentiable by autograd).

    Returns ``y`` or ``(s, y)`` like :func:`rms_norm`, with the fp32 ``rstd``
    appended when ``return_rstd``.
    """
    s = x if residual is None else x + residual
    y, rstd = _aten_forward(s, weight, eps, offset, cast_before_weight)
    out = (y,) if residual is None else (s, y)
    if return_rstd:
        out = (*out, rstd)
    return out[0] if len(out) == 1 else out
