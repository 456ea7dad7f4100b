"""The reference model's mixture of experts (``n_experts``; presets ``tiny-moe``, ``tiny-moe-dense``).

- the experts' forward is the formula, written out here per token with the model's own weights
  (dense experts and CoLA ones; the grouped GEMM itself is test_grouped_gemm.py's);
- the router sends each token to the top_k experts of its softmax, their scores renormalised;
- backend="boost" follows the parity rule against eager and fp64, in one graph, the custom grouped
  GEMM op counted in it (fp32 and bf16);
- parameter counts from the shapes, the experts found by expert parallelism's pattern, and the
  configs that cannot work refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import check_against_eager

from boost_compile.distributed.expert_parallel import find_experts
from boost_compile.models import Llama, LlamaConfig
from boost_compile.models.moe import Experts, MoE, experts_params

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def moe_model(preset: str = "tiny-moe", **overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.preset(preset, **overrides))


def expert_by_formula(experts: Experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of ``x`` [d]: down(silu(gate(x)) * up(x)), each matrix dense or two factors."""
    def matrix(name: str, v: torch.Tensor) -> torch.Tensor:
        if experts.rank is None:
            return v @ getattr(experts, name)[e]
        latent = v @ getattr(experts, f"{name}_down")[e]
        latent = F.silu(latent) if experts.activation == "silu" else latent
        return latent @ getattr(experts, f"{name}_up")[e]

    return matrix("down", F.silu(matrix("gate", x)) * matrix("up", x))


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-dense"])
def test_experts_forward_is_the_formula(preset):
    experts = moe_model(preset).double().layers[0].mlp.experts
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 64, generator=gen, dtype=torch.float64)
    index = torch.tensor([[0, 3], [3, 1], [1, 0], [3, 2], [0, 1], [1, 3]])  # expert 2 once, each other more
    weights = torch.rand(6, 2, generator=gen, dtype=torch.float64)
    want = torch.stack([sum(weights[t, j] * expert_by_formula(experts, int(index[t, j]), hidden[t]) for j in range(2))
                        for t in range(6)])
    with torch.no_grad():
        torch.testing.assert_close(experts(hidden, index, weights), want)


def test_router_picks_the_top_k_and_renormalises():
    moe = moe_model().layers[0].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(1, 5, 64)
    seen = {}
    moe.experts.register_forward_hook(lambda m, args, out: seen.update(index=args[1], weights=args[2]))
    with torch.no_grad():
        moe(x)
        scores = moe.router(x.reshape(5, 64)).softmax(-1)
    top = scores.topk(2, dim=-1)
    assert torch.equal(seen["index"], top.indices)
    torch.testing.assert_close(seen["weights"], top.values / top.values.sum(-1, keepdim=True))


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-dense"])
def test_parameter_count_from_the_shapes(preset):
    cfg = LlamaConfig.preset(preset)
    model = moe_model(preset)
    assert model.num_params() == cfg.num_params()
    rank = None if cfg.projection == "dense" else cfg.rank_mlp
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == cfg.n_layers * experts_params(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim, rank)
    # the experts modules are what expert parallelism shards (routed: stacked, forward(hidden, index, weights))
    assert find_experts(model) == {f"layers.{i}.mlp.experts": "routed" for i in range(cfg.n_layers)}


def _graphs_of(options=None):
    """Compile with the boost backend, counting each graph's grouped GEMMs: torch's, and the custom op's."""
    from boost_compile.backend import boost_backend

    graphs = []

    def counting(gm, inputs):
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        graphs.append((ops.count(torch._grouped_mm), ops.count(torch.ops.boost.grouped_mm.default)))
        return boost_backend(gm, inputs, options)

    return lambda m: torch.compile(m, backend=counting), graphs


def test_backend_boost_fp32_compiles_the_custom_grouped_gemm_in_one_graph():
    """fp32 on the CPU: each of a CoLA block's 6 factors is the custom op boost::grouped_mm, in one
    graph (aot_eager inside the boost passes); the parity rule against eager and fp64."""
    compile_fn, graphs = _graphs_of({"inner": "aot_eager"})
    check_against_eager(moe_model(n_layers=1), compile_fn, lambda m, _: m(TOKENS, TARGETS), what="tiny-moe fp32")
    assert graphs == [(0, 6)]


def test_backend_boost_bf16_puts_the_grouped_gemms_in_the_graph():
    """bf16: one graph, the 6 grouped GEMMs of a CoLA MoE block (3 matrices x 2 factors; torch's kernel
    inside the custom op), and the parity rule against eager bf16 and fp64 (aot_eager inside the boost
    passes; Inductor's compile of it: the extended test below and benchmarks/moe_step.py)."""
    compile_fn, graphs = _graphs_of({"inner": "aot_eager"})
    model = moe_model(n_layers=1).to(torch.bfloat16)
    check_against_eager(model, compile_fn, lambda m, _: m(TOKENS, TARGETS), what="tiny-moe bf16")
    assert graphs == [(0, 6)]


@pytest.mark.extended
def test_backend_boost_fp32_with_inductor():
    """Inductor compiles the graph around the custom op (fp32, one layer): the parity rule."""
    compile_fn, graphs = _graphs_of()
    check_against_eager(moe_model(n_layers=1), compile_fn, lambda m, _: m(TOKENS, TARGETS), what="tiny-moe fp32 inductor")
    assert graphs == [(0, 6)]


@pytest.mark.parametrize(("overrides", "words"), [
    ({"projection": "lax"}, "LaX"),
    ({"experts_top_k": 5}, "experts_top_k must be between 1 and n_experts"),
    ({"n_experts": -1}, "n_experts must be a non-negative"),
    ({"expert_ffn_dim": 0}, "expert_ffn_dim must be a positive"),
])
def test_configs_that_cannot_work_are_refused(overrides, words):
    with pytest.raises(ValueError, match=words):
        LlamaConfig.preset("tiny-moe", **overrides)


def test_experts_with_biases_are_refused():
    with pytest.raises(ValueError, match="experts have no biases"):
        Llama(LlamaConfig.preset("tiny-moe", bias=True))
