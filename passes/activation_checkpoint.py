"""Activation checkpointing: decide, per node, what the backward keeps and what it recomputes.

``options={"checkpoint": "none" | "lowrank" | "full" | "budget"}``:

``"lowrank"`` (BOOST's low-rank checkpointing). Inside the decoder blocks (the
nodes between the residual stream's source and its last add) the backward keeps

- the residual stream: the source (embedding output) and every add of the stream;
- the output of every bottleneck's down factor, ``x A`` ([T, r], before the
  activation, which is recomputed at width r). When ``group_linears`` fused the
  down factors of one input (q/k/v, gate/up) into ``split(linear(x, cat(A_i)))``,
  the kept tensor is the grouped GEMM's output [T, sum r_i]: the same bytes as
  the separate outputs, one tensor, and the split is a free view in backward;
- dense policy, for a linear of the block that is not part of a bottleneck (a
  dense model, or a layer factorize_ left dense): its output is kept when it is
  no wider than the residual stream (q/k/v/o/down of a Llama; grouped q/k/v as
  one [T, d + 2 d_kv] tensor) and recomputed when it is wider (gate/up, [T, d_ff]).
  The narrow outputs are the dense block's cheapest tensors per GEMM of
  recompute; o/down outputs only feed the residual add, whose backward needs no
  input, so they are tagged but never actually stored;
- every collective (``torch.ops._c10d_functional.*``, also inside the forward
  body of an ``autograd.Function``, and the project's TP wrappers
  ``boost_compile.distributed.collectives.*_tp`` that tp_collectives inserts):
  a collective is never recomputed, so the backward issues exactly the
  collectives it issues without checkpointing. A down factor followed by its
  all-reduce is therefore kept after the all-reduce (``copy_to_tp``, identity
  in forward, is kept too: its output is a view, so nothing is stored).

Everything else in the blocks is recomputed in backward: the norms, the up
GEMMs, RoPE, attention, the activations and the SwiGLU product. Nodes outside
the blocks that are computed from the module's parameters and buffers alone
(RoPE tables, concatenated group weights) are recomputed as well; the rest
(embedding lookup, final norm, head, loss) is left to the partitioner.

``"full"``: the whole decoder block is recomputed; kept are the stream's source
and the output of every block (the last stream add inside one ``layers.<i>``
module, read from ``nn_module_stack``; an add with no module path counts as its
own block), plus collectives. A block compiled alone (``block_graph``, set by
``compile_blocks``) is one block whatever its adds' paths (they have none: the
block is the compiled module): its input is kept, the add inside it recomputed.

``"budget"``: no tags; PyTorch's min-cut partitioner chooses under
``torch._functorch.config.activation_memory_budget = checkpoint_budget``.

Mechanism (torch 2.13). The Torch-IR pass tags nodes with
``node.meta["recompute"] = CheckpointPolicy.MUST_SAVE / MUST_RECOMPUTE``; AOT
autograd copies ``recompute`` (and ``custom``, where the pass writes the block
and role for reporting) onto every ATen node it traces from a tagged node
(``torch.fx.proxy._COPY_META_FIELDS``), and the min-cut partitioner
(``min_cut_rematerialization_partition``) honours them: a MUST_RECOMPUTE node is
forced to the backward side of the cut, a MUST_SAVE node is banned from
recompute. Views inherit tags but the partitioner never saves a view (it saves
the base), and a MUST_SAVE node the backward does not need is not stored.
The decomposition of one tagged Torch-IR ``linear`` also tags its input view
(``view(x)``), which is why the weight gradient of a down factor still reads
the recomputed norm output, not a stored one.

Known limitation: "budget" fails on DTensor graphs (the vanilla TP plan):
PyTorch's knapsack cannot size the DeviceMesh input (torch 2.13).

The pass only tags; ``checkpoint_partitioner`` (its own module) splits the joint
graph by the tags, and ``saved_tensors`` reports what was kept.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from boost_compile import _torch_compat as compat
from boost_compile.analysis import GraphView
from boost_compile.analysis.fx_utils import (
    ACTIVATION_TARGETS,
    CAT_TARGETS,
    LINEAR_TARGETS,
    SPLIT_TARGETS,
    forward_bodies,
    hop_name,
    is_collective,
    module_block,
    module_path,
)
from boost_compile.pass_manager import GraphPass, PassContext, PassReport

SAVE = CheckpointPolicy.MUST_SAVE
RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
#: Key in ``node.meta["custom"]`` with ``{"block": ..., "role": ...}`` (copied to ATen nodes).
META_KEY = "boost_checkpoint"
GEMM_TARGETS = LINEAR_TARGETS | {torch.matmul, operator.matmul}


def _width(node: Any) -> int | None:
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dim() > 0:
        try:
            return int(val.shape[-1])
        except TypeError:
            return None
    return None


def _is_state_placeholder(node: fx.Node, view: GraphView) -> bool:
    """A placeholder that is module state (parameter or buffer), not a data input."""
    if view.is_param(node):
        return True
    name = compat.placeholder_source_name(node) or ""
    return "_buffers[" in name or "_parameters[" in name


# ----------------------------------------------------------------------------- the plan


@dataclass
class CheckpointPlan:
    """What the pass decided: ``policy[node]``, with a block and a role per kept node."""

    mode: str
    policy: dict[fx.Node, CheckpointPolicy] = field(default_factory=dict)
    role: dict[fx.Node, str] = field(default_factory=dict)
    block: dict[fx.Node, str | None] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    reason: str | None = None

    def saved(self) -> list[fx.Node]:
        return [n for n, p in self.policy.items() if p == SAVE]

    def recomputed(self) -> list[fx.Node]:
        return [n for n, p in self.policy.items() if p == RECOMPUTE]


def plan_checkpoint(view: GraphView, mode: str, block_graph: bool = False) -> CheckpointPlan:
    """Choose the policy of every node of a differentiated graph (``mode``: lowrank or full;
    ``block_graph``: the graph is one block compiled alone)."""
    plan = CheckpointPlan(mode)
    graph = view.graph
    stream = view.residual_stream
    if not stream:
        plan.reason = "no residual stream: no decoder blocks to checkpoint"
        return plan
    g = view.nx
    region = (nx.descendants(g, stream[0]) | {stream[0]}) & (nx.ancestors(g, stream[-1]) | {stream[-1]})
    plan.block = _blocks(graph, region)
    plan.blocks = list(dict.fromkeys(b for n in stream[1:] if (b := plan.block.get(n)) is not None))
    keep: dict[fx.Node, str] = {}

    if mode == "lowrank":
        keep.update({n: "residual" for n in stream})
        keep.update(_lowrank_keeps(view, region, width=_width(stream[-1])))
    else:  # full: the stream's source and the last stream add of each block
        keep[stream[0]] = "residual"
        for i, node in enumerate(stream[1:], start=1):
            nxt = stream[i + 1] if i + 1 < len(stream) else None
            key = plan.block.get(node)
            if nxt is None or (not block_graph and (key is None or plan.block.get(nxt) != key)):
                keep[node] = "block output"
    # collectives everywhere, in every mode: never recomputed
    for node in graph.nodes:
        if is_collective(node):
            keep[node] = "collective"

    calls = ("call_function", "call_method", "call_module")
    state_only = _state_only(view)
    feeders: set[fx.Node] = set()  # everything upstream of the blocks, outside them
    stack = [a for node in region for a in node.all_input_nodes if a not in region]
    while stack:
        node = stack.pop()
        if node not in feeders:
            feeders.add(node)
            stack.extend(a for a in node.all_input_nodes if a not in region)
    for node in graph.nodes:  # graph order, so reports read top to bottom
        if node in keep:
            plan.policy[node], plan.role[node] = SAVE, keep[node]
        elif node.op in calls and (node in region or (node in feeders and node in state_only)):
            plan.policy[node] = RECOMPUTE
    return plan


def _blocks(graph: fx.Graph, region: set[fx.Node]) -> dict[fx.Node, str | None]:
    """Block of each region node: its numbered module, else the first block among its inputs."""
    out: dict[fx.Node, str | None] = {}
    for node in graph.nodes:
        if node not in region:
            continue
        key = module_block(node)
        if key is None:
            key = next((out[a] for a in node.all_input_nodes if out.get(a) is not None), None)
        out[node] = key
    return out


def _state_only(view: GraphView) -> set[fx.Node]:
    """Nodes computed from parameters, buffers and constants alone (no data input upstream)."""
    data = [p for p in view.placeholders if not _is_state_placeholder(p, view)]
    tainted: set[fx.Node] = set(data)
    for p in data:
        tainted |= nx.descendants(view.nx, p)
    return {n for n in view.graph.nodes if n not in tainted and n.op != "placeholder"}


def _lowrank_keeps(view: GraphView, region: set[fx.Node], width: int | None) -> dict[fx.Node, str]:
    """Down-factor outputs (grouped or not) and, by the dense policy, narrow dense outputs."""
    keep: dict[fx.Node, str] = {}
    ratio = view.config.bottleneck_max_ratio
    in_chain: set[fx.Node] = set()
    for chain in view.bottlenecks:
        in_chain |= {chain.down.node, chain.up.node}
        if chain.down.node in region:
            keep[chain.down.node] = f"down {chain.name}"
    for node in region:
        if node.target not in SPLIT_TARGETS and not (node.op == "call_method" and node.target == "split"):
            continue
        grouped = node.args[0]
        members = _split_members(node)
        if not isinstance(grouped, fx.Node) or not _is_grouped_gemm(grouped) or not members:
            continue
        d_in = _width(_gemm_input(grouped))
        ups = [_up_after(view, m) for m in members]
        if d_in and all(
            up is not None and up.d_in == _width(m) and up.d_in <= ratio * min(d_in, up.d_out)
            for m, up in zip(members, ups, strict=True)
        ):
            keep[grouped] = "down (grouped) " + "+".join(_label(m) for m in members)
            in_chain |= {up.node for up in ups if up is not None}
        elif width is not None and all((_width(m) or width + 1) <= width for m in members):
            keep[grouped] = "dense (grouped) " + "+".join(_label(m) for m in members)
    for site in view.linears:
        # an up-like linear (narrow input, e.g. the up factor of a chain the analysis
        # cannot see through a collective) is recomputed, never kept as "dense"
        up_like = site.d_in <= ratio * site.d_out
        if site.node in region and site.node not in in_chain and not up_like:
            if width is not None and site.d_out <= width:
                keep[site.node] = f"dense {site.name}"
    return keep


def _split_members(split: fx.Node) -> list[fx.Node]:
    items = [u for u in split.users if u.op == "call_function" and u.target is operator.getitem]
    return sorted(items, key=lambda u: u.args[1])


def _is_grouped_gemm(node: fx.Node) -> bool:
    """``linear(x, cat(W_i))`` / ``matmul(x, cat(W_i))``, optionally ``+ bias`` (group_linears' output)."""
    if node.op == "call_function" and node.target in (operator.add, torch.add) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    if node.op != "call_function" or node.target not in GEMM_TARGETS or len(node.args) < 2:
        return False
    w = node.args[1]
    return isinstance(w, fx.Node) and w.op == "call_function" and w.target in CAT_TARGETS


def _gemm_input(node: fx.Node) -> fx.Node:
    if node.target in (operator.add, torch.add):
        node = node.args[0]
    return node.args[0]


def _up_after(view: GraphView, piece: fx.Node):
    """The up factor fed by ``piece``, directly or through one elementwise activation and the
    latent's elementwise work (LaX's crossing: :meth:`GraphView.latent_path`)."""
    start = piece
    users = list(piece.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in ACTIVATION_TARGETS:
        start = users[0]
    found = view.latent_path(start)
    return None if found is None else found[0]


def _label(node: fx.Node) -> str:
    return module_path(node) or node.name


# ----------------------------------------------------------------------------- the pass


class CheckpointPass(GraphPass):
    """Tags the Torch-IR graph with the checkpoint policy (see the module docstring)."""

    name = "checkpoint"

    def enabled(self) -> bool:
        return self.config.checkpoint != "none"

    def config_section(self) -> Any:
        return {"checkpoint": self.config.checkpoint, "budget": self.config.checkpoint_budget,
                "block_graph": self.config.block_graph}

    def run(self, ctx: PassContext) -> PassReport:
        report = PassReport(self.name)
        mode = self.config.checkpoint
        if mode == "budget":
            report.not_applicable = (
                "checkpoint='budget': the min-cut partitioner chooses under "
                f"activation_memory_budget={self.config.checkpoint_budget}"
            )
            return report
        if not ctx.needs_grad():
            report.not_applicable = "graph is not differentiated (no backward to save for)"
            return report
        plan = plan_checkpoint(ctx.view, mode, self.config.block_graph)
        if plan.reason is not None:
            report.details["reason"] = plan.reason
            return report
        for node, policy in plan.policy.items():
            info = {"block": plan.block.get(node) or "-", "role": plan.role.get(node, "recompute")}
            _tag(node, policy, info)
        for block in plan.blocks or ["(graph)"]:
            report.found.append(block)
            report.rewritten.append(block)
        per_block: dict[str, dict[str, Any]] = {}
        for node in plan.policy:
            entry = per_block.setdefault(plan.block.get(node) or "-", {"saved": [], "recompute": 0})
            if plan.policy[node] == SAVE:
                entry["saved"].append(f"{node.name}: {plan.role[node]}")
            else:
                entry["recompute"] += 1
        report.details = {"mode": mode, "blocks": per_block}
        return report


def _tag(node: fx.Node, policy: CheckpointPolicy, info: dict[str, str]) -> None:
    """Tag a node and, for an autograd.Function, the nodes of its forward body.

    AOT autograd traces a higher-order op's body with the body nodes' own meta,
    so a tag on the outer node alone would not reach the ATen ops inside. Other
    higher-order ops (a user's own ``checkpoint`` regions) keep their tags; only
    the collectives inside them are forced to be kept.
    """
    node.meta["recompute"] = policy
    node.meta["custom"] = {**(node.meta.get("custom") or {}), META_KEY: info}
    whole = hop_name(node.target) == "autograd_function_apply"
    for body in forward_bodies(node):
        for inner in body.graph.nodes:
            if inner.op not in ("call_function", "call_method", "call_module"):
                continue
            if is_collective(inner):
                _tag(inner, SAVE, {**info, "role": "collective"})
            elif whole:
                _tag(inner, policy, info)
