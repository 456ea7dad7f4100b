"""factorize_ (module swap) and the compile-time factorize pass.

Tolerances (fp32): factor math 1e-5 relative; model outputs after an exact
low-rank factorization 1e-4 absolute on logits of order 1.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import tiny_hf_llama

import boost_compile as bc
from boost_compile.analysis import capture_views
from boost_compile.config import ConfigError, FactorizeConfig
from boost_compile.factorize import cola_factors, svd_factors
from boost_compile.models import Llama, LlamaConfig
from boost_compile.models.lowrank import LowRankLinear, cola_std
from boost_compile.passes.factorize import FactorizeGradientError


def tiny_dense(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig.preset("tiny-dense"))


def make_weights_low_rank(model: nn.Module, rank: int) -> None:
    """Replace every block linear's weight by an exactly rank-``rank`` matrix."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name.startswith("layers."):
                u = torch.randn(m.out_features, rank) / rank**0.5
                v = torch.randn(rank, m.in_features) / m.in_features**0.5
                m.weight.copy_(u @ v)


# ----------------------------------------------------------------------------- the math


@pytest.mark.parametrize("shape,rank", [((48, 32), 8), ((32, 48), 5), ((40, 40), 40)])
def test_svd_error_is_discarded_energy(shape, rank):
    torch.manual_seed(0)
    w = torch.randn(*shape, dtype=torch.float64).float()
    down, up = svd_factors(w, rank)
    assert down.shape == (rank, shape[1]) and up.shape == (shape[0], rank)
    s = torch.linalg.svdvals(w.double())
    err2 = (w.double() - up.double() @ down.double()).pow(2).sum()
    expected = s[rank:].pow(2).sum()
    assert torch.allclose(err2, expected, rtol=1e-4, atol=1e-6 * s.pow(2).sum().item())
    if rank == min(shape):  # full rank reproduces the layer
        torch.testing.assert_close(up @ down, w, rtol=1e-5, atol=1e-5)


def test_svd_keeps_dtype_and_computes_in_fp32():
    w = torch.randn(32, 16).bfloat16()
    down, up = svd_factors(w, 4)
    assert down.dtype == up.dtype == torch.bfloat16


def test_cola_init_std():
    down, up = cola_factors(512, 256, 64, generator=torch.Generator().manual_seed(0))
    std = cola_std(512, 256, 64)
    assert abs(down.std().item() / std - 1) < 0.02 and abs(up.std().item() / std - 1) < 0.02


def test_rank_resolution():
    assert FactorizeConfig(rank=7).rank_for(64, 32) == 7
    assert FactorizeConfig(rank_ratio=0.25).rank_for(64, 176) == 16
    # param_ratio: r (d_in + d_out) = ratio * d_in * d_out
    assert FactorizeConfig(param_ratio=0.5).rank_for(64, 64) == 16
    with pytest.raises(ConfigError, match="exactly one of rank, rank_ratio, param_ratio"):
        FactorizeConfig(rank=4, rank_ratio=0.5)
    with pytest.raises(ConfigError, match="exactly one"):
        FactorizeConfig()
    with pytest.raises(ConfigError, match="choose one of"):
        FactorizeConfig(rank=4, init="qr")


# ----------------------------------------------------------------------------- factorize_


def test_factorize_picks_block_linears_only():
    model = tiny_dense()
    report = bc.factorize_(model, FactorizeConfig(rank_ratio=0.25))
    n = model.config.n_layers
    assert len(report.layers) == 7 * n and not report.skipped
    assert isinstance(model.output, nn.Linear), "the output head stays dense"
    assert isinstance(model.tok_embeddings, nn.Embedding)
    lowrank = [name for name, m in model.named_modules() if isinstance(m, LowRankLinear)]
    assert len(lowrank) == 7 * n and all(name.startswith("layers.") for name in lowrank)
    q = model.layers[0].attention.q_proj
    assert q.rank == 16 and q.activation is None
    assert report.params_after < report.params_before


def test_factorize_svd_reproduces_exactly_low_rank_model():
    model = tiny_dense()
    make_weights_low_rank(model, rank=4)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(tokens)
    bc.factorize_(model, FactorizeConfig(rank=4, init="svd"))
    with torch.no_grad():
        out = model(tokens)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)


def test_factorize_skips_rank_that_saves_nothing():
    model = tiny_dense()
    # rank 24 saves on 64x64 (break-even 32) but not on 64->32 k/v (break-even 21.3)
    with pytest.warns(UserWarning, match="saves nothing"):
        report = bc.factorize_(model, FactorizeConfig(rank=24))
    skipped = sorted(name for name, _ in report.skipped)
    n = model.config.n_layers
    assert skipped == sorted(f"layers.{i}.attention.{p}" for i in range(n) for p in ("k_proj", "v_proj"))
    assert isinstance(model.layers[0].attention.k_proj, nn.Linear)
    assert isinstance(model.layers[0].attention.q_proj, LowRankLinear)


def test_filter_fn_overrides_the_graph_choice():
    model = tiny_dense()
    report = bc.factorize_(model, FactorizeConfig(rank=8), filter_fn=lambda m, fqn: fqn in ("output", "layers.0.mlp.up_proj"))
    assert sorted(x.fqn for x in report.layers) == ["layers.0.mlp.up_proj", "output"]
    assert isinstance(model.output, LowRankLinear)


def test_random_init_with_activation_is_cola():
    model = tiny_dense()
    bc.factorize_(model, FactorizeConfig(rank=16, init="random", activation="silu"))
    layer = model.layers[0].mlp.gate_proj
    assert isinstance(layer, LowRankLinear) and layer.activation == "silu"
    std = cola_std(64, 176, 16)
    assert abs(layer.up.weight.std().item() / std - 1) < 0.1


def test_factorize_needs_an_input_without_embedding():
    mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    with pytest.raises(ValueError, match="example_inputs"):
        bc.factorize_(mlp, FactorizeConfig(rank=4))


def test_factorize_hugging_face_llama_then_train_compiled():
    hf = tiny_hf_llama()
    report = bc.factorize_(hf, FactorizeConfig(rank_ratio=0.25))
    assert len(report.layers) == 14 and isinstance(hf.lm_head, nn.Linear)
    compiled_model = copy.deepcopy(hf)
    tokens = torch.randint(0, 256, (2, 16))
    loss = hf(input_ids=tokens, labels=tokens).loss
    loss.backward()
    compiled = torch.compile(compiled_model, backend="boost", options={"inner": "aot_eager"})
    loss_c = compiled(input_ids=tokens, labels=tokens).loss
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)
    views = capture_views(compiled_model, tokens)
    assert len(views[0].bottlenecks) == 14
    for (name, p), p_c in zip(hf.named_parameters(), compiled_model.parameters(), strict=True):
        rel = (p_c.grad - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
        assert rel <= 1e-5, name


# ----------------------------------------------------------------------------- the pass


def test_compile_time_factorize_on_frozen_model():
    model = tiny_dense().eval()
    make_weights_low_rank(model, rank=4)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(tokens)
        options = {"inner": "aot_eager", "factorize": {"rank": 4}}
        report = bc.explain(model, tokens, options=options)
        out = torch.compile(model, backend="boost", options=options)(tokens)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
    rep = next(r for r in report.graphs[0].reports if r.name == "factorize")
    n = model.config.n_layers
    assert len(rep.found) == len(rep.rewritten) == 7 * n
    after = next(s for s in report.graphs[0].stages if s.name == "factorize").op_counts
    assert after["linear"] == 2 * 7 * n + 1  # each block linear became two, the head stays


@pytest.mark.slow
def test_compile_time_factorize_with_inductor():
    model = tiny_dense().eval()
    make_weights_low_rank(model, rank=4)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(tokens)
        out = torch.compile(model, backend="boost", options={"factorize": {"rank": 4}})(tokens)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)


def test_compile_time_factorize_refuses_training_graph():
    model = tiny_dense()
    tokens = torch.randint(0, 256, (2, 16))
    compiled = torch.compile(model, backend="boost", options={"inner": "aot_eager", "factorize": {"rank": 4}})
    with pytest.raises(Exception, match="factorize_") as info:
        compiled(tokens)
    assert isinstance(info.value, FactorizeGradientError) or "FactorizeGradientError" in str(info.value)


def test_compile_time_factorize_strict_flags_skipped_layers():
    model = tiny_dense().eval()
    tokens = torch.randint(0, 256, (2, 16))
    options = {"inner": "aot_eager", "strict": True, "factorize": {"rank": 24}}
    with warnings.catch_warnings(), torch.no_grad():
        with pytest.raises(Exception, match="strict: pass 'factorize' skipped 4 site"):
            torch.compile(model, backend="boost", options=options)(tokens)


def test_gpt2_conv1d_is_factorized_as_the_linear_it_is():
    """GPT-2's Conv1D (y = x @ W + b, W as [d_in, d_out]) becomes a bottleneck: every block
    projection, found from the graph (addmm); with W of exact rank 4 the logits do not move."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Conv1D):
                d_in, d_out = module.weight.shape
                module.weight.copy_(torch.randn(d_in, 4) @ torch.randn(4, d_out) * 0.02)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(tokens).logits
    report = bc.factorize_(model, FactorizeConfig(rank=4, init="svd"))
    assert sorted(x.fqn for x in report.layers) == sorted(
        f"transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    layer = model.transformer.h[0].attn.c_attn
    assert isinstance(layer, LowRankLinear) and (layer.in_features, layer.out_features) == (64, 192)
    assert layer.up.bias is not None  # Conv1D's bias kept on the up factor
    with torch.no_grad():
        out = model(tokens).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
