"""Factorize dense linears of a frozen graph into bottlenecks at compile time.

Pattern (Torch IR, W a parameter placeholder inside a repeated block):

    y = linear(x, W, b)                     # or x @ W, mm(x, W), addmm(b, x, W)

Rewrite (A, B computed now from W's real value by truncated SVD, or CoLA init,
held as constants of the graph module):

    h = linear(x, A)                        # A: [r, d_in]
    h = silu(h)                             # only with factorize.activation
    y = linear(h, B, b)                     # B: [d_out, r]

For evaluation, inference and graph experiments on unmodified models. Training
needs the factors as parameters the optimizer sees, so on a graph that needs
gradients this pass refuses and points to ``factorize_``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis import ACTIVATION_TARGETS, remove_dead_code, unused_nodes
from boost_compile.factorize import cola_factors, saves_parameters, svd_factors
from boost_compile.models.lowrank import break_even_rank
from boost_compile.pass_manager import GraphPass, PassContext, PassReport

_ACTIVATION_FN = {name: fn for fn, name in ACTIVATION_TARGETS.items() if fn.__module__.startswith("torch.nn")}


class FactorizeGradientError(RuntimeError):
    """The compile-time factorization was asked for on a graph that needs gradients."""


class FactorizePass(GraphPass):
    name = "factorize"
    exact = False  # a low-rank approximation of each weight: verify compares later passes to its graph

    def enabled(self) -> bool:
        return self.config.factorize is not None and self.config.factorize.enabled

    def config_section(self) -> Any:
        return self.config.factorize

    def run(self, ctx: PassContext) -> PassReport:
        unused = unused_nodes(ctx.gm.graph)  # what the captured graph leaves unused stays
        cfg = self.config.factorize
        assert cfg is not None
        if ctx.needs_grad():
            raise FactorizeGradientError(
                "options={'factorize': ...} factorizes a frozen graph at compile time, but this "
                "graph needs gradients: the factors would not be parameters the optimizer can "
                "see. For training call boost_compile.factorize_(model, FactorizeConfig(...)) "
                "before torch.compile; for evaluation run under torch.no_grad() or freeze the model."
            )
        report = PassReport(self.name)
        view = ctx.view
        graph = ctx.gm.graph
        for i, site in enumerate(view.block_linears):
            report.found.append(site.name)
            rank = cfg.rank_for(site.d_in, site.d_out)
            if not saves_parameters(site.d_in, site.d_out, rank):
                report.skip(site.name, f"rank {rank} saves nothing (break-even {break_even_rank(site.d_in, site.d_out):.1f})")
                continue
            weight = _real_value(ctx, site.weight)
            if weight is None:
                report.skip(site.name, "weight value not available at compile time")
                continue
            w = weight if site.layout == "out_in" else weight.t()
            if cfg.init == "svd":
                down, up = svd_factors(w, rank)
            else:
                down, up = cola_factors(site.d_in, site.d_out, rank, dtype=w.dtype, device=w.device)
            down_name, up_name = f"boost_factor_{i}_down", f"boost_factor_{i}_up"
            _add_constant(ctx.gm, down_name, down)
            _add_constant(ctx.gm, up_name, up)
            # constants go to the top of the graph, where later passes expect weights
            first_op = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first_op):
                a = graph.get_attr(down_name)
                b = graph.get_attr(up_name)
            with graph.inserting_before(site.node):
                h = graph.call_function(compat.TORCH_LINEAR, (site.input, a))
                if cfg.activation is not None:
                    h = graph.call_function(_ACTIVATION_FN[cfg.activation], (h,))
                y = graph.call_function(compat.TORCH_LINEAR, (h, b, site.bias))
            y.meta.update(site.node.meta)
            site.node.replace_all_uses_with(y)
            graph.erase_node(site.node)
            report.rewritten.append(site.name)
            report.details[site.name] = {"d_in": site.d_in, "d_out": site.d_out, "rank": rank}
        remove_dead_code(graph, unused)
        return report


def _add_constant(gm: fx.GraphModule, name: str, value: torch.Tensor) -> None:
    """A buffer of the graph module, with a source so AOT autograd accepts it.

    Dynamo's graph module maps every parameter and buffer to where it came from in
    the user's model; a tensor made at compile time comes from nowhere, so it gets
    a ``ConstantSource`` of its own name.
    """
    gm.register_buffer(name, value.contiguous())
    compat.give_constant_source(gm, name)


def _real_value(ctx: PassContext, node: fx.Node) -> torch.Tensor | None:
    if node.op == "get_attr":
        obj: Any = ctx.gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj.detach() if isinstance(obj, torch.Tensor) else None
    value = ctx.view.example_of(node)
    return value.detach() if isinstance(value, torch.Tensor) else None
