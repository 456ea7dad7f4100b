"""List the collectives of each ATen graph with their payload (read-only).

Pattern: every ``_c10d_functional`` collective node (all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single); ``wait_tensor`` is not a collective.
For each: kind, shape, dtype and bytes of the tensor it sends, read from the
node's ``val`` metadata. ``explain`` prints them per graph with totals, and the
tensor-parallel tests check the bytes per layer against the formulas of BOOST.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from boost_compile.analysis import graph_kind
from boost_compile.pass_manager import AtenPass, PassReport

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def collectives_of(graph: fx.Graph) -> list[dict[str, Any]]:
    """``[{kind, shape, dtype, bytes}]`` for the collectives of an ATen graph, in order."""
    found = []
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "_c10d_functional" or target._opname not in COLLECTIVES:
            continue
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        shape = tuple(int(s) for s in val.shape) if val is not None else None
        nbytes = val.numel() * val.element_size() if val is not None else None
        found.append({"kind": target._opname, "shape": shape, "dtype": str(val.dtype) if val is not None else None, "bytes": nbytes})
    return found


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
