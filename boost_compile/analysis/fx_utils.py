"""Small FX predicates every pass shares, each defined once.

What a node calls (linear, matmul, an activation, one of the project's custom
ops, a functional collective), which module made it (``nn_module_stack``), and
which graph it belongs to (forward or backward). Torch IR and ATen alike, unless
a docstring says otherwise.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from boost_compile import _torch_compat as compat

# ----------------------------------------------------------------------------- targets

#: ``F.linear`` as the user wrote it and as Dynamo records it.
LINEAR_TARGETS = frozenset({compat.TORCH_LINEAR, torch.nn.functional.linear})
MATMUL_TARGETS = frozenset({operator.matmul, torch.matmul, torch.Tensor.matmul})
MM_TARGETS = frozenset({torch.mm, torch.Tensor.mm})
ADDMM_TARGETS = frozenset({torch.addmm})
ADD_TARGETS = frozenset({operator.add, operator.iadd, torch.add, torch.Tensor.add})
MUL_TARGETS = frozenset({operator.mul, operator.imul, torch.mul, torch.Tensor.mul})
RMS_NORM_TARGETS = frozenset({torch.rms_norm, torch.nn.functional.rms_norm})
LAYER_NORM_TARGETS = frozenset({torch.layer_norm, torch.nn.functional.layer_norm})
RSQRT_TARGETS = frozenset({torch.rsqrt, torch.Tensor.rsqrt})
SQRT_TARGETS = frozenset({torch.sqrt, torch.Tensor.sqrt})
SPLIT_TARGETS = frozenset({torch.split, torch.Tensor.split, torch.functional.split})
CAT_TARGETS = frozenset({torch.cat, torch.concat, torch.concatenate})

#: Elementwise binary ops allowed on a bottleneck's latent between its factors: LaX's
#: ``h + h_prev``, a scale ``h * s``, a gate ``h * sigmoid(g)`` (Torch IR).
LATENT_OP_TARGETS = ADD_TARGETS | MUL_TARGETS | frozenset({operator.sub, torch.sub, operator.truediv, torch.div})
LATENT_OP_METHODS = frozenset({"add", "mul", "sub", "div"})

#: Elementwise unary activations allowed between the two factors of a bottleneck.
ACTIVATION_TARGETS: dict[Any, str] = {
    torch.nn.functional.silu: "silu",
    torch.nn.functional.gelu: "gelu",
    torch.nn.functional.relu: "relu",
    torch.relu: "relu",
    torch.sigmoid: "sigmoid",
    torch.tanh: "tanh",
}
#: The same activations written as tensor methods (``x.silu()``).
ACTIVATION_METHODS = {"silu": "silu", "relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh"}


def is_call(node: fx.Node, targets: Any, method: str | None = None) -> bool:
    """``node`` calls one of ``targets``, or the tensor method ``method``."""
    if node.op == "call_function" and node.target in targets:
        return True
    return method is not None and node.op == "call_method" and node.target == method


def is_custom_op(node: Any, name: str) -> bool:
    """``node`` calls the project's custom op ``boost::<name>`` (its default overload)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and (
        getattr(node.target, "__name__", "") == f"{name}.default"
    )


def is_full_view(node: Any) -> bool:
    """``tp_full_view(w)``: a sharded parameter seen with its whole shape while tracing."""
    return is_custom_op(node, "tp_full_view")


def sole_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


# ----------------------------------------------------------------------------- values


def meta_tensor(node: Any) -> torch.Tensor | None:
    """The fake tensor a node's metadata holds (Torch IR: example_value; ATen: val)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def static_shape(node: Any) -> tuple[int, ...] | None:
    """A node's shape as ints, or None (no metadata, or symbolic sizes)."""
    t = meta_tensor(node)
    if t is None:
        return None
    try:
        return tuple(int(s) for s in t.shape)
    except TypeError:  # symbolic sizes
        return None


# ----------------------------------------------------------------------------- names


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


_STACK_ROOT = re.compile(r"^L\['[^']+'\](?:\[\d+\])*\.?")
_BLOCK_RE = re.compile(r"^(.*\.\d+)(?:\.|$)")


def stack_entry_fqn(value: Any) -> str:
    """One ``nn_module_stack`` entry -> a module path: ``L['self'].layers.0`` -> ``layers.0``
    (also ``L['args'][0].model...``, ``._modules['x']`` and ``[i]`` spellings)."""
    fqn = value[0] if isinstance(value, tuple) else str(value)
    fqn = _STACK_ROOT.sub("", str(fqn))
    fqn = re.sub(r"\._modules\['([^']+)'\]", r".\1", fqn)
    return re.sub(r"\[(\d+)\]", r".\1", fqn).strip(".")


def _module_stack(meta: dict[str, Any]) -> dict[str, Any]:
    # an ATen backward node carries its forward node's stack as fwd_nn_module_stack
    return meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack") or {}


def module_path(node: fx.Node | dict[str, Any]) -> str:
    """The innermost module that made a node (``layers.0.attention.q_proj``), "" if unknown.

    Takes a node or its ``meta``."""
    stack = _module_stack(node if isinstance(node, dict) else node.meta)
    return stack_entry_fqn(list(stack.values())[-1]) if stack else ""


def module_block(node: fx.Node | dict[str, Any]) -> str | None:
    """``layers.0`` for a node inside ``layers.0...``: the outermost numbered module, or None."""
    stack = _module_stack(node if isinstance(node, dict) else node.meta)
    for value in stack.values():
        match = _BLOCK_RE.match(stack_entry_fqn(value))
        if match:
            return match.group(1)
    return None


def in_blocks(module: str) -> bool:
    """Whether a module path lies inside a repeated block (``layers.3.mlp``)."""
    return bool(re.search(r"\.\d+(\.|$)", module))


def node_target_name(node: fx.Node) -> str:
    """``aten.mm``, ``Tensor.view``, ``operator.add``, ``linear``: a node's op, for counting."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    if isinstance(target, compat.OpOverload):
        return str(target.overloadpacket)
    name = getattr(target, "__name__", str(target))
    module = getattr(target, "__module__", "") or ""
    if module.startswith("_operator"):
        return f"operator.{name}"
    return name


def count_ops(graph: fx.Graph) -> dict[str, int]:
    """``{op name: count}`` over the call nodes of a graph."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            key = node_target_name(node)
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def graph_kind(graph: fx.Graph) -> str:
    """"backward" for an AOT backward graph (it takes ``tangents_*``), else "forward"."""
    names = (n.name for n in graph.nodes if n.op == "placeholder")
    return "backward" if any(name.startswith("tangents") for name in names) else "forward"


# ----------------------------------------------------------------------------- collectives

#: The project's differentiable TP collectives (autograd.Functions over functional
#: collectives, inserted by tp_collectives): functions named ``*_tp`` in this module.
PROJECT_COLLECTIVES = "boost_compile.distributed.collectives"


def collective_kind(target: Any) -> str | None:
    """The functional collective a call target issues (``all_reduce``, ``wait_tensor``,
    ``all_reduce_tp``, ...), or None.

    Counted: the ops of the functional-collective namespaces (ATen graphs, and
    Torch IR after tracing through them), torch's functional-collective Python
    wrappers, and this project's ``*_tp`` collectives (Torch IR).
    """
    name = compat.op_namespace_and_name(target)
    if name is not None and name[0] in compat.COLLECTIVE_NAMESPACES:
        return name[1]
    module = getattr(target, "__module__", "") or ""
    fn = getattr(target, "__name__", "")
    if module.startswith(compat.FUNCTIONAL_COLLECTIVES_MODULE) or (module == PROJECT_COLLECTIVES and fn.endswith("_tp")):
        return fn
    return None


def is_collective(node: fx.Node, *, waits: bool = True, bodies: bool = True) -> bool:
    """``node`` issues a functional collective (see ``collective_kind``).

    ``waits=False`` leaves out ``wait_tensor`` (it issues nothing, it waits);
    ``bodies``: a higher-order op counts when its forward body holds a collective
    (an ``autograd.Function`` traced by Dynamo)."""
    if node.op == "call_function":
        kind = collective_kind(node.target)
        if kind is not None and (waits or kind != "wait_tensor"):
            return True
    return bodies and any(
        is_collective(n, waits=waits) for body in forward_bodies(node) for n in body.graph.nodes
    )


def hop_name(target: Any) -> str | None:
    """A higher-order op's name (``autograd_function_apply``), else None."""
    name = getattr(target, "name", None)
    return name() if callable(name) else None


def forward_bodies(node: fx.Node) -> list[fx.GraphModule]:
    """The subgraphs a higher-order op runs in forward (its get_attr arguments).

    Dynamo turns an ``autograd.Function`` into ``autograd_function_apply(fwd, bwd, ...)``:
    only ``fwd`` runs in forward. Other higher-order ops: every subgraph argument.
    """
    owner = node.graph.owning_module
    if node.op != "call_function" or owner is None:
        return []
    args = node.args[:1] if hop_name(node.target) == "autograd_function_apply" else node.all_input_nodes
    bodies = []
    for arg in args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(owner, str(arg.target), None)
            if isinstance(sub, fx.GraphModule):
                bodies.append(sub)
    return bodies


def collectives_of(graph: fx.Graph) -> list[dict[str, Any]]:
    """``[{kind, shape, dtype, bytes}]`` for the collectives of an ATen graph, in order (waits left out)."""
    found = []
    for node in graph.nodes:
        if not is_collective(node, waits=False, bodies=False):
            continue
        src = node.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        shape = tuple(int(s) for s in val.shape) if val is not None else None
        nbytes = val.numel() * val.element_size() if val is not None else None
        found.append({
            "kind": collective_kind(node.target), "shape": shape, "dtype": str(val.dtype) if val is not None else None,
            "bytes": nbytes, "module": module_path(node), "source": source_of(node),
        })
    return found


def source_of(node: fx.Node) -> str:
    """The Torch-IR node a forward collective was traced from (empty in backward)."""
    sources = node.meta.get("from_node") or []
    while sources:
        src = sources[-1]
        if not getattr(src, "from_node", None):
            return str(src.name)
        sources = src.from_node
    return ""


# ----------------------------------------------------------------------------- dead code

#: In-place operators Dynamo may record as calls whose result nobody reads.
_INPLACE_OPERATORS = frozenset(
    getattr(operator, f"i{name}")
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul")
)


def mutates(node: fx.Node) -> bool:
    """``node`` writes into one of its inputs, or has some other effect beyond its value.

    FX's own ``Node.is_impure`` calls a ``call_method`` pure, so ``x[..., :16].copy_(y)``
    (Hugging Face's latent attention filling its key), ``out.index_add_(0, idx, y)`` (a
    mixture of experts gathering its experts) and ``w.requires_grad_()`` would be dead code
    to ``Graph.eliminate_dead_code``: their results are never read. Here a trailing
    underscore (the in-place convention of tensor methods and ATen ops), an ``out=``
    argument, a mutable op schema and the in-place operators count as effects too.
    """
    if node.is_impure():
        return True
    if "out" in node.kwargs:
        return True
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return False
    target = node.target
    if target in _INPLACE_OPERATORS:
        return True
    schema = compat.op_schema(target)
    if schema is not None and schema.is_mutable:
        return True
    name = getattr(target, "__name__", "")
    if name.endswith(".default") or "." in name:  # an OpOverload: ``add_.Tensor``
        name = getattr(getattr(target, "overloadpacket", None), "__name__", name.split(".")[0])
    return name.endswith("_") and not name.endswith("__")


#: Tensor methods and functions whose output may share the input's memory (a view).
_VIEW_NAMES = frozenset({
    "view", "reshape", "transpose", "t", "permute", "unsqueeze", "squeeze", "flatten", "unflatten",
    "expand", "expand_as", "narrow", "select", "split", "chunk", "unbind", "tensor_split", "movedim",
    "view_as", "as_strided", "diagonal", "unfold", "getitem", "__getitem__", "contiguous", "detach",
})


def written_in_place(node: fx.Node) -> fx.Node | None:
    """The first node that writes in place into ``node``'s output or a view of it, else None."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.args and user.args[0] is n and mutates(user):
                return user
            name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
            if user.op in ("call_method", "call_function") and name in _VIEW_NAMES:
                todo.append(user)
    return None


def weight_only_nodes(graph: fx.Graph, static: set[str]) -> set[fx.Node]:
    """Call nodes whose every placeholder ancestor is a parameter or buffer (a name in ``static``).

    The concatenated weights of a grouped GEMM, a weight's transpose or cast, RoPE tables: values
    that depend on the module's state alone, not on the batch.
    """
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if all(a in out or (a.op == "placeholder" and a.name in static) for a in node.all_input_nodes):
            out.add(node)
    return out


def unused_nodes(graph: fx.Graph) -> frozenset[fx.Node]:
    """The nodes nobody reads: take them before a pass, and keep them after it."""
    return frozenset(n for n in graph.nodes if not n.users)


def remove_dead_code(graph: fx.Graph, keep: frozenset[fx.Node] = frozenset()) -> bool:
    """Remove what a pass left unused, keeping every node that :func:`mutates` and ``keep``.

    Passes call this, never FX's own ``eliminate_dead_code``, after they rewire a graph:
    FX's drops the in-place writes whose results nobody reads, and what Dynamo left unused
    on purpose: Hugging Face's Mamba captures ``torch.vmap`` regions (``_vmap_increment_nesting``
    ... ``_vmap_decrement_nesting``) in part, and removing them broke functorch's nesting. A pass
    passes ``keep=unused_nodes(graph)`` taken before it, so only what it made dead goes.

    Only ``graph`` itself: FX's would also clean the subgraphs of higher-order ops (an
    ``autograd.Function``'s forward and backward bodies) with its own purity test, and dropped
    the ``scatter_add_`` in PhiMoE's router backward (its gradients silently wrong). A pass
    never rewrites those bodies, so nothing in them is its to remove.
    """
    removed = False
    for node in reversed(graph.nodes):
        if not node.users and node.op not in ("placeholder", "output") and node not in keep and not mutates(node):
            graph.erase_node(node)
            removed = True
    return removed
