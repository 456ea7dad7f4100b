"""Shared test helpers: a Dynamo reset around every test, gradient comparison, tiny HF Llama."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch import nn

# boost-train's token cache: one throwaway folder per test session (subprocesses inherit it),
# never the user's ~/.cache
os.environ.setdefault("BOOST_COMPILE_CACHE", tempfile.mkdtemp(prefix="boost-test-cache-"))

#: Denominator floor of the norm-wise relative error (a zero reference stays finite).
TINY = 1e-30


@pytest.fixture(autouse=True)
def _reset_dynamo():
    """Every test starts and ends with empty Dynamo caches (no recompile-limit noise)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ``||value - ref|| / max(||ref||, TINY)``, computed in fp64."""
    value, ref = value.detach().double(), ref.detach().double()
    return ((value - ref).norm() / ref.norm().clamp_min(TINY)).item()


def assert_grads_close(model_a: nn.Module, model_b: nn.Module, rtol: float) -> None:
    """Every parameter has a gradient in both models, equal to ``rtol`` norm-wise.

    ``model_a`` is the reference (its gradient norm is the denominator). The two
    models must have the same parameter names, as two copies of one model do.
    """
    params_a = dict(model_a.named_parameters())
    params_b = dict(model_b.named_parameters())
    assert params_a.keys() == params_b.keys(), "the models do not have the same parameters"
    assert params_a, "the model has no parameters"
    missing = [n for n in params_a if params_a[n].grad is None or params_b[n].grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    errors = {n: rel_err(params_b[n].grad, params_a[n].grad) for n in params_a}
    bad = {n: e for n, e in errors.items() if not e <= rtol}  # `not <=` also catches NaN
    assert not bad, f"{len(bad)}/{len(errors)} gradients differ by more than {rtol:g}: {bad}"


def tiny_hf_llama(attn_implementation: str = "sdpa", seed: int = 0, vocab_size: int = 256) -> nn.Module:
    """A randomly initialised two-layer ``transformers.LlamaForCausalLM`` (nothing downloaded)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)
