"""What the passes read from a captured graph: ``GraphView`` and its sites (``view``),
RMSNorm matching (``norm_match``), look-only capture (``capture``) and the shared FX
predicates (``fx_utils``)."""

from boost_compile.analysis.capture import capture_views, private_forward
from boost_compile.analysis.fx_utils import (
    ACTIVATION_TARGETS,
    count_ops,
    graph_kind,
    meta_tensor,
    mutates,
    remove_dead_code,
    source_to_fqn,
    unused_nodes,
)
from boost_compile.analysis.norm_match import LayerNormSite, RMSNormSite
from boost_compile.analysis.view import BottleneckChain, GraphView, LinearSite, SiblingGroup

__all__ = [
    "ACTIVATION_TARGETS",
    "BottleneckChain",
    "GraphView",
    "LayerNormSite",
    "LinearSite",
    "RMSNormSite",
    "SiblingGroup",
    "capture_views",
    "count_ops",
    "graph_kind",
    "meta_tensor",
    "mutates",
    "private_forward",
    "remove_dead_code",
    "source_to_fqn",
    "unused_nodes",
]
