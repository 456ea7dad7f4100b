"""The partial-gradient rule of ``tp_localize``: where a replicated tensor's gradient is one rank's share.

Each rank computes its slice of a sharded op's output from the whole of a replicated input, so
each rank's gradient of that input covers its slice alone; the unsharded model's is their sum
(Qwen3's ``q_norm`` weight scaling this rank's heads). Mixed into the localizer, whose walk
provides the placements read here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from boost_compile.analysis.fx_utils import is_custom_op, is_full_view
from boost_compile.distributed.collectives import copy_to_tp, gather_from_tp, scatter_to_tp
from boost_compile.passes.tp_op_rules import FIRST_ARG_ONLY

#: where tp_localize records each node's placement (``node.meta``)
PLACEMENT_KEY = "boost_tp_placement"


class PartialGradients:
    """``copy_to_tp`` on every replicated tensor that a sharded op reads whole and that needs a gradient."""

    ctx: Any
    graph: fx.Graph
    place: dict[fx.Node, Any]
    full: dict[fx.Node, tuple | None]
    group: str
    repairs: list[str]
    col_inputs: set[fx.Node]
    partial_sums: dict[fx.Node, fx.Node]
    sharded_norms: list[fx.Node]
    site_of: dict[fx.Node, Any]

    def _sharded(self, node: fx.Node) -> bool:
        raise NotImplementedError

    def _where(self, node: fx.Node) -> str:
        raise NotImplementedError

    def _shape_str(self, node: fx.Node) -> str:
        raise NotImplementedError

    def _sum_partial_gradients(self) -> None:
        """A replicated tensor read whole by an op whose output is sharded gets a partial gradient.

        Each rank computes its slice of the op's output from the whole tensor, so each rank's
        gradient of it covers that slice alone; the unsharded model's gradient is their sum.
        Qwen3's ``q_norm`` weight, one per head_dim and shared by every head, scales this rank's
        heads only::

            q = q_heads * w              # q_heads [B, T, H/p, hd] sharded on heads, w [hd] whole
            q = q_heads * copy_to_tp(w)  # identity forward; w's gradient summed over the group

        The same holds for a per-head bias broadcast over sharded heads, a replicated weight
        applied to each rank's heads, an attention bias or mask that needs a gradient. The
        placements say where it happens: a tensor placed replicated that needs a gradient,
        read by a node placed sharded, not sliced on the way (a sliced one gets ``scatter_to_tp``,
        whose backward gathers) and not the input of a column-parallel GEMM (``tp_collectives``
        sums that one, hoisted to where the latent's uses meet). One ``copy_to_tp`` per tensor
        serves all its sharded readers: their partial gradients are summed once."""
        if not self.ctx.grad_enabled:
            return
        needs_grad = self._needing_grad()
        skip_nodes = {n for site_out in self.sharded_norms for n in self.site_of[site_out].nodes} if self.sharded_norms else set()
        for node in list(self.graph.nodes):
            if node.op not in ("call_function", "call_method") or not self._sharded(node) or node in skip_nodes:
                continue
            if node.target in (scatter_to_tp, gather_from_tp, copy_to_tp) or is_full_view(node) or any(
                    is_custom_op(node, m) for m in ("tp_stream_in", "tp_stream_out", "tp_vocab_out")):
                continue  # their own backward is the collective; a marker reads this rank's shard or slice
            inputs = tensor_inputs(node)
            if node.op == "call_method" and node.target in FIRST_ARG_ONLY:
                inputs = inputs[:1]  # the others lend a dtype or a shape, no gradient
            for x in inputs:
                if self._sharded(x) or x not in needs_grad or (x.op == "call_function" and x.target is copy_to_tp):
                    continue
                if node in self.col_inputs and x is _gemm_input(node):
                    continue
                if x not in self.partial_sums:
                    with self.graph.inserting_after(x):
                        summed = self.graph.call_function(copy_to_tp, (x, self.group))
                    summed.meta = {k: v for k, v in x.meta.items() if k != PLACEMENT_KEY}
                    summed.meta[PLACEMENT_KEY] = None
                    self.place[summed], self.full[summed] = None, self.full.get(x)
                    self.partial_sums[x] = summed
                    self.repairs.append(f"sum the gradient of {x.name} {self._shape_str(x)} over the group: "
                                        f"replicated, read whole by {self._where(node)} whose output is sharded")
                node.replace_input_with(x, self.partial_sums[x])

    def _needing_grad(self) -> set[fx.Node]:
        """The nodes a gradient reaches: floating-point values computed from an input that requires
        one. From the inputs, not the nodes' recorded ``requires_grad``: a capture traced with grad
        off (parallelize_'s) records none past the placeholders. A node counted that no gradient
        reaches at run time costs nothing: autograd never calls its backward."""
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        found = {n for n, x in zip(placeholders, self.ctx.example_inputs, strict=False)
                 if isinstance(x, torch.Tensor) and x.requires_grad}
        for node in self.graph.nodes:
            if node.op in ("call_function", "call_method") and any(x in found for x in node.all_input_nodes):
                val = node.meta.get("example_value")
                vals = val if isinstance(val, (tuple, list)) else (val,)
                if any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals):
                    found.add(node)
        return found


def _gemm_input(node: fx.Node) -> Any:
    """The activation a GEMM multiplies: ``addmm(bias, x, W)`` takes it second."""
    return node.args[1] if node.target is torch.addmm else node.args[0]


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Inputs that hold tensors (one with a recorded value, or a collective tp_localize inserted)."""
    out = []
    for n in node.all_input_nodes:
        if PLACEMENT_KEY in n.meta and n.target in (scatter_to_tp, gather_from_tp):
            out.append(n)
            continue
        val = n.meta.get("example_value")
        if isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)):
            out.append(n)
    return out
