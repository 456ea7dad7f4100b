"""Group linears that read one input into one GEMM and a split.

Pattern (Torch IR): two or more linears on the same input, no path between them
(q/k/v and gate/up, or the down factors of their bottlenecks), any number of
leading dimensions, with or without bias, any output widths:

    q = linear(x, Wq)          k = linear(x, Wk, bk)          v = linear(x, Wv)

Rewrite:

    w = cat([Wq, Wk, Wv], 0)                   # [dq + dk + dv, d_in]
    b = cat([zeros(dq), bk, zeros(dv)])        # only when some member has a bias
    q, k, v = split(linear(x, w, b), [dq, dk, dv], -1)

``x @ W`` members (W stored [d_in, d_out]) are grouped among themselves with
``cat(..., 1)`` and ``matmul``. The weights are concatenated in the graph every
step: the model's parameters stay what the user and the optimizer see, and the
copy costs one read and write of the group's weights per step (forward) plus the
split of its gradient (backward), which is small next to the GEMM on T tokens
when T is much larger than d_out (measured in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis import LinearSite, remove_dead_code, unused_nodes
from boost_compile.analysis.fx_utils import node_target_name, written_in_place
from boost_compile.pass_manager import GraphPass, PassContext, PassReport


class GroupLinearsPass(GraphPass):
    name = "group_linears"

    def enabled(self) -> bool:
        return self.config.group.enabled

    def config_section(self) -> Any:
        return self.config.group

    def run(self, ctx: PassContext) -> PassReport:
        unused = unused_nodes(ctx.gm.graph)  # what the captured graph leaves unused stays
        report = PassReport(self.name)
        if ctx.has_dtensor:
            report.not_applicable = "DTensor parameters (PyTorch's own tensor parallelism)"
            return report
        min_members = self.config.group.min_members
        groups = ctx.view.sibling_groups
        order = {n: i for i, n in enumerate(ctx.gm.graph.nodes)}
        for group in groups:
            for layout in ("out_in", "in_out"):
                members = [m for m in group.members if m.layout == layout]
                if len(members) < min_members:
                    continue
                name = "+".join(m.name for m in members)
                report.found.append(name)
                reason = _why_not(members, ctx, order)
                if reason is not None:
                    report.skip(name, reason)
                    continue
                _rewrite(ctx.gm.graph, members, layout, order)
                report.rewritten.append(name)
                report.details[name] = {
                    "members": len(members),
                    "d_in": members[0].d_in,
                    "d_out": [m.d_out for m in members],
                }
        remove_dead_code(ctx.gm.graph, unused)
        return report


def _why_not(members: list[LinearSite], ctx: PassContext, order: dict[fx.Node, int]) -> str | None:
    """A reason the members cannot share one GEMM, or None."""
    first = min(order[m.node] for m in members)
    late = [m.name for m in members if any(order[n] > first for n in (m.weight, m.bias) if n is not None)]
    if late:
        return f"weights of {late} are defined after the first member"
    dtypes = {_dtype(m.weight) for m in members}
    if any(m.bias is not None for m in members) and None in dtypes:
        return "weight dtype unknown, cannot build the zero bias of a member without one"
    if len(dtypes) != 1:
        return f"weights have different dtypes {sorted(map(str, dtypes))}"
    if len({m.d_in for m in members}) != 1:
        return "members disagree on the input width"
    for m in members:
        if m.bias is not None and not ctx.view.is_param(m.bias):
            return f"{m.name}: bias is computed in the graph, not a parameter"
    for m in members:
        if (writer := written_in_place(m.node)) is not None:
            # a view of the grouped output's split cannot be written in place (autograd refuses
            # it): Gemma 3n's ``per_layer_projection *= scale``
            return f"{m.name}: its output is written in place ({node_target_name(writer)} at {writer.name})"
    roles = {m.name: _tp_role(m.weight, ctx) for m in members}
    if len(set(roles.values())) > 1:
        # one GEMM has one input gradient: a column-parallel member's is this rank's partial sum
        # (all-reduced), a replicated member's is whole (MLA without a q latent: q_proj beside
        # kv_a_proj_with_mqa)
        return f"members have different tensor-parallel roles {roles}"
    return None


def _tp_role(weight: fx.Node, ctx: PassContext) -> str:
    """The role ``parallelize_`` gave the parameter behind ``weight`` ("replicate" when none)."""
    spec = getattr(ctx.view.example_of(weight), "_boost_tp", None)
    return spec.role if spec is not None else "replicate"


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("example_value", node.meta.get("val"))
    return getattr(val, "dtype", None)


def _rewrite(graph: fx.Graph, members: list[LinearSite], layout: str, order: dict[fx.Node, int]) -> None:
    first = min(members, key=lambda m: order[m.node])
    x = first.input
    sizes = [m.d_out for m in members]
    with graph.inserting_before(first.node):
        weights = [m.weight for m in members]
        w = graph.call_function(torch.cat, (weights, 0 if layout == "out_in" else 1))
        bias = None
        if any(m.bias is not None for m in members):
            val = first.weight.meta.get("example_value", first.weight.meta.get("val"))
            parts = [
                m.bias
                if m.bias is not None
                else graph.call_function(torch.zeros, (m.d_out,), {"dtype": val.dtype, "device": val.device})
                for m in members
            ]
            bias = graph.call_function(torch.cat, (parts, 0))
        if layout == "out_in":
            y = graph.call_function(compat.TORCH_LINEAR, (x, w, bias))
        else:
            y = graph.call_function(torch.matmul, (x, w))
            if bias is not None:
                y = graph.call_function(operator.add, (y, bias))
        split = graph.call_function(torch.split, (y, sizes, -1))
        outs = [graph.call_function(operator.getitem, (split, i)) for i in range(len(members))]
    for m, out in zip(members, outs, strict=True):
        out.meta.update(m.node.meta)
        m.node.replace_all_uses_with(out)
        graph.erase_node(m.node)
