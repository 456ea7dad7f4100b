"""Graph passes of the boost backend, one per file, in the order they run.

Torch-IR passes (on the Dynamo graph, before the inner compiler):
  tp_localize     a parallelized model's whole-shape graph -> this rank's program,
                  every node's shape checked against the unsharded graph
  factorize       dense linear -> bottleneck, for frozen graphs (opt-in)
  group_linears   linears sharing an input -> one GEMM + split
  tp_collectives  collectives of a model sharded by parallelize_ (online RMSNorm)
  rmsnorm         every RMSNorm site -> the fused boost::rms_norm op
  checkpoint      tags what backward keeps / recomputes (activation_checkpoint.py; opt-in;
                  runs last, it must see the rewritten graph; its partitioner is
                  checkpoint_partitioner.py, its report saved_tensors.py)

ATen passes (on the forward/backward graphs, inside the inner compiler):
  tp_overlap         each collective issued early, waited for late (opt-in: tp.overlap)
  op_census          counts ATen ops per graph, for ``explain``
  collective_census  lists each collective with its bytes, for ``explain``
"""

from __future__ import annotations

from boost_compile.config import BoostConfig
from boost_compile.pass_manager import AtenPass, GraphPass
from boost_compile.passes.activation_checkpoint import CheckpointPass
from boost_compile.passes.checkpoint_partitioner import checkpoint_partitioner
from boost_compile.passes.collective_census import CollectiveCensusPass
from boost_compile.passes.factorize import FactorizePass
from boost_compile.passes.group_linears import GroupLinearsPass
from boost_compile.passes.op_census import OpCensusPass
from boost_compile.passes.rmsnorm import RMSNormPass
from boost_compile.passes.tp_collectives import TPCollectivesPass
from boost_compile.passes.tp_localize import TPLocalizePass
from boost_compile.passes.tp_overlap import TPOverlapPass

#: Torch-IR passes, in order.
GRAPH_PASSES: tuple[type[GraphPass], ...] = (
    TPLocalizePass,  # first: every later pass sees this rank's shapes
    FactorizePass,
    GroupLinearsPass,
    TPCollectivesPass,
    RMSNormPass,
    CheckpointPass,  # last: tags the rewritten graph (activation checkpointing)
)
#: ATen passes, in order.
ATEN_PASSES: tuple[type[AtenPass], ...] = (TPOverlapPass, OpCensusPass, CollectiveCensusPass)


def graph_passes(config: BoostConfig) -> list[GraphPass]:
    return [cls(config) for cls in GRAPH_PASSES]


def aten_passes(config: BoostConfig) -> list[AtenPass]:
    return [cls(config) for cls in ATEN_PASSES]


__all__ = ["ATEN_PASSES", "GRAPH_PASSES", "aten_passes", "checkpoint_partitioner", "graph_passes"]
