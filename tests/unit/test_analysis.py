"""Graph analysis on captured (Torch IR) graphs: every form it must recognise.

Each test builds a small module in the form under test, captures it with Dynamo
(no compile) and checks the sites the analysis reports, including negative cases
that must not match.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import tiny_hf_llama

from boost_compile.analysis import GraphView, capture_views, source_to_fqn
from boost_compile.config import AnalysisConfig
from boost_compile.models import Llama, LlamaConfig


def view_of(model: nn.Module, *inputs: torch.Tensor, **kw) -> GraphView:
    views = capture_views(model, *inputs, **kw)
    assert len(views) == 1, "expected one graph (no graph break)"
    return views[0]


# ----------------------------------------------------------------------------- linears


class DenseForms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.lin_nobias = nn.Linear(16, 8, bias=False)
        self.W = nn.Parameter(torch.randn(16, 4))
        self.Wt = nn.Parameter(torch.randn(6, 16))
        self.M = nn.Parameter(torch.randn(16, 5))
        self.b = nn.Parameter(torch.randn(5))

    def forward(self, x):
        a = self.lin(x)
        b = self.lin_nobias(x)
        c = x @ self.W
        d = torch.matmul(x, self.Wt.t())
        flat = x.reshape(-1, 16)
        e = torch.mm(flat, self.M)
        f = torch.addmm(self.b, flat, self.M)
        return a, b, c, d, e, f


def test_dense_linear_forms():
    view = view_of(DenseForms(), torch.randn(2, 3, 16))
    by_name = {s.name: s for s in view.linears}
    assert len(view.linears) == 6
    assert by_name["lin"].form == "linear" and by_name["lin"].bias is not None
    assert (by_name["lin"].d_in, by_name["lin"].d_out) == (16, 8)
    assert by_name["lin_nobias"].bias is None
    assert by_name["W"].form == "matmul" and by_name["W"].layout == "in_out"
    assert (by_name["W"].d_in, by_name["W"].d_out) == (16, 4)
    assert by_name["Wt"].layout == "out_in" and (by_name["Wt"].d_in, by_name["Wt"].d_out) == (16, 6)
    forms = sorted(s.form for s in view.linears if s.name == "M")
    assert forms == ["addmm", "mm"]


def test_activation_matmul_is_not_a_linear():
    class AttnLike(nn.Module):
        def forward(self, q, k):
            return q @ k.transpose(-1, -2)

    view = view_of(AttnLike(), torch.randn(2, 4, 8), torch.randn(2, 4, 8))
    assert view.linears == []


# ----------------------------------------------------------------------------- bottlenecks


class Bottlenecks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(64, 8, bias=False)
        self.up = nn.Linear(8, 48)
        self.A = nn.Parameter(torch.randn(64, 16))
        self.B = nn.Parameter(torch.randn(16, 64))
        self.wide_in = nn.Linear(64, 40, bias=False)  # inner 40 > 0.5 * 64: not a bottleneck
        self.wide_out = nn.Linear(40, 64, bias=False)

    def forward(self, x):
        y1 = self.up(self.down(x))  # plain low-rank, with a bias on the up factor
        y2 = F.silu(x @ self.A) @ self.B  # CoLA written with raw matmuls
        y3 = self.wide_out(self.wide_in(x))
        return y1, y2, y3


def test_bottleneck_chains():
    view = view_of(Bottlenecks(), torch.randn(2, 5, 64))
    chains = {c.down.name: c for c in view.bottlenecks}
    assert set(chains) == {"down", "A"}
    assert chains["down"].rank == 8 and chains["down"].activation is None
    assert chains["down"].up.bias is not None
    assert chains["A"].rank == 16 and chains["A"].activation == "silu"


def test_bottleneck_ratio_is_configurable():
    view = view_of(Bottlenecks(), torch.randn(2, 5, 64), config=AnalysisConfig(bottleneck_max_ratio=0.7))
    assert {c.down.name for c in view.bottlenecks} == {"down", "A", "wide_in"}
    view = view_of(Bottlenecks(), torch.randn(2, 5, 64), config=AnalysisConfig(bottleneck_max_ratio=0.2))
    assert {c.down.name for c in view.bottlenecks} == {"down"}


def test_a_latent_may_have_other_uses():
    """A latent read elsewhere too (LaX carries it to the next block) is still a bottleneck's."""
    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down = nn.Linear(32, 4, bias=False)
            self.up = nn.Linear(4, 32, bias=False)

        def forward(self, x):
            h = self.down(x)
            return self.up(h) + h.sum()

    (chain,) = view_of(Leaky(), torch.randn(3, 32)).bottlenecks
    assert (chain.down.name, chain.up.name, chain.latent_ops) == ("down", "up", ())


class Crossing(nn.Module):
    """Three bottlenecks of rank 8; the second and third add the previous one's latent (LaX),
    the third also gates its own and scales the crossing."""

    def __init__(self) -> None:
        super().__init__()
        self.A = nn.ParameterList([nn.Parameter(torch.randn(64, 8)) for _ in range(3)])
        self.B = nn.ParameterList([nn.Parameter(torch.randn(8, 64)) for _ in range(3)])
        self.gate = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h0 = F.silu(x @ self.A[0])
        x = x + h0 @ self.B[0]
        h1 = F.silu(x @ self.A[1])
        x = x + (h1 + h0) @ self.B[1]
        h2 = F.silu(x @ self.A[2])
        return x + (h2 * torch.sigmoid(self.gate) + 0.5 * h1) @ self.B[2]


def test_latent_crossing_and_elementwise_work():
    from boost_compile.explain import latent_work

    view = view_of(Crossing(), torch.randn(2, 5, 64))
    chains = view.bottlenecks
    assert [(c.down.name, c.up.name, c.rank, c.activation) for c in chains] == [
        (f"A.{i}", f"B.{i}", 8, "silu") for i in range(3)]
    assert [len(c.latent_ops) for c in chains] == [0, 1, 2]
    assert chains[1].crossings == (chains[0].latent,)
    assert [latent_work(c, chains) for c in chains] == [
        "", "+ latent of A.0", f"* {chains[2].latent_ops[0].args[1].name}, + 0.5 * latent of A.1"]


@pytest.mark.parametrize("between", ["softmax", "per_token", "other_width"])
def test_latent_work_that_is_no_bottleneck(between):
    """What the latent may not go through: a reduction over its channels, a per-token scale
    (it differs from token to token, so under TP it would have to be whole first) and an
    operand of another width."""
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A = nn.Parameter(torch.randn(64, 8))
            self.B = nn.Parameter(torch.randn(8, 64))
            self.wide = nn.Parameter(torch.randn(2, 5, 1))

        def forward(self, x):
            h = F.silu(x @ self.A)
            if between == "softmax":
                h = h.softmax(-1)
            elif between == "per_token":
                h = h * x.mean(-1, keepdim=True)
            else:
                h = h * self.wide
            return h @ self.B

    assert view_of(Odd(), torch.randn(2, 5, 64)).bottlenecks == []


# ----------------------------------------------------------------------------- siblings


class Siblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(32, 32, bias=False)
        self.k = nn.Linear(32, 16, bias=False)
        self.v = nn.Linear(32, 16, bias=True)
        self.after = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return q, k, v


def test_sibling_group_with_different_widths():
    view = view_of(Siblings(), torch.randn(2, 3, 32))
    assert len(view.sibling_groups) == 1
    assert [m.name for m in view.sibling_groups[0].members] == ["q", "k", "v"]


def test_dependent_linears_are_not_siblings():
    class Dependent(nn.Module):
        """a and b both read x, but b's bias is computed from a's output."""

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.wb = nn.Parameter(torch.randn(8, 8))
            self.c = nn.Linear(8, 4, bias=False)

        def forward(self, x):
            a = self.a(x)
            b = F.linear(x, self.wb, a.mean(0))
            return b, self.c(x)

    class Chained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8, bias=False)

        def forward(self, x):
            return self.b(self.a(x))

    assert view_of(Chained(), torch.randn(2, 8)).sibling_groups == []
    view = view_of(Dependent(), torch.randn(2, 8))
    assert len([s for s in view.linears if s.input.name == "l_x_"]) == 3
    # b depends on a, so only one of them joins c
    assert [[m.name for m in g.members] for g in view.sibling_groups] == [["a", "c"]]


# ----------------------------------------------------------------------------- RMSNorm


class Norms(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fused = nn.RMSNorm(d, eps=1e-5)
        self.w_dec = nn.Parameter(torch.ones(d))
        self.w_hf = nn.Parameter(torch.ones(d))
        self.w_gemma = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        a = self.fused(x)
        # decomposed
        b = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w_dec
        # Hugging Face Llama: fp32 upcast, cast back before the weight
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        c = self.w_hf * h.to(x.dtype)
        # Gemma: (1 + w), cast back after
        g = x.float()
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)
        d = (g * (1.0 + self.w_gemma.float())).type_as(x)
        return a, b, c, d


def test_rmsnorm_forms():
    view = view_of(Norms(), torch.randn(2, 3, 16))
    sites = {s.form: s for s in view.rmsnorms}
    assert sorted(sites) == ["decomposed", "fused", "hf_upcast", "one_plus_w"]
    assert sites["fused"].eps == 1e-5 and sites["fused"].name == "fused"
    assert sites["decomposed"].eps == 1e-6 and sites["decomposed"].param_name == "w_dec"
    assert sites["hf_upcast"].upcast and sites["hf_upcast"].eps == 1e-5 and sites["hf_upcast"].param_name == "w_hf"
    assert sites["one_plus_w"].weight_offset == 1.0 and sites["one_plus_w"].param_name == "w_gemma"
    # each site's output is the value the module returns
    outputs = {n for n in view.graph.output_node().args[0]}
    assert {s.output for s in view.rmsnorms} == outputs


def test_not_an_rmsnorm():
    class MeanOverBatch(nn.Module):
        def forward(self, x):  # statistic over dim 0, not the last dim
            return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)

    class Cubed(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6)

    assert view_of(MeanOverBatch(), torch.randn(4, 8)).rmsnorms == []
    assert view_of(Cubed(), torch.randn(4, 8)).rmsnorms == []


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("preset", ["tiny", "tiny-lowrank", "tiny-dense"])
def test_reference_model_structure(preset):
    cfg = LlamaConfig.preset(preset)
    view = view_of(Llama(cfg), torch.randint(0, cfg.vocab_size, (2, 8)))
    n = cfg.n_layers
    low_rank = preset != "tiny-dense"
    # 7 projections per block (+ the head), each a factor pair when low-rank
    assert len(view.linears) == (14 if low_rank else 7) * n + 1
    assert len(view.bottlenecks) == (7 * n if low_rank else 0)
    acts = {c.activation for c in view.bottlenecks}
    assert acts == ({"silu"} if preset == "tiny" else ({None} if low_rank else set()))
    # q/k/v and gate/up share an input in every block
    assert sorted(len(g.members) for g in view.sibling_groups) == [2] * n + [3] * n
    assert len(view.rmsnorms) == 2 * n + 1 and {s.form for s in view.rmsnorms} == {"fused"}
    assert len(view.residual_stream) == 2 * n + 1
    head = [s for s in view.linears if s.name == "output"]
    assert len(head) == 1 and not view.in_block(head[0])
    assert len(view.block_linears) == len(view.linears) - 1


def test_hugging_face_llama_structure():
    model = tiny_hf_llama()
    view = view_of(model, torch.randint(0, 256, (1, 8)))
    n = model.config.num_hidden_layers
    assert {s.form for s in view.rmsnorms} == {"hf_upcast"} and len(view.rmsnorms) == 2 * n + 1
    groups = [[m.name for m in g.members] for g in view.sibling_groups]
    assert ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"] in groups
    assert ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"] in groups
    assert len(view.residual_stream) == 2 * n + 1
    assert [s.name for s in view.linears if not view.in_block(s)] == ["lm_head"]


def test_source_names_to_fqn():
    assert source_to_fqn("L['self']._modules['layers']._modules['0']._parameters['weight']") == "layers.0.weight"
    assert source_to_fqn("L['args'][0]._modules['model']._modules['norm']._parameters['weight']") == "model.norm.weight"
    assert source_to_fqn("L['self']._parameters['W']") == "W"


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def test_capture_leaves_no_compiled_entry_on_the_class_forward():
    """A capture for analysis must not occupy Dynamo's cache of the class's forward, which every
    instance shares (pipeline stages of one class count against one recompile limit)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    model = _Shared()
    views = capture_views(model, torch.randn(2, 8))
    assert len(views) == 1 and "forward" not in vars(model)
    assert _debug_get_cache_entry_list(_Shared.forward.__code__) == []
    compiled = torch.compile(model, backend="eager")
    compiled(torch.randn(2, 8))
    assert len(_debug_get_cache_entry_list(_Shared.forward.__code__)) == 1  # the real compile does cache
    torch._dynamo.reset()
