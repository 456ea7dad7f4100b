"""The op rules of ``tp_localize``: op tables, and how views, splits, permutes and indexing move a sharded dim.

``Sharded`` says where a tensor is cut; ``ShapeRules`` holds the localizer's
rules for the ops that only rearrange dims (view/reshape, permute, expand,
split/chunk, indexing, cat, repeat_interleave): which output dim carries the
shard, and the size arguments rewritten to this rank's. The arithmetic under
them (``view_target_dim``) matches a view's dims group by group. The op tables
say which ops are elementwise, reductions, views, splits, GEMMs, attention.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from boost_compile import _torch_compat as compat
from boost_compile.distributed.collectives import local_size


@dataclass(frozen=True)
class Sharded:
    """A tensor cut on ``dim`` over the TP group; ``sections``: whole sizes of a fused weight's parts."""

    dim: int
    sections: tuple[int, ...] | None = None


Placement = Sharded | None  # None: every rank holds the whole tensor

WHOLE_HEADS = ("each rank must hold whole heads: use a TP degree that divides the head and kv-head counts, "
                "and keep heads the outer dim of the model's views")


class ShapeRules:
    """Placement rules for the dim-rearranging ops; mixed into the localizer, whose
    walk provides the state below and the three methods it refuses, locates and
    scatters with."""

    place: dict[fx.Node, Any]
    full: dict[fx.Node, tuple | None]
    world: int
    repairs: list[str]

    def _refuse(self, node: fx.Node, why: str, hint: str) -> None:
        raise NotImplementedError

    def _where(self, node: fx.Node) -> str:
        raise NotImplementedError

    def _scatter_input(self, node: fx.Node, x: fx.Node, dim: int) -> None:
        raise NotImplementedError

    def _view(self, node: fx.Node) -> Placement:
        return self._reshape_like(node, rewrite=True)

    def _reshape_like(self, node: fx.Node, rewrite: bool) -> Placement:
        x = node.args[0]
        p = self.place[x]
        src, dst = self.full[x], self.full[node]
        # a padded vocabulary dim passes only whole (checked by _keeps_vocab_sharding)
        padded = hint(src[p.dim]) % self.world != 0
        o, why = view_target_dim(src, dst, p.dim, 1 if padded else self.world)
        if p.sections and o is not None and src[p.dim] == dst[o]:
            # the fused dim passes through whole (GPT-2's [B*T, 3d] -> [B, T, 3d])
            if rewrite:
                self._rewrite_size(node, o, dst)
            return Sharded(o, p.sections)
        if p.sections:
            self._refuse(node, "a view that splits or merges a fused output before it is split into its parts",
                         "split the fused output first")
        if o is None:
            self._refuse(node, f"a {fn_name(node)} of a sharded tensor that no rank's slice can follow: {why}",
                         "each rank must hold whole heads: a TP degree that divides the head counts, "
                         "and heads as the outer dim of the view")
        if rewrite:
            self._rewrite_size(node, o, dst)
        return Sharded(o)

    def _rewrite_size(self, node: fx.Node, o: int, dst: tuple) -> None:
        """Replace the size argument at output dim ``o`` with this rank's size."""
        args = list(node.args)
        if len(args) == 2 and isinstance(args[1], (list, tuple, torch.Size)):
            sizes, pos = list(args[1]), 1
        else:
            sizes, pos = args[1:], None
        if "size" in node.kwargs or "shape" in node.kwargs:
            key = "size" if "size" in node.kwargs else "shape"
            sizes = list(node.kwargs[key])
        if len(sizes) != len(dst):
            self._refuse(node, f"cannot read the sizes of this view ({sizes})", "")
        value = sizes[o]
        if isinstance(value, int) and value == -1:
            return
        if not isinstance(value, int):
            self._refuse(node, f"the size of sharded dim {o} is computed in the graph ({value})", "use static shapes for the sharded dims")
        local = local_size(value, self.world)
        before = tuple(sizes)
        sizes[o] = local
        if "size" in node.kwargs or "shape" in node.kwargs:
            node.kwargs = {**node.kwargs, key: tuple(sizes)}
        elif pos is not None:
            args[1] = type(args[1])(sizes) if not isinstance(args[1], torch.Size) else tuple(sizes)
            node.args = tuple(args)
        else:
            node.args = (args[0], *sizes)
        self.repairs.append(f"repaired {fn_name(node)}{before} -> {tuple(sizes)} at {self._where(node)}")

    def _set_arg(self, node: fx.Node, i: int, value: Any, what: str) -> None:
        args = list(node.args)
        args[i] = value
        node.args = tuple(args)
        self.repairs.append(f"repaired {fn_name(node)} {what} at {self._where(node)}")

    def _same_leading(self, node: fx.Node) -> Placement:
        p = self.place[node.args[0]]
        if p.dim >= min(len(self.full[node.args[0]]), len(self.full[node])) - 1 and fn_name(node) == "view_as_complex":
            self._refuse(node, "view_as_complex of the sharded last dim", WHOLE_HEADS)
        return Sharded(p.dim, p.sections)

    def _permute(self, node: fx.Node) -> Placement:
        x = node.args[0]
        p = self.place[x]
        nd = len(self.full[x])
        name = fn_name(node)
        if name == "t":
            order = list(range(nd))[::-1]
        elif name in ("transpose", "swapaxes"):
            a, b = (d % nd for d in int_args(node, 1, 2, ("dim0", "dim1")))
            order = list(range(nd))
            order[a], order[b] = order[b], order[a]
        elif name == "permute":
            dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
            order = [d % nd for d in dims]
        else:  # movedim
            src, dst = int_args(node, 1, 2, ("source", "destination"))
            order = list(range(nd))
            moved = order.pop(src % nd)
            order.insert(dst % nd, moved)
        return Sharded(order.index(p.dim), p.sections)

    def _expand(self, node: fx.Node) -> Placement:
        x = node.args[0]
        p = self.place[x]
        dst = self.full[node]
        od = p.dim + len(dst) - len(self.full[x])
        self._rewrite_size(node, od, dst)
        return Sharded(od, p.sections)

    def _as_other(self, node: fx.Node) -> Placement:
        x, other = node.args[0], node.args[1]
        px, po = self.place.get(x), self.place.get(other)
        if px is not None and po is not None and len(self.full[x]) == len(self.full[other]) and px == po:
            return px
        if fn_name(node) == "expand_as" and px is not None and po is not None:
            return Sharded(px.dim + len(self.full[other]) - len(self.full[x]))
        self._refuse(node, f"{fn_name(node)} between a tensor sharded as {px} and one sharded as {po}", "")

    def _split(self, node: fx.Node) -> list[Placement]:
        x = node.args[0]
        p = self.place[x]
        nd = len(self.full[x])
        name = fn_name(node)
        dim_default = 0
        if name == "unbind":
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", dim_default)
        else:
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", dim_default)
        dim %= nd
        n_out = len(node.meta.get("example_value") or ())
        if dim != p.dim:
            out_dim = p.dim - 1 if name == "unbind" and dim < p.dim else p.dim
            return [Sharded(out_dim, p.sections)] * n_out
        if not p.sections or name not in ("split", "chunk"):
            self._refuse(node, f"{name} along the sharded dim {dim} of a tensor that is not a fused output cut part by part",
                         "split only fused GEMM outputs (fused q/k/v) on their sharded dim")
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections", node.kwargs.get("chunks"))
        parts = tuple(p.sections)
        if name == "chunk":
            if size != len(parts) or len(set(parts)) != 1:
                self._refuse(node, f"chunk({size}) of a fused output whose parts are {list(parts)}", "")
            return [Sharded(dim)] * n_out
        wanted = (size,) * len(parts) if isinstance(size, int) else tuple(size)
        if wanted != parts:
            self._refuse(node, f"split({size}) of a fused output cut into parts {list(parts)}", "")
        local = size // self.world if isinstance(size, int) else [s // self.world for s in size]
        self._set_arg(node, 1, local, f"split sizes {size} -> {local}")
        return [Sharded(dim)] * n_out

    def _getitem(self, node: fx.Node) -> Placement:
        src, idx = node.args[0], node.args[1]
        p = self.place[src]
        if isinstance(p, list):
            return p[idx]
        nd = len(self.full[src])
        if not isinstance(idx, tuple):
            idx = (idx,)
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        in_dim, out_dim, result = 0, 0, None
        sections = p.sections
        for k, item in enumerate(idx):
            if item is Ellipsis:
                skip = nd - n_real
                if in_dim <= p.dim < in_dim + skip:
                    result = out_dim + (p.dim - in_dim)
                in_dim += skip
                out_dim += skip
            elif item is None:
                out_dim += 1
            elif isinstance(item, slice):
                if in_dim == p.dim:
                    if item != slice(None, None, None):
                        local = self._section_slice(node, item, p, self.full[src][p.dim])
                        idx = (*idx[:k], local, *idx[k + 1:])
                        sections = None
                    result = out_dim
                in_dim += 1
                out_dim += 1
            elif isinstance(item, int):
                if in_dim == p.dim:
                    self._refuse(node, f"indexing the sharded dim {p.dim} with {item}", "")
                in_dim += 1
            else:
                self._refuse(node, f"advanced indexing ({item}) of a sharded tensor", "")
        if result is None:
            result = out_dim + (p.dim - in_dim)
        if sections != p.sections:
            self._set_arg(node, 1, idx, f"slice of a fused part -> {idx}")
        return Sharded(result, sections)

    def _section_slice(self, node: fx.Node, item: slice, p: Sharded, width: int) -> slice:
        """A slice that takes exactly one part of a fused output (Phi-3's ``qkv[..., :q_pos]``)
        becomes the slice of this rank's share of that part."""
        start, stop = item.start or 0, width if item.stop is None else item.stop
        bounds = [sum(p.sections[:i]) for i in range(len(p.sections) + 1)] if p.sections else []
        if item.step not in (None, 1) or not p.sections or (start, stop) not in zip(bounds, bounds[1:], strict=False):
            self._refuse(node, f"slicing {item} of the sharded dim {p.dim}",
                         "slice only a fused output, along the parts it is made of")
        i = bounds.index(start)
        local = start // self.world
        return slice(local, local + p.sections[i] // self.world, None)

    def _cat(self, node: fx.Node) -> Placement:
        # torch.cat skips 1-d empty tensors (an empty KV cache): they take no part
        tensors = [t for t in node.args[0] if not (self.full.get(t) is not None and len(self.full[t]) == 1 and is_zero(self.full[t][0]))]
        nd = len(self.full[node])
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % nd
        places = {self.place.get(t) for t in tensors}
        sharded = [q for q in places if q is not None]
        if len(set(sharded)) != 1:
            self._refuse(node, f"cat of tensors sharded differently ({places})", "")
        p = sharded[0]
        if p.dim == dim:
            self._refuse(node, f"cat along the sharded dim {dim}", "")
        for t in tensors:
            if self.place.get(t) is None:
                if p.sections:
                    self._refuse(node, f"cat of a replicated {t.name} with a fused output cut part by part", "")
                self._scatter_input(node, t, p.dim)
        return p

    def _stack(self, node: fx.Node) -> Placement:
        """``stack(tensors, dim)``: every tensor cut alike; a new dim at or before the cut moves it
        one out (the interleaved rotary of GLM and Cohere: ``stack((-x2, x1), -1).flatten(-2)``)."""
        tensors = list(node.args[0])
        nd = len(self.full[node])
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % nd
        places = {self.place.get(t) for t in tensors}
        sharded = [q for q in places if q is not None]
        if len(set(sharded)) != 1 or sharded[0].sections:
            self._refuse(node, f"stack of tensors sharded differently ({places})", "")
        p = sharded[0]
        for t in tensors:
            if self.place.get(t) is None:
                self._scatter_input(node, t, p.dim)
        return Sharded(p.dim + 1 if dim <= p.dim else p.dim)

    def _repeat_interleave(self, node: fx.Node) -> Placement:
        """Each element repeated n times in place: a rank's contiguous heads stay contiguous (GQA)."""
        x = node.args[0]
        p = self.place[x]
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if not isinstance(repeats, int) or dim is None:
            self._refuse(node, "repeat_interleave of a sharded tensor with per-element repeats or no dim", "")
        return Sharded(p.dim, p.sections if dim % len(self.full[x]) != p.dim else None)

    def _new_tensor(self, node: fx.Node) -> Placement:
        """``x.new_empty(sizes)`` (``new_zeros``, ``new_ones``, ``new_full``): a tensor that holds none
        of ``x``'s values, so any cut of it is exact. It follows ``x``'s cut when it has ``x``'s rank
        and ``x``'s whole size on the sharded dim, the sizes written out as numbers (a buffer over
        this rank's heads: DeepSeek's ``key_states``, filled by ``copy_`` of the heads' parts);
        otherwise every rank makes it whole. What is written into it is checked by ``copy_``'s rule."""
        x = node.args[0]
        p = self.place[x]
        src, dst = self.full[x], self.full[node]
        if dst is None:
            self._refuse(node, f"{fn_name(node)} of a sharded tensor with no tensor output", "")
        if p.sections or len(dst) != len(src) or not dims_equal(dst[p.dim], src[p.dim]):
            return None
        args, kwargs = list(node.args), dict(node.kwargs)
        if "size" in kwargs:
            sizes, where = list(kwargs["size"]), "size"
        elif fn_name(node) == "new_full" or (len(args) > 1 and isinstance(args[1], (list, tuple, torch.Size))):
            sizes, where = list(args[1]), 1
        else:
            sizes, where = args[1:], None
        if len(sizes) != len(dst) or not all(isinstance(v, int) for v in sizes):
            self._refuse(node, f"{fn_name(node)} of a buffer cut like its sharded input, with sizes {sizes} that are not "
                         "numbers", "use static shapes for the sharded dims")
        before = tuple(sizes)
        sizes[p.dim] = local_size(sizes[p.dim], self.world)
        if where == "size":
            node.kwargs = {**kwargs, "size": tuple(sizes)}
        elif where == 1:
            args[1] = tuple(sizes)
            node.args = tuple(args)
        else:
            node.args = (args[0], *sizes)
        self.repairs.append(f"repaired {fn_name(node)}{before} -> {tuple(sizes)} at {self._where(node)} "
                            f"(a buffer cut like {x.name} on dim {p.dim})")
        return Sharded(p.dim)

    def _last_two_whole(self, node: fx.Node) -> Placement:
        p = self.place[node.args[0]]
        if p.dim >= len(self.full[node]) - 2:
            self._refuse(node, f"{fn_name(node)} of a matrix sharded on dim {p.dim}", "")
        return p


# ----------------------------------------------------------------------------- shape arithmetic


def fn_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def is_zero(size: Any) -> bool:
    return isinstance(size, int) and size == 0


def is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def dims_equal(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def hint(size: Any) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else int(size)


def view_target_dim(src: Sequence[Any], dst: Sequence[Any], d: int, world: int) -> tuple[int | None, str]:
    """The output dim that carries input dim ``d``'s sharding through a reshape, or (None, why).

    Dims are grouped so that each group's sizes multiply to the same number on both
    sides. A rank's contiguous slice of ``d`` stays one contiguous slice of the output
    when ``d`` is the outermost non-1 dim of its group and the group's outermost
    non-1 output dim divides by ``world``.
    """
    for gi, gj in view_groups([hint(s) for s in src], [hint(s) for s in dst]):
        if d not in gi:
            continue
        outer = [k for k in gi if hint(src[k]) != 1]
        if not outer or outer[0] != d:
            return None, f"the sharded dim {d} is merged under dim {outer[0]}, so a rank's part is not contiguous"
        targets = [k for k in gj if hint(dst[k]) != 1]
        if not targets:
            return None, f"the sharded dim {d} disappears"
        size = hint(dst[targets[0]])
        if size % world:
            return None, (f"the sharded dim {d} becomes dim {targets[0]} of size {size} (the outermost of "
                          f"{[hint(dst[k]) for k in gj]}), which the TP degree {world} does not divide")
        return targets[0], ""
    return None, "the view's sizes do not match its input's"


def view_groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    """Consecutive dims of ``a`` and ``b`` whose sizes multiply to the same number."""
    groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], 1, 1
        if i < len(a):
            pa, i = a[i], i + 1
            gi.append(i - 1)
        if j < len(b):
            pb, j = b[j], j + 1
            gj.append(j - 1)
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                gi.append(i - 1)
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
                gj.append(j - 1)
            else:
                return []
        groups.append((gi, gj))
    return groups


def int_args(node: fx.Node, i: int, j: int, names: tuple[str, str]) -> tuple[int, int]:
    a = node.args[i] if len(node.args) > i else node.kwargs[names[0]]
    b = node.args[j] if len(node.args) > j else node.kwargs[names[1]]
    return int(a), int(b)


# ----------------------------------------------------------------------------- op tables and op classification

ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    operator.iadd, operator.imul, operator.isub, operator.itruediv,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt,
    torch.exp, torch.log, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.clamp, torch.where,
    torch.masked_fill, torch.maximum, torch.minimum, torch.reciprocal, torch.cos, torch.sin, torch.erf,
    torch.square, torch.polar, torch.complex, torch.real, torch.imag,
    operator.gt, operator.lt, operator.ge, operator.le, operator.eq, operator.ne,
    torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne, torch.expm1, torch.log1p,
    F.silu, F.gelu, F.relu, F.dropout, torch.dropout, F.softplus, F.tanh,
}
ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "float", "half", "bfloat16", "double", "to", "type", "type_as",
    "contiguous", "clone", "detach", "rsqrt", "sqrt", "exp", "log", "sigmoid", "tanh", "silu", "relu",
    "masked_fill", "clamp", "abs", "reciprocal", "cos", "sin", "square", "__add__", "__mul__", "__sub__",
    "__truediv__", "__radd__", "__rmul__", "add_", "mul_", "gt", "lt", "ge", "le", "eq", "ne", "expm1", "log1p",
}
#: methods whose second tensor argument only lends its dtype or shape
FIRST_ARG_ONLY = {"type_as", "to", "view_as", "expand_as", "reshape_as"}
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "norm", "logsumexp", "argmax", "argmin", "all", "any"}
SOFTMAX = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
VIEWS = {"view", "reshape"}
SPLITS = {"split", "chunk", "unbind", "split_with_sizes", "tensor_split"}
MATMUL = {operator.matmul, torch.matmul, torch.bmm, torch.mm}
SDPA = {F.scaled_dot_product_attention, compat.TORCH_SDPA}
#: ``x.new_*(sizes)``: tensors of x's dtype and device that hold none of its values
NEW_TENSORS = {"new_empty", "new_zeros", "new_ones", "new_full"}
LIKE_FACTORIES = {torch.ones_like, torch.zeros_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like}


def is_method_or_fn(node: fx.Node, names: set[str], functions: Sequence[Any] = ()) -> bool:
    if node.op == "call_method":
        return node.target in names
    if node.op == "call_function":
        if node.target in functions:
            return True
        return (getattr(node.target, "__module__", "") in ("torch", "torch.functional", compat.TORCH_FUNCTIONS_MODULE)
                and fn_name(node) in names)
    return False



def index_keeps_dim(idx: Any, nd: int, d: int) -> bool:
    """Whether ``x[idx]`` leaves dim ``d`` of an ``nd``-dim tensor whole (only basic indexing)."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in items):
        return False
    real = [i for i in items if i is not None]
    if Ellipsis in real:
        k = real.index(Ellipsis)
        real = real[:k] + [slice(None)] * (nd - len(real) + 1) + real[k + 1:]
    real += [slice(None)] * (nd - len(real))
    return real[d] == slice(None)


def reduced_dims(node: fx.Node, nd: int) -> set[int]:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return set(range(nd))
    if isinstance(dim, int):
        return {dim % nd}
    if isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        return {d % nd for d in dim}
    return set(range(nd))


def placement_str(p: Any) -> str:
    if p is None:
        return "(replicated)"
    if isinstance(p, list):
        return "(parts)"
    return f"(sharded on dim {p.dim})"


def source_line(node: fx.Node) -> str:
    """``file:line  code`` of the model line that made the node (its innermost frame)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    file, line, fn, code = frames[-1]
    return f"{file}:{line} in {fn}: {code.strip()}"
