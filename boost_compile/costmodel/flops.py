"""Model FLOPs per token of training and model FLOPs utilization (MFU), counted as torchtitan
and Megatron count them: 3x the forward's matmul FLOPs, recompute left out; the matmuls and
attention are the scale model's (:mod:`boost_compile.costmodel.scale_model`)."""

from __future__ import annotations

from boost_compile.costmodel import scale_model as sm


def model_flops_per_token(matmul_weights: float, layers: int, attention_width: int, seq: int,
                          causal_fraction: float = 0.5) -> float:
    """Model FLOPs of training on one token, as MFU counts them: 3x the forward (the backward's dX and dW).

    The forward: 2 FLOPs per weight of every matmul a token goes through (``matmul_weights``:
    the block projections, each low-rank factor on its own, and the output head; not the
    embedding lookup), plus attention's QK^T and PV, :func:`attention_flops` per token in each of
    ``layers`` (``attention_width`` = heads x head_dim, ``causal_fraction`` of the s x s scores).
    Recompute is left out: activation checkpointing's, and fused attention's recomputed scores
    (the time model's ``Workload.attention_bwd_factor`` of 2.5 prices those; MFU counts 2).
    """
    attention = sm.attention_flops(1, seq, attention_width, causal_fraction) / seq
    return 3.0 * (2.0 * matmul_weights + layers * attention)


def training_flops_per_token(shape: sm.Shape, system: str, seq: int, causal_fraction: float = 0.5) -> float:
    """:func:`model_flops_per_token` of ``shape`` from the scale model's GEMMs: ``full-rank`` for the
    dense model, ``vanilla`` or ``btp`` for its low-rank one (the same FLOPs at p = 1); every layer's
    :func:`layer_gemms` at p = 1, attention over all heads, and the [d, vocab] head."""
    sm._check_system(system)
    gemms = sum(sm.linear_flops(g.m, g.k, g.n) for g in sm.layer_gemms(system, shape, 1, 1))
    attention = sm.attention_flops(1, seq, shape.heads * shape.head_dim, causal_fraction) / seq
    return 3.0 * (shape.layers * (gemms + attention) + sm.linear_flops(1, shape.d, shape.vocab))


def model_flops_utilization(flops_per_token: float, tokens_per_s: float, devices: int, peak_flops: float) -> float:
    """MFU: the model FLOPs a run does per second over what its ``devices`` could do at ``peak_flops`` each."""
    return flops_per_token * tokens_per_s / (devices * peak_flops)
