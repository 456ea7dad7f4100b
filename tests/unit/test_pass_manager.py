"""Pass manager: ordering, reports, strict mode, and the ATen pipeline's uuid."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.pass_manager import (
    AtenPipeline,
    GraphPass,
    PassContext,
    PassReport,
    StrictPassError,
    run_graph_passes,
)
from boost_compile.passes import aten_passes


class MulByTwoPass(GraphPass):
    """Test pass: rewrites every ``x * 2`` into ``x + x``; skips ``x * 3``."""

    name = "mul_by_two"

    def run(self, ctx: PassContext) -> PassReport:
        import operator

        report = PassReport(self.name)
        for node in list(ctx.gm.graph.nodes):
            if node.op == "call_function" and node.target is operator.mul and node.args[1] in (2, 3):
                report.found.append(node.name)
                if node.args[1] == 3:
                    report.skip(node.name, "factor 3 is not handled")
                    continue
                with ctx.gm.graph.inserting_before(node):
                    add = ctx.gm.graph.call_function(operator.add, (node.args[0], node.args[0]))
                node.replace_all_uses_with(add)
                ctx.gm.graph.erase_node(node)
                report.rewritten.append(node.name)
        return report


def capture(fn, *inputs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return graphs[0]


def test_pass_rewrites_and_reports():
    gm, inputs = capture(lambda x: (x * 2).sin(), torch.randn(4))
    ctx = PassContext(gm, inputs, BoostConfig())
    (report,) = run_graph_passes([MulByTwoPass(ctx.config)], ctx)
    assert len(report.found) == 1 and len(report.rewritten) == 1 and not report.skipped
    ops = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    assert "mul" not in ops and "add" in ops
    x = torch.randn(4)
    torch.testing.assert_close(gm(x)[0], (x * 2).sin())


def test_strict_raises_on_skip_and_on_nothing_found():
    gm, inputs = capture(lambda x: x * 3, torch.randn(4))
    relaxed = PassContext(gm, inputs, BoostConfig())
    (report,) = run_graph_passes([MulByTwoPass(relaxed.config)], relaxed)
    assert report.skipped == [(report.found[0], "factor 3 is not handled")]

    strict = BoostConfig(strict=True)
    gm, inputs = capture(lambda x: x * 3, torch.randn(4))
    with pytest.raises(StrictPassError, match="skipped 1 site"):
        run_graph_passes([MulByTwoPass(strict)], PassContext(gm, inputs, strict))
    gm, inputs = capture(lambda x: x.cos(), torch.randn(4))
    with pytest.raises(StrictPassError, match="found no site"):
        run_graph_passes([MulByTwoPass(strict)], PassContext(gm, inputs, strict))


def test_disabled_pass_does_not_run():
    class Off(MulByTwoPass):
        def enabled(self) -> bool:
            return False

    gm, inputs = capture(lambda x: x * 2, torch.randn(4))
    before = gm.code
    assert run_graph_passes([Off(BoostConfig())], PassContext(gm, inputs, BoostConfig())) == []
    assert gm.code == before


def test_uuid_follows_config():
    on = AtenPipeline(aten_passes(BoostConfig()))
    same = AtenPipeline(aten_passes(BoostConfig()))
    off = AtenPipeline(aten_passes(BoostConfig.from_options({"op_census": {"enabled": False}})))
    assert on.uuid() == same.uuid()
    assert on.uuid() != off.uuid()
    assert MulByTwoPass(BoostConfig()).uuid() == MulByTwoPass(BoostConfig(strict=True)).uuid()


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_op_census_sees_forward_and_backward(inner):
    model = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 2))
    rec = Recorder()
    backend = functools.partial(compile_graph, config=BoostConfig(inner=inner), recorder=rec)
    compiled = torch.compile(model, backend=backend)
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False):
        compiled(torch.randn(3, 8)).sum().backward()
    (graph,) = rec.graphs
    census = [r for r in graph.aten_reports if r.name == "op_census"]
    kinds = sorted(r.details["graph"] for r in census)
    assert kinds == ["backward", "forward"]
    fwd = next(r for r in census if r.details["graph"] == "forward").details["op_counts"]
    assert sum(v for k, v in fwd.items() if k in ("aten.addmm", "aten.mm")) == 2
