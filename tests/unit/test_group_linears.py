"""The group_linears pass: structure (how many GEMMs before/after) and parity.

Parity: loss/outputs and every parameter gradient follow the suite's parity rule
against eager and float64 (conftest.assert_parity).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import check_recorded_compile, tiny_hf_llama, upcast

from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.models import Llama, LlamaConfig
from boost_compile.pass_manager import StrictPassError

RTOL = 1e-5
GEMMS = ("linear", "matmul", "mm", "addmm")


def compile_recorded(model: nn.Module, inner: str = "aot_eager", **options):
    rec = Recorder(keep_partitions=False)  # the compile caches' keys of an unrecorded compile
    config = BoostConfig.from_options({"inner": inner, **options})
    backend = functools.partial(compile_graph, config=config, recorder=rec)
    return torch.compile(model, backend=backend, fullgraph=True), rec


def group_report(graph):
    (report,) = [r for r in graph.reports if r.name == "group_linears"]
    return report


def gemm_count(op_counts: dict[str, int]) -> int:
    return sum(v for k, v in op_counts.items() if k in GEMMS)


def check_parity(model: nn.Module, inputs, inner: str = "aot_eager", loss_fn=None, **options):
    """The parity rule (conftest) for the compiled model; its one graph's record."""
    loss_fn = loss_fn or (lambda out: upcast(out).pow(2).mean() if isinstance(out, torch.Tensor)
                          else sum(upcast(o).pow(2).mean() for o in out))
    return check_recorded_compile(model, lambda m: compile_recorded(m, inner, **options), loss_fn, inputs)


@pytest.mark.parametrize(
    "preset,before,after",
    [("tiny", 14, 11), ("tiny-lowrank", 14, 11), ("tiny-dense", 7, 4)],
)
@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_reference_models(preset, before, after, inner):
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset(preset))
    tokens, targets = torch.randint(0, 256, (2, 2, 16))
    # (tokens, targets) as test_parity.py calls it: the same graph, one cold Inductor compile shared
    # through the FX graph cache
    graph = check_parity(model, (tokens, targets), inner, loss_fn=lambda loss: loss)
    report = group_report(graph)
    n = model.config.n_layers
    assert len(report.rewritten) == 2 * n and not report.skipped
    captured, grouped = graph.stages[0].op_counts, graph.stages[-1].op_counts
    head = 1
    assert gemm_count(captured) == before * n + head
    assert gemm_count(grouped) == after * n + head
    assert grouped["split"] == 2 * n


def test_hugging_face_llama():
    model = tiny_hf_llama()
    tokens = torch.randint(0, 256, (2, 16))
    graph = check_parity(model, (tokens,), loss_fn=lambda out: upcast(out.logits).logsumexp(-1).mean())
    report = group_report(graph)
    assert sorted(d["members"] for d in report.details.values()) == [2, 2, 3, 3]
    assert gemm_count(graph.stages[-1].op_counts) == 4 * 2 + 1


class Shapes(nn.Module):
    """Siblings with mixed bias, different widths, and ``x @ W`` members."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8, bias=False)
        self.b = nn.Linear(16, 12, bias=True)
        self.c = nn.Linear(16, 4, bias=False)
        self.U = nn.Parameter(torch.randn(16, 6))
        self.V = nn.Parameter(torch.randn(16, 10))

    def forward(self, x):
        return self.a(x), self.b(x), self.c(x), x @ self.U, torch.matmul(x, self.V)


@pytest.mark.parametrize("shape", [(5, 16), (2, 5, 16), (2, 3, 5, 16)])
def test_leading_dims_bias_and_matmul_members(shape):
    x = torch.randn(*shape)
    graph = check_parity(Shapes(), (x,))
    report = group_report(graph)
    assert sorted(d["members"] for d in report.details.values()) == [2, 3]
    assert gemm_count(graph.stages[-1].op_counts) == 2


def test_computed_bias_is_skipped_with_a_reason():
    class ComputedBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(8, 16))
            self.w2 = nn.Parameter(torch.randn(8, 16))
            self.b = nn.Parameter(torch.randn(8))

        def forward(self, x):
            return F.linear(x, self.w1, self.b * 2), F.linear(x, self.w2)

    graph = check_parity(ComputedBias(), (torch.randn(3, 16),))
    report = group_report(graph)
    assert report.rewritten == [] and "bias is computed in the graph" in report.skipped[0][1]
    with pytest.raises(Exception, match="strict: pass 'group_linears' skipped 1 site"):
        compiled, _ = compile_recorded(ComputedBias(), strict=True)
        compiled(torch.randn(3, 16))


def test_strict_when_nothing_to_group():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    compiled, _ = compile_recorded(model, strict=True)
    with pytest.raises(Exception, match="found no site") as info:
        compiled(torch.randn(2, 8))
    assert isinstance(info.value, StrictPassError) or "StrictPassError" in str(info.value)


def test_disabled():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny"))
    compiled, rec = compile_recorded(model, group={"enabled": False})
    compiled(torch.randint(0, 256, (1, 8)))
    assert all(r.name != "group_linears" for r in rec.graphs[0].reports)
    assert "split" not in rec.graphs[0].stages[-1].op_counts
