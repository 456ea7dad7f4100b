"""Tests for the reference models: LowRankLinear and the Llama decoder."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from boost_compile.models import Llama, LlamaConfig, LowRankLinear, break_even_rank
from boost_compile.models.llama import apply_rope, rope_tables
from boost_compile.models.lowrank import cola_std

TINY_PRESETS = ["tiny", "tiny-dense", "tiny-lowrank", "tiny-lax"]
SIZES = ["60m", "130m", "350m", "1b", "7b"]


def tiny(name: str = "tiny", **overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset(name, **overrides))


def tokens(batch: int = 2, seq: int = 16, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


# --- LowRankLinear -----------------------------------------------------------


def test_lowrank_structure_and_repr():
    layer = LowRankLinear(32, 48, 8, bias=True, activation="silu")
    assert layer.down.weight.shape == (8, 32)
    assert layer.up.weight.shape == (48, 8)
    assert layer.down.bias is None and layer.up.bias.shape == (48,)
    assert (layer.in_features, layer.out_features, layer.rank) == (32, 48, 8)
    assert "rank=8" in repr(layer) and "activation=silu" in repr(layer)
    assert layer(torch.randn(3, 5, 32)).shape == (3, 5, 48)


@pytest.mark.parametrize("activation", [None, "silu", "gelu", "relu"])
def test_from_factors_matches_matmuls(activation):
    torch.manual_seed(0)
    A, B, bias = torch.randn(24, 6), torch.randn(6, 40), torch.randn(40)
    x = torch.randn(4, 24)
    layer = LowRankLinear.from_factors(A, B, bias=bias, activation=activation)
    h = x @ A
    if activation is not None:
        h = getattr(F, activation)(h)
    torch.testing.assert_close(layer(x), h @ B + bias)


def test_from_factors_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="factors must be"):
        LowRankLinear.from_factors(torch.randn(8, 4), torch.randn(5, 8))


def test_unknown_activation_and_init():
    with pytest.raises(ValueError, match="valid choices"):
        LowRankLinear(8, 8, 2, activation="tanh")
    with pytest.raises(ValueError, match="cola, kaiming"):
        LowRankLinear(8, 8, 2).reset_parameters("xavier")


def test_cola_init_std():
    torch.manual_seed(0)
    d_in, d_out, rank = 512, 1376, 128
    layer = LowRankLinear(d_in, d_out, rank, bias=True, activation="silu")
    expected = rank**-0.25 * (d_in + d_out) ** -0.25
    assert cola_std(d_in, d_out, rank) == pytest.approx(expected)
    for weight in (layer.down.weight, layer.up.weight):
        assert weight.std().item() == pytest.approx(expected, rel=0.02)
        assert abs(weight.mean().item()) < 0.1 * expected
    assert torch.count_nonzero(layer.up.bias) == 0


def test_kaiming_init_matches_linear_bound():
    layer = LowRankLinear(64, 64, 16)
    layer.reset_parameters("kaiming")
    assert layer.down.weight.abs().max() <= 1 / 64**0.5
    assert layer.up.weight.abs().max() <= 1 / 16**0.5


def test_break_even_rank():
    assert break_even_rank(512, 512) == 256
    assert break_even_rank(512, 1376) == pytest.approx(512 * 1376 / 1888)


# --- config and presets -------------------------------------------------------


def test_presets_listed_and_construct():
    names = LlamaConfig.presets()
    assert set(TINY_PRESETS) <= set(names)
    for size in SIZES:
        assert {f"cola-{size}", f"lowrank-{size}", f"llama-{size}", f"lax-{size}"} <= set(names)
    for name in names:
        LlamaConfig.preset(name)  # validates


def test_paper_shapes():
    cfg = LlamaConfig.preset("cola-7b")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (4096, 32, 32, 32)
    assert (cfg.ffn_dim, cfg.rank_attn, cfg.rank_mlp) == (11008, 1024, 1024)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.projection) == (32000, 4096, "cola")
    assert LlamaConfig.preset("lowrank-60m").projection == "lowrank"
    assert LlamaConfig.preset("llama-350m").projection == "dense"
    assert LlamaConfig.preset("cola-130m").max_seq_len == 1024
    assert LlamaConfig.preset("cola-60m", vocab_size=256).vocab_size == 256


def test_param_count_arithmetic():
    # Llama-7B has 6,738,415,616 parameters (untied, vocab 32000).
    assert LlamaConfig.preset("llama-7b").num_params() == 6_738_415_616
    for size in SIZES:
        dense = LlamaConfig.preset(f"llama-{size}").num_params()
        cola = LlamaConfig.preset(f"cola-{size}").num_params()
        lowrank = LlamaConfig.preset(f"lowrank-{size}").num_params()
        assert cola == lowrank < dense
    # CoLA-60M: 42.8M parameters against 58.1M dense.
    assert LlamaConfig.preset("cola-60m").num_params() == 42_770_944


def test_meta_instantiation_matches_arithmetic():
    for name in ("cola-60m", "llama-60m"):
        cfg = LlamaConfig.preset(name)
        model = Llama(cfg, device="meta")
        assert model.num_params() == cfg.num_params()
        assert model.tok_embeddings.weight.is_meta


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_param_count_matches_config(name):
    model = tiny(name)
    assert model.num_params() == model.config.num_params()


def test_lowrank_fewer_params_than_dense():
    dense, lowrank = tiny("tiny-dense"), tiny("tiny-lowrank")
    d, r = 64, 16
    dense_q = dense.layers[0].attention.q_proj
    lowrank_q = lowrank.layers[0].attention.q_proj
    assert sum(p.numel() for p in dense_q.parameters()) == d * d
    assert sum(p.numel() for p in lowrank_q.parameters()) == r * (d + d)
    assert lowrank.num_params() < dense.num_params()


def test_projection_kinds():
    assert isinstance(tiny("tiny-dense").layers[0].mlp.up_proj, torch.nn.Linear)
    lowrank = tiny("tiny-lowrank").layers[0].mlp.up_proj
    cola = tiny("tiny").layers[0].attention.k_proj
    assert isinstance(lowrank, LowRankLinear) and lowrank.activation is None
    assert isinstance(cola, LowRankLinear) and cola.activation == "silu"
    assert tiny("tiny").config.rank_attn == 16


def test_default_rank_is_quarter_dim():
    cfg = LlamaConfig(
        vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64,
        max_seq_len=8, projection="cola",
    )  # fmt: skip
    assert cfg.rank_attn == cfg.rank_mlp == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dim": 66}, r"dim \(66\) must be divisible by n_heads \(4\)"),
        ({"n_kv_heads": 3}, r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
        ({"projection": "svd"}, "valid choices: dense, lowrank, cola"),
        ({"rank_attn": 32}, "break-even"),
        ({"rank_mlp": 64}, "rank_mlp=64 is not below the break-even"),
        ({"n_layers": 0}, "n_layers must be a positive integer"),
        ({"dim": 24, "n_heads": 8, "n_kv_heads": 8}, "must be even for RoPE"),
    ],
)
def test_invalid_configs(overrides, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.preset("tiny", **overrides)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="valid presets: tiny, tiny-dense"):
        LlamaConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        LlamaConfig.preset("tiny", width=3)


def test_preset_switched_to_dense_drops_ranks():
    cfg = LlamaConfig.preset("cola-60m", projection="dense")
    assert cfg.num_params() == LlamaConfig.preset("llama-60m").num_params()


# --- forward behaviour --------------------------------------------------------


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_shapes_and_loss(name):
    model = tiny(name)
    x = tokens()
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    loss = model(x, x)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 256), x.reshape(-1)))
    # freshly initialised: close to uniform over the 256 bytes
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_too_long_sequence_raises():
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        tiny()(tokens(seq=65))


def test_deterministic_given_seed():
    a, b = tiny(), tiny()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


def test_init_statistics():
    model = tiny("tiny-dense", dim=256, n_heads=4, n_kv_heads=4, ffn_dim=512)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(256))
    cola = tiny("tiny").layers[0].mlp.down_proj
    assert cola.down.weight.std().item() == pytest.approx(cola_std(176, 64, 16), rel=0.1)


def test_gqa():
    model = tiny("tiny-dense", n_heads=4, n_kv_heads=1)
    attn = model.layers[0].attention
    assert attn.k_proj.weight.shape == (16, 64) and attn.q_proj.weight.shape == (64, 64)
    assert model(tokens()).shape == (2, 16, 256)


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = tiny("tiny-dense", n_heads=4, n_kv_heads=2)
    mha = tiny("tiny-dense", n_heads=4, n_kv_heads=4)
    state = gqa.state_dict()
    for i in range(gqa.config.n_layers):
        for name in ("k_proj", "v_proj"):
            w = state[f"layers.{i}.attention.{name}.weight"]  # [2 heads * 16, 64]
            state[f"layers.{i}.attention.{name}.weight"] = (
                w.view(2, 1, 16, 64).expand(2, 2, 16, 64).reshape(64, 64)
            )
    mha.load_state_dict(state)
    x = tokens()
    torch.testing.assert_close(mha(x), gqa(x))


def test_tied_embeddings_share_storage():
    model = tiny(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert model.num_params() == model.config.num_params() == tiny().num_params() - 256 * 64


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_causal(name):
    model = tiny(name)
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    out_x, out_y = model(x), model(y)
    torch.testing.assert_close(out_x[:, :10], out_y[:, :10])
    assert not torch.allclose(out_x[:, 10:], out_y[:, 10:])


def test_rope_hand_check():
    cos, sin = rope_tables(head_dim=4, max_seq_len=3, theta=100.0)
    # inv_freq = [1, 1/10]; position 2 -> angles [2, 0.2, 2, 0.2]
    angles = torch.tensor([2.0, 0.2, 2.0, 0.2])
    torch.testing.assert_close(cos[2], angles.cos())
    torch.testing.assert_close(sin[2], angles.sin())
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    out = apply_rope(x, cos[2:3], sin[2:3]).flatten()
    # pairs (x0, x2) and (x1, x3) are rotated by angles 2 and 0.2
    c0, s0, c1, s1 = angles[0].cos(), angles[0].sin(), angles[1].cos(), angles[1].sin()
    expected = torch.stack([1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1])
    torch.testing.assert_close(out, expected)


def test_rope_relative_position():
    torch.manual_seed(0)
    cos, sin = rope_tables(head_dim=16, max_seq_len=32, theta=10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum()

    torch.testing.assert_close(score(5, 2), score(20, 17))
    torch.testing.assert_close(score(0, 0), (q * k).sum())
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_rope_buffers_not_persistent():
    keys = tiny().state_dict().keys()
    assert not any("rope" in key for key in keys)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_compile_fullgraph_matches_eager(name):
    torch._dynamo.reset()
    model = tiny(name)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = tokens()
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x, x), model(x, x))


def test_no_graph_breaks():
    torch._dynamo.reset()
    model = tiny(tie_embeddings=True, n_kv_heads=1, rank_attn=8)
    explanation = torch._dynamo.explain(model)(tokens(), tokens())
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_backward_reaches_every_parameter():
    model = tiny()
    model(tokens(), tokens()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
