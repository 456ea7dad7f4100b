"""Dropout on tensors cut across tensor-parallel ranks, by Megatron's rule.

Every rank of a TP group is seeded alike, so a random op on a *replicated* tensor
draws the same values on every rank (as it must: the ranks' copies stay equal). On
a *sharded* tensor (the attention probabilities of each rank's own heads, an MLP's
d_ff slice, btp's d-sharded stream) the same draw would give every rank the same
mask on its slice: head h and head h + H/p would be dropped alike, which one
process never does. Megatron keeps a second RNG stream, different on each rank,
for such regions; here it is a pure function:

    seed = randint(0, 2**62)                 # one draw per graph call, from the default
                                             # generator: the same on every rank
    mask = tp_dropout_mask(seed, rank, site, shape, p)   # a generator seeded by
                                             # (seed, rank, site): this rank's own stream

``tp_localize`` puts a ``tp_dropout`` (and ``tp_attention_dropout`` for
``scaled_dot_product_attention(dropout_p > 0)``) in place of each dropout whose input
is sharded, numbering them (``site``) within the graph. The default generator
advances as in one process (one scalar draw), so replicated randomness stays in
step across ranks; the mask depends only on its inputs, so a checkpointed region
recomputes the same mask, and a resumed run, whose default generator state is in
the checkpoint, draws the same masks as the uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

#: the seed's range: a non-negative int64
SEED_HIGH = 2**62

# odd multipliers that spread (seed, rank, site) over the generator's 64-bit seed
_RANK_MIX, _SITE_MIX = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F


def stream_seed(seed: int, rank: int, site: int) -> int:
    """The generator seed of one rank's stream at one dropout site."""
    return (seed + (rank + 1) * _RANK_MIX + (site + 1) * _SITE_MIX) % 2**63


@torch.library.custom_op("boost::tp_dropout_mask", mutates_args=())
def tp_dropout_mask(seed: torch.Tensor, rank: int, site: int, shape: Sequence[int], p: float,
                    device: torch.device) -> torch.Tensor:
    """A keep-mask (bool, ``shape``) drawn from this rank's stream for ``site``: keep with 1 - p."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(int(seed.item()), rank, site))
    return torch.rand(tuple(shape), generator=generator, device=device) >= p


@tp_dropout_mask.register_fake
def _(seed: torch.Tensor, rank: int, site: int, shape: Sequence[int], p: float, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=torch.bool, device=device)


def draw_seed() -> torch.Tensor:
    """One int64 from the default CPU generator: the same on every rank seeded alike."""
    return torch.randint(0, SEED_HIGH, (), dtype=torch.int64)


def tp_dropout(x: torch.Tensor, p: float, seed: torch.Tensor, rank: int, site: int) -> torch.Tensor:
    """``F.dropout(x, p, training=True)`` with this rank's mask for ``site``."""
    if p <= 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    mask = tp_dropout_mask(seed, rank, site, list(x.shape), float(p), x.device)
    return x * mask.to(x.dtype) * (1.0 / (1.0 - p))


def tp_attention_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                         dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                         seed: torch.Tensor, rank: int, site: int) -> torch.Tensor:
    """``scaled_dot_product_attention`` with dropout on this rank's heads, written out: the
    attention probabilities get this rank's mask for ``site`` (SDPA's own dropout would draw
    from the shared generator)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        n, s = q.shape[-2], k.shape[-2]
        causal = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(s - n)
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = F.softmax(scores, dim=-1)
    return tp_dropout(probs, dropout_p, seed, rank, site) @ v
