"""Norms are found by what they compute: LayerNorm sites, and norms without a weight.

Analysis (analysis/norm_match.py): ``F.layer_norm`` / ``nn.LayerNorm`` over the last dim
is a LayerNorm site with or without weight and bias; one over two dims is not. A
weightless ``F.rms_norm(x, (x.size(-1),))`` (modded-nanogpt) and a spelled-out one are
RMSNorm sites with no weight. The ``rmsnorm`` rewrite takes the weightless RMSNorms
(parity against eager under the suite's rule) and leaves LayerNorm to Inductor.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import check_recorded_compile

from boost_compile.analysis import capture_views
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig

D = 32
ON_CPU = {"inner": "aot_eager", "rmsnorm": {"devices": ["cpu"]}}


class WeightlessFused(nn.Module):
    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),))


class WeightlessSpelled(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    """A norm, then a linear."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(self.norm(x))


def _view(norm: nn.Module):
    torch.manual_seed(0)
    (view,) = capture_views(Block(norm), torch.randn(2, 3, D))
    return view


@pytest.mark.parametrize("norm", [WeightlessFused(), WeightlessSpelled()], ids=["fused", "spelled"])
def test_weightless_rmsnorm_is_a_site(norm):
    view = _view(norm)
    (site,) = view.rmsnorms
    assert site.weight is None and site.param_name is None
    assert view.layernorms == []
    (linear,) = view.linears
    assert linear.input is site.output


@pytest.mark.parametrize(("weight", "bias"), [(True, True), (True, False), (False, False)])
def test_layernorm_is_a_site(weight, bias):
    norm = nn.LayerNorm(D, elementwise_affine=weight, bias=bias)
    view = _view(norm)
    (site,) = view.layernorms
    assert view.rmsnorms == []
    assert site.eps == pytest.approx(1e-5)
    assert (site.param_name == "norm.weight") == weight and (site.weight is not None) == weight
    assert (site.bias_name == "norm.bias") == bias and (site.bias is not None) == bias
    assert site.name == ("norm" if weight else site.output.name)
    assert [s.output for s in view.norms] == [site.output]


def test_layernorm_over_two_dims_is_not_a_site():
    class TwoDims(nn.Module):
        def forward(self, x):
            return F.layer_norm(x, x.shape[-2:])

    assert _view(TwoDims()).layernorms == []


def _compile_recorded(model: nn.Module):
    rec = Recorder()
    backend = functools.partial(compile_graph, config=BoostConfig.from_options(ON_CPU), recorder=rec)
    return torch.compile(model, backend=backend, fullgraph=True), rec


@pytest.mark.parametrize("norm", [WeightlessFused, WeightlessSpelled], ids=["fused", "spelled"])
def test_rmsnorm_rewrite_takes_weightless_norms(norm):
    torch.manual_seed(0)
    model = Block(norm())
    x = torch.randn(2, 3, D).requires_grad_()
    graph = check_recorded_compile(model, _compile_recorded, lambda y: y.pow(2).mean(), (x,))
    (report,) = [r for r in graph.reports if r.name == "rmsnorm"]
    assert len(report.found) == len(report.rewritten) == 1 and not report.skipped
    (forward,) = [r for r in graph.aten_reports if r.name == "op_census" and r.details["graph"] == "forward"]
    assert forward.details["op_counts"].get("boost.rms_norm") == 1


def test_rmsnorm_rewrite_leaves_layernorm():
    torch.manual_seed(0)
    model = Block(nn.LayerNorm(D))
    x = torch.randn(2, 3, D).requires_grad_()
    graph = check_recorded_compile(model, _compile_recorded, lambda y: y.pow(2).mean(), (x,))
    (report,) = [r for r in graph.reports if r.name == "rmsnorm"]
    assert report.found == [] and report.rewritten == []
