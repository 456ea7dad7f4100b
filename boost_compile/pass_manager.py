"""Ordered graph passes, their reports, and the cache-safe ATen pass wrapper.

Two levels of pass:

- ``GraphPass`` runs on the Dynamo graph (Torch IR), where parameters are still
  placeholders with names, before the graph is handed to the inner compiler.
- ``AtenPass`` runs on the forward and backward ATen graphs (after AOT autograd).
  Under Inductor it goes in as ``post_grad_custom_post_pass``; the wrapper is a
  ``CustomGraphPass`` whose ``uuid()`` hashes the passes' source and config, so the
  FX graph cache stays valid and still hits.

Every pass returns a ``PassReport`` (sites found / rewritten / skipped with a
reason). In strict mode a pass that found nothing, or skipped a site, raises
``StrictPassError``: a silent no-op is the classic failure of compiler passes.
Under ``TORCH_TRACE`` each report, each graph a pass changed and an ATen graph's
collectives also go to PyTorch's structured trace, for tlparse (``trace.py``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile import trace
from boost_compile.analysis import GraphView
from boost_compile.config import BoostConfig
from boost_compile.verify import Snapshot, Verifier, VerifyError, code_of, snapshot

log = logging.getLogger("boost_compile")


class StrictPassError(RuntimeError):
    """A pass in strict mode did not rewrite what it was expected to."""


@dataclass
class PassReport:
    """What one pass saw and did on one graph."""

    name: str
    found: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    #: Set when the pass does not apply to this graph by design (e.g. a CUDA-only
    #: rewrite on a CPU graph): strict mode accepts it, explain shows the reason.
    not_applicable: str | None = None
    #: ``verify`` found that the rewrite changed what the graph computes and undid it
    dropped: bool = False

    def skip(self, site: str, reason: str) -> None:
        self.skipped.append((site, reason))
        log.info("%s: skipped %s: %s", self.name, site, reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "found": list(self.found),
            "rewritten": list(self.rewritten),
            "skipped": [list(s) for s in self.skipped],
            "details": self.details,
            "not_applicable": self.not_applicable,
            "dropped": self.dropped,
        }

    def line(self) -> str:
        if self.not_applicable:
            return f"{self.name}: not applicable ({self.not_applicable})"
        if "summary" in self.details:  # a pass that says what it found in its own words
            line = f"{self.name}: {self.details['summary']}"
        else:
            line = f"{self.name}: found {len(self.found)}, rewritten {len(self.rewritten)}, skipped {len(self.skipped)}"
        return line + (" -- DROPPED by verify (the rewrite changed what the graph computes)" if self.dropped else "")


@dataclass
class PassContext:
    """What a pass may read: the config, the real inputs and the shared analysis."""

    gm: fx.GraphModule
    example_inputs: Sequence[Any]
    config: BoostConfig
    grad_enabled: bool = True
    _view: GraphView | None = None

    @property
    def view(self) -> GraphView:
        """The analysis of the current graph (rebuilt after a pass rewrites it)."""
        if self._view is None:
            self._view = GraphView(self.gm, self.example_inputs, self.config.analysis)
        return self._view

    def invalidate(self) -> None:
        self._view = None

    @property
    def has_dtensor(self) -> bool:
        """Whether parameters are DTensors (the "vanilla" TP plan): passes that cut
        or concatenate weights leave such graphs to DTensor."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(t, DTensor) for t in self.example_inputs)

    def needs_grad(self) -> bool:
        """Whether the compiled graph will be differentiated (a training graph)."""
        if not self.grad_enabled:
            return False
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in self.example_inputs)


def _stable_repr(obj: Any) -> str:
    if is_dataclass(obj):
        obj = asdict(obj)
    return json.dumps(obj, sort_keys=True, default=repr)


def _source_and_config_hash(p: GraphPass | AtenPass) -> str:
    """sha256 of the source file that defines the pass and of its config section."""
    src = inspect.getsource(inspect.getmodule(type(p)))
    return hashlib.sha256((src + _stable_repr(p.config_section())).encode()).hexdigest()


class GraphPass:
    """A Torch-IR pass: ``run(ctx) -> PassReport``, mutating ``ctx.gm`` in place.

    Subclasses set ``name`` and read their own section of the config.
    ``expects_sites``: under strict mode, finding nothing is an error.
    """

    name: ClassVar[str] = "pass"
    expects_sites: ClassVar[bool] = True
    #: the rewrite keeps what the graph computes (up to rounding); False for an approximation by
    #: design (compile-time factorization), which ``verify`` reports and then compares against
    exact: ClassVar[bool] = True
    #: verify may undo the rewrite alone (False: a tensor-parallel pass, without which no rank's
    #: program exists)
    droppable: ClassVar[bool] = True
    #: under TP, the pass after which the rank's program is whole (its collectives inserted): the
    #: passes before it are checked with it, as one program
    completes_rank_program: ClassVar[bool] = False

    def __init__(self, config: BoostConfig) -> None:
        self.config = config

    def enabled(self) -> bool:
        return True

    def run(self, ctx: PassContext) -> PassReport:  # pragma: no cover - interface
        raise NotImplementedError

    def uuid(self) -> str:
        """Hash of this pass's source and config (changes when either does)."""
        return _source_and_config_hash(self)

    def config_section(self) -> Any:
        return None


class AtenPass:
    """A pass on an ATen graph (forward or backward), run by the inner compiler."""

    name: ClassVar[str] = "aten_pass"
    #: the pass only reads the graph (a census): nothing of it to verify
    observes_only: ClassVar[bool] = False

    def __init__(self, config: BoostConfig) -> None:
        self.config = config

    def enabled(self) -> bool:
        return True

    def __call__(self, graph: fx.Graph) -> PassReport:  # pragma: no cover - interface
        raise NotImplementedError

    def config_section(self) -> Any:
        return None

    def uuid(self) -> str:
        return _source_and_config_hash(self)


class AtenPipeline(compat.CustomGraphPass):
    """The enabled ATen passes as one ``CustomGraphPass`` for Inductor.

    ``sink`` collects each run's report; Inductor may run the pipeline on the
    forward and the backward graph, so reports are appended per graph.
    """

    def __init__(self, passes: Sequence[AtenPass], sink: list[PassReport] | None = None) -> None:
        self.passes = list(passes)
        self.sink = sink if sink is not None else []

    def __call__(self, graph: fx.Graph) -> None:
        traced = trace.PassTrace.of_aten(graph)
        for p in self.passes:
            report = p(graph)
            self.sink.append(report)
            traced.after(report)
        graph.lint()
        trace.emit_collectives(graph)

    def uuid(self) -> bytes:
        h = hashlib.sha256(inspect.getsource(inspect.getmodule(AtenPipeline)).encode())
        for p in self.passes:
            h.update(p.uuid().encode())
        return h.digest()


@dataclass
class StageRecord:
    """The graph code after one stage, for ``explain``."""

    name: str
    code: str
    op_counts: dict[str, int]


def run_graph_passes(
    passes: Sequence[GraphPass],
    ctx: PassContext,
    stages: list[StageRecord] | None = None,
    verifier: Verifier | None = None,
) -> list[PassReport]:
    """Run the enabled passes in order; check strict mode after each.

    With a ``verifier``, each pass that changed the graph is checked against the captured
    graph; one that breaks the parity rule is undone (its report says so) and the next pass
    runs on the graph as it was before it. Under TP the passes up to the one that completes the
    rank's program are checked together with it (``_check_rank_program``).
    """
    from boost_compile.analysis import count_ops

    reports = []
    traced = trace.PassTrace.of_module(ctx.gm)
    pending: list[_Applied] = []  # under TP: rewrites of a rank's program not yet whole
    for p in passes:
        if not p.enabled():
            continue
        before = snapshot(ctx.gm) if verifier is not None and verifier.available else None
        report = _run_pass(p, ctx)
        if before is not None:
            _verify(_Applied(p, report, before), ctx, verifier, pending)
        reports.append(report)
        log.info("%s", report.line())
        traced.after(report)  # before the strict check: a failing pass's report is in the trace too
        if ctx.config.strict:
            check_strict(p, report)
        if stages is not None:
            stages.append(StageRecord(p.name, ctx.gm.code, count_ops(ctx.gm.graph)))
    if pending and verifier is not None:
        verifier.unverified(" + ".join(a.p.name for a in pending), "the rank's program was never whole (no pass "
                            "inserted its collectives)")
    return reports


@dataclass
class _Applied:
    """A pass that ran: its report and the graph before it."""

    p: GraphPass
    report: PassReport
    before: Snapshot


def _run_pass(p: GraphPass, ctx: PassContext) -> PassReport:
    report = p.run(ctx)
    ctx.gm.graph.lint()
    ctx.gm.recompile()
    ctx.invalidate()
    return report


def _verify(applied: _Applied, ctx: PassContext, verifier: Verifier, pending: list[_Applied]) -> None:
    """Check one pass's rewrite; undo it when it breaks the rule."""
    changed = code_of(ctx.gm) != applied.before.code
    if changed and not applied.p.exact:
        verifier.rebase(applied.p.name, ctx.gm)
    elif verifier.waits_for_program(applied.p):
        if changed:
            pending.append(applied)
    elif pending:
        _check_rank_program([*pending, applied], ctx, verifier)
        pending.clear()
    elif changed and not verifier.check_pass(applied.p.name, ctx.gm):
        applied.before.restore(ctx.gm)
        applied.report.dropped = True


def _check_rank_program(unit: list[_Applied], ctx: PassContext, verifier: Verifier) -> None:
    """A rank's program, checked once it is whole: the TP passes and what ran between them.

    On a mismatch the rewrites verify may drop (grouping, say) are undone from the last one back,
    the TP passes after each run again on the graph before it, and the result is checked again; a
    rank's program still wrong without any of them has nothing to fall back to (the captured graph
    reads shards as whole tensors) and raises.
    """
    names = " + ".join(a.p.name for a in unit)
    if verifier.check_pass(names, ctx.gm):
        return
    for k in reversed([i for i, a in enumerate(unit) if a.p.droppable]):
        unit[k].before.restore(ctx.gm)
        ctx.invalidate()
        for a in unit[k:]:
            if a.p.droppable:
                a.report.dropped = True
            else:  # the TP pass again, on the graph without the dropped rewrites: its report replaced
                vars(a.report).update(vars(_run_pass(a.p, ctx)))
        kept = [a.p.name for a in unit if not a.report.dropped]
        if verifier.check_pass(" + ".join(kept), ctx.gm):
            return
    raise VerifyError(f"verify: the tensor-parallel program of graph {verifier.graph_name} ({names}) differs from "
                      "the unsharded model even without the rewrites between its passes")


def check_strict(p: GraphPass, report: PassReport) -> None:
    if report.not_applicable:
        return
    if report.skipped:
        reasons = "; ".join(f"{s}: {r}" for s, r in report.skipped)
        raise StrictPassError(f"strict: pass {p.name!r} skipped {len(report.skipped)} site(s): {reasons}")
    if p.expects_sites and not report.found:
        raise StrictPassError(
            f"strict: pass {p.name!r} is enabled but found no site to rewrite in this graph"
        )
