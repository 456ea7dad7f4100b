"""List the collectives of each ATen graph with their payload (read-only).

Pattern: every functional collective node (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, ...: ``fx_utils.is_collective``); ``wait_tensor`` is not a collective.
For each: kind, shape, dtype and bytes of the tensor it sends, read from the
node's ``val`` metadata, and where it comes from: the module (``nn_module_stack``,
or for a backward collective the forward module it differentiates) and, in the
forward graph, the Torch-IR node that made it (``from_node``: ``cross_entropy``
for the vocabulary-parallel loss, ``gather_from_tp``, ``reduce_from_tp_3``, ...).
``explain`` prints them per graph with totals, and the tensor-parallel tests
check the bytes per layer against the formulas of BOOST.md.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from boost_compile.analysis.fx_utils import collective_kind, graph_kind, is_collective, module_path
from boost_compile.pass_manager import AtenPass, PassReport


def collectives_of(graph: fx.Graph) -> list[dict[str, Any]]:
    """``[{kind, shape, dtype, bytes}]`` for the collectives of an ATen graph, in order (waits left out)."""
    found = []
    for node in graph.nodes:
        if not is_collective(node, waits=False, bodies=False):
            continue
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        shape = tuple(int(s) for s in val.shape) if val is not None else None
        nbytes = val.numel() * val.element_size() if val is not None else None
        found.append({
            "kind": collective_kind(node.target), "shape": shape, "dtype": str(val.dtype) if val is not None else None,
            "bytes": nbytes, "module": module_path(node), "source": source_of(node),
        })
    return found


def source_of(node: fx.Node) -> str:
    """The Torch-IR node a forward collective was traced from (empty in backward)."""
    sources = node.meta.get("from_node") or []
    while sources:
        src = sources[-1]
        if not getattr(src, "from_node", None):
            return str(src.name)
        sources = src.from_node
    return ""


class CollectiveCensusPass(AtenPass):
    name = "collective_census"

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
