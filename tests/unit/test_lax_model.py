"""The LaX reference model (projection="lax"): each projection's latent crosses into the same
projection of the next block, y_i = (h_i + h_{i-1}) B_i with h_i = silu(x A_i).

Checked against a forward written out here from the formula with the model's own weights; the
first block has no crossing; the captured graph reads linear -> silu -> add -> linear per
projection; backend="boost" follows the parity rule; presets, parameter counts, and a
boost-train run exported and generated from (boost-train's refusal of pipeline stages for LaX
is in test_train_parallel_config.py).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, check_against_eager

from boost_compile.models import LaxLinear, Llama, LlamaConfig, LowRankLinear
from boost_compile.models.llama import PAPER_SHAPES, apply_rope, repeat_kv

NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def lax(n_layers: int = 2, **overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset("tiny-lax", n_layers=n_layers, **overrides))


def reference_forward(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """The LaX formula written out with the model's weights: a loop over the blocks that keeps
    each projection's latent of the block before (none before the first)."""
    cfg = model.config
    seq = tokens.shape[1]
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    previous: dict[str, torch.Tensor] = {}

    def proj(module: LaxLinear, name: str, x: torch.Tensor, latents: dict[str, torch.Tensor]) -> torch.Tensor:
        h = F.silu(x @ module.down.weight.T)  # h_i = silu(x A_i)
        latents[name] = h
        z = h + previous[name] if name in previous else h  # h_{-1} absent in the first block
        return z @ module.up.weight.T  # y_i = (h_i + h_{i-1}) B_i

    x = model.tok_embeddings.weight[tokens]
    for block in model.layers:
        latents: dict[str, torch.Tensor] = {}
        a = block.attention
        n = block.attention_norm(x)
        b, s = tokens.shape
        q = proj(a.q_proj, "q_proj", n, latents).view(b, s, cfg.n_heads, -1).transpose(1, 2)
        k = proj(a.k_proj, "k_proj", n, latents).view(b, s, cfg.n_kv_heads, -1).transpose(1, 2)
        v = proj(a.v_proj, "v_proj", n, latents).view(b, s, cfg.n_kv_heads, -1).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = cfg.n_heads // cfg.n_kv_heads
        att = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), is_causal=True)
        x = x + proj(a.o_proj, "o_proj", att.transpose(1, 2).reshape(b, s, -1), latents)
        m = block.mlp
        n = block.ffn_norm(x)
        hidden = F.silu(proj(m.gate_proj, "gate_proj", n, latents)) * proj(m.up_proj, "up_proj", n, latents)
        x = x + proj(m.down_proj, "down_proj", hidden, latents)
        previous = latents
    return model.norm(x) @ model.output.weight.T


# ----------------------------------------------------------------------------- the formula


@pytest.mark.parametrize("n_layers", [1, 3])
def test_forward_is_the_formula(n_layers):
    model = lax(n_layers)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference_forward(model, TOKENS))


def test_first_block_has_no_crossing():
    """One block: LaX is CoLA with the same weights, bit for bit; from the second on it is not."""
    for n_layers, same in ((1, True), (2, False)):
        model = lax(n_layers)
        torch.manual_seed(0)
        cola = Llama(LlamaConfig.preset("tiny", n_layers=n_layers))
        cola.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert torch.equal(model(TOKENS), cola(TOKENS)) == same


def test_block_returns_its_latents_and_leaves_the_input_alone():
    model = lax()
    block = model.layers[1]
    x = torch.randn(2, 16, 64)
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    previous = {name: torch.randn(2, 16, 16) for name in NAMES}
    given = dict(previous)
    out, latents = block(x, cos, sin, previous)
    assert previous == given and set(latents) == set(NAMES)
    n = block.attention_norm(x)
    torch.testing.assert_close(latents["q_proj"], F.silu(block.attention.q_proj.down(n)))
    assert out.shape == x.shape
    # without latents (a pipeline stage passes the stream alone) a LaX block refuses to run
    with pytest.raises(TypeError, match=r"block\(x, cos, sin, latents\)"):
        model.layers[0](x, cos, sin)


def test_lax_linear():
    torch.manual_seed(0)
    layer = LaxLinear(24, 40, 6, bias=True)
    x, prev = torch.randn(3, 24), torch.randn(3, 6)
    y, h = layer(x, prev)
    torch.testing.assert_close(h, F.silu(x @ layer.down.weight.T))
    torch.testing.assert_close(y, (h + prev) @ layer.up.weight.T + layer.up.bias)
    torch.testing.assert_close(layer(x)[0], (h @ layer.up.weight.T) + layer.up.bias)
    assert isinstance(layer, LowRankLinear) and layer.activation == "silu" and "crossing=True" in repr(layer)
    assert [k for k, _ in layer.named_parameters()] == ["down.weight", "up.weight", "up.bias"]


def _graph_ops(model: Llama) -> dict[str, list[str]]:
    """Per projection module of the Dynamo graph: the op names it owns, in order."""
    ops: dict[str, list[str]] = {}

    def backend(gm, _inputs):
        for node in gm.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if node.op == "call_function" and stack:
                owner = list(stack.values())[-1][0].removeprefix("L['self'].")
                owner = owner.removesuffix(".down").removesuffix(".up")
                ops.setdefault(owner, []).append(getattr(node.target, "__name__", str(node.target)))
        return gm

    torch.compile(model, backend=backend, fullgraph=True)(TOKENS)
    return ops


def test_captured_graph_reads_linear_silu_add_linear():
    ops = _graph_ops(lax(3))
    for i in range(3):
        for name in NAMES:
            owner = f"layers.{i}.{'attention' if name in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{name}"
            want = ["linear", "silu", "linear"] if i == 0 else ["linear", "silu", "add", "linear"]
            assert ops[owner] == want, (owner, ops[owner])


def test_boost_backend_parity():
    def boost(m):
        return torch.compile(m, backend="boost", options={"inner": "aot_eager"}, fullgraph=True)

    ratio = check_against_eager(lax(), boost, lambda m, x: m(*x), (TOKENS, TARGETS), "tiny LaX")
    assert ratio < 4


def test_backward_reaches_every_parameter():
    model = lax()
    model(TOKENS, TARGETS).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------- presets and counts


def test_presets_and_parameter_counts():
    names = LlamaConfig.presets()
    assert "tiny-lax" in names
    for size in PAPER_SHAPES:
        cfg, cola = LlamaConfig.preset(f"lax-{size}"), LlamaConfig.preset(f"cola-{size}")
        assert cfg.projection == "lax"
        assert cfg.projection_shapes() == cola.projection_shapes()
        # the crossing adds no weight: LaX counts what CoLA counts
        assert cfg.num_params() == cola.num_params()
    assert LlamaConfig.preset("lax-60m").num_params() == 42_770_944
    meta = Llama(LlamaConfig.preset("lax-60m"), device="meta")
    assert meta.num_params() == meta.config.num_params()
    model = lax()
    assert model.num_params() == model.config.num_params() == Llama(LlamaConfig.preset("tiny")).num_params()
    assert sum(isinstance(m, LaxLinear) for m in model.modules()) == 2 * 7


def test_save_and_load_pretrained(tmp_path):
    model = lax().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["projection"] == "lax" and "lowrank_layers" not in config
    loaded = Llama.from_pretrained(tmp_path)
    assert isinstance(loaded.layers[1].mlp.down_proj, LaxLinear)
    assert_same_state(model, loaded)
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS), model(TOKENS))


# ----------------------------------------------------------------------------- boost-train, export, generate


def test_train_export_and_generate_round_trip(tmp_path):
    """boost-train (boost with aot_eager) on tiny-lax, boost-export, then boost-generate."""
    from test_export import TOKENS as EXPORT_TOKENS
    from test_export import train
    from test_generate import PROMPT, eager_greedy

    from boost_compile.export import export, load_exported, load_trained
    from boost_compile.generate import load_generator

    out = train(tmp_path / "run", "model=tiny-lax", "passes=boost_aot_eager")
    info = export(out, tmp_path / "out")
    assert info["format"] == "boost_llama"
    loaded = load_exported(tmp_path / "out")
    trained, _ = load_trained(out)
    assert loaded.config.projection == "lax" and loaded.config == trained.config
    assert_same_state(trained, loaded)
    with torch.no_grad():
        assert torch.equal(loaded(EXPORT_TOKENS), trained(EXPORT_TOKENS))
    gen = load_generator(out, inner="aot_eager")
    assert gen.options["inner"] == "aot_eager"
    assert gen(PROMPT, max_new_tokens=6) == eager_greedy(trained, PROMPT, 6, gen.window)
