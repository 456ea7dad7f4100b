"""Find RMSNorms in a captured graph, however the model spells them.

``find_rmsnorms`` returns one ``RMSNormSite`` per norm: ``torch.rms_norm`` /
``nn.RMSNorm`` nodes, and the decomposed ``x * rsqrt(mean(x^2) + eps) * w`` chain
in its common spellings, matched by value (``x.float()`` written twice is one x,
see ``same_value``): Hugging Face's and Meta's fp32-upcast forms, and Gemma's
``(1 + w)`` weight form. ``find_layernorms`` finds ``F.layer_norm`` / ``nn.LayerNorm``
over the last dim. A norm is found by what it computes: weight and bias are optional.
``GraphView.rmsnorms`` / ``layernorms`` call them; passes read the sites.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from boost_compile.analysis.fx_utils import (
    ADD_TARGETS,
    LAYER_NORM_TARGETS,
    MUL_TARGETS,
    RMS_NORM_TARGETS,
    RSQRT_TARGETS,
    SQRT_TARGETS,
    is_call,
    meta_tensor,
    sole_user,
    static_shape,
)


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


@dataclass
class LayerNormSite:
    """A LayerNorm over the last dim: ``out = (x - mean(x)) / sqrt(var(x) + eps) * w + b``.

    ``F.layer_norm`` / ``nn.LayerNorm`` (weight and bias optional); ``nodes`` as for
    ``RMSNormSite``. ``bias_name``: the bias parameter's name, when it has one.
    """

    input: fx.Node
    output: fx.Node
    weight: fx.Node | None
    bias: fx.Node | None
    eps: float
    nodes: list[fx.Node] = field(default_factory=list)
    param_name: str | None = None
    bias_name: str | None = None
    form: str = "layer_norm"

    @property
    def name(self) -> str:
        named = self.param_name or self.bias_name
        if named is None:
            return self.output.name
        return named.rsplit(".", 1)[0]


def find_layernorms(graph: fx.Graph, param_names: Mapping[fx.Node, str]) -> list[LayerNormSite]:
    """Every ``F.layer_norm`` / ``torch.layer_norm`` that normalises over the last dim alone."""
    sites = []
    for node in graph.nodes:
        if not is_call(node, LAYER_NORM_TARGETS):
            continue
        args = list(node.args) + [None] * 5
        x, shape = args[0], args[1] if args[1] is not None else node.kwargs.get("normalized_shape")
        weight = args[2] if args[2] is not None else node.kwargs.get("weight")
        bias = args[3] if args[3] is not None else node.kwargs.get("bias")
        eps = args[4] if args[4] is not None else node.kwargs.get("eps", 1e-5)
        if isinstance(shape, int):
            shape = (shape,)
        if not isinstance(x, fx.Node) or not isinstance(shape, (list, tuple)) or len(shape) != 1 or not _is_number(eps):
            continue  # over several dims, or a computed eps: not a site
        sites.append(LayerNormSite(
            input=x, output=node, weight=weight if isinstance(weight, fx.Node) else None,
            bias=bias if isinstance(bias, fx.Node) else None, eps=float(eps), nodes=[node],
            param_name=param_names.get(weight) if isinstance(weight, fx.Node) else None,
            bias_name=param_names.get(bias) if isinstance(bias, fx.Node) else None,
        ))
    return sites


def find_rmsnorms(
    graph: fx.Graph, is_param: Callable[[Any], bool], param_names: Mapping[fx.Node, str]
) -> list[RMSNormSite]:
    """Every RMSNorm of ``graph``: ``torch.rms_norm`` nodes, and the spelled-out forms
    found from their ``rsqrt`` or ``sqrt`` (see ``_decomposed``). ``is_param`` says
    which nodes are parameters; ``param_names`` names them."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    sites = []
    for node in graph.nodes:
        if is_call(node, RMS_NORM_TARGETS):
            sites.append(_fused(node, param_names))
        elif is_call(node, RSQRT_TARGETS, "rsqrt") or is_call(node, SQRT_TARGETS, "sqrt"):
            site = _decomposed(node, is_param, param_names, order)
            if site is not None:
                sites.append(site)
    return sites


def _fused(node: fx.Node, param_names: Mapping[fx.Node, str]) -> RMSNormSite:
    args = list(node.args) + [None] * 4
    weight = args[2] if args[2] is not None else node.kwargs.get("weight")
    eps = args[3] if args[3] is not None else node.kwargs.get("eps")
    return RMSNormSite(
        form="fused", input=node.args[0], output=node, weight=weight, eps=eps,
        nodes=[node], param_name=param_names.get(weight) if isinstance(weight, fx.Node) else None,
    )

def _decomposed(
    root: fx.Node, is_param: Callable[[Any], bool], param_names: Mapping[fx.Node, str], order: Mapping[fx.Node, int]
) -> RMSNormSite | None:
    """Match outward from the ``rsqrt``/``sqrt`` of ``x * rsqrt(mean(x^2, -1) + eps) * w``.

    Values, not node identity: the two uses of ``x`` (in the square and in the
    product) may be two nodes that compute the same value (``x.float()`` written
    twice, see ``same_value``). Accepted spellings:

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
    if not isinstance(plus, fx.Node) or not is_call(plus, ADD_TARGETS, "add") or plus.kwargs:
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
    cast = sole_user(out)
    if _casts_back(cast, out, inp):
        out, cast_before = cast, True
        pattern.append(cast)
    weight, offset = None, 0.0
    mul = sole_user(out)
    if mul is not None and is_call(mul, MUL_TARGETS, "mul") and len(mul.args) == 2 and not mul.kwargs:
        other = mul.args[1] if mul.args[0] is out else mul.args[0]
        w, off, w_nodes = _weight_factor(other, is_param)
        if w is not None:
            weight, offset = w, off
            pattern.extend(w_nodes + [mul])
            out = mul
            # Gemma casts back after the weight multiply.
            cast = sole_user(out)
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
        upcast=upcast, nodes=_replaced_nodes(pattern, out, order),
        param_name=param_names.get(weight) if weight is not None else None,
    )

def _replaced_nodes(pattern: list[fx.Node], output: fx.Node, order: Mapping[fx.Node, int]) -> list[fx.Node]:
    """The nodes of ``pattern`` that die once ``output`` is replaced, in graph order.

    A matched node that something outside the site also reads (a cast of the
    input the rest of the block reuses) stays out: it is not the site's to erase.
    """
    dead = {output}
    for node in sorted(set(pattern), key=order.__getitem__, reverse=True):  # users first
        if node is not output and node.users and all(u in dead for u in node.users):
            dead.add(node)
    return sorted(dead, key=order.__getitem__)

def _weight_factor(node: Any, is_param: Callable[[Any], bool]) -> tuple[fx.Node | None, float, list[fx.Node]]:
    """``w``, ``w.float()`` or ``1 + w`` (any order); returns (param, offset, nodes)."""
    if not isinstance(node, fx.Node):
        return None, 0.0, []
    if is_param(node):
        return node, 0.0, []
    if _is_cast(node):
        inner, off, inner_nodes = _weight_factor(node.args[0], is_param)
        if inner is not None:
            return inner, off, inner_nodes + [node]
    if is_call(node, ADD_TARGETS, "add") and not node.kwargs:
        base, const = _split_const(node)
        if base is not None and const is not None:
            inner, off, inner_nodes = _weight_factor(base, is_param)
            if inner is not None and off == 0.0:
                return inner, float(const), inner_nodes + [node]
    return None, 0.0, []


# ----------------------------------------------------------------------------- small matchers


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
#: How deep ``same_value`` follows two computations before it gives up (answers False).
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
    x = static_shape(mean.args[0])
    last = -1 if x is None else len(x) - 1
    return keepdim is True and dim in (-1, last)


def _mean_over_last_dim(stat: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """``mean(s, -1, keepdim=True)``, ``sum(s, -1, keepdim=True) / d`` or ``* (1 / d)``
    with d the last dim's size: (s, the statistic's nodes)."""
    if not isinstance(stat, fx.Node):
        return None
    if is_call(stat, _MEAN_TARGETS, "mean"):
        return (stat.args[0], [stat]) if _is_last_dim_keepdim(stat) and isinstance(stat.args[0], fx.Node) else None
    if stat.kwargs or len(stat.args) != 2:
        return None
    if is_call(stat, _DIV_TARGETS, "div"):
        total, d = stat.args
        if not _is_number(d) or d == 0:
            return None
        inv_d = 1.0 / d
    elif is_call(stat, MUL_TARGETS, "mul"):
        total, inv_d = _split_const(stat)
    else:
        return None
    if not isinstance(total, fx.Node) or not is_call(total, _SUM_TARGETS, "sum") or not _is_last_dim_keepdim(total):
        return None
    shape = static_shape(total.args[0])
    if not shape or inv_d is None or abs(inv_d * shape[-1] - 1.0) > 1e-9:
        return None
    return total.args[0], [total, stat]


def _square_base(node: Any, memo: dict | None = None) -> fx.Node | None:
    """x for ``x ** 2``, ``x.pow(2)``, ``x * x``, ``x.square()``."""
    if not isinstance(node, fx.Node):
        return None
    if is_call(node, _POW_TARGETS, "pow"):
        base = node.args[0] if node.args else None
        exponent = node.args[1] if len(node.args) > 1 else node.kwargs.get("exponent")
        if isinstance(base, fx.Node) and _is_number(exponent) and exponent == 2:
            return base
        return None
    if is_call(node, MUL_TARGETS, "mul") and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        return a if isinstance(a, fx.Node) and same_value(a, b, memo) else None
    if is_call(node, _SQUARE_TARGETS, "square") and len(node.args) == 1 and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _times_inverse_root(
    root: fx.Node, x: fx.Node, memo: dict | None = None
) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """The product of x (by value) and the inverse of ``root``: ``x * rsqrt(.)``,
    ``x * (1 / sqrt(.))``, ``x * sqrt(.).reciprocal()`` or ``x / sqrt(.)``, either
    operand order. Returns (product, x as that node reads it, the nodes from root on)."""
    if is_call(root, RSQRT_TARGETS, "rsqrt"):
        inverses = [(root, [root])]
    else:  # sqrt
        inverses = []
        for u in root.users:
            if u.kwargs or not u.args or u.args[-1] is not root:
                continue
            if is_call(u, _RECIPROCAL_TARGETS, "reciprocal") and len(u.args) == 1:
                inverses.append((u, [root, u]))
            elif is_call(u, _DIV_TARGETS, "div") and len(u.args) == 2:
                num = u.args[0]
                if _is_number(num) and num == 1:
                    inverses.append((u, [root, u]))
                elif isinstance(num, fx.Node) and same_value(num, x, memo):
                    return u, num, [root, u]
    for inv, nodes in inverses:
        for u in inv.users:
            if not is_call(u, MUL_TARGETS, "mul") or len(u.args) != 2 or u.kwargs:
                continue
            a, b = u.args
            other = b if a is inv else a
            if isinstance(other, fx.Node) and other is not inv and same_value(other, x, memo):
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


def same_value(a: Any, b: Any, memo: dict | None = None, depth: int = 0) -> bool:
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
        return len(a) == len(b) and all(same_value(x, y, memo, depth) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k], memo, depth) for k in a)
    if isinstance(a, slice) and isinstance(b, slice):
        return same_value((a.start, a.stop, a.step), (b.start, b.stop, b.step), memo, depth)
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
        return cast_a[1] == cast_b[1] and same_value(cast_a[0], cast_b[0], memo, depth)
    if a.op != b.op or a.target != b.target or not _is_pure(a):
        return False
    if a.op == "get_attr":
        return True
    if same_value(a.args, b.args, memo, depth) and same_value(a.kwargs, b.kwargs, memo, depth):
        return True
    commutative = is_call(a, ADD_TARGETS, "add") or is_call(a, MUL_TARGETS, "mul")
    return (
        commutative and not a.kwargs and not b.kwargs and len(a.args) == len(b.args) == 2
        and same_value(a.args[0], b.args[1], memo, depth) and same_value(a.args[1], b.args[0], memo, depth)
    )
