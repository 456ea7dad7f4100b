"""List the collectives of each ATen graph with their payload (read-only).

Pattern: every functional collective node (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, ...: ``fx_utils.is_collective``); ``wait_tensor`` is not a collective.
For each: kind, shape, dtype and bytes of the tensor it sends, read from the
node's ``val`` metadata, and where it comes from: the module (``nn_module_stack``,
or for a backward collective the forward module it differentiates) and, in the
forward graph, the Torch-IR node that made it (``from_node``: ``cross_entropy``
for the vocabulary-parallel loss, ``gather_from_tp``, ``reduce_from_tp_3``, ...).
The listing itself is ``fx_utils.collectives_of`` (the structured trace uses it too);
``explain`` prints them per graph with totals, and the tensor-parallel tests
check the bytes per layer against the formulas of BOOST.md.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from boost_compile.analysis.fx_utils import collectives_of, graph_kind
from boost_compile.pass_manager import AtenPass, PassReport


class CollectiveCensusPass(AtenPass):
    name = "collective_census"
    observes_only = True

    def enabled(self) -> bool:
        return self.config.op_census.enabled

    def config_section(self) -> Any:
        return self.config.op_census

    def __call__(self, graph: fx.Graph) -> PassReport:
        kind = graph_kind(graph)
        found = collectives_of(graph)
        report = PassReport(self.name)
        report.details = {"graph": kind, "collectives": found, "total_bytes": sum(c["bytes"] or 0 for c in found)}
        return report
