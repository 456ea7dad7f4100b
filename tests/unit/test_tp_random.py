"""The rank-local dropout of tensor parallelism (boost_compile/distributed/tp_random.py): a
mask that is a function of (seed, rank, site), kept with probability 1 - p, and the attention
with dropout written out, which is scaled_dot_product_attention itself when nothing is dropped.
The graph rewrite and its effect on two ranks: tests/distributed/test_tp_dropout.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from boost_compile.distributed.tp_random import tp_attention_dropout, tp_dropout, tp_dropout_mask


def mask(seed: int, rank: int, site: int, p: float = 0.1, shape=(4, 64, 64)) -> torch.Tensor:
    return tp_dropout_mask(torch.tensor(seed), rank, site, list(shape), p, torch.device("cpu"))


def test_the_mask_is_a_function_of_seed_rank_and_site():
    assert torch.equal(mask(7, 0, 0), mask(7, 0, 0))
    for other in (mask(7, 1, 0), mask(7, 0, 1), mask(8, 0, 0)):
        assert not torch.equal(mask(7, 0, 0), other)
    # no draw from the default generator: the shared stream stays where it was
    state = torch.get_rng_state()
    mask(7, 0, 0)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_mask_keeps_one_minus_p(p):
    kept = mask(3, 1, 2, p, (200_000,)).double().mean().item()
    assert abs(kept - (1 - p)) < 5 * ((p * (1 - p)) / 200_000) ** 0.5  # five standard deviations


def test_dropout_scales_what_it_keeps():
    x = torch.randn(8, 32, dtype=torch.float64)
    seed = torch.tensor(11)
    out = tp_dropout(x, 0.25, seed, 0, 3)
    keep = mask(11, 0, 3, 0.25, x.shape)
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))
    assert torch.allclose(out[keep], x[keep] / 0.75, rtol=0, atol=1e-15)
    assert tp_dropout(x, 0.0, seed, 0, 3) is x


@pytest.mark.parametrize("causal, with_mask, gqa", [(True, False, False), (False, True, False), (True, False, True)])
def test_attention_without_dropout_is_sdpa(causal, with_mask, gqa):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, dtype=torch.float64, generator=g)
    kv_heads = 2 if gqa else 4
    k, v = (torch.randn(2, kv_heads, 8, 16, dtype=torch.float64, generator=g) for _ in range(2))
    attn_mask = torch.randn(8, 8, dtype=torch.float64, generator=g) if with_mask else None
    ours = tp_attention_dropout(q, k, v, attn_mask, 0.0, causal, None, gqa, torch.tensor(1), 0, 0)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=gqa)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)
