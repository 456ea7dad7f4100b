"""Passes keep the in-place writes whose results nobody reads (analysis.remove_dead_code).

FX's ``Graph.eliminate_dead_code`` calls every ``call_method`` pure. A pass that rewired a
graph and then ran it dropped ``key[..., :16].copy_(k_nope)`` (Hugging Face's latent attention,
DeepSeek-V2/V3 and MiniCPM3: the key then read uninitialised memory) and
``out.index_add_(0, idx, y)`` (gpt-oss's and Llama 4's experts: their weights got no gradient).
The two models below are those constructs at their smallest, each beside a pair of linears
that share an input, so group_linears rewrites the graph and cleans up after itself. A pass
also keeps what the captured graph itself leaves unused (Hugging Face's Mamba captures parts
of ``torch.vmap`` regions: removing them broke functorch's nesting), and group_linears leaves
alone a member whose output is written in place (a view of a split cannot be: Gemma 3n).
``verify`` is off in these tests: they check the passes themselves, not the safety net.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from test_group_linears import check_parity, group_report

from boost_compile.analysis import mutates, remove_dead_code, unused_nodes


class LatentKey(nn.Module):
    """MLA's key: a down projection split into a latent and a rope part, written into
    a preallocated key with two slice copies (as transformers' DeepseekV3Attention does)."""

    def __init__(self, d: int = 32, latent: int = 12, rope: int = 4) -> None:
        super().__init__()
        self.q_a = nn.Linear(d, 16, bias=False)
        self.kv_a = nn.Linear(d, latent + rope, bias=False)
        self.kv_b = nn.Linear(latent, 8, bias=False)
        self.latent, self.rope = latent, rope

    def forward(self, x):
        q = self.q_a(x)
        nope, rot = torch.split(self.kv_a(x), [self.latent, self.rope], dim=-1)
        k_nope = self.kv_b(nope)
        key = k_nope.new_empty(*k_nope.shape[:-1], 8 + self.rope)
        key[..., :8].copy_(k_nope)
        key[..., 8:].copy_(rot)
        return q.sum(-1, keepdim=True) * key


class IndexAddExperts(nn.Module):
    """Routed experts with 3-D weights and biases, gathered by ``index_add_`` (gpt-oss)."""

    def __init__(self, d: int = 16, hidden: int = 24, experts: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, d, bias=False)
        self.w = nn.Parameter(torch.randn(experts, d, hidden) / d**0.5)
        self.b = nn.Parameter(torch.randn(experts, hidden) / 10)
        self.experts = experts

    def forward(self, x):
        h = torch.relu(self.gate(x)) * self.up(x)
        flat = h.reshape(-1, h.shape[-1])
        out = torch.zeros(flat.shape[0], self.w.shape[-1], dtype=h.dtype)
        route = torch.arange(flat.shape[0]) % self.experts
        for e in range(self.experts):
            idx = (route == e).nonzero().squeeze(-1)
            out.index_add_(0, idx, flat[idx] @ self.w[e] + self.b[e])
        return out


@pytest.mark.parametrize("model_cls,written", [(LatentKey, "Tensor.copy_"), (IndexAddExperts, "Tensor.index_add_")])
def test_grouped_graph_keeps_unread_inplace_writes(model_cls, written):
    torch.manual_seed(0)
    model = model_cls()
    graph = check_parity(model, (torch.randn(2, 5, 32 if model_cls is LatentKey else 16),), verify=False)
    assert len(group_report(graph).rewritten) == 1
    # every in-place write of the captured graph is still in the rewritten one
    assert graph.stages[-1].op_counts.get(written) == graph.stages[0].op_counts.get(written) > 0


def test_mutates_and_remove_dead_code():
    graph = fx.Graph()
    x = graph.placeholder("x")
    buf = graph.call_method("new_zeros", (x, (4,)))
    graph.call_method("copy_", (graph.call_method("__getitem__", (buf, slice(0, 2))), x))
    graph.call_function(torch.ops.aten.add_.Tensor, (buf, x))
    graph.call_function(torch.add, (x, x))  # dead and pure
    graph.output(buf)
    nodes = {n.name: n for n in graph.nodes}
    assert mutates(nodes["copy_"]) and mutates(nodes["add__tensor"])
    assert not mutates(nodes["new_zeros"]) and not mutates(nodes["add"])
    assert remove_dead_code(graph)
    assert [n.name for n in graph.nodes] == ["x", "new_zeros", "getitem", "copy_", "add__tensor", "output"]


def test_what_the_captured_graph_leaves_unused_stays():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.neg, (x,))  # unused before the pass: kept
    keep = unused_nodes(graph)
    graph.call_function(torch.abs, (x,))  # made unused by "the pass": removed
    graph.output(x)
    assert remove_dead_code(graph, keep)
    assert [n.name for n in graph.nodes] == ["x", "neg", "output"]


class ScaledInPlace(nn.Module):
    """Two linears on one input; one output scaled in place through a view (Gemma 3n's
    ``per_layer_projection *= scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 12)
        self.b = nn.Linear(8, 12)

    def forward(self, x):
        y = self.a(x).reshape(*x.shape[:-1], 3, 4)
        y *= 0.5
        return y.flatten(-2) * self.b(x)


def test_a_member_written_in_place_is_not_grouped():
    torch.manual_seed(0)
    graph = check_parity(ScaledInPlace(), (torch.randn(2, 5, 8),), verify=False)
    report = group_report(graph)
    assert not report.rewritten
    ((site, why),) = report.skipped
    assert site == "a+b" and why.startswith("a: its output is written in place (operator.imul at ")


def test_hugging_face_mamba_is_exact_with_grouping_on():
    """Its graph holds unused vmap bookkeeping that a pass must not remove (verify off)."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=1,
                                         expand=2, conv_kernel=4, time_step_rank=4))
    tokens = torch.randint(0, 128, (2, 8))
    check_parity(model, (tokens,), verify=False, loss_fn=lambda out: out.logits.float().logsumexp(-1).mean())


class _ScatterBackward(torch.autograd.Function):
    """A backward that adds into its gradient in place, its result unread (PhiMoE's router)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad * 2
        out.scatter_add_(-1, index, grad)
        return out, None


class FunctionWithInplaceBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        index = torch.zeros(*x.shape[:-1], 4, dtype=torch.long)
        return _ScatterBackward.apply(self.a(x), index) * self.b(x)


def test_a_pass_leaves_the_bodies_of_autograd_functions_alone():
    """FX's dead-code removal recursed into the backward body and dropped its scatter_add_."""
    torch.manual_seed(0)
    graph = check_parity(FunctionWithInplaceBackward(), (torch.randn(2, 3, 8),), verify=False)
    assert len(group_report(graph).rewritten) == 1
