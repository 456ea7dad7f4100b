"""The boost passes' structured-trace artifacts (boost_compile/trace.py), as tlparse shows them.

End to end: a child process compiles a tiny CoLA Llama with ``backend="boost"`` under
``TORCH_TRACE`` (it must be set before torch is imported), runs forward and backward, and
writes the reports its passes returned; ``tlparse`` turns the trace into its report, whose
boost artifacts must hold those same reports and the rewritten graphs. In this process: the
tensor-parallel ``boost_collectives`` artifact on a hand-built ATen graph with collectives
(no process group needed), and that without a trace no payload is ever built.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

from boost_compile import trace
from boost_compile.analysis import fx_utils
from boost_compile.config import BoostConfig
from boost_compile.pass_manager import AtenPipeline
from boost_compile.passes.collective_census import CollectiveCensusPass
from boost_compile.passes.op_census import OpCensusPass
from boost_compile.passes.tp_overlap import TPOverlapPass

N_LAYERS = 1
#: RMSNorm sites of the tiny Llama: two per block and the final norm
NORM_SITES = 2 * N_LAYERS + 1

#: The child: compile, forward + backward, and the reports the passes returned (as JSON).
CHILD = """
import json, sys
import torch
import boost_compile.backend as backend
from boost_compile.analysis.fx_utils import graph_kind
from boost_compile.models import Llama, LlamaConfig

inner, n_layers, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
reports = {"dynamo": [], "aten": []}
run_graph_passes = backend.run_graph_passes

def recording_graph_passes(*args, **kwargs):
    found = run_graph_passes(*args, **kwargs)
    reports["dynamo"] += [{"graph": "dynamo", **r.to_dict()} for r in found]
    return found

class RecordingPipeline(backend.AtenPipeline):
    def __call__(self, graph):
        start = len(self.sink)
        super().__call__(graph)
        reports["aten"] += [{"graph": graph_kind(graph), **r.to_dict()} for r in self.sink[start:]]

backend.run_graph_passes, backend.AtenPipeline = recording_graph_passes, RecordingPipeline
torch.manual_seed(0)
model = Llama(LlamaConfig.preset("tiny", n_layers=n_layers))
options = {"inner": inner, "rmsnorm": {"devices": ["cpu"]}}
compiled = torch.compile(model, backend="boost", options=options, fullgraph=True)
tokens = torch.randint(0, 256, (2, 16))
compiled(tokens, tokens).backward()
with open(out, "w") as f:
    json.dump(reports, f, default=str)
"""


def tlparse_binary() -> str:
    """tlparse next to this interpreter (the venv's), else on PATH; a dev dependency."""
    here = Path(sys.executable).parent / "tlparse"
    found = str(here) if here.exists() else shutil.which("tlparse")
    if found is None:
        pytest.fail("tlparse not found next to sys.executable nor on PATH: install the dev extras (pip install -e '.[dev]')")
    return found


def child_env(trace_dir: Path) -> dict[str, str]:
    """The child's environment: the trace on; Inductor's FX graph and AOT caches off, since a
    cache hit skips the post-grad passes (and so the ATen artifacts); kernels stay cached."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_COMPILE_DEBUG", "TORCH_LOGS")}
    env.update(
        TORCH_TRACE=str(trace_dir), OMP_NUM_THREADS="1", TORCHINDUCTOR_FX_GRAPH_CACHE="0",
        TORCHINDUCTOR_AUTOGRAD_CACHE="0", TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    return env


class Parsed:
    """tlparse's output for one trace: its index page and the boost artifacts of its compiles."""

    def __init__(self, out: Path, reports: dict[str, list[dict[str, Any]]]) -> None:
        self.out = out
        self.reports = reports
        self.index = (out / "index.html").read_text()
        directory = json.loads((out / "compile_directory.json").read_text())
        self.artifacts = sorted(
            (a for compile_ in directory.values() for a in compile_["artifacts"] if a["name"].startswith("boost_")),
            key=lambda a: a["number"],
        )

    @staticmethod
    def name(artifact: dict[str, Any]) -> str:
        """An artifact's name without tlparse's ``_<number>.<ext>`` tail."""
        return artifact["name"].rsplit("_", 1)[0]

    def names(self) -> list[str]:
        return [self.name(a) for a in self.artifacts]

    def text(self, name: str) -> list[str]:
        """The files of every artifact called ``name``, in order."""
        return [(self.out / a["url"]).read_text() for a in self.artifacts if self.name(a) == name]

    def report_payloads(self) -> list[dict[str, Any]]:
        """Every ``boost_<pass>_report``, parsed, in order."""
        return [json.loads((self.out / a["url"]).read_text()) for a in self.artifacts if self.name(a).endswith("_report")]


@pytest.fixture(scope="module", params=["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def parsed(request, tmp_path_factory) -> Parsed:
    """Compile in a child under TORCH_TRACE, then tlparse the trace (once per inner compiler)."""
    tmp = tmp_path_factory.mktemp(f"trace_{request.param}")
    trace_dir, out, reports = tmp / "trace", tmp / "tl_out", tmp / "reports.json"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, request.param, str(N_LAYERS), str(reports)],
        env=child_env(trace_dir), timeout=600, capture_output=True, text=True,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    (log,) = trace_dir.glob("*.log")  # one process, one log
    done = subprocess.run([tlparse_binary(), str(log), "--no-browser", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return Parsed(out, json.loads(reports.read_text()))


def test_every_pass_report_is_in_the_tlparse_report(parsed: Parsed) -> None:
    expected = parsed.reports["dynamo"] + parsed.reports["aten"]
    names = [f"boost_{r['name']}_report" for r in expected]
    assert [n for n in parsed.names() if n.endswith("_report")] == names
    # the payloads are the reports the passes returned, in order, each naming its graph
    assert parsed.report_payloads() == json.loads(json.dumps(expected))
    assert {r["graph"] for r in parsed.reports["aten"]} == {"forward", "backward"}
    # linked from the index page
    for a in parsed.artifacts:
        assert a["url"] in parsed.index, a["url"]


def test_rewrite_counts_match_the_passes(parsed: Parsed) -> None:
    by_name = {p["name"]: p for p in parsed.report_payloads() if p["graph"] == "dynamo"}
    assert len(by_name["rmsnorm"]["rewritten"]) == NORM_SITES
    assert len(by_name["group_linears"]["rewritten"]) == 2 * N_LAYERS  # q/k/v and gate/up down factors
    assert by_name["tp_localize"]["not_applicable"]  # not parallelized: says why


def test_graph_after_a_rewriting_pass(parsed: Parsed) -> None:
    (norm_graph,) = parsed.text("boost_rmsnorm_graph")
    assert norm_graph.startswith("# boost: the dynamo graph after rmsnorm")
    assert norm_graph.count("torch.ops.boost.rms_norm.default(") == NORM_SITES
    (grouped,) = parsed.text("boost_group_linears_graph")
    assert "torch.ops.boost.rms_norm" not in grouped  # the graph after group_linears, before rmsnorm
    assert "torch.cat(" in grouped
    # passes that changed nothing (not applicable; the read-only censuses) emit no graph
    graphs = {n for n in parsed.names() if n.endswith("_graph")}
    assert graphs == {"boost_group_linears_graph", "boost_rmsnorm_graph"}
    assert "boost_collectives" not in parsed.names()  # no collective without tensor parallelism


# --- in this process: a captured trace --------------------------------------------------


class _Artifacts(logging.Handler):
    """Collects the ``artifact`` entries trace_structured writes: (name, encoding, payload)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.entries: list[tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "metadata", {}).get("artifact")
        if meta is not None:
            self.entries.append((meta["name"], meta["encoding"], record.payload))

    def named(self, name: str) -> list[str]:
        return [payload for n, _, payload in self.entries if n == name]


@pytest.fixture
def captured(monkeypatch) -> Iterator[_Artifacts]:
    """A structured trace written to a list instead of TORCH_TRACE's file: the trace logger's
    only handler for the test (in place of torch's lazy handler; conftest already keeps
    pytest's capture handlers off this logger)."""
    logger = logging.getLogger(trace.TRACE_LOGGER)
    handler = _Artifacts()
    monkeypatch.setattr(logger, "handlers", [handler])
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.setLevel(level)
        logger.propagate = propagate


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """The trace logger as a process without TORCH_TRACE has it once torch's lazy handler has
    found no trace directory and removed itself: no handler at all. A context, not a fixture, so
    it holds for the test body alone, after every fixture and hook has run."""
    logger = logging.getLogger(trace.TRACE_LOGGER)
    handlers = logger.handlers
    logger.handlers = []
    try:
        yield
    finally:
        logger.handlers = handlers


def tp_backward_like() -> fx.Graph:
    """A backward-like TP graph: dx = g @ w, all_reduce(dx) and its wait, dw = g.t() @ x, and an
    all_gather; ``val`` metadata gives each collective's input its shape and dtype."""
    funcol = torch.ops._c10d_functional
    g = fx.Graph()
    grad, x, w = g.placeholder("tangents_1"), g.placeholder("x"), g.placeholder("w")
    dx = g.call_function(torch.ops.aten.mm.default, (grad, w))
    other = g.call_function(torch.ops.aten.relu.default, (x,))
    reduced = g.call_function(funcol.wait_tensor.default, (g.call_function(funcol.all_reduce.default, (dx, "sum", "0")),))
    gathered = g.call_function(funcol.wait_tensor.default, (g.call_function(funcol.all_gather_into_tensor.default, (x, 2, "0")),))
    dw = g.call_function(torch.ops.aten.mm.default, (g.call_function(torch.ops.aten.t.default, (grad,)), x))
    g.output((g.call_function(operator.mul, (reduced, 2)), dw, other, gathered))
    vals = {"tangents_1": torch.empty(4, 16), "x": torch.empty(4, 8, dtype=torch.bfloat16), "w": torch.empty(16, 8)}
    vals["mm_default"] = torch.empty(4, 8)
    for node in g.nodes:
        if node.name in vals:
            node.meta["val"] = vals[node.name]
    return g


def tp_pipeline(census: bool = True) -> AtenPipeline:
    """tp_overlap (it moves nodes), op_census and, with ``census``, collective_census."""
    config = BoostConfig.from_options({"tp": {"enabled": True, "overlap": True}})
    passes = [TPOverlapPass(config), OpCensusPass(config)] + ([CollectiveCensusPass(config)] if census else [])
    return AtenPipeline(passes)


def test_collectives_artifact_of_a_tp_graph(captured: _Artifacts) -> None:
    pipeline = tp_pipeline()
    pipeline(tp_backward_like())
    (payload,) = captured.named("boost_collectives")
    collectives = json.loads(payload)
    # all_reduce of the fp32 [4, 8] dx, all_gather of the bf16 [4, 8] x
    assert collectives["graph"] == "backward"
    assert collectives["count"] == 2
    assert collectives["by_kind"] == {"all_reduce": {"count": 1, "bytes": 128}, "all_gather_into_tensor": {"count": 1, "bytes": 64}}
    assert collectives["total_bytes"] == 192
    census = next(r for r in pipeline.sink if r.name == "collective_census")
    assert collectives["collectives"] == json.loads(json.dumps(census.details["collectives"]))
    # tp_overlap moved nodes: its graph is traced; the read-only censuses' are not
    (overlapped,) = captured.named("boost_tp_overlap_graph")
    assert overlapped.startswith("# boost: the backward graph after tp_overlap")
    assert not captured.named("boost_op_census_graph") and not captured.named("boost_collective_census_graph")
    reports = [json.loads(p) for n, _, p in captured.entries if n.endswith("_report")]
    assert [r["name"] for r in reports] == ["tp_overlap", "op_census", "collective_census"]
    assert all(r["graph"] == "backward" for r in reports)


def test_collectives_payload_totals() -> None:
    found = [{"kind": "all_reduce", "bytes": 10}, {"kind": "all_reduce", "bytes": 6}, {"kind": "reduce_scatter_tensor", "bytes": None}]
    payload = trace.collectives_payload("forward", found)
    assert payload["by_kind"] == {"all_reduce": {"count": 2, "bytes": 16}, "reduce_scatter_tensor": {"count": 1, "bytes": 0}}
    assert (payload["count"], payload["total_bytes"], payload["collectives"]) == (3, 16, found)


# --- without a trace: nothing built ------------------------------------------------------


def _compile_and_run(pipeline: AtenPipeline) -> None:
    """The Torch-IR passes (inner eager: one Dynamo graph) and the ATen pipeline on a TP graph."""
    from boost_compile.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", n_layers=N_LAYERS))
    options = {"inner": "eager", "rmsnorm": {"devices": ["cpu"]}}
    tokens = torch.randint(0, 256, (2, 16))
    torch.compile(model, backend="boost", options=options, fullgraph=True)(tokens, tokens)
    pipeline(tp_backward_like())


@pytest.fixture
def payload_spy(monkeypatch) -> list[str]:
    """Records every call that builds a payload or prints a graph for the trace."""
    calls: list[str] = []

    def spy(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    real_emit = trace.emit
    monkeypatch.setattr(trace, "emit", lambda name, enc, payload_fn: real_emit(name, enc, spy(name, payload_fn)))
    for name in ("render_module", "render_graph", "report_payload", "collectives_payload"):
        monkeypatch.setattr(trace, name, spy(name, getattr(trace, name)))
    # the scan for collectives (the runs below leave out the census pass, its own user)
    monkeypatch.setattr(fx_utils, "collectives_of", spy("collectives_of", fx_utils.collectives_of))
    return calls


def test_no_trace_builds_no_payload(payload_spy: list[str]) -> None:
    with untraced():
        assert not trace.tracing()
        _compile_and_run(tp_pipeline(census=False))
    assert payload_spy == []


def test_a_trace_builds_the_payloads(payload_spy: list[str], captured: _Artifacts) -> None:
    """Control for the test above: the same run with a trace on builds them (so the spy sees them)."""
    torch._dynamo.reset()
    _compile_and_run(tp_pipeline(census=False))
    for name in ("render_module", "render_graph", "report_payload", "collectives_of", "collectives_payload", "boost_rmsnorm_report"):
        assert name in payload_spy, name
    assert len(captured.named("boost_rmsnorm_report")) == 1


def test_per_block_trace_shows_the_block_rewrite_once(captured: _Artifacts) -> None:
    """compile_blocks on four identical blocks: the trace holds one block graph's pass reports
    (the blocks share it), each rewrite of one block, not four."""
    from boost_compile import compile_blocks
    from boost_compile.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", n_layers=4))
    compile_blocks(model, {"inner": "aot_eager"})
    tokens = torch.randint(0, 256, (1, 16))
    model(tokens, tokens).backward()
    (group,) = [json.loads(p) for p in captured.named("boost_group_linears_report")]
    assert len(group["rewritten"]) == 2, group  # one block's q/k/v and gate/up downs
    assert all(not site.startswith("layers.") for site in group["rewritten"]), group
