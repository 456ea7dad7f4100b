"""Graph passes of the boost backend, one per file, in the order they run.

Torch-IR passes (on the Dynamo graph, before the inner compiler):
  factorize       dense linear -> bottleneck, for frozen graphs (opt-in)
  group_linears   linears sharing an input -> one GEMM + split
  rmsnorm         every RMSNorm site -> the fused boost::rms_norm op

ATen passes (on the forward/backward graphs, inside the inner compiler):
  op_census   counts ATen ops per graph, for ``explain``
"""

from __future__ import annotations

from boost_compile.config import BoostConfig
from boost_compile.pass_manager import AtenPass, GraphPass
from boost_compile.passes.factorize import FactorizePass
from boost_compile.passes.group_linears import GroupLinearsPass
from boost_compile.passes.op_census import OpCensusPass
from boost_compile.passes.rmsnorm import RMSNormPass

#: Torch-IR passes, in order.
GRAPH_PASSES: tuple[type[GraphPass], ...] = (FactorizePass, GroupLinearsPass, RMSNormPass)
#: ATen passes, in order.
ATEN_PASSES: tuple[type[AtenPass], ...] = (OpCensusPass,)


def graph_passes(config: BoostConfig) -> list[GraphPass]:
    return [cls(config) for cls in GRAPH_PASSES]


def aten_passes(config: BoostConfig) -> list[AtenPass]:
    return [cls(config) for cls in ATEN_PASSES]


__all__ = ["ATEN_PASSES", "GRAPH_PASSES", "aten_passes", "graph_passes"]
