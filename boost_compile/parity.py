"""The parity rule: is a tested run as close to float64 as eager PyTorch is?

A tested run (a rewritten graph, a compiled model, a sharded one) and eager PyTorch in the
same dtype both compute what a float64 run computes, the truth. Rounding in another order
keeps err(tested) near err(eager); a bug puts it orders of magnitude above:

    err(tested, fp64) <= C * err(eager, fp64) + floor        (C and floor per dtype: PARITY)

err is the norm-wise relative error ``||x - truth|| / ||truth||`` of one tensor, in fp64. A
tensor that is zero in exact arithmetic (an attention key's bias gradient: softmax ignores a
shift shared by every key) has a truth made of fp64 rounding alone; its error is measured
against the largest tensor of its kind (``scale``), as its own norm would make noise look
like an error. The test suite (tests/conftest.py) and ``verify`` use this one rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

#: (C, floor) per dtype of the tested run: C leaves room for a run that rounds in another
#: order (partial sums over ranks, fused kernels, grouped GEMMs); the floor, a few units of
#: the dtype's rounding, for quantities eager happens to get (almost) exact.
PARITY: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (8.0, 8 * torch.finfo(torch.float32).eps),
    torch.bfloat16: (4.0, torch.finfo(torch.bfloat16).eps),
    torch.float16: (4.0, torch.finfo(torch.float16).eps),
}
#: Denominator floor of the relative error (a zero reference stays finite).
TINY = 1e-30
#: A truth whose norm is below this fraction of the largest of its kind is zero in exact
#: arithmetic (fp64 rounding is about 1e-16 of the terms it sums).
ZERO_IN_EXACT = 1e-9


def rel_err(value: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """``||value - ref|| / max(||ref||, TINY)`` in fp64; against ``scale`` where ``ref`` is
    zero in exact arithmetic (its norm below ``ZERO_IN_EXACT * scale``)."""
    wide = torch.complex128 if value.is_complex() or ref.is_complex() else torch.float64
    value, ref = value.detach().to(wide), ref.detach().to(wide)
    if value.shape != ref.shape:
        return math.inf
    norm = ref.norm().item()
    den = scale if norm <= ZERO_IN_EXACT * scale else norm
    return (value - ref).norm().item() / max(den, TINY)


def norm64(t: torch.Tensor) -> float:
    """``||t||`` in float64 (complex128 for a complex tensor)."""
    return t.detach().to(torch.complex128 if t.is_complex() else torch.float64).norm().item()


def bound(eager_err: float, dtype: torch.dtype) -> float:
    c, floor = PARITY.get(dtype, PARITY[torch.float32])
    return c * eager_err + floor


@dataclass(frozen=True)
class Mismatch:
    """One tensor that breaks the rule."""

    name: str
    tested: float
    eager: float
    bound: float

    def __str__(self) -> str:
        return f"{self.name}: err {self.tested:.3e} > bound {self.bound:.3e} (eager {self.eager:.3e})"


def compare(
    tested: Mapping[str, torch.Tensor | None],
    eager: Mapping[str, torch.Tensor | None],
    truth: Mapping[str, torch.Tensor | None],
    dtype: torch.dtype,
) -> list[Mismatch]:
    """Every tensor of ``truth`` that ``tested`` misses or gets wrong under the rule.

    A tensor eager has and the tested run lacks (a gradient gone missing), or one that is
    not finite where eager's is, always breaks it; one eager itself lacks is not judged.
    """
    scale = max((norm64(t) for t in truth.values() if t is not None), default=0.0)
    bad = []
    for name, ref in truth.items():
        e = eager.get(name)
        if ref is None or e is None:
            continue
        t = tested.get(name)
        e_err = rel_err(e, ref, scale)
        if t is None:
            bad.append(Mismatch(name, math.inf, e_err, bound(e_err, dtype)))
            continue
        t_err = rel_err(t, ref, scale)
        if not t_err <= bound(e_err, dtype) and not (math.isnan(t_err) and math.isnan(e_err)):
            bad.append(Mismatch(name, t_err, e_err, bound(e_err, dtype)))
    return bad


class Float64Program(torch.overrides.TorchFunctionMode):
    """Inside it, the float64 copy of a float32 program runs that program in float64 throughout.

    Model code casts to fp32 for its statistics (``x.to(torch.float32)`` in Hugging Face's
    RMSNorms, ``logits.float()`` in its losses, ``softmax(..., dtype=torch.float32)``). In the
    float32 program those casts do nothing; in its float64 copy they round to fp32, so a truth
    run without this mode carries fp32 rounding of its own. Here a float64 tensor's cast to
    float32 is no op at all, as in the float32 program; an integer's cast to float32 gives
    float64 (positions for a rotary table); a ``dtype=torch.float32`` keyword is float64 where a
    float64 tensor is an argument. float32 tensors, and every other dtype, are left as asked. For
    float64 programs only: a float32 one run inside it would get float64 positions.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _CASTS and x is not None and _wants(func, args, kwargs) is torch.float32:
            if x.dtype == torch.float64:
                return x
            if not x.dtype.is_floating_point and not x.dtype.is_complex:
                return x.to(torch.float64)
        if kwargs.get("dtype") is torch.float32 and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


_CASTS = (torch.Tensor.float, torch.Tensor.to, torch.Tensor.type)


def _wants(func: object, args: tuple, kwargs: dict) -> object:
    """The dtype a cast asks for (None where it names none)."""
    if func is torch.Tensor.float:
        return torch.float32
    return kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
