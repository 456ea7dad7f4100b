"""tp_overlap on a hand-built backward-like graph: the collective moves up to its input, its wait
down to its first user, nothing else changes order (the two-process parity runs are in test_tp.py)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from boost_compile.config import BoostConfig
from boost_compile.passes.tp_overlap import TPOverlapPass

funcol = torch.ops._c10d_functional


def backward_like() -> fx.Graph:
    """dx = g @ w; [unrelated work]; ar = all_reduce(dx); y = wait(ar); dw = g.t() @ x; out = y * 2."""
    g = fx.Graph()
    grad, x, w = g.placeholder("tangents_1"), g.placeholder("x"), g.placeholder("w")
    dx = g.call_function(torch.ops.aten.mm.default, (grad, w))
    other = g.call_function(torch.ops.aten.relu.default, (x,))
    ar = g.call_function(funcol.all_reduce.default, (dx, "sum", "0"))
    y = g.call_function(funcol.wait_tensor.default, (ar,))
    gt = g.call_function(torch.ops.aten.t.default, (grad,))
    dw = g.call_function(torch.ops.aten.mm.default, (gt, x))
    out = g.call_function(operator.mul, (y, 2))
    g.output((out, dw, other))
    return g


def names(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes if n.op == "call_function"]


def test_collective_raised_and_wait_sunk():
    graph = backward_like()
    before = names(graph)
    report = TPOverlapPass(BoostConfig.from_options({"tp": {"overlap": True}}))(graph)
    after = names(graph)
    assert sorted(after) == sorted(before)
    # issued right after the GEMM that makes its input (the unrelated relu moved after it),
    # waited for right before its only user: relu, t and the weight-gradient GEMM run in between
    assert after == ["mm_default", "all_reduce_default", "relu_default", "t_default", "mm_default_1", "wait_tensor_default", "mul"]
    assert (report.details["delayed"], report.details["sunk"], report.details["ops_between"]) == (1, 1, 3)


def test_an_op_whose_user_cannot_move_stays():
    # relu's user is an in-place copy (impure): neither may move past the collective
    graph = backward_like()
    relu = next(n for n in graph.nodes if n.name == "relu_default")
    with graph.inserting_after(relu):
        graph.call_function(torch.ops.aten.copy_.default, (next(iter(graph.nodes)), relu))
    TPOverlapPass(BoostConfig.from_options({"tp": {"overlap": True}}))(graph)
    after = names(graph)
    assert after.index("relu_default") < after.index("copy__default") < after.index("all_reduce_default")


def test_off_by_default():
    assert not TPOverlapPass(BoostConfig()).enabled()
    assert TPOverlapPass(BoostConfig.from_options({"tp": {"overlap": True}})).enabled()
