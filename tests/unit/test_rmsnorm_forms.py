"""Every way of writing an RMSNorm is one site, matched by value (analysis/norm_match.py).

One tiny module per spelling: a norm with a weight, then an ``nn.Linear``
(d = 32). The analysis must find exactly one site with the right form, weight,
eps and offset, whose ``nodes`` are every node the site replaces; look-alikes
that are not RMSNorms must not match. Then each form goes through the backend
with the rmsnorm pass forced on CPU: the pass rewrites the site and the loss and
every gradient (the input's too) follow the parity rule against eager and float64
(conftest.assert_parity).
"""

from __future__ import annotations

import functools

import networkx as nx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import check_against_eager, check_recorded_compile, upcast

from boost_compile.analysis import capture_views
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig

D = 32
ON_CPU = {"inner": "aot_eager", "rmsnorm": {"devices": ["cpu"]}}


# ----------------------------------------------------------------------------- the forms


class _Norm(nn.Module):
    """A weight over the last dim and an eps; subclasses spell the norm out."""

    eps = 1e-6

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(D))


class TwiceCast(_Norm):
    """The input cast to fp32 twice: two graph nodes, one value."""

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + self.eps)).type_as(x) * self.weight


class TwiceCastSpelledDifferently(_Norm):
    eps = 1e-5

    def forward(self, x):
        v = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return (x.type(torch.float32) * torch.rsqrt(v + self.eps)).type_as(x) * self.weight


class MulSelf(_Norm):
    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


class PowOperator(_Norm):
    eps = 1e-5

    def forward(self, x):
        return x * torch.rsqrt((x**2).mean(-1, keepdim=True) + self.eps) * self.weight


class Square(_Norm):
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(torch.square(x).mean(-1, keepdim=True) + self.eps))


class SumOverD(_Norm):
    def forward(self, x):
        return (
            x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / x.shape[-1] + self.eps) * self.weight
        )


class SumTimesInverseD(_Norm):
    eps = 1e-5

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) * (1.0 / D) + self.eps) * self.weight


class TorchMeanKeywords(_Norm):
    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x.pow(2), dim=-1, keepdim=True) + self.eps) * self.weight


class DimAsList(_Norm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean([-1], keepdim=True) + self.eps) * self.weight


class DimAsLastIndex(_Norm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(x.dim() - 1, keepdim=True) + self.eps) * self.weight


class OneOverSqrt(_Norm):
    def forward(self, x):
        return x * (1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * self.weight


class SqrtReciprocal(_Norm):
    eps = 1e-5

    def forward(self, x):
        return x * torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps).reciprocal() * self.weight


class DivideBySqrt(_Norm):
    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class EpsFirst(_Norm):
    def forward(self, x):
        return x * torch.rsqrt(self.eps + x.pow(2).mean(-1, keepdim=True)) * self.weight


class MetaLlama(_Norm):
    """Meta's original Llama: normalise in fp32, cast back, then the weight."""

    eps = 1e-5

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class HuggingFaceLlama(_Norm):
    """Hugging Face's Llama: fp32 upcast, cast back to the input dtype, weight first."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)


class Gemma(_Norm):
    """Gemma: the weight enters as ``1 + w``, in fp32, and the cast back comes last."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(D))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Fused(nn.RMSNorm):
    eps_value = 1e-5

    def __init__(self) -> None:
        super().__init__(D, eps=self.eps_value)
        nn.init.normal_(self.weight, 1.0, 0.1)


class FusedFunctional(_Norm):
    def forward(self, x):
        return F.rms_norm(x, (D,), self.weight, self.eps)


class SharedCast(_Norm):
    """Twice-cast form whose second ``x.float()`` is also read outside the norm."""

    def forward(self, x):
        h = x.float()
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (h * torch.rsqrt(v + self.eps)).type_as(x) * self.weight, h


#: name -> (norm class, form, weight offset, upcast)
FORMS = {
    "twice_cast": (TwiceCast, "hf_upcast", 0.0, True),
    "twice_cast_to_type": (TwiceCastSpelledDifferently, "hf_upcast", 0.0, True),
    "mul_self": (MulSelf, "decomposed", 0.0, False),
    "pow_operator": (PowOperator, "decomposed", 0.0, False),
    "square": (Square, "decomposed", 0.0, False),
    "sum_over_d": (SumOverD, "decomposed", 0.0, False),
    "sum_times_inverse_d": (SumTimesInverseD, "decomposed", 0.0, False),
    "torch_mean_keywords": (TorchMeanKeywords, "decomposed", 0.0, False),
    "dim_as_list": (DimAsList, "decomposed", 0.0, False),
    "dim_as_last_index": (DimAsLastIndex, "decomposed", 0.0, False),
    "one_over_sqrt": (OneOverSqrt, "decomposed", 0.0, False),
    "sqrt_reciprocal": (SqrtReciprocal, "decomposed", 0.0, False),
    "divide_by_sqrt": (DivideBySqrt, "decomposed", 0.0, False),
    "eps_first": (EpsFirst, "decomposed", 0.0, False),
    "meta_llama": (MetaLlama, "hf_upcast", 0.0, True),
    "hugging_face_llama": (HuggingFaceLlama, "hf_upcast", 0.0, True),
    "gemma": (Gemma, "one_plus_w", 1.0, True),
    "shared_cast": (SharedCast, "hf_upcast", 0.0, True),
    "fused": (Fused, "fused", 0.0, False),
    "fused_functional": (FusedFunctional, "fused", 0.0, False),
}
UPCAST_FORMS = [name for name, (_, _, _, upcast) in FORMS.items() if upcast]
CASES = [pytest.param(name, torch.float32, id=name) for name in FORMS] + [
    pytest.param(name, torch.bfloat16, id=f"{name}-bf16") for name in UPCAST_FORMS + ["fused"]
]


class Block(nn.Module):
    """The norm, then a linear (plus whatever else the norm hands back)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        out = self.norm(x)
        if isinstance(out, tuple):
            out, extra = out
            return self.proj(out) + extra.to(out.dtype)
        return self.proj(out)


def make_block(name: str, dtype: torch.dtype = torch.float32) -> Block:
    torch.manual_seed(0)
    return Block(FORMS[name][0]()).to(dtype)


def eps_of(norm: nn.Module) -> float:
    return norm.eps_value if isinstance(norm, Fused) else norm.eps


# ----------------------------------------------------------------------------- analysis


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_form_is_one_site(name, dtype):
    _, form, offset, upcast = FORMS[name]
    model = make_block(name, dtype)
    (view,) = capture_views(model, torch.randn(2, 3, D, dtype=dtype))
    (site,) = view.rmsnorms
    assert site.form == form
    assert site.param_name == "norm.weight" and view.param_names[site.weight] == "norm.weight"
    assert site.eps == pytest.approx(eps_of(model.norm), rel=1e-12)
    assert site.weight_offset == offset
    assert site.upcast == upcast
    (x,) = [p for p in view.placeholders if not view.is_param(p)]
    assert site.input is x
    (linear,) = view.linears
    assert linear.input is site.output
    if form == "fused":
        assert site.nodes == [site.output]
        return
    # nodes: every node the site replaces, and only those (each dies with the output)
    assert (
        site.output in site.nodes and site.input not in site.nodes and site.weight not in site.nodes
    )
    for node in site.nodes:
        assert node is site.output or set(node.users) <= set(site.nodes), node
    if name == "shared_cast":  # h = x.float() is read after the norm: not the site's
        casts = [n for n in view.graph.nodes if n.op == "call_method" and n.target == "float"]
        assert len(casts) == 2 and sum(n in site.nodes for n in casts) == 1
    else:  # the whole computation from x and w to the output
        region = nx.ancestors(view.nx, site.output) - set(view.placeholders)
        assert set(site.nodes) == region | {site.output}


class OtherInput(nn.Module):
    def forward(self, x, y):  # statistic of y, applied to x
        return x * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


class ShiftedInput(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt((x + 1).pow(2).mean(-1, keepdim=True) + 1e-6)


class MeanOverDim0(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)


class NoKeepdim(nn.Module):
    def forward(self, x):  # [d, d]: broadcasts over the wrong axis, still runs
        return x * torch.rsqrt(x.pow(2).mean(-1) + 1e-6)


class WrongDivisor(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / (D // 2) + 1e-6)


class Cubed(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6)


class TwoOverSqrt(nn.Module):
    def forward(self, x):
        return x * (2 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class OtherDtypeCasts(nn.Module):
    def forward(self, x):  # x.float() in the statistic, x.double() in the product
        v = x.float().pow(2).mean(-1, keepdim=True)
        return x.double() * torch.rsqrt(v + 1e-6)


class DropoutTwice(nn.Module):
    def forward(self, x):  # two dropouts of x are two different values
        v = F.dropout(x, 0.5, training=True).pow(2).mean(-1, keepdim=True)
        return F.dropout(x, 0.5, training=True) * torch.rsqrt(v + 1e-6)


@pytest.mark.parametrize(
    ("module", "inputs"),
    [
        (OtherInput(), (torch.randn(4, D), torch.randn(4, D))),
        (ShiftedInput(), (torch.randn(4, D),)),
        (MeanOverDim0(), (torch.randn(4, D),)),
        (NoKeepdim(), (torch.randn(D, D),)),
        (WrongDivisor(), (torch.randn(4, D),)),
        (Cubed(), (torch.randn(4, D),)),
        (TwoOverSqrt(), (torch.randn(4, D),)),
        (OtherDtypeCasts(), (torch.randn(4, D, dtype=torch.bfloat16),)),
        (DropoutTwice(), (torch.randn(4, D),)),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_look_alike_is_not_a_site(module, inputs):
    (view,) = capture_views(module, *inputs)
    assert view.rmsnorms == []


# ----------------------------------------------------------------------------- the pass


def compile_recorded(model: nn.Module):
    rec = Recorder()
    config = BoostConfig.from_options(ON_CPU)
    backend = functools.partial(compile_graph, config=config, recorder=rec)
    return torch.compile(model, backend=backend, fullgraph=True), rec


def check_parity(model: nn.Module, compile_fn, x: torch.Tensor):
    """The parity rule (conftest) on the loss, the parameters' and the input's gradients."""
    check_against_eager(model, compile_fn, lambda m, x: upcast(m(x)).pow(2).mean(), x.requires_grad_())


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_form_is_rewritten_with_parity(name, dtype):
    _, form, offset, _ = FORMS[name]
    model = make_block(name, dtype)
    x = torch.randn(2, 3, D, dtype=dtype).requires_grad_()
    graph = check_recorded_compile(model, compile_recorded, lambda y: upcast(y).pow(2).mean(), (x,))
    (report,) = [r for r in graph.reports if r.name == "rmsnorm"]
    assert report.found == report.rewritten == ["norm"] and not report.skipped
    assert report.details["norm"]["form"] == form and report.details["norm"]["offset"] == offset
    assert report.details["norm"]["eps"] == pytest.approx(eps_of(model.norm), rel=1e-12)
    # the decomposed chain is gone: one fused norm and nothing of the old statistic
    (forward,) = [
        r for r in graph.aten_reports if r.name == "op_census" and r.details["graph"] == "forward"
    ]
    counts = forward.details["op_counts"]
    assert counts.get("boost.rms_norm") == 1
    assert not any(
        op in counts for op in ("aten.rsqrt", "aten.sqrt", "aten.mean", "aten.sum", "aten.pow")
    )


def test_registered_backend_name():
    """``backend="boost"`` with ``options=`` runs the same pipeline (the twice-cast form)."""
    check_parity(make_block("twice_cast"), lambda m: torch.compile(m, backend="boost", options=ON_CPU),
                 torch.randn(2, 3, D))
