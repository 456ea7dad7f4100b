"""Logits cut on the vocabulary, in eager code: the vocabulary-parallel loss outside compiled graphs.

    logits = head(h)                          # [B, T, ceil(V/p)]: this rank's vocabulary slice
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                                              # -> vocab_parallel_cross_entropy (all-reduces of [N])
    probs = logits.softmax(-1)                # any other op: the logits gathered whole first

A model compiled block by block under btp or megatron runs its head and loss eagerly. Its
vocabulary-parallel head returns :class:`VocabShardedLogits`, a tensor subclass holding this
rank's slice: ops that leave the vocabulary dim alone (casts, ``flatten``/``view``/``reshape``
of the other dims, indexing them) keep it sliced, ``F.cross_entropy`` with the default weights
and no label smoothing becomes ``vocab_parallel_cross_entropy`` (compiled by Inductor when the
blocks are, ``prepare_blocks``), and every other op sees the
logits gathered (``gather_from_tp``), so its result is the one-process one. ``.whole()`` gathers
them explicitly. Its ``shape`` is the slice's: code that reads the vocabulary size from the
logits sees ``ceil(V/p)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from boost_compile import _torch_compat as compat
from boost_compile.distributed.collectives import gather_from_tp, vocab_parallel_cross_entropy
from boost_compile.distributed.shard import VocabShard
from boost_compile.loss_logits import METADATA, keep_last_dim


class VocabShardedLogits(torch.Tensor):
    """This rank's vocabulary slice of a model's logits, in eager code (see the module docstring)."""

    _boost_shard: VocabShard
    #: the vocabulary-parallel loss F.cross_entropy becomes (compiled by ``prepare_blocks`` with Inductor
    #: when the blocks are: fused, it reads the slice once forward and once backward)
    _boost_loss: Callable[..., torch.Tensor]

    @staticmethod
    def wrap(local: torch.Tensor, shard: VocabShard, loss: Callable[..., torch.Tensor] | None = None) -> VocabShardedLogits:
        out = local.as_subclass(VocabShardedLogits)
        out._boost_shard = shard
        out._boost_loss = loss if loss is not None else vocab_parallel_cross_entropy
        return out

    def whole(self) -> torch.Tensor:
        """The logits with the whole vocabulary (an all-gather; padding dropped)."""
        s = self._boost_shard
        return gather_from_tp(compat.plain_tensor(self), s.group_name, s.world, s.rank, -1, s.vocab)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        x = args[0] if args and isinstance(args[0], cls) else None
        if x is not None:
            if func in METADATA:
                return func(compat.plain_tensor(x), *args[1:], **kwargs)
            kept = _keep(func, x, args[1:], kwargs)
            if kept is not None:
                return kept
            if func is F.cross_entropy:
                loss = _vocab_parallel_loss(x, args[1:], kwargs)
                if loss is not None:
                    return loss

        def whole(a: Any) -> Any:
            return a.whole() if isinstance(a, cls) else a

        return func(*compat.map_nested(whole, args), **compat.map_nested(whole, kwargs))


def _rewrap(out: Any, like: VocabShardedLogits) -> Any:
    return VocabShardedLogits.wrap(out, like._boost_shard, like._boost_loss) if isinstance(out, torch.Tensor) else out


def _keep(func: Any, x: VocabShardedLogits, rest: tuple, kwargs: dict) -> Any:
    """The op on the slice, still sliced, when it leaves the vocabulary dim alone; else None."""
    kept = keep_last_dim(func, compat.plain_tensor(x), rest, kwargs, x._boost_shard.vocab)
    return None if kept is None else _rewrap(kept, x)


def _vocab_parallel_loss(x: VocabShardedLogits, rest: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.cross_entropy(x, target, ...)`` as the vocabulary-parallel loss, when it has one."""
    names = ("target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    given = dict(zip(names, rest, strict=False)) | kwargs
    target = given.get("target")
    if (x.dim() != 2 or not isinstance(target, torch.Tensor) or target.dim() != 1
            or given.get("weight") is not None or given.get("size_average") is not None
            or given.get("reduce") is not None or given.get("label_smoothing", 0.0) != 0.0
            or given.get("reduction", "mean") not in ("mean", "sum", "none")):
        return None
    s = x._boost_shard
    return x._boost_loss(compat.plain_tensor(x), target, s.group_name, s.world, s.rank, s.vocab,
                         given.get("ignore_index", -100), given.get("reduction", "mean"))


__all__ = ["VocabShardedLogits"]
