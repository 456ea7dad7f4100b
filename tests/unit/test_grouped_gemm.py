"""The experts' grouped GEMM (``boost_compile.models.grouped_gemm``): each row times its expert's
matrix, forward and both gradients, against the products written out per expert, in float64,
float32 and bfloat16, an expert without rows and dropped rows (past the last offset) included;
eager and compiled (the custom op ``boost::grouped_mm`` in one graph); the op passes
torch.library's own checks."""

from __future__ import annotations

import pytest
import torch

from boost_compile.models.grouped_gemm import grouped_mm

#: 4 experts: 2 rows, none, 5 rows, 3 rows; then 2 rows no expert took (dropped)
OFFSETS = torch.tensor([2, 2, 7, 10], dtype=torch.int32)
ROWS, D_IN, D_OUT = 12, 8, 16


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, D_IN, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(4, D_IN, D_OUT, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    return x, w


def written_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each expert's rows times its matrix, the dropped rows zero (float64)."""
    x, w = x.double(), w.double()
    parts = [x[0:2] @ w[0], x[7:7] @ w[1], x[2:7] @ w[2], x[7:10] @ w[3], torch.zeros(2, D_OUT, dtype=torch.float64)]
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_rows_times_their_experts_matrix_and_both_gradients(dtype, compiled):
    x, w = inputs(dtype)
    fn = torch.compile(grouped_mm, fullgraph=True, backend="aot_eager") if compiled else grouped_mm
    out = fn(x, w, OFFSETS)
    upstream = torch.randn(ROWS, D_OUT, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.double() * upstream).sum().backward()
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    want = written_out(x64, w64)
    (want * upstream).sum().backward()
    tol = {torch.float64: {}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 5e-2, "rtol": 2e-2}}[dtype]
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(w.grad.double(), w64.grad, **tol)
    assert torch.all(out[10:] == 0) and torch.all(w.grad[1] == 0)  # the dropped rows; the expert with none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiles_as_one_graph_through_the_custom_op(dtype):
    graphs = []

    def backend(gm, _inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    x, w = inputs(dtype)
    torch.compile(grouped_mm, fullgraph=True, backend=backend)(x, w, OFFSETS)
    assert len(graphs) == 1 and torch.ops.boost.grouped_mm.default in graphs[0]


def test_the_custom_op_passes_torch_library_checks():
    x, w = inputs(torch.float32)
    torch.library.opcheck(torch.ops.boost.grouped_mm.default, (x.detach().requires_grad_(), w, OFFSETS))
