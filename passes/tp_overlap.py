"""Issue each collective as early and wait for it as late as the graph allows (``tp.overlap``).

Pattern, on the forward and backward ATen graphs of a parallelized model:

    dW = mm(g.t(), x)          # work the collective does not need ...
    y = all_reduce(dx)
    z = wait_tensor(y)
  ->
    y = all_reduce(dx)         # issued first
    dW = mm(g.t(), x)          # ... moved after the issue (order kept)
    z = wait_tensor(y)         # the wait moved down to just before z's first user

A functional collective returns at once and its ``wait_tensor`` blocks until it
is done, so whatever runs between the two overlaps the transfer (gloo's thread
on CPU, NCCL's stream on GPU). In backward the input-gradient all-reduce of an
up factor is issued before that factor's weight-gradient GEMM, which does not
need it; in forward there is little to overlap (each all-reduce feeds the very
next op). The order is the same on every rank (it only depends on the graph),
so the ranks still issue their collectives in the same sequence. Only ops
between two collectives move, later, past the second one's issue; nothing
moves across a collective the other way, and data dependencies hold (an op
moves only if the collective does not depend on it, and its users move with it).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis.fx_utils import graph_kind, is_collective
from boost_compile.pass_manager import AtenPass, PassReport

_WAIT = compat.WAIT_TENSOR


class TPOverlapPass(AtenPass):
    name = "tp_overlap"

    def enabled(self) -> bool:
        return self.config.tp.enabled and self.config.tp.overlap

    def config_section(self) -> Any:
        return self.config.tp

    def __call__(self, graph: fx.Graph) -> PassReport:
        report = PassReport(self.name)
        delayed = _delay_independent_work(graph)
        sunk, between = _sink_waits(graph)
        graph.lint()
        report.details = {
            "graph": graph_kind(graph), "delayed": delayed, "sunk": sunk, "ops_between": between,
            "summary": (f"{sunk} waits moved later, {between} ops now run while a collective is in flight "
                        f"({delayed} of them moved after the collective's issue)"),
        }
        return report


def _movable(node: fx.Node) -> bool:
    return (node.op == "call_function" and not is_collective(node, waits=False, bodies=False) and node.target is not _WAIT
            and not node.is_impure())


def _delay_independent_work(graph: fx.Graph) -> int:
    """Between two collectives, move the ops the second one does not depend on to just after its
    issue (keeping their order): in backward, the weight-gradient GEMMs."""
    moved = 0
    nodes = list(graph.nodes)
    start = 0
    for i, node in enumerate(nodes):
        if not is_collective(node, waits=False, bodies=False):
            continue
        segment = nodes[start:i]
        inside = set(segment)
        needed, todo = set(), [node]
        while todo:
            for a in todo.pop().all_input_nodes:
                if a in inside and a not in needed:
                    needed.add(a)
                    todo.append(a)
        candidates = {n for n in segment if n not in needed and _movable(n)}
        stuck = True
        while stuck:  # an op whose user stays before the collective must stay too
            stuck = {n for n in candidates if any(u in inside and u not in candidates for u in n.users)}
            candidates -= stuck
        anchor = node
        for n in segment:
            if n in candidates:
                anchor.append(n)
                anchor = n
                moved += 1
        nodes = list(graph.nodes)
        start = nodes.index(anchor) + 1
    return moved


def _sink_waits(graph: fx.Graph) -> tuple[int, int]:
    """Each ``wait_tensor`` moved down to just before its first user; returns (waits moved, ops
    that now run between a collective's issue and its wait)."""
    sunk = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _WAIT or not node.users:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(node.users, key=order.__getitem__)
        if node.next is not first:
            first.prepend(node)
            sunk += 1
    order = {n: i for i, n in enumerate(graph.nodes)}
    between = sum(
        order[n] - order[n.args[0]] - 1
        for n in graph.nodes
        if (n.op == "call_function" and n.target is _WAIT and isinstance(n.args[0], fx.Node)
            and is_collective(n.args[0], waits=False, bodies=False))
    )
    return sunk, between
