"""Count the ATen ops of each graph the inner compiler sees (read-only).

Pattern: none; the pass walks ``graph.nodes`` and records ``{aten op: count}``
and whether the graph is a forward or a backward (it has ``tangents_*`` inputs).
``explain`` uses it for the "op counts after" column. It changes nothing, so it is
safe in every mode, and its ``uuid()`` keeps Inductor's FX graph cache valid.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from boost_compile.analysis import count_ops, graph_kind
from boost_compile.pass_manager import AtenPass, PassReport


class OpCensusPass(AtenPass):
    name = "op_census"
    observes_only = True

    def enabled(self) -> bool:
        return self.config.op_census.enabled

    def config_section(self) -> Any:
        return self.config.op_census

    def __call__(self, graph: fx.Graph) -> PassReport:
        kind = graph_kind(graph)
        report = PassReport(self.name)
        report.details = {"graph": kind, "op_counts": count_ops(graph)}
        return report
