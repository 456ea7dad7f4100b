"""Logits whose cross-entropy runs compiled: the eager loss of a model compiled block by block.

    logits = head(h)                          # LossLogits: the head's output, same data
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                                              # -> the compiled F.cross_entropy (one fused pass each way)
    probs = logits.softmax(-1)                # any other op: on the plain tensor, as eager

Per block (``compile_blocks``) the head and the loss run eagerly. Eager ``F.cross_entropy`` on
[tokens, vocabulary] logits writes the whole log-softmax forward and, backward, fills a zero
gradient, scatters into it and runs the log-softmax backward: four passes over the largest
tensor of the step, which the whole-model graph fuses into two. ``compile_blocks`` therefore hooks
the model's output head (when the blocks' code is compiled with Inductor) so that its logits are
:class:`LossLogits`: ops that keep the vocabulary dim as it is (casts, ``flatten``/``view``/
``reshape`` of the other dims, indexing them) keep the wrapper, ``F.cross_entropy`` becomes the
compiled one with the same arguments, and every other op sees the plain tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from boost_compile import _torch_compat as compat

T = torch.Tensor
#: read-only metadata, answered by the plain tensor
METADATA = {T.shape.__get__, T.dtype.__get__, T.device.__get__, T.requires_grad.__get__, T.grad_fn.__get__,
            T.is_leaf.__get__, T.ndim.__get__, T.layout.__get__, T.dim, T.size, T.numel, T.is_floating_point,
            T.is_contiguous, T.__len__, T.element_size, T.data_ptr}
#: casts and copies that keep the vocabulary dim as it is
CASTS = {T.float, T.double, T.half, T.bfloat16, T.contiguous, T.clone, T.detach}
RESHAPES = {T.view, T.reshape, torch.reshape}
FLATTENS = {T.flatten, torch.flatten}


def keep_last_dim(func: Any, local: torch.Tensor, rest: tuple, kwargs: dict, vocab: int) -> torch.Tensor | None:
    """``func(local, *rest, **kwargs)`` when it leaves the last (vocabulary) dim as it is, else None.

    ``vocab``: a size a reshape may name the last dim by besides its own (a rank's slice of the
    vocabulary is reshaped with the whole vocabulary's size: ``view(-1, V)``)."""
    last = local.dim() - 1
    if func in CASTS and not rest and not kwargs:
        return func(local)
    if func is T.to and _dtype_only(rest, kwargs):
        return local.to(*rest, **kwargs)
    if func in FLATTENS:
        start = rest[0] if rest else kwargs.get("start_dim", 0)
        end = rest[1] if len(rest) > 1 else kwargs.get("end_dim", -1)
        return func(local, start, end) if end % local.dim() < last else None
    if func in RESHAPES and not kwargs:
        shape = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else list(rest)
        if shape and isinstance(shape[-1], int) and shape[-1] in (local.shape[-1], vocab):
            shape[-1] = local.shape[-1]
            return local.reshape(shape) if func is not T.view else local.view(shape)
        return None
    if func is T.__getitem__ and len(rest) == 1 and _leaves_last(rest[0], local.dim()):
        return local[rest[0]]
    return None


def _dtype_only(rest: tuple, kwargs: dict) -> bool:
    return (len(rest) == 1 and isinstance(rest[0], torch.dtype) and not kwargs) or (
        not rest and set(kwargs) == {"dtype"})


def _leaves_last(index: Any, ndim: int) -> bool:
    """Whether ``t[index]`` keeps the last dim whole and last: indices of the other dims only."""
    items = index if isinstance(index, tuple) else (index,)
    if any(i is None or isinstance(i, (torch.Tensor, list, bool)) for i in items):
        return False
    if any(i is Ellipsis for i in items):  # t[..., :-1, :]: the dims after the ellipsis are the last ones
        return items[-1] is Ellipsis or items[-1] == slice(None)
    return len(items) < ndim or (len(items) == ndim and items[-1] == slice(None))


class LossLogits(torch.Tensor):
    """A model's logits whose ``F.cross_entropy`` is ``_boost_loss`` (see the module docstring)."""

    #: F.cross_entropy compiled (``compiled_cross_entropy``), called with the same arguments
    _boost_loss: Callable[..., torch.Tensor]

    @staticmethod
    def wrap(logits: torch.Tensor, loss: Callable[..., torch.Tensor]) -> LossLogits:
        out = logits.as_subclass(LossLogits)
        out._boost_loss = loss
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        x = args[0] if args and isinstance(args[0], cls) else None
        if x is not None:
            local = compat.plain_tensor(x)
            if func in METADATA:
                return func(local, *args[1:], **kwargs)
            kept = keep_last_dim(func, local, args[1:], kwargs, local.shape[-1])
            if kept is not None:
                return LossLogits.wrap(kept, x._boost_loss)
            if func is F.cross_entropy:
                return x._boost_loss(local, *args[1:], **kwargs)

        def plain(a: Any) -> Any:
            return compat.plain_tensor(a) if isinstance(a, cls) else a

        return func(*compat.map_nested(plain, args), **compat.map_nested(plain, kwargs))


def compiled_cross_entropy() -> Callable[..., torch.Tensor]:
    """``F.cross_entropy`` compiled with Inductor (its signature and results, fused)."""
    return torch.compile(F.cross_entropy, backend="inductor")


__all__ = ["LossLogits", "compiled_cross_entropy", "keep_last_dim"]
