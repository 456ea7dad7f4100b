"""``GraphView``: one view of a Dynamo-captured (Torch IR) graph that every pass reads.

Dynamo hands the backend a ``GraphModule`` whose parameters are placeholders; the
real tensors come in ``example_inputs``. ``GraphView`` finds, once:

- linears: ``F.linear(x, W[, b])``, ``x @ W`` / ``torch.matmul(x, W)``,
  ``torch.mm(x2d, W)`` and ``torch.addmm(b, x2d, W)`` where W is a parameter
  (also ``x @ W.t()``);
- bottleneck chains: ``linear(x, A) -> [elementwise act] -> linear(., B)`` with the
  inner width r at most ``bottleneck_max_ratio`` of both outer widths; between the
  activation and ``B`` the latent may go through elementwise work that keeps its
  shape (:meth:`GraphView.latent_path`): LaX's crossing ``h_i + h_{i-1}`` (the same
  projection's latent one block earlier), a scale, a gate; the latent may have
  other users (LaX carries it to the next block);
- sibling groups: two or more linears that read the same input and have no path
  between them (q/k/v, gate/up);
- RMSNorm and LayerNorm sites (``norm_match``), with or without a weight;
- the residual stream: the chain of adds ``h = h + branch(h)``.

A networkx DiGraph mirrors the FX data-flow edges for reachability questions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis.fx_utils import (
    ACTIVATION_METHODS,
    ACTIVATION_TARGETS,
    ADD_TARGETS,
    ADDMM_TARGETS,
    LATENT_OP_METHODS,
    LATENT_OP_TARGETS,
    LINEAR_TARGETS,
    MATMUL_TARGETS,
    MM_TARGETS,
    count_ops,
    is_call,
    is_full_view,
    meta_tensor,
    source_to_fqn,
    static_shape,
)
from boost_compile.analysis.norm_match import LayerNormSite, RMSNormSite, find_layernorms, find_rmsnorms
from boost_compile.config import AnalysisConfig


@dataclass
class LinearSite:
    """One GEMM against a parameter: ``out = input @ W(^T) [+ bias]``.

    ``layout`` is "out_in" for ``F.linear`` (W is [d_out, d_in]) and "in_out" for
    ``x @ W`` (W is [d_in, d_out]).
    """

    node: fx.Node
    input: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    d_in: int
    d_out: int
    layout: str
    form: str
    param_name: str | None = None

    @property
    def name(self) -> str:
        """The owning module's name (``layers.0.attention.q_proj``) or the node's."""
        if self.param_name is None:
            return self.node.name
        return self.param_name.removesuffix(".weight")


@dataclass
class BottleneckChain:
    """``up(act(down(x)) [op ...])`` with a narrow inner width ``rank``.

    ``latent_ops``: the elementwise nodes between the activation (or the down factor)
    and ``up``, in order (empty for a plain bottleneck); ``crossings``: the other
    tensors of the same shape they combine with (LaX: the previous block's latent).
    """

    down: LinearSite
    up: LinearSite
    activation: str | None
    activation_node: fx.Node | None
    rank: int
    latent_ops: tuple[fx.Node, ...] = ()
    crossings: tuple[fx.Node, ...] = ()

    @property
    def name(self) -> str:
        return _common_prefix(self.down.name, self.up.name) or self.down.name

    @property
    def latent(self) -> fx.Node:
        """The latent other chains may cross with: the activation's output, else the down factor's."""
        return self.activation_node or self.down.node


@dataclass
class SiblingGroup:
    """Linears that read one input and are independent of one another."""

    input: fx.Node
    members: list[LinearSite]

    @property
    def name(self) -> str:
        return "+".join(m.name for m in self.members)



def _common_prefix(a: str, b: str) -> str:
    parts_a, parts_b = a.split("."), b.split(".")
    common = []
    for x, y in zip(parts_a, parts_b, strict=False):
        if x != y:
            break
        common.append(x)
    return ".".join(common)



# ----------------------------------------------------------------------------- the view


class GraphView:
    """Structures of one captured graph; computed lazily, once each."""

    def __init__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any] | None = None,
        config: AnalysisConfig | None = None,
    ) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.config = config or AnalysisConfig()
        self.example_inputs = list(example_inputs) if example_inputs is not None else None
        # Dynamo drops the placeholders' source metadata once the backend
        # returns, so parameter names are read now, not lazily.
        self.param_names = self._read_param_names()

    # -- placeholders and parameters ------------------------------------------------

    @cached_property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def _read_param_names(self) -> dict[fx.Node, str]:
        """Placeholder (or get_attr) -> fully-qualified parameter name."""
        names: dict[fx.Node, str] = {}
        for i, node in enumerate(self.placeholders):
            if not self._is_param_placeholder(node, i):
                continue
            source = compat.placeholder_source_name(node)
            names[node] = source_to_fqn(source) if source is not None else node.name
        for node in self.graph.nodes:
            if node.op == "get_attr":
                names[node] = str(node.target)
            elif is_full_view(node) and node.args[0] in names:
                # a sharded parameter seen whole while tracing (parallelize_): the parameter itself
                names[node] = names[node.args[0]]
        return names

    def _is_param_placeholder(self, node: fx.Node, index: int) -> bool:
        if self.example_inputs is not None and index < len(self.example_inputs):
            value = self.example_inputs[index]
            if isinstance(value, torch.nn.Parameter):
                return True
        source = compat.placeholder_source_name(node)
        return source is not None and "_parameters[" in source

    def is_param(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and node in self.param_names

    def example_of(self, node: fx.Node) -> Any:
        """The real tensor behind a placeholder, when example inputs were given."""
        if self.example_inputs is None or node.op != "placeholder":
            return None
        return self.example_inputs[self.placeholders.index(node)]

    # -- the networkx view ----------------------------------------------------------

    @cached_property
    def nx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for node in self.graph.nodes:
            g.add_node(node)
            for user in node.users:
                g.add_edge(node, user)
        return g

    def has_path(self, a: fx.Node, b: fx.Node) -> bool:
        return a is not b and nx.has_path(self.nx, a, b)

    def ancestors(self, node: fx.Node) -> set[fx.Node]:
        return nx.ancestors(self.nx, node)

    def descendants(self, node: fx.Node) -> set[fx.Node]:
        return nx.descendants(self.nx, node)

    # -- linears --------------------------------------------------------------------

    @cached_property
    def linears(self) -> list[LinearSite]:
        sites = [s for n in self.graph.nodes if (s := self._match_linear(n)) is not None]
        return sites

    @cached_property
    def linear_by_node(self) -> dict[fx.Node, LinearSite]:
        return {s.node: s for s in self.linears}

    def weight_shape(self, node: fx.Node) -> tuple[int, ...] | None:
        """Shape of a parameter placeholder, or of a tensor attribute (``get_attr``)."""
        if node.op == "get_attr":
            value: Any = self.gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            return tuple(value.shape) if isinstance(value, torch.Tensor) else None
        return static_shape(node)

    def _weight_of(self, node: Any) -> tuple[fx.Node, bool] | None:
        """A parameter node used directly, or through ``.t()``/``.T`` (second item: transposed)."""
        if not isinstance(node, fx.Node):
            return None
        if self.is_param(node):
            return node, False
        transposed = (
            (node.op == "call_method" and node.target == "t")
            or (node.op == "call_function" and node.target in (torch.t, torch.Tensor.t))
            or (node.op == "call_function" and node.target is getattr and node.args[1] == "T")
        )
        if transposed and self.is_param(node.args[0]):
            return node.args[0], True
        return None

    def _match_linear(self, node: fx.Node) -> LinearSite | None:
        if node.op not in ("call_function", "call_method"):
            return None
        if is_call(node, LINEAR_TARGETS):
            x, w = node.args[0], node.args[1]
            b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if not self.is_param(w):
                return None
            shape = self.weight_shape(w)
            if shape is None or len(shape) != 2:
                return None
            return self._site(node, x, w, b, shape[1], shape[0], "out_in", "linear")
        if is_call(node, MATMUL_TARGETS, "matmul") or is_call(node, MM_TARGETS, "mm"):
            x, w = node.args[0], node.args[1]
            found = self._weight_of(w)
            if found is None:
                return None
            param, transposed = found
            shape = self.weight_shape(param)
            if shape is None or len(shape) != 2:
                return None
            form = "mm" if is_call(node, MM_TARGETS, "mm") else "matmul"
            if transposed:
                return self._site(node, x, param, None, shape[1], shape[0], "out_in", form)
            return self._site(node, x, param, None, shape[0], shape[1], "in_out", form)
        if is_call(node, ADDMM_TARGETS, "addmm"):
            b, x, w = node.args[0], node.args[1], node.args[2]
            found = self._weight_of(w)
            if found is None or not self.is_param(b):
                return None
            param, transposed = found
            shape = self.weight_shape(param)
            if shape is None or len(shape) != 2:
                return None
            d_in, d_out = (shape[1], shape[0]) if transposed else shape
            return self._site(node, x, param, b, d_in, d_out, "out_in" if transposed else "in_out", "addmm")
        return None

    def _site(self, node, x, w, b, d_in, d_out, layout, form) -> LinearSite | None:
        if not isinstance(x, fx.Node):
            return None
        return LinearSite(
            node=node, input=x, weight=w, bias=b if isinstance(b, fx.Node) else None,
            d_in=int(d_in), d_out=int(d_out), layout=layout, form=form,
            param_name=self.param_names.get(w),
        )

    # -- bottlenecks ----------------------------------------------------------------

    @cached_property
    def bottlenecks(self) -> list[BottleneckChain]:
        chains = []
        max_ratio = self.config.bottleneck_max_ratio
        for down in self.linears:
            start, act, act_node = down.node, None, None
            users = list(down.node.users)
            if len(users) == 1 and (act_name := self._activation_name(users[0])) is not None:
                act, act_node = act_name, users[0]
                start = act_node
            found = self.latent_path(start)
            if found is None:
                continue
            up, ops = found
            r = down.d_out
            if up.d_in != r:
                continue
            if r <= max_ratio * down.d_in and r <= max_ratio * up.d_out:
                crossings = tuple(
                    a for op in ops for a in op.all_input_nodes
                    if a is not start and a not in ops and _same_shape(a, start)
                )
                chains.append(BottleneckChain(down, up, act, act_node, r, ops, crossings))
        return chains

    def latent_path(self, start: fx.Node) -> tuple[LinearSite, tuple[fx.Node, ...]] | None:
        """The up factor a latent ``start`` feeds, and the elementwise nodes on the way.

        The first linear (in graph order) whose input is ``start`` or is reached
        from it through binary elementwise ops (:data:`LATENT_OP_TARGETS`) whose
        output keeps ``start``'s shape and whose other operand is a scalar, a tensor
        of that shape (another latent) or one that is the same for every token (a
        scale, or a gate over the r channels). None when no linear is reached that way.
        """
        order = self._order
        reached, todo, via = {start}, [start], {start: ()}
        best: tuple[int, LinearSite, tuple[fx.Node, ...]] | None = None
        while todo:
            node = todo.pop()
            for user in node.users:
                site = self.linear_by_node.get(user)
                if site is not None and site.input is node:
                    if best is None or order[user] < best[0]:
                        best = (order[user], site, via[node])
                elif user not in reached and self._latent_op(user, node, start):
                    reached.add(user)
                    via[user] = (*via[node], user)
                    todo.append(user)
        return None if best is None else (best[1], best[2])

    @cached_property
    def _order(self) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(self.graph.nodes)}

    @staticmethod
    def _latent_op(node: fx.Node, operand: fx.Node, latent: fx.Node) -> bool:
        """``node`` combines ``operand`` elementwise with a scalar, a same-shaped tensor or a
        small broadcast one, keeping ``latent``'s shape."""
        if not is_call(node, LATENT_OP_TARGETS) and not (node.op == "call_method" and node.target in LATENT_OP_METHODS):
            return False
        if node.kwargs or len(node.args) != 2 or not _same_shape(node, latent):
            return False
        other = node.args[1] if node.args[0] is operand else node.args[0]
        if other is operand:
            return False
        if isinstance(other, (int, float)):
            return True
        value = meta_tensor(other) if isinstance(other, fx.Node) else None
        shape = static_shape(latent)
        if value is None or shape is None:
            return False
        dims = tuple(value.shape)
        # another latent, or the same value for every token (a scalar tensor, a gate over the r channels)
        return dims == shape or (all(s == 1 for s in dims[:-1]) and (not dims or dims[-1] in (1, shape[-1])))

    @staticmethod
    def _activation_name(node: fx.Node) -> str | None:
        if node.op == "call_function" and node.target in ACTIVATION_TARGETS:
            return ACTIVATION_TARGETS[node.target]
        if node.op == "call_method" and node.target in ACTIVATION_METHODS:
            return ACTIVATION_METHODS[node.target]
        return None

    # -- sibling groups -------------------------------------------------------------

    @cached_property
    def sibling_groups(self) -> list[SiblingGroup]:
        by_input: dict[fx.Node, list[LinearSite]] = {}
        for site in self.linears:
            by_input.setdefault(site.input, []).append(site)
        groups = []
        for inp, members in by_input.items():
            if len(members) < 2:
                continue
            # Greedy: keep members in graph order with no path to an earlier member.
            independent: list[LinearSite] = []
            for m in members:
                if all(not self.has_path(o.node, m.node) and not self.has_path(m.node, o.node) for o in independent):
                    independent.append(m)
            if len(independent) >= 2:
                groups.append(SiblingGroup(inp, independent))
        return groups

    # -- RMSNorm --------------------------------------------------------------------

    @cached_property
    def rmsnorms(self) -> list[RMSNormSite]:
        """Every RMSNorm site (see ``norm_match.find_rmsnorms``)."""
        return find_rmsnorms(self.graph, self.is_param, self.param_names)

    @cached_property
    def layernorms(self) -> list[LayerNormSite]:
        """Every LayerNorm over the last dim (see ``norm_match.find_layernorms``)."""
        return find_layernorms(self.graph, self.param_names)

    @cached_property
    def norms(self) -> list[RMSNormSite | LayerNormSite]:
        """RMSNorm and LayerNorm sites, in graph order."""
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        return sorted([*self.rmsnorms, *self.layernorms], key=lambda s: order[s.output])

    @cached_property
    def residual_stream(self) -> list[fx.Node]:
        """The skip path: ``[source, add_1, add_2, ...]`` of a pre-norm network.

        An add is on the stream when one operand is an ancestor of the other (the
        skip operand feeds the branch). The longest such chain is the stream. Views
        between two adds that keep the last dim (OPT flattens the tokens around its
        MLP: ``h.reshape(-1, d)``, then ``.view(shape)``) are on the stream too.
        """
        skip_of: dict[fx.Node, fx.Node] = {}
        for node in self.graph.nodes:
            if not is_call(node, ADD_TARGETS, "add") or len(node.args) < 2:
                continue
            a, b = node.args[0], node.args[1]
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                continue
            if static_shape(a) is None or static_shape(a) != static_shape(b):
                continue
            if self.has_path(a, b):
                skip_of[node] = a
            elif self.has_path(b, a):
                skip_of[node] = b
        best: list[fx.Node] = []
        memo: dict[fx.Node, list[fx.Node]] = {}
        for node in self.graph.nodes:  # topological order
            if node not in skip_of:
                continue
            skip, views = skip_of[node], []
            while skip not in memo and _is_stream_view(skip):  # OPT: h.reshape(-1, d) + mlp, .view(shape)
                views.append(skip)
                skip = skip.args[0]
            chain = memo[skip] + views[::-1] + [node] if skip in memo else [skip_of[node], node]
            memo[node] = chain
            if len(chain) > len(best):
                best = chain
        return best if len(best) >= 2 else []

    @cached_property
    def _block_region(self) -> set[fx.Node]:
        """Nodes downstream of the stream's source and upstream of its last add."""
        stream = self.residual_stream
        if not stream:
            return set()
        return (nx.descendants(self.nx, stream[0]) | {stream[0]}) & nx.ancestors(self.nx, stream[-1])

    def in_block(self, site: LinearSite) -> bool:
        """Whether a linear lies on a branch that is added back into the residual stream."""
        return site.node in self._block_region

    @cached_property
    def block_linears(self) -> list[LinearSite]:
        """Linears inside the repeated blocks (not the embedding, not the output head)."""
        return [s for s in self.linears if self.in_block(s)]

    # -- summaries ------------------------------------------------------------------

    def op_counts(self) -> dict[str, int]:
        return count_ops(self.graph)

    def summary(self) -> dict[str, Any]:
        return {
            "linears": len(self.linears),
            "bottlenecks": len(self.bottlenecks),
            "sibling_groups": [len(g.members) for g in self.sibling_groups],
            "rmsnorms": {form: sum(1 for s in self.rmsnorms if s.form == form) for form in sorted({s.form for s in self.rmsnorms})},
            "layernorms": len(self.layernorms),
            "residual_adds": max(0, len(self.residual_stream) - 1),
        }


def _same_shape(a: Any, b: Any) -> bool:
    sa, sb = static_shape(a), static_shape(b)
    return sa is not None and sa == sb


def _is_stream_view(node: Any) -> bool:
    """A view or reshape of one tensor that keeps its last dim (the stream's width)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    viewing = (node.op == "call_method" and node.target in ("view", "reshape", "flatten")) or (
        node.op == "call_function" and node.target in (torch.reshape, torch.flatten)
    )
    a, b = static_shape(node), static_shape(node.args[0])
    return viewing and a is not None and b is not None and len(a) > 0 and len(b) > 0 and a[-1] == b[-1]
