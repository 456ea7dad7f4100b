"""One view of a Dynamo-captured (Torch IR) graph that every pass reads.

Dynamo hands the backend a ``GraphModule`` whose parameters are placeholders; the
real tensors come in ``example_inputs``. ``GraphView`` finds, once:

- linears: ``F.linear(x, W[, b])``, ``x @ W`` / ``torch.matmul(x, W)``,
  ``torch.mm(x2d, W)`` and ``torch.addmm(b, x2d, W)`` where W is a parameter
  (also ``x @ W.t()``);
- bottleneck chains: ``linear(x, A) -> [elementwise act] -> linear(., B)`` with the
  inner width r at most ``bottleneck_max_ratio`` of both outer widths;
- sibling groups: two or more linears that read the same input and have no path
  between them (q/k/v, gate/up);
- RMSNorm sites: ``torch.rms_norm`` / ``nn.RMSNorm``, the decomposed
  ``x * rsqrt(mean(x^2) + eps) * w`` chain in its common spellings (matched by
  value: ``x.float()`` written twice is one x), Hugging Face's and Meta's
  fp32-upcast forms and the ``(1 + w)`` weight form;
- the residual stream: the chain of adds ``h = h + branch(h)``.

A networkx DiGraph mirrors the FX data-flow edges for reachability questions.
"""

from __future__ import annotations

import contextlib
import operator
import re
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from boost_compile.config import AnalysisConfig

_LINEAR_TARGETS = {torch._C._nn.linear, torch.nn.functional.linear}
_MATMUL_TARGETS = {operator.matmul, torch.matmul, torch.Tensor.matmul}
_MM_TARGETS = {torch.mm, torch.Tensor.mm}
_ADDMM_TARGETS = {torch.addmm}
_ADD_TARGETS = {operator.add, operator.iadd, torch.add, torch.Tensor.add}
_MUL_TARGETS = {operator.mul, operator.imul, torch.mul, torch.Tensor.mul}
_RMS_NORM_TARGETS = {torch.rms_norm, torch.nn.functional.rms_norm}
_RSQRT_TARGETS = {torch.rsqrt, torch.Tensor.rsqrt}

#: Elementwise unary activations allowed between the two factors of a bottleneck.
ACTIVATION_TARGETS: dict[Any, str] = {
    torch.nn.functional.silu: "silu",
    torch.nn.functional.gelu: "gelu",
    torch.nn.functional.relu: "relu",
    torch.relu: "relu",
    torch.sigmoid: "sigmoid",
    torch.tanh: "tanh",
}
_ACTIVATION_METHODS = {"silu": "silu", "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh"}


# ----------------------------------------------------------------------------- sites


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
    """``up(act(down(x)))`` with a narrow inner width ``rank``."""

    down: LinearSite
    up: LinearSite
    activation: str | None
    activation_node: fx.Node | None
    rank: int

    @property
    def name(self) -> str:
        return _common_prefix(self.down.name, self.up.name) or self.down.name


@dataclass
class SiblingGroup:
    """Linears that read one input and are independent of one another."""

    input: fx.Node
    members: list[LinearSite]

    @property
    def name(self) -> str:
        return "+".join(m.name for m in self.members)


@dataclass
class RMSNormSite:
    """An RMSNorm: ``out = x * rsqrt(mean(x^2, -1) + eps) * (offset + w)``.

    ``form``: "fused" (torch.rms_norm), "decomposed", "hf_upcast" (computed in
    fp32 and cast back before the weight), "one_plus_w" (Gemma's (1 + w) weight).
    ``nodes`` are every node the site replaces (for a rewrite to erase).
    """

    form: str
    input: fx.Node
    output: fx.Node
    weight: fx.Node | None
    eps: float | None
    weight_offset: float = 0.0
    upcast: bool = False
    nodes: list[fx.Node] = field(default_factory=list)
    param_name: str | None = None

    @property
    def name(self) -> str:
        if self.param_name is None:
            return self.output.name
        return self.param_name.removesuffix(".weight")


# ----------------------------------------------------------------------------- helpers


def meta_tensor(node: Any) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    t = meta_tensor(node)
    if t is None:
        return None
    try:
        return tuple(int(s) for s in t.shape)
    except TypeError:  # symbolic sizes
        return None


def _is(node: fx.Node, targets: set, method: str | None = None) -> bool:
    if node.op == "call_function" and node.target in targets:
        return True
    return method is not None and node.op == "call_method" and node.target == method


def _common_prefix(a: str, b: str) -> str:
    parts_a, parts_b = a.split("."), b.split(".")
    common = []
    for x, y in zip(parts_a, parts_b, strict=False):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]")


def source_to_fqn(source_name: str) -> str:
    """``L['self']._modules['layers']._modules['0']._parameters['weight']`` -> ``layers.0.weight``."""
    starts = [i for key in ("._modules[", "._parameters[", "._buffers[") if (i := source_name.find(key)) >= 0]
    if starts:  # everything before the first module attribute is the root (L['self'], L['args'][0], ...)
        rest = source_name[min(starts):]
    else:
        head = re.match(r"L\['[^']+'\]", source_name)
        rest = source_name[head.end():] if head else source_name
    parts = [m.group(1) or m.group(2) or m.group(3) for m in _SOURCE_PART.finditer(rest)]
    return ".".join(p for p in parts if p is not None)


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
        # Dynamo drops the placeholders' "grapharg" metadata once the backend
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
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            names[node] = source_to_fqn(source.name) if source is not None else node.name
        for node in self.graph.nodes:
            if node.op == "get_attr":
                names[node] = str(node.target)
            elif _is_full_view(node) and node.args[0] in names:
                # a sharded parameter seen whole while tracing (parallelize_): the parameter itself
                names[node] = names[node.args[0]]
        return names

    def _is_param_placeholder(self, node: fx.Node, index: int) -> bool:
        if self.example_inputs is not None and index < len(self.example_inputs):
            value = self.example_inputs[index]
            if isinstance(value, torch.nn.Parameter):
                return True
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        return source is not None and "_parameters[" in source.name

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
        return _shape(node)

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
        if _is(node, _LINEAR_TARGETS):
            x, w = node.args[0], node.args[1]
            b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if not self.is_param(w):
                return None
            shape = self.weight_shape(w)
            if shape is None or len(shape) != 2:
                return None
            return self._site(node, x, w, b, shape[1], shape[0], "out_in", "linear")
        if _is(node, _MATMUL_TARGETS, "matmul") or _is(node, _MM_TARGETS, "mm"):
            x, w = node.args[0], node.args[1]
            found = self._weight_of(w)
            if found is None:
                return None
            param, transposed = found
            shape = self.weight_shape(param)
            if shape is None or len(shape) != 2:
                return None
            form = "mm" if _is(node, _MM_TARGETS, "mm") else "matmul"
            if transposed:
                return self._site(node, x, param, None, shape[1], shape[0], "out_in", form)
            return self._site(node, x, param, None, shape[0], shape[1], "in_out", form)
        if _is(node, _ADDMM_TARGETS, "addmm"):
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
            users = list(down.node.users)
            if len(users) != 1:
                continue
            nxt, act, act_node = users[0], None, None
            act_name = self._activation_name(nxt)
            if act_name is not None:
                act, act_node = act_name, nxt
                if len(nxt.users) != 1:
                    continue
                nxt = next(iter(nxt.users))
            up = self.linear_by_node.get(nxt)
            if up is None or up.input is not (act_node or down.node):
                continue
            r = down.d_out
            if up.d_in != r:
                continue
            if r <= max_ratio * down.d_in and r <= max_ratio * up.d_out:
                chains.append(BottleneckChain(down, up, act, act_node, r))
        return chains

    @staticmethod
    def _activation_name(node: fx.Node) -> str | None:
        if node.op == "call_function" and node.target in ACTIVATION_TARGETS:
            return ACTIVATION_TARGETS[node.target]
        if node.op == "call_method" and node.target in _ACTIVATION_METHODS:
            return _ACTIVATION_METHODS[node.target]
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
        """Every RMSNorm: ``torch.rms_norm`` nodes, and the spelled-out forms found from
        their ``rsqrt`` or ``sqrt`` (see ``_decomposed_rmsnorm``)."""
        sites = []
        for node in self.graph.nodes:
            if _is(node, _RMS_NORM_TARGETS):
                sites.append(self._fused_rmsnorm(node))
            elif _is(node, _RSQRT_TARGETS, "rsqrt") or _is(node, _SQRT_TARGETS, "sqrt"):
                site = self._decomposed_rmsnorm(node)
                if site is not None:
                    sites.append(site)
        return sites

    @cached_property
    def _node_order(self) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def _fused_rmsnorm(self, node: fx.Node) -> RMSNormSite:
        args = list(node.args) + [None] * 4
        weight = args[2] if args[2] is not None else node.kwargs.get("weight")
        eps = args[3] if args[3] is not None else node.kwargs.get("eps")
        return RMSNormSite(
            form="fused", input=node.args[0], output=node, weight=weight, eps=eps,
            nodes=[node], param_name=self.param_names.get(weight) if isinstance(weight, fx.Node) else None,
        )

    def _decomposed_rmsnorm(self, root: fx.Node) -> RMSNormSite | None:
        """Match outward from the ``rsqrt``/``sqrt`` of ``x * rsqrt(mean(x^2, -1) + eps) * w``.

        Values, not node identity: the two uses of ``x`` (in the square and in the
        product) may be two nodes that compute the same value (``x.float()`` written
        twice, see ``_same_value``). Accepted spellings:

        - square: ``x * x``, ``x ** 2``, ``x.pow(2)``, ``torch.square(x)``;
        - statistic over the last dim with keepdim: ``mean(., -1)`` (dim ``-1``,
          ``[-1]`` or the last index), ``sum(., -1) / d`` or ``sum(., -1) * (1 / d)``;
        - ``v + eps`` or ``eps + v``;
        - ``x * rsqrt(.)``, ``x * (1 / sqrt(.))``, ``x * sqrt(.).reciprocal()``, ``x / sqrt(.)``;
        - an fp32 upcast of the input (``x.float()``, ``x.to(torch.float32)``, ...);
        - weight ``w``, ``w.float()`` or ``1 + w``, with a cast back to the input's dtype
          before the weight multiply (Hugging Face's and Meta's Llama: "hf_upcast") or
          after it (Gemma).
        """
        memo: dict = {}
        if len(root.args) != 1 or root.kwargs:
            return None
        plus = root.args[0]
        if not isinstance(plus, fx.Node) or not _is(plus, _ADD_TARGETS, "add") or plus.kwargs:
            return None
        stat, eps = _split_const(plus)
        found = _mean_over_last_dim(stat)
        if found is None:
            return None
        sq, stat_nodes = found
        x_sq = _square_base(sq, memo)
        if x_sq is None:
            return None
        product = _times_inverse_root(root, x_sq, memo)
        if product is None:
            return None
        normed, x_mul, root_nodes = product
        pattern = [sq, *stat_nodes, plus, *root_nodes]
        inp, upcast = x_sq, False
        if _is_cast(x_sq, to_fp32=True):
            inp, upcast = x_sq.args[0], True
            pattern.append(x_sq)
        if x_mul is not x_sq and x_mul is not inp:  # the same value written twice
            upcast = upcast or _is_cast(x_mul, to_fp32=True)
            pattern.append(x_mul)
        out, cast_before = normed, False
        # optional cast back to the input dtype, then the weight multiply
        cast = _sole_user(out)
        if _casts_back(cast, out, inp):
            out, cast_before = cast, True
            pattern.append(cast)
        weight, offset = None, 0.0
        mul = _sole_user(out)
        if mul is not None and _is(mul, _MUL_TARGETS, "mul") and len(mul.args) == 2 and not mul.kwargs:
            other = mul.args[1] if mul.args[0] is out else mul.args[0]
            w, off, w_nodes = self._weight_factor(other)
            if w is not None:
                weight, offset = w, off
                pattern.extend(w_nodes + [mul])
                out = mul
                # Gemma casts back after the weight multiply.
                cast = _sole_user(out)
                if _casts_back(cast, out, inp):
                    out = cast
                    pattern.append(cast)
        if offset:
            form = "one_plus_w"
        elif upcast and cast_before:
            form = "hf_upcast"
        else:
            form = "decomposed"
        return RMSNormSite(
            form=form, input=inp, output=out, weight=weight, eps=eps, weight_offset=offset,
            upcast=upcast, nodes=self._replaced_nodes(pattern, out),
            param_name=self.param_names.get(weight) if weight is not None else None,
        )

    def _replaced_nodes(self, pattern: list[fx.Node], output: fx.Node) -> list[fx.Node]:
        """The nodes of ``pattern`` that die once ``output`` is replaced, in graph order.

        A matched node that something outside the site also reads (a cast of the
        input the rest of the block reuses) stays out: it is not the site's to erase.
        """
        order = self._node_order
        dead = {output}
        for node in sorted(set(pattern), key=order.__getitem__, reverse=True):  # users first
            if node is not output and node.users and all(u in dead for u in node.users):
                dead.add(node)
        return sorted(dead, key=order.__getitem__)

    def _weight_factor(self, node: Any) -> tuple[fx.Node | None, float, list[fx.Node]]:
        """``w``, ``w.float()`` or ``1 + w`` (any order); returns (param, offset, nodes)."""
        if not isinstance(node, fx.Node):
            return None, 0.0, []
        if self.is_param(node):
            return node, 0.0, []
        if _is_cast(node):
            inner, off, inner_nodes = self._weight_factor(node.args[0])
            if inner is not None:
                return inner, off, inner_nodes + [node]
        if _is(node, _ADD_TARGETS, "add") and not node.kwargs:
            base, const = _split_const(node)
            if base is not None and const is not None:
                inner, off, inner_nodes = self._weight_factor(base)
                if inner is not None and off == 0.0:
                    return inner, float(const), inner_nodes + [node]
        return None, 0.0, []

    @cached_property
    def residual_stream(self) -> list[fx.Node]:
        """The skip path: ``[source, add_1, add_2, ...]`` of a pre-norm network.

        An add is on the stream when one operand is an ancestor of the other (the
        skip operand feeds the branch). The longest such chain is the stream.
        """
        skip_of: dict[fx.Node, fx.Node] = {}
        for node in self.graph.nodes:
            if not _is(node, _ADD_TARGETS, "add") or len(node.args) < 2:
                continue
            a, b = node.args[0], node.args[1]
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                continue
            if _shape(a) is None or _shape(a) != _shape(b):
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
            skip = skip_of[node]
            chain = memo[skip] + [node] if skip in memo else [skip, node]
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
            "residual_adds": max(0, len(self.residual_stream) - 1),
        }


@contextlib.contextmanager
def private_forward(model: Any) -> Iterator[None]:
    """Run ``model``'s ``forward`` from a copy of its code object while inside.

    Dynamo keeps compiled entries on the code object, and every instance of a
    class shares one. A capture made only to look at the graph (``capture_views``,
    ``parallelize_``'s check) would otherwise leave an entry on the class's
    ``forward``: it counts against Dynamo's recompile limit for every instance
    (pipeline stages of one class on one rank) and is evaluated before each call.
    The copy, and its entries, are dropped on exit.
    """
    method = getattr(model, "forward", None)
    func = getattr(method, "__func__", None)
    if not isinstance(model, torch.nn.Module) or not isinstance(func, types.FunctionType) or "forward" in vars(model):
        yield
        return
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__dict__ = func.__kwdefaults__, dict(func.__dict__)
    copy.__qualname__, copy.__module__ = func.__qualname__, func.__module__
    model.forward = types.MethodType(copy, model)
    try:
        yield
    finally:
        del model.forward


def capture_views(
    model: Any, *example_inputs: Any, config: AnalysisConfig | None = None, grad: bool = False
) -> list[GraphView]:
    """Capture ``model(*example_inputs)`` with Dynamo and analyse each graph (no compile)."""
    views: list[GraphView] = []

    def backend(gm: fx.GraphModule, inputs: Sequence[Any]) -> Any:
        views.append(GraphView(gm, inputs, config))
        return gm.forward

    with torch.set_grad_enabled(grad), private_forward(model):
        torch.compile(model, backend=backend, dynamic=False)(*example_inputs)
    return views


def graph_kind(graph: fx.Graph) -> str:
    """"backward" for an AOT backward graph (it takes ``tangents_*``), else "forward"."""
    names = (n.name for n in graph.nodes if n.op == "placeholder")
    return "backward" if any(name.startswith("tangents") for name in names) else "forward"


def count_ops(graph: fx.Graph) -> dict[str, int]:
    """``{op name: count}`` over the call nodes of a graph."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            key = node_target_name(node)
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def node_target_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket).replace("aten.", "aten.")
    name = getattr(target, "__name__", str(target))
    module = getattr(target, "__module__", "") or ""
    if module.startswith("_operator"):
        return f"operator.{name}"
    return name


# ----------------------------------------------------------------------------- small matchers


def _is_full_view(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "tp_full_view.default"


_SQRT_TARGETS = {torch.sqrt, torch.Tensor.sqrt}
_RECIPROCAL_TARGETS = {torch.reciprocal, torch.Tensor.reciprocal}
_DIV_TARGETS = {operator.truediv, torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.true_divide}
_MEAN_TARGETS = {torch.mean, torch.Tensor.mean}
_SUM_TARGETS = {torch.sum, torch.Tensor.sum}
_POW_TARGETS = {operator.pow, torch.pow, torch.Tensor.pow}
_SQUARE_TARGETS = {torch.square, torch.Tensor.square}
_CAST_METHODS = ("to", "type", "type_as", "float", "half", "bfloat16", "double")
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.setitem, operator.delitem,
}
#: Ops whose name says they draw random numbers or return uninitialised memory: never equal.
_NONDETERMINISTIC_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson", "empty")
#: How deep ``_same_value`` follows two computations before it gives up (answers False).
_SAME_VALUE_DEPTH = 64


def _split_const(node: Any) -> tuple[fx.Node | None, float | None]:
    """For ``a + c`` / ``c + a`` (or ``*``) with c a Python number: (a, c)."""
    if not isinstance(node, fx.Node):
        return None, None
    a, b = (list(node.args) + [None, None])[:2]
    if isinstance(a, fx.Node) and _is_number(b):
        return a, float(b)
    if isinstance(b, fx.Node) and _is_number(a):
        return b, float(a)
    return None, None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sole_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_last_dim_keepdim(mean: fx.Node) -> bool:
    """``mean``/``sum`` over the last dim alone (``-1``, ``[-1]`` or the last index), keepdim."""
    if set(mean.kwargs) - {"dim", "keepdim"} or len(mean.args) > 3 or not mean.args:
        return False  # dtype=..., out=...: not the plain statistic
    dim = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or isinstance(dim, bool):
        return False
    x = _shape(mean.args[0])
    last = -1 if x is None else len(x) - 1
    return keepdim is True and dim in (-1, last)


def _mean_over_last_dim(stat: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """``mean(s, -1, keepdim=True)``, ``sum(s, -1, keepdim=True) / d`` or ``* (1 / d)``
    with d the last dim's size: (s, the statistic's nodes)."""
    if not isinstance(stat, fx.Node):
        return None
    if _is(stat, _MEAN_TARGETS, "mean"):
        return (stat.args[0], [stat]) if _is_last_dim_keepdim(stat) and isinstance(stat.args[0], fx.Node) else None
    if stat.kwargs or len(stat.args) != 2:
        return None
    if _is(stat, _DIV_TARGETS, "div"):
        total, d = stat.args
        if not _is_number(d) or d == 0:
            return None
        inv_d = 1.0 / d
    elif _is(stat, _MUL_TARGETS, "mul"):
        total, inv_d = _split_const(stat)
    else:
        return None
    if not isinstance(total, fx.Node) or not _is(total, _SUM_TARGETS, "sum") or not _is_last_dim_keepdim(total):
        return None
    shape = _shape(total.args[0])
    if not shape or inv_d is None or abs(inv_d * shape[-1] - 1.0) > 1e-9:
        return None
    return total.args[0], [total, stat]


def _square_base(node: Any, memo: dict | None = None) -> fx.Node | None:
    """x for ``x ** 2``, ``x.pow(2)``, ``x * x``, ``x.square()``."""
    if not isinstance(node, fx.Node):
        return None
    if _is(node, _POW_TARGETS, "pow"):
        base = node.args[0] if node.args else None
        exponent = node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
        if isinstance(base, fx.Node) and _is_number(exponent) and exponent == 2:
            return base
        return None
    if _is(node, _MUL_TARGETS, "mul") and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        return a if isinstance(a, fx.Node) and _same_value(a, b, memo) else None
    if _is(node, _SQUARE_TARGETS, "square") and len(node.args) == 1 and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _times_inverse_root(
    root: fx.Node, x: fx.Node, memo: dict | None = None
) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """The product of x (by value) and the inverse of ``root``: ``x * rsqrt(.)``,
    ``x * (1 / sqrt(.))``, ``x * sqrt(.).reciprocal()`` or ``x / sqrt(.)``, either
    operand order. Returns (product, x as that node reads it, the nodes from root on)."""
    if _is(root, _RSQRT_TARGETS, "rsqrt"):
        inverses = [(root, [root])]
    else:  # sqrt
        inverses = []
        for u in root.users:
            if u.kwargs or not u.args or u.args[-1] is not root:
                continue
            if _is(u, _RECIPROCAL_TARGETS, "reciprocal") and len(u.args) == 1:
                inverses.append((u, [root, u]))
            elif _is(u, _DIV_TARGETS, "div") and len(u.args) == 2:
                num = u.args[0]
                if _is_number(num) and num == 1:
                    inverses.append((u, [root, u]))
                elif isinstance(num, fx.Node) and _same_value(num, x, memo):
                    return u, num, [root, u]
    for inv, nodes in inverses:
        for u in inv.users:
            if not _is(u, _MUL_TARGETS, "mul") or len(u.args) != 2 or u.kwargs:
                continue
            a, b = u.args
            other = b if a is inv else a
            if isinstance(other, fx.Node) and other is not inv and _same_value(other, x, memo):
                return u, other, nodes + [u]
    return None


def _is_cast(node: Any, to_fp32: bool = False) -> bool:
    """``x.to(dtype)``, ``x.float()``, ``x.type(dtype)``, ``x.type_as(y)``, ``x.to(y.dtype)``.

    ``to_fp32``: only a cast whose result is fp32 (read from the metadata when there is some).
    """
    if not isinstance(node, fx.Node) or node.op != "call_method" or node.target not in _CAST_METHODS:
        return False
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is not None and not isinstance(value, torch.Tensor):
        return False  # x.type() returns a string
    if not to_fp32:
        return True
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float32
    return node.target == "float" or torch.float32 in list(node.args[1:]) + list(node.kwargs.values())


def _casts_back(cast: fx.Node | None, src: fx.Node, inp: fx.Node) -> bool:
    """``cast`` is a cast of ``src`` to the dtype of ``inp`` (when the metadata says)."""
    if not _is_cast(cast) or cast.args[0] is not src:
        return False
    out, x = meta_tensor(cast), meta_tensor(inp)
    return out is None or x is None or out.dtype == x.dtype


def _cast_of(node: fx.Node) -> tuple[fx.Node, torch.dtype] | None:
    """(source, dtype) for a cast that changes nothing but the dtype (the metadata says)."""
    if not _is_cast(node):
        return None
    src, out = meta_tensor(node.args[0]), meta_tensor(node)
    if src is None or out is None or src.device != out.device:
        return None
    return node.args[0], out.dtype


def _skip_noop_casts(node: fx.Node) -> fx.Node:
    """``x.float()`` of an fp32 x is x."""
    while (cast := _cast_of(node)) is not None and meta_tensor(cast[0]).dtype == cast[1]:
        node = cast[0]
    return node


def _is_pure(node: fx.Node) -> bool:
    """A node whose value depends only on its inputs (no mutation, no randomness)."""
    if node.op == "get_attr":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if node.target in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__")):
        return False
    if any(word in name for word in _NONDETERMINISTIC_WORDS):
        return False
    try:
        return not node.is_impure()
    except Exception:  # pragma: no cover - depends on the torch version
        return True


def _same_value(a: Any, b: Any, memo: dict | None = None, depth: int = 0) -> bool:
    """Whether two node arguments hold the same value, up to common subexpressions.

    Two nodes are equal when they are the same node, or the same pure op/target on
    equal args and kwargs (either operand order for add and mul). Casts that only
    change the dtype are equal when their sources are and they produce the same
    dtype (``x.float()``, ``x.to(torch.float32)``, ``x.type(torch.float32)``); a
    cast to the dtype a value already has is that value. Python constants compare
    by ``==``, lists and tuples element-wise. Conservative: False when unsure.
    """
    if a is b:
        return True
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        a, b = _skip_noop_casts(a), _skip_noop_casts(b)
        if a is b:
            return True
        if depth >= _SAME_VALUE_DEPTH:
            return False
        memo = {} if memo is None else memo
        key = (a, b)
        if key not in memo:
            memo[key] = False
            memo[key] = _same_node(a, b, memo, depth + 1)
        return memo[key]
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y, memo, depth) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k], memo, depth) for k in a)
    if isinstance(a, slice) and isinstance(b, slice):
        return _same_value((a.start, a.stop, a.step), (b.start, b.stop, b.step), memo, depth)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False  # distinct tensor constants
    if _is_number(a) and _is_number(b):
        return a == b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _same_node(a: fx.Node, b: fx.Node, memo: dict, depth: int) -> bool:
    cast_a, cast_b = _cast_of(a), _cast_of(b)
    if cast_a is not None and cast_b is not None:
        return cast_a[1] == cast_b[1] and _same_value(cast_a[0], cast_b[0], memo, depth)
    if a.op != b.op or a.target != b.target or not _is_pure(a):
        return False
    if a.op == "get_attr":
        return True
    if _same_value(a.args, b.args, memo, depth) and _same_value(a.kwargs, b.kwargs, memo, depth):
        return True
    commutative = _is(a, _ADD_TARGETS, "add") or _is(a, _MUL_TARGETS, "mul")
    return (
        commutative and not a.kwargs and not b.kwargs and len(a.args) == len(b.args) == 2
        and _same_value(a.args[0], b.args[1], memo, depth) and _same_value(a.args[1], b.args[0], memo, depth)
    )
