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
own block), plus collectives.

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

``CheckpointPartitioner`` is the partitioner the backend hands to the inner
compiler when checkpoint != "none" (aot_eager: ``partition_fn``; Inductor:
``custom_partitioner_fn``, whose ``uuid`` keys the AOT-autograd and FX caches,
so a tagged graph never reuses an untagged compile). On the joint graph it
first forces every collective to MUST_SAVE (a tag inherited from a recomputed
op, e.g. a DTensor linear that all-gathers, would otherwise win over the
partitioner's own ``force_save_collectives``), keeps random ops when the graph
has an opaque input (DTensor's DeviceMesh: see
``keep_random_ops_beside_opaque_inputs``), patches the activation budget for
"budget", and runs min-cut. With a ``sink`` (explain, the benchmark) it also records what
was saved: the backward graph's placeholders other than tangents are exactly
the saved values (they share the forward node's meta), equal to the forward
graph's outputs after the user outputs; ``saved_tensors_report`` turns them
into a ``PassReport``. A recomputed op is a backward node that has a forward
node of the same name (both graphs are cut from one joint graph).

Attention is recomputed from the kept tensors. On CPU, SDPA is tagged
nondeterministic-seeded, so the partitioner also keeps the generator state for
its recompute (``rng_state_output_*``, a few KB), as it would for dropout.

Known limitation: "budget" fails on DTensor graphs (the vanilla TP plan):
PyTorch's knapsack cannot size the DeviceMesh input (torch 2.13).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch.utils.checkpoint import CheckpointPolicy

from boost_compile.analysis import ACTIVATION_TARGETS, GraphView
from boost_compile.config import BoostConfig
from boost_compile.pass_manager import GraphPass, PassContext, PassReport

SAVE = CheckpointPolicy.MUST_SAVE
RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
#: Key in ``node.meta["custom"]`` with ``{"block": ..., "role": ...}`` (copied to ATen nodes).
META_KEY = "boost_checkpoint"
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})

_SPLIT_TARGETS = {torch.split, torch.Tensor.split, torch.functional.split}
_GEMM_TARGETS = {torch._C._nn.linear, torch.nn.functional.linear, torch.matmul, operator.matmul}
_CAT_TARGETS = {torch.cat, torch.concat, torch.concatenate}
_PROJECT_COLLECTIVES = "boost_compile.distributed.collectives"
_BLOCK_RE = re.compile(r"^(.*\.\d+)(?:\.|$)")


# ----------------------------------------------------------------------------- small helpers


def is_collective(node: fx.Node) -> bool:
    """A functional collective (``_c10d_functional`` op), or a call whose forward body holds one."""
    if node.op == "call_function" and _collective_target(node.target):
        return True
    return any(is_collective(n) for body in forward_bodies(node) for n in body.graph.nodes)


def forward_bodies(node: fx.Node) -> list[fx.GraphModule]:
    """The subgraphs a higher-order op runs in forward (its get_attr arguments).

    Dynamo turns an ``autograd.Function`` into ``autograd_function_apply(fwd, bwd, ...)``:
    only ``fwd`` runs in forward. Other higher-order ops: every subgraph argument.
    """
    owner = node.graph.owning_module
    if node.op != "call_function" or owner is None:
        return []
    args = node.args[:1] if _hop_name(node.target) == "autograd_function_apply" else node.all_input_nodes
    bodies = []
    for arg in args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(owner, str(arg.target), None)
            if isinstance(sub, fx.GraphModule):
                bodies.append(sub)
    return bodies


def _hop_name(target: Any) -> str | None:
    name = getattr(target, "name", None)
    return name() if callable(name) else None


def _collective_target(target: Any) -> bool:
    namespace = getattr(target, "namespace", None)
    if namespace is None:
        qualified = getattr(target, "_qualified_op_name", "")
        namespace = qualified.split("::")[0] if "::" in qualified else None
    if namespace in COLLECTIVE_NAMESPACES:
        return True
    # torch's functional-collective wrappers, and this project's differentiable TP
    # collectives (autograd.Functions over _c10d_functional ops, inserted by tp_collectives)
    module = getattr(target, "__module__", "") or ""
    if module.startswith("torch.distributed._functional_collectives"):
        return True
    return module == _PROJECT_COLLECTIVES and getattr(target, "__name__", "").endswith("_tp")


def _width(node: Any) -> int | None:
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dim() > 0:
        try:
            return int(val.shape[-1])
        except TypeError:
            return None
    return None


def _fqn(value: Any) -> str:
    """``L['self'].layers.0`` / ``L['args'][0].model.layers.0`` -> ``layers.0`` / ``model.layers.0``."""
    fqn = value[0] if isinstance(value, tuple) else str(value)
    fqn = re.sub(r"^L\['[^']+'\](?:\[\d+\])*\.?", "", fqn)
    return re.sub(r"\._modules\['([^']+)'\]", r".\1", fqn).lstrip(".")


def _module_block(meta: dict[str, Any]) -> str | None:
    """``layers.0`` for a node inside ``L['self'].layers.0...`` (the outermost numbered module)."""
    stack = meta.get("nn_module_stack") or {}
    for value in stack.values():
        fqn = _fqn(value)
        match = _BLOCK_RE.match(fqn)
        if match:
            return match.group(1)
    return None


def _meta_block(node: fx.Node) -> tuple[bool, str | None]:
    """(known, block) from the checkpoint pass's tag, else from ``nn_module_stack``."""
    info = (node.meta.get("custom") or {}).get(META_KEY)
    if info:
        block = info.get("block")
        return True, None if block in (None, "-") else block
    if node.meta.get("nn_module_stack"):
        return True, _module_block(node.meta)
    return False, None


def _find_block(node: fx.Node, depth: int = 6) -> str | None:
    """The block of a node, or of its nearest neighbour that knows (nodes a pass created)."""
    seen, frontier = {node}, [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            known, block = _meta_block(n)
            if known:
                return block
            for m in (*n.all_input_nodes, *n.users):
                if m not in seen:
                    seen.add(m)
                    nxt.append(m)
        frontier = nxt
    return None


def _module_path(meta: dict[str, Any]) -> str | None:
    stack = meta.get("nn_module_stack") or {}
    if not stack:
        return None
    return _fqn(list(stack.values())[-1]) or None


def _is_state_placeholder(node: fx.Node, view: GraphView) -> bool:
    """A placeholder that is module state (parameter or buffer), not a data input."""
    if view.is_param(node):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = source.name if source is not None else ""
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


def plan_checkpoint(view: GraphView, mode: str) -> CheckpointPlan:
    """Choose the policy of every node of a differentiated graph (``mode``: lowrank or full)."""
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
            if key is None or nxt is None or plan.block.get(nxt) != key:
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
        key = _module_block(node.meta)
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
        if node.target not in _SPLIT_TARGETS and not (node.op == "call_method" and node.target == "split"):
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
    if node.op != "call_function" or node.target not in _GEMM_TARGETS or len(node.args) < 2:
        return False
    w = node.args[1]
    return isinstance(w, fx.Node) and w.op == "call_function" and w.target in _CAT_TARGETS


def _gemm_input(node: fx.Node) -> fx.Node:
    if node.target in (operator.add, torch.add):
        node = node.args[0]
    return node.args[0]


def _up_after(view: GraphView, piece: fx.Node):
    """The up factor fed by ``piece``, directly or through one elementwise activation."""
    nxt = piece
    users = list(nxt.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in ACTIVATION_TARGETS:
        nxt = users[0]
        users = list(nxt.users)
    if len(users) != 1:
        return None
    up = view.linear_by_node.get(users[0])
    return up if up is not None and up.input is nxt else None


def _label(node: fx.Node) -> str:
    return _module_path(node.meta) or node.name


# ----------------------------------------------------------------------------- the pass


class CheckpointPass(GraphPass):
    """Tags the Torch-IR graph with the checkpoint policy (see the module docstring)."""

    name = "checkpoint"

    def enabled(self) -> bool:
        return self.config.checkpoint != "none"

    def config_section(self) -> Any:
        return {"checkpoint": self.config.checkpoint, "budget": self.config.checkpoint_budget}

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
        plan = plan_checkpoint(ctx.view, mode)
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
    whole = _hop_name(node.target) == "autograd_function_apply"
    for body in forward_bodies(node):
        for inner in body.graph.nodes:
            if inner.op not in ("call_function", "call_method", "call_module"):
                continue
            if is_collective(inner):
                _tag(inner, SAVE, {**info, "role": "collective"})
            elif whole:
                _tag(inner, policy, info)


# ----------------------------------------------------------------------------- the partitioner


def force_save_collectives(joint: fx.GraphModule) -> int:
    """Every functional collective of the joint graph is MUST_SAVE; returns how many were retagged."""
    changed = 0
    for node in joint.graph.nodes:
        if node.op == "call_function" and _collective_target(node.target):
            if node.meta.get("recompute") != SAVE:
                node.meta["recompute"] = SAVE
                changed += 1
            info = (node.meta.get("custom") or {}).get(META_KEY)
            if info is not None and info.get("role") != "collective":  # for the report
                node.meta["custom"] = {**node.meta["custom"], META_KEY: {**info, "role": "collective"}}
    return changed


def keep_random_ops_beside_opaque_inputs(joint: fx.GraphModule) -> int:
    """With an opaque graph input (DTensor's DeviceMesh), random ops are kept, not recomputed.

    Recomputing a random op makes the partitioner thread the generator state
    through forward and backward (``functionalize_rng_ops``); in torch 2.13 that
    shifts the saved values past an opaque one, and AOT autograd then finds the
    DeviceMesh among the saved tensors. On CPU the random op is SDPA, so under
    DTensor (the "vanilla" TP plan) attention's outputs are kept instead of
    recomputed. Returns how many nodes were retagged.
    """
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node

    if not any(is_opaque_node(p) for p in joint.graph.find_nodes(op="placeholder")):
        return 0
    changed = 0
    for node in joint.graph.nodes:
        random = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        if random and node.meta.get("recompute") in (RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
            # a multi-output op is kept through its getitems (a tuple cannot be saved)
            for kept in (node, *(u for u in node.users if u.target is operator.getitem)):
                kept.meta["recompute"] = SAVE
                info = (kept.meta.get("custom") or {}).get(META_KEY)
                if info is not None:  # for the report
                    role = {**info, "role": "random op kept (opaque graph input)"}
                    kept.meta["custom"] = {**kept.meta["custom"], META_KEY: role}
                changed += 1
    return changed


class CheckpointPartitioner(CustomPartitionerFn):
    """Splits the joint graph for the inner compiler (aot_eager or Inductor).

    ``base``: "min_cut" (checkpointing, and Inductor's own default) or "default"
    (aot_autograd's default partitioner, used for checkpoint="none" on aot_eager
    when only recording). ``sink``: receives one ``saved_tensors`` report per
    joint graph.
    """

    def __init__(self, config: BoostConfig, base: str = "min_cut", sink: list[PassReport] | None = None) -> None:
        self.mode = config.checkpoint
        self.budget = config.checkpoint_budget
        self.base = base
        self.sink = sink

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        import torch._functorch.config as functorch_config
        from torch._functorch.partitioners import (
            default_partition,
            min_cut_rematerialization_partition,
        )

        if self.mode != "none":
            force_save_collectives(gm)
            keep_random_ops_beside_opaque_inputs(gm)
        num_fwd_outputs = kwargs.get("num_fwd_outputs")
        primals = [n.name for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
        indices = kwargs.get("static_lifetime_input_indices") or []
        static = {primals[i] for i in indices if i < len(primals)}
        if self.base == "default":
            kwargs.pop("compiler", None)
            fw, bw = default_partition(gm, joint_inputs, **kwargs)
        else:
            patch = {"activation_memory_budget": self.budget} if self.mode == "budget" else {}
            with functorch_config.patch(patch):
                fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        if self.sink is not None:
            report = saved_tensors_report(
                fw, bw, num_fwd_outputs=num_fwd_outputs, static_inputs=static, mode=self.mode
            )
            self.sink.append(report)
        return fw, bw

    # Inductor deep-copies (and may pickle) its config, this object included: the
    # copy shares the sink, so the reports still reach the caller; a pickle drops it.
    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointPartitioner:
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "sink": None}

    def uuid(self) -> str:
        src = inspect.getsource(inspect.getmodule(type(self)))
        key = json.dumps({"mode": self.mode, "budget": self.budget, "base": self.base})
        return hashlib.sha256((src + key).encode()).hexdigest()


def checkpoint_partitioner(config: BoostConfig, sink: list[PassReport] | None = None) -> CheckpointPartitioner | None:
    """The partitioner for ``config``, or None to keep the inner compiler's own.

    checkpoint="none" keeps the default unless a ``sink`` asks to record the saved
    tensors; then the default partitioner is wrapped, not changed (aot_eager's is
    ``default_partition``, Inductor's is min-cut).
    """
    if config.checkpoint == "none" and sink is None:
        return None
    base = "default" if config.checkpoint == "none" and config.inner == "aot_eager" else "min_cut"
    return CheckpointPartitioner(config, base=base, sink=sink)


# ----------------------------------------------------------------------------- what was saved


def _nbytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    return 0


def _returns_alias(target: Any) -> bool:
    """An ATen op whose first output aliases its first input (a view, detach, split, ...)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and first is not None and not out.is_write and out.before_set == first.before_set


def storage_base(node: fx.Node) -> fx.Node:
    """The node that owns the memory ``node`` lives in (follows views and split getitems)."""
    while node.op == "call_function":
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            parent = node.args[0]
            if parent.op == "call_function" and _returns_alias(parent.target):
                node = parent.args[0]
                continue
            return node
        if _returns_alias(node.target) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        return node
    return node


def saved_tensors_report(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int | None = None,
    static_inputs: set[str] | None = None,
    mode: str = "",
) -> PassReport:
    """What the forward hands to the backward, and what the backward recomputes.

    ``details["saved"]``: one entry per saved value (the backward's non-tangent
    placeholders, in order): name, shape, dtype, bytes, the ``storage`` it lives
    in (itself, or the base of a view) and that storage's bytes, kind, block, role
    (the checkpoint pass's, else "partitioner") and module path. Kinds:

    - "input": a primal (parameter, buffer, data input) or a view of one;
    - "weight": computed from parameters and buffers alone (``static_inputs``),
      e.g. the concatenated weights of a group: no per-token memory;
    - "rng_state": generator state kept to recompute a random op (SDPA on CPU);
    - "symint": a saved size;
    - "activation": everything else.

    ``details["recomputed"]``: per block, the forward ops the backward runs again.
    ``details["collectives"]``: functional collectives in the forward and backward.
    """
    report = PassReport("saved_tensors")
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    fw_calls = {n.name: n for n in fw.graph.nodes if n.op == "call_function"}
    static = static_inputs or set()
    weight_only = _weight_only(fw.graph, static)

    def block_of(node: fx.Node) -> str:
        src = fw_nodes.get(node.name)
        return (_find_block(src) if src is not None else None) or _find_block(node) or "-"

    saved = []
    for node in bw.graph.find_nodes(op="placeholder"):
        if node.name.startswith(("tangents", "bwd_seed", "bwd_base_offset")):
            continue
        val = node.meta.get("val")
        info = (node.meta.get("custom") or {}).get(META_KEY) or {}
        src = fw_nodes.get(node.name)
        base = storage_base(src) if src is not None else node
        if node.name.startswith("rng_state"):
            kind = "rng_state"
        elif not isinstance(val, torch.Tensor):
            kind = "symint"
        elif base.op == "placeholder":
            kind = "input"
        elif base in weight_only:
            kind = "weight"
        else:
            kind = "activation"
        base_val = base.meta.get("val") if base is not node else val
        saved.append({
            "name": node.name,
            "shape": list(val.shape) if isinstance(val, torch.Tensor) else [],
            "dtype": str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else type(val).__name__,
            "bytes": _nbytes(val),
            "storage": base.name,
            "storage_bytes": _nbytes(base_val),
            "kind": kind,
            "block": block_of(node),
            "role": info.get("role") or "partitioner",
            "module": _module_path(node.meta) or "-",
        })
    recomputed: dict[str, dict[str, int]] = {}
    for node in bw.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        src = fw_calls.get(node.name)
        if getattr(node.target, "__name__", "") == "run_with_rng_state":
            # a random op replayed from its saved generator state (new name in backward)
            target, block = node.args[1], _find_block(node) or "-"
        elif src is not None:
            target, block = node.target, _find_block(src) or "-"
        else:
            continue
        op = str(getattr(target, "overloadpacket", target))
        per = recomputed.setdefault(block, {})
        per[op] = per.get(op, 0) + 1
    fw_out = fw.graph.find_nodes(op="output")[0].args[0]
    report.details = {
        "mode": mode,
        "saved": saved,
        "recomputed": {b: dict(sorted(c.items())) for b, c in recomputed.items()},
        "collectives": {
            "forward": sum(1 for n in fw.graph.nodes if n.op == "call_function" and _collective_target(n.target)),
            "backward": sum(1 for n in bw.graph.nodes if n.op == "call_function" and _collective_target(n.target)),
        },
        "num_fwd_outputs": num_fwd_outputs,
        "fw_output_names": [getattr(o, "name", None) for o in fw_out],
    }
    report.found = [s["name"] for s in saved]
    return report


def _weight_only(graph: fx.Graph, static: set[str]) -> set[fx.Node]:
    """Call nodes whose every placeholder ancestor is a parameter or buffer."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if all(a in out or (a.op == "placeholder" and a.name in static) for a in inputs):
            out.add(node)
    return out


def activation_bytes(report: PassReport) -> dict[str, int]:
    """Saved bytes per block ("-": outside the blocks), parameters and inputs excluded.

    Counts each storage once (a saved view holds its whole base alive), for the
    kinds "activation" and "rng_state" (the generator states kept to recompute
    random ops).
    """
    out: dict[str, int] = {}
    seen: set[str] = set()
    for s in report.details.get("saved", []):
        if s["kind"] in ("activation", "rng_state") and s["storage"] not in seen:
            seen.add(s["storage"])
            out[s["block"]] = out.get(s["block"], 0) + s["storage_bytes"]
    return out


def saved_markdown(report: PassReport) -> list[str]:
    """Markdown lines for ``explain``: per block, what is kept (name, shape, bytes) and recomputed."""
    details = report.details
    saved = [s for s in details.get("saved", []) if s["kind"] not in ("input", "symint")]
    per_block = activation_bytes(report)
    inputs = sum(1 for s in details.get("saved", []) if s["kind"] == "input")
    lines = [
        f"checkpoint: `{details.get('mode') or 'none'}`; kept for backward: "
        f"{sum(per_block.values()):,} bytes of activations in {len(saved)} tensors "
        f"(and {inputs} parameters/inputs, not counted); "
        f"collectives forward/backward: {details['collectives']['forward']}/{details['collectives']['backward']}",
        "",
        "| block | tensor | shape | dtype | bytes | kind | kept as |",
        "|---|---|---|---|---:|---|---|",
    ]
    for s in saved:
        alias = f" (view of {s['storage']})" if s["storage"] != s["name"] else ""
        lines.append(
            f"| {s['block']} | {s['name']}{alias} | {s['shape']} | {s['dtype']} | {s['bytes']:,} "
            f"| {s['kind']} | {s['role']} |"
        )
    lines += ["", "| block | bytes kept | recomputed in backward |", "|---|---:|---|"]
    recomputed = details.get("recomputed", {})
    for block in sorted(set(per_block) | set(recomputed), key=_block_order):
        ops = recomputed.get(block, {})
        top = ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"| {block} | {per_block.get(block, 0):,} | {top or '-'} |")
    return lines + [""]


def _block_order(block: str) -> tuple[int, str, int]:
    """Blocks in layer order (``layers.2`` before ``layers.10``), "-" last."""
    if block == "-":
        return (1, "", 0)
    head, _, tail = block.rpartition(".")
    return (0, head, int(tail)) if tail.isdigit() else (0, block, 0)


__all__: list[str] = [
    "CheckpointPass",
    "CheckpointPartitioner",
    "CheckpointPlan",
    "activation_bytes",
    "checkpoint_partitioner",
    "force_save_collectives",
    "is_collective",
    "plan_checkpoint",
    "saved_markdown",
    "saved_tensors_report",
    "storage_base",
]
