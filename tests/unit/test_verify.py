"""``verify``: every rewrite checked against the graph it replaced (boost_compile/verify.py).

A planted wrong rewrite (a pass after group_linears that swaps two outputs of a grouped GEMM)
is named with its first differing node and dropped, and the compile returns eager's numbers;
strict mode raises. A correct compile is reported verified, stage by stage.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import check_against_eager, upcast

import boost_compile.backend as backend
from boost_compile.analysis.fx_utils import SPLIT_TARGETS
from boost_compile.backend import Recorder, compile_graph
from boost_compile.config import BoostConfig
from boost_compile.explain import explain
from boost_compile.models import Llama, LlamaConfig
from boost_compile.pass_manager import GraphPass, PassContext, PassReport
from boost_compile.passes import graph_passes
from boost_compile.verify import VerifyError, VerifyWarning

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


class SwapGroupedOutputs(GraphPass):
    """Wrong on purpose: the first grouped GEMM's split hands member 0 the output of member 1."""

    name = "swap_grouped_outputs"

    def run(self, ctx: PassContext) -> PassReport:
        report = PassReport(self.name)
        for node in ctx.gm.graph.nodes:
            if node.op == "call_function" and node.target in SPLIT_TARGETS and node.args[1] == [16, 16]:
                first, second = sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])[:2]
                first.args, second.args = (node, 1), (node, 0)
                report.found.append(node.name)
                report.rewritten.append(node.name)
                break
        return report


class TwoHeads(nn.Module):
    """Two linears on one input (grouped into one GEMM) with outputs of the same width."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.a(x)) * torch.sigmoid(self.b(x)))


@pytest.fixture
def planted(monkeypatch):
    def with_planted(config):
        passes = graph_passes(config)
        at = [p.name for p in passes].index("group_linears") + 1
        return [*passes[:at], SwapGroupedOutputs(config), *passes[at:]]

    monkeypatch.setattr(backend, "graph_passes", with_planted)


def compile_recorded(model, **options):
    rec = Recorder(keep_partitions=False)
    config = BoostConfig.from_options({"inner": "aot_eager", "verify": True} | options)
    fn = torch.compile(model, backend=lambda gm, ex: compile_graph(gm, ex, config, rec), fullgraph=True)
    return fn, rec


def test_planted_swap_is_named_dropped_and_eager_numbers_kept(planted):
    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(3, 8, requires_grad=True)
    records = []

    def compile_fn(m):
        fn, rec = compile_recorded(m)
        records.append(rec)
        return fn

    with pytest.warns(VerifyWarning, match=r"swap_grouped_outputs changed what graph .* computes: .*"
                      r"first node whose value differs: relu"):
        check_against_eager(model, compile_fn, lambda m, x: upcast(m(*x)).pow(2).sum(), (x,), "planted swap")
    (graph,) = records[0].graphs
    by_stage = {c.stage: c.status for c in graph.verify.checks}
    assert by_stage["group_linears"] == "verified"
    assert by_stage["swap_grouped_outputs"] == "dropped"
    assert by_stage["compiled (aot_eager)"] == "verified"
    (swap,) = [r for r in graph.reports if r.name == "swap_grouped_outputs"]
    assert swap.dropped and "DROPPED by verify" in swap.line()
    # grouping itself survived: one GEMM for a and b in the graph that runs
    assert graph.stages[-1].op_counts["linear"] == 2


def test_strict_raises_on_the_planted_swap(planted):
    fn, _ = compile_recorded(TwoHeads(), strict=True)
    with pytest.raises(Exception, match="swap_grouped_outputs changed what graph") as info:
        fn(torch.randn(3, 8))
    assert isinstance(info.value, VerifyError) or "VerifyError" in str(info.value)  # Dynamo wraps a backend's error


def test_a_correct_compile_is_verified_stage_by_stage():
    torch.manual_seed(0)
    report = explain(Llama(LlamaConfig.preset("tiny")), TOKENS, TOKENS, options={"inner": "aot_eager", "verify": True})
    (graph,) = report.graphs
    assert graph.verify.unavailable is None
    statuses = {c.stage: c.status for c in graph.verify.checks}
    assert statuses == {"group_linears": "verified", "compiled (aot_eager)": "verified"}, statuses
    text = report.markdown()
    assert "### Verify" in text and "group_linears: verified" in text
    assert report.to_dict()["graphs"][0]["verify"]["checks"][0]["stage"] == "group_linears"


def test_verify_leaves_the_callers_random_state_alone():
    """The reference and the checks draw dropout masks from a generator state of their own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    state = torch.get_rng_state()
    fn, rec = compile_recorded(model)
    verified = fn(x)
    after_verified = torch.get_rng_state()
    torch._dynamo.reset()
    torch.set_rng_state(state)
    plain = torch.compile(model, backend="boost", options={"inner": "aot_eager"})(x)
    assert torch.equal(after_verified, torch.get_rng_state())
    assert torch.equal(verified, plain)  # the same mask as a compile without verify
    assert [(c.stage, c.status) for c in rec.graphs[0].verify.checks] == [("compiled (aot_eager)", "verified")]


def test_verify_true_is_a_switch():
    assert BoostConfig.from_options({"verify": True}).verify.enabled
    assert not BoostConfig.from_options({"group": False}).group.enabled


def test_dynamic_shapes_are_verified_at_their_sizes():
    """A dynamic-shape graph takes its sizes as symbolic ints: verify runs it at their values."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny"))
    rec = Recorder(keep_partitions=False)
    config = BoostConfig.from_options({"inner": "aot_eager", "verify": True})
    fn = torch.compile(model, backend=lambda gm, ex: compile_graph(gm, ex, config, rec), dynamic=True)
    fn(TOKENS, TOKENS).backward()
    dynamic = [g for g in rec.graphs if any(isinstance(x, torch.SymInt) for x in g.view.example_inputs)]
    assert dynamic
    for graph in dynamic:
        assert graph.verify.checks and all(c.status == "verified" for c in graph.verify.checks), graph.verify.lines()


def test_compile_time_factorize_is_reported_and_later_passes_compared_with_its_graph():
    """factorize approximates by design: not dropped; group_linears is judged against its graph."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny-dense")).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", VerifyWarning)
        report = explain(model, TOKENS, options={"inner": "aot_eager", "verify": True, "factorize": {"rank": 4}})
    statuses = [(c.stage, c.status) for c in report.graphs[0].verify.checks]
    assert statuses == [("factorize", "unverified"), ("group_linears", "verified"), ("compiled (aot_eager)", "verified")]


def test_a_graph_past_max_gib_is_reported_not_verified():
    fn, rec = compile_recorded(TwoHeads(), verify={"max_gib": 1e-9})
    fn(torch.randn(3, 8))
    assert "over verify.max_gib=1e-09" in rec.graphs[0].verify.unavailable


def test_verify_is_on_by_default_and_false_turns_it_off():
    assert BoostConfig().verify.enabled
    assert not BoostConfig.from_options({"verify": False}).verify.enabled


def test_the_runs_inputs_keep_the_example_inputs_strides():
    """An Inductor graph asserts its inputs' strides: a slice of a wider tensor must stay one."""
    from boost_compile.verify import Inputs

    wide = torch.randn(4, 16)
    sliced, broadcast = wide[:, :8], torch.randn(1, 8).expand(4, 8)
    gm = torch.fx.symbolic_trace(lambda a, b: a + b)
    for fp64 in (False, True):
        (a, b), _ = Inputs(gm, [sliced, broadcast]).fresh(fp64)
        assert a.stride() == sliced.stride() and torch.equal(a.float(), sliced)
        assert torch.equal(b.float(), broadcast)  # a broadcast view is copied whole


class FXDeadCode(GraphPass):
    """Wrong on purpose: FX's own dead-code removal, which also cleans autograd.Function bodies
    and drops the in-place write of a backward (what PhiMoE lost)."""

    name = "fx_dead_code"

    def run(self, ctx: PassContext) -> PassReport:
        report = PassReport(self.name)
        if ctx.gm.graph.eliminate_dead_code():
            report.found.append("graph")
            report.rewritten.append("graph")
        return report


def test_a_pass_that_edits_a_function_body_is_dropped_and_the_reference_kept(monkeypatch):
    """The reference and the fallbacks own their copies of higher-order ops' bodies."""
    from test_dead_code import FunctionWithInplaceBackward

    monkeypatch.setattr(backend, "graph_passes", lambda config: [*graph_passes(config), FXDeadCode(config)])
    torch.manual_seed(0)
    records = []

    def compile_fn(m):
        fn, rec = compile_recorded(m)
        records.append(rec)
        return fn

    with pytest.warns(VerifyWarning, match="fx_dead_code changed what graph"):
        check_against_eager(FunctionWithInplaceBackward(), compile_fn, lambda m, x: upcast(m(*x)).pow(2).sum(),
                            (torch.randn(2, 3, 8),), "FX dead code planted")
    assert [c.status for c in records[0].graphs[0].verify.checks][-2:] == ["dropped", "verified"]


def test_the_callers_saved_tensor_hooks_see_the_step_not_verify():
    """A memory census through saved-tensor hooks counts the same first step with verify on or off."""
    counts = []
    for verify in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        fn, _ = compile_recorded(TwoHeads(), verify=verify)
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, p=packed: p.append(t.numel()) or t, lambda t: t):
            fn(torch.randn(3, 8)).sum().backward()
        counts.append(sum(packed))
    assert counts[0] == counts[1] > 0


def test_the_float64_copy_widens_float_casts_too():
    from boost_compile.verify import float64_graph

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x):
        return x.float().pow(2).mean(-1) + x.to(torch.float32).sum()

    torch.compile(f, backend=keep)(torch.randn(3, 4))
    wide = float64_graph(graphs[0])
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (out,) = wide(x)
    assert out.dtype == torch.float64
    assert torch.equal(out, x.pow(2).mean(-1) + x.sum())  # the same float64 ops, no fp32 rounding
    assert [n.target for n in wide.graph.nodes if n.op == "call_method"].count("float") == 0


def test_the_verifier_lets_go_of_its_runs_after_the_first_call(monkeypatch):
    """After the first call's checks the verifier drops its reference runs, inputs and graphs: they
    hold every output and gradient of the graph twice (once in float64), and the verifier may live
    on in a reference cycle until the collector runs (a 350M Llama block's: 148 MiB of a rank's peak)."""
    seen = []
    checked = backend.CheckedOnFirstCall._checked

    def spy(self, verifier):
        seen.append(verifier)
        assert verifier.truth is not None and verifier.eager is not None  # what the checks compare with
        return checked(self, verifier)

    monkeypatch.setattr(backend.CheckedOnFirstCall, "_checked", spy)
    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.randn(4, 8)
    compiled = torch.compile(model, backend="boost", options={"inner": "aot_eager", "verify": True})
    compiled(x).sum().backward()
    (verifier,) = seen
    assert verifier.report.checks and all(c.status == "verified" for c in verifier.report.checks)
    assert (verifier.eager, verifier.truth, verifier.inputs, verifier.captured) == (None, None, None, None)
    assert not verifier.available  # nothing can be checked against a released reference


def test_the_float64_copy_runs_a_grouped_gemm_as_a_loop():
    """torch's grouped GEMM has no float64 kernel: in the float64 copy it is the loop of matmuls, so a
    bf16 MoE graph (transformers' experts trace it) keeps its float64 reference."""
    from boost_compile import _torch_compat as compat
    from boost_compile.verify import float64_graph

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    offs = torch.tensor([2, 2, 7, 9], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 8, generator=gen), torch.randn(4, 8, 16, generator=gen)
    torch.compile(lambda a, b, o: compat.grouped_mm(a, b, o), backend=keep, fullgraph=True)(
        x.bfloat16(), w.bfloat16(), offs)
    wide = float64_graph(graphs[0])
    (out,) = wide(x.double(), w.double(), offs)
    want = torch.cat([x[:2].double() @ w[0].double(), x[2:7].double() @ w[2].double(), x[7:].double() @ w[3].double()])
    assert out.dtype == torch.float64 and torch.equal(out, want)
