"""Structured-trace artifacts of the boost passes, for ``tlparse``.

``TORCH_TRACE=<dir>`` makes PyTorch write a structured trace of every compile (a log
per process in ``<dir>``), and ``tlparse <log>`` turns it into an HTML report: a page per
compile with the graphs of Dynamo, AOTAutograd and Inductor. The boost passes rewrite
the graph between Dynamo and Inductor; the artifacts below put what they did on the
same page, per graph:

- ``boost_<pass>_report`` (json): the pass's ``PassReport`` (found, rewritten, skipped
  with the reason, not_applicable, details) and which graph it ran on (``"dynamo"``
  for the Torch-IR passes, ``"forward"`` / ``"backward"`` for the ATen passes);
- ``boost_<pass>_graph`` (string): the readable graph after the pass, when the pass
  changed it;
- ``boost_collectives`` (json): the collectives of a forward or backward ATen graph with
  their bytes, totals per kind, when the graph has any (tensor-parallel graphs).

Without ``TORCH_TRACE`` this costs one look at the trace logger's handlers per graph:
no graph is printed, no payload built. It is the test ``trace_structured`` itself makes,
so boost builds its payloads exactly when torch builds its own (also, for instance, under
pytest, which attaches handlers to every non-propagating logger).

On an FX graph cache hit Inductor skips its post-grad passes, so the ATen artifacts
appear only for graphs it compiles (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` to see them
every time); the Torch-IR ones appear on every compile.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis import fx_utils
from boost_compile.analysis.fx_utils import graph_kind


class PassReport(Protocol):
    """What the trace reads of a pass's report (``pass_manager.PassReport``; named here, not
    imported: the pass manager imports this module)."""

    name: str

    def to_dict(self) -> dict[str, Any]: ...

#: The logger ``trace_structured`` writes to; it has a handler exactly when a trace is on.
TRACE_LOGGER = compat.TRACE_LOGGER

#: The graph name the Torch-IR passes' artifacts carry.
DYNAMO_GRAPH = "dynamo"


def tracing() -> bool:
    """Whether a structured trace is being written (``TORCH_TRACE`` or ``TORCH_COMPILE_DEBUG``)."""
    return bool(logging.getLogger(TRACE_LOGGER).handlers)


def _to_json(obj: Any) -> str:
    """Indented JSON (tlparse shows it as is); what JSON cannot hold is written as ``str``."""
    return json.dumps(obj, indent=1, default=str)


def emit(name: str, encoding: str, payload_fn: Callable[[], str]) -> None:
    """One ``artifact`` entry; ``payload_fn`` is called only while a trace is written."""
    compat.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=payload_fn,
    )


def report_payload(report: PassReport, graph: str) -> dict[str, Any]:
    """The report as the ``boost_<pass>_report`` artifact holds it."""
    return {"graph": graph, **report.to_dict()}


def emit_report(report: PassReport, graph: str) -> None:
    emit(f"boost_{report.name}_report", "json", lambda: _to_json(report_payload(report, graph)))


def emit_graph(pass_name: str, graph: str, text: str) -> None:
    emit(f"boost_{pass_name}_graph", "string", lambda: f"# boost: the {graph} graph after {pass_name}\n{text}")


def render_module(gm: fx.GraphModule) -> str:
    """The readable code of a graph module, submodules included."""
    return gm.print_readable(print_output=False)


def render_graph(graph: fx.Graph) -> str:
    """The readable code of an ATen graph: its module's if it has one (Inductor's), else the graph's own."""
    if isinstance(graph.owning_module, fx.GraphModule):
        return render_module(graph.owning_module)
    return graph.python_code(root_module="self").src


class PassTrace:
    """Traces the passes run on one graph: each one's report, and the graph after it.

    The graph is emitted only when the pass changed its text. Not every pass, since the
    census passes only read the graph, and copies of an unchanged graph would bury the
    ones that matter (a large model's graph is megabytes). Not "when the report lists a
    rewrite" either: the report can understate (tp_overlap reorders nodes and says so only
    in its details; tp_localize rewrites spellings it does not count) or overstate (the
    checkpoint pass tags node metadata, which the code does not show). Comparing the text
    is exact; it prints the graph once before the first pass and once after each, and
    only while a trace is written.
    """

    def __init__(self, graph_fn: Callable[[], str], render: Callable[[], str]) -> None:
        self.on = tracing()
        self.render = render
        self.graph = graph_fn() if self.on else ""
        self.last = render() if self.on else None

    @classmethod
    def of_module(cls, gm: fx.GraphModule) -> PassTrace:
        """For the Torch-IR passes, on the Dynamo graph module."""
        return cls(lambda: DYNAMO_GRAPH, lambda: render_module(gm))

    @classmethod
    def of_aten(cls, graph: fx.Graph) -> PassTrace:
        """For the ATen passes, on a forward or backward graph."""
        return cls(lambda: graph_kind(graph), lambda: render_graph(graph))

    def after(self, report: PassReport) -> None:
        """Record one pass that just ran."""
        if not self.on:
            return
        emit_report(report, self.graph)
        text = self.render()
        if text != self.last:
            emit_graph(report.name, self.graph, text)
        self.last = text


def collectives_payload(graph: str, collectives: list[dict[str, Any]]) -> dict[str, Any]:
    """``boost_collectives``: the collectives in order, with their count and bytes per kind."""
    by_kind: dict[str, dict[str, int]] = {}
    for c in collectives:
        entry = by_kind.setdefault(str(c["kind"]), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c["bytes"] or 0
    return {
        "graph": graph,
        "count": len(collectives),
        "total_bytes": sum(c["bytes"] or 0 for c in collectives),
        "by_kind": by_kind,
        "collectives": collectives,
    }


def emit_collectives(graph: fx.Graph) -> None:
    """``boost_collectives`` for an ATen graph that has collectives (nothing for one without)."""
    if not tracing():
        return
    found = fx_utils.collectives_of(graph)
    if found:
        kind = graph_kind(graph)
        emit("boost_collectives", "json", lambda: _to_json(collectives_payload(kind, found)))
