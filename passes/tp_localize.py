"""Turn a parallelized model's whole-shape graph into this rank's program, and check it.

``parallelize_`` makes every sharded parameter read as ``tp_full_view(shard)``
while Dynamo traces, so the captured graph is the *unsharded* model's, with its
shapes and everything the model derives from them:

    w = tp_full_view(w_shard, 0, 2, "btp")        # seen [64, 16], held [32, 16]
    B, T, C = x.size()                             # C = 64, the whole width
    q = linear(x, w).view(2, 16, 4, C // 4)        # view(2, 16, 4, 16)

This pass follows where each tensor is sharded (one dim, or replicated), from the
parameters' ``ShardSpec`` through every op, and rewrites the arguments that name a
sharded size to this rank's size:

    q = linear(x, w_shard).view(2, 16, 2, 16)      # 2 local heads of the whole size

A fused weight split into parts (nanoGPT's ``c_attn`` -> q, k, v) is cut part by
part, and its ``split(n_embd)`` becomes ``split(n_embd / p)``. Where a replicated
tensor meets a sharded one (a tied embedding's output entering the d-sharded
stream) it inserts ``scatter_to_tp``; where a sharded tensor meets a consumer that
needs it whole (the final norm, a replicated head, the graph's output)
``gather_from_tp``. Reductions over the sharded dim are allowed only inside an
RMSNorm site, whose statistic ``tp_collectives`` then sums over the group.

The output head cut on the vocabulary makes the logits sharded on their last
dim; they pass casts, views that keep that dim whole and indexing of other dims
sharded, a plain ``F.cross_entropy`` on them becomes
``vocab_parallel_cross_entropy`` (all-reduces of [N] only), and any other
consumer, like the graph's output, gets them gathered (padding dropped).

Then shapes are propagated again through the rank's graph, and every node must
have the unsharded node's shape with exactly its sharded dim divided by the TP
degree (rounded up for a padded vocabulary). What cannot be placed (LayerNorm or softmax over the sharded dim, a view
that no contiguous slice can hold, a parameter read other than through its
module attribute, ...) is refused with a ``ParallelizeError`` that names the op,
the shapes and the model's source line, before the first step runs.
"""

from __future__ import annotations

import inspect
import logging
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from boost_compile.analysis import GraphView, RMSNormSite
from boost_compile.distributed.collectives import (
    gather_from_tp,
    local_size,
    scatter_to_tp,
    vocab_parallel_cross_entropy,
)
from boost_compile.distributed.parallelize import ParallelizeError, ShardSpec
from boost_compile.pass_manager import GraphPass, PassContext, PassReport

PLACEMENT_KEY = "boost_tp_placement"
SHARDED_NORMS_KEY = "boost_tp_sharded_norms"


@dataclass(frozen=True)
class Sharded:
    """A tensor cut on ``dim`` over the TP group; ``sections``: whole sizes of a fused weight's parts."""

    dim: int
    sections: tuple[int, ...] | None = None


Placement = Sharded | None  # None: every rank holds the whole tensor

_FULL_VIEW = "tp_full_view"
_DEFAULT_HINT = ("shard this model with another plan (megatron keeps the stream whole; vanilla uses DTensor's "
                 "own rules), or change the model so that this op sees whole tensors or only its rank's heads")
_WHOLE_HEADS = ("each rank must hold whole heads: use a TP degree that divides the head and kv-head counts, "
                "and keep heads the outer dim of the model's views")


def _is_full_view(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and getattr(node.target, "__name__", "") == f"{_FULL_VIEW}.default"


def _is_op(node: Any, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and getattr(node.target, "__name__", "") == f"{name}.default"


# ----------------------------------------------------------------------------- op tables

_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    operator.iadd, operator.imul, operator.isub, operator.itruediv,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt,
    torch.exp, torch.log, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.clamp, torch.where,
    torch.masked_fill, torch.maximum, torch.minimum, torch.reciprocal, torch.cos, torch.sin, torch.erf,
    torch.square, torch.polar, torch.complex, torch.real, torch.imag,
    F.silu, F.gelu, F.relu, F.dropout, F.softplus, F.tanh,
}
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "pow", "float", "half", "bfloat16", "double", "to", "type", "type_as",
    "contiguous", "clone", "detach", "rsqrt", "sqrt", "exp", "log", "sigmoid", "tanh", "silu", "relu",
    "masked_fill", "clamp", "abs", "reciprocal", "cos", "sin", "square", "__add__", "__mul__", "__sub__",
    "__truediv__", "__radd__", "__rmul__", "add_", "mul_",
}
#: methods whose second tensor argument only lends its dtype or shape
_FIRST_ARG_ONLY = {"type_as", "to", "view_as", "expand_as", "reshape_as"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "norm", "logsumexp", "argmax", "argmin", "all", "any"}
_SOFTMAX = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
_VIEWS = {"view", "reshape"}
_SPLITS = {"split", "chunk", "unbind", "split_with_sizes", "tensor_split"}
_LINEAR = {torch._C._nn.linear, F.linear}
_MATMUL = {operator.matmul, torch.matmul, torch.bmm, torch.mm}
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_LIKE_FACTORIES = {torch.ones_like, torch.zeros_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like}


def _fn_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _is_method_or_fn(node: fx.Node, names: set[str], functions: Sequence[Any] = ()) -> bool:
    if node.op == "call_method":
        return node.target in names
    if node.op == "call_function":
        if node.target in functions:
            return True
        return getattr(node.target, "__module__", "") in ("torch", "torch.functional", "torch._C._VariableFunctions") and _fn_name(node) in names
    return False


# ----------------------------------------------------------------------------- the pass


class TPPass(GraphPass):
    """A pass on a model sharded by ``parallelize_``: enabled and configured by ``tp``."""

    def enabled(self) -> bool:
        return self.config.tp.enabled

    def config_section(self) -> Any:
        return self.config.tp


class TPLocalizePass(TPPass):
    name = "tp_localize"
    expects_sites = False

    def run(self, ctx: PassContext) -> PassReport:
        report = PassReport(self.name)
        specs = shard_specs(ctx)
        if not specs:
            report.not_applicable = "the model was not parallelized with parallelize_"
            return report
        _Localizer(ctx, specs, report).run()
        return report


def shard_specs(ctx: PassContext) -> dict[fx.Node, ShardSpec]:
    """Placeholder -> the ShardSpec ``parallelize_`` attached to the parameter behind it."""
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    return {
        node: value._boost_tp
        for node, value in zip(placeholders, ctx.example_inputs, strict=False)
        if getattr(value, "_boost_tp", None) is not None
    }


class _Localizer:
    """One walk over the graph in topological order: place, rewrite, then check."""

    def __init__(self, ctx: PassContext, specs: dict[fx.Node, ShardSpec], report: PassReport) -> None:
        self.ctx, self.gm, self.graph = ctx, ctx.gm, ctx.gm.graph
        self.specs, self.report = specs, report
        first = next(iter(specs.values()))
        self.group, self.world, self.rank = first.group_name, first.world, first.rank
        self.place: dict[fx.Node, Any] = {}
        self.full = {n: _shape_of(n) for n in self.graph.nodes}
        self.scattered: dict[fx.Node, fx.Node] = {}
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.repairs: list[str] = []
        self.exempt: set[fx.Node] = set()  # reductions inside an RMSNorm site on a sharded input
        self.vocab: set[fx.Node] = set()  # sharded on the vocabulary: the head's output and what follows it
        self.vocab_losses = 0
        self.sharded_norms: list[fx.Node] = []
        view = GraphView(self.gm, ctx.example_inputs, ctx.config.analysis)
        self.site_of: dict[fx.Node, RMSNormSite] = {}
        for site in view.rmsnorms:
            for n in site.nodes:
                self.site_of.setdefault(n, site)
        self.decided: set[int] = set()

    # -- driver ---------------------------------------------------------------------

    def _canonical_weight_reads(self) -> None:
        """One spelling per weight GEMM, the one ``tp_collectives`` matches: ``x.matmul(W)`` and
        ``x.mm(W)`` become ``x @ W``; ``torch.t(W)`` and ``W.T`` become ``W.t()``."""
        weights = {n for n in self.graph.nodes if _is_full_view(n) or (n.op == "placeholder" and n in self.specs)}
        for node in self.graph.nodes:
            if node.op == "call_method" and node.target in ("matmul", "mm", "__matmul__") and len(node.args) == 2:
                node.op, node.target = "call_function", operator.matmul
            transposed = (node.op == "call_function" and node.target is torch.t) or (
                node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT")
            )
            if transposed and node.args[0] in weights and len(self.full.get(node) or ()) == 2:
                node.op, node.target, node.args, node.kwargs = "call_method", "t", (node.args[0],), {}

    def run(self) -> None:
        self._canonical_weight_reads()
        for node in list(self.graph.nodes):
            if node.op == "output":
                self._output(node)
                continue
            site = self.site_of.get(node)
            if site is not None and id(site) not in self.decided:
                self.decided.add(id(site))
                self._decide_site(site)
            self.place[node] = self._place(node)
            node.meta[PLACEMENT_KEY] = self.place[node]
            self._track_vocab(node)
        self._remove_full_views()
        self.gm.meta[SHARDED_NORMS_KEY] = list(self.sharded_norms)
        self.graph.lint()
        self.gm.recompile()
        checked = self._propagate_and_check()
        self.report.found.append(f"{checked} nodes checked against the unsharded graph")
        self.report.rewritten.extend(self.repairs)
        repaired = len([r for r in self.repairs if r.startswith("repaired")])
        self.report.details = {
            "checked": checked,
            "repaired": repaired,
            "scatters": len(self.scattered),
            "gathers": len(self.gathered),
            "refused": 0,
            "vocab_parallel_losses": self.vocab_losses,
            "summary": (
                f"sharding-consistency check: {checked} nodes checked against the unsharded graph, "
                f"{repaired} repaired, {len(self.scattered)} scattered, {len(self.gathered)} gathered, 0 refused"
                + (f"; {self.vocab_losses} vocab-parallel cross-entropy" if self.vocab_losses else "")
            ),
        }

    # -- placement of one node --------------------------------------------------------

    def _place(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            if node in self.specs and self.specs[node].dim is not None:
                bad = [u for u in node.users if not _is_full_view(u)]
                if bad:
                    self._refuse(bad[0], f"the model reads the shard of a sharded parameter directly ({node.name}), not through its module attribute",
                                 "read parameters as module attributes (self.weight), not through _parameters or named_parameters(), inside forward")
            return None
        if node.op == "get_attr":
            return None
        if _is_op(node, "tp_stream_in"):  # a pipeline stage's input: this rank's d-slice of the stream
            return Sharded(len(self.full[node]) - 1)
        if _is_op(node, "tp_stream_out"):  # a pipeline stage's output: this rank's d-slice, not gathered
            x = node.args[0]
            last = len(self.full[x]) - 1
            if self.place.get(x) is None:
                self._scatter_input(node, x, last)
            elif self.place[x] != Sharded(last):
                self._refuse(node, f"the stage returns a stream sharded as {self.place[x]}, not on its last dim", "")
            return None  # the local slice itself: what the next stage receives
        if _is_op(node, "tp_vocab_out"):  # a last stage's logits: this rank's vocabulary slice, not gathered
            x = node.args[0]
            if x not in self.vocab or self.place.get(x) != Sharded(len(self.full[x]) - 1):
                self._refuse(node, "the stage returns logits marked as vocabulary-sharded (shard_logits) that are not "
                             "the vocabulary-parallel head's output, sharded on their last dim",
                             "use shard_logits only on a stage whose last op is the untied output head")
            return None
        if _is_full_view(node):
            spec = self.specs.get(node.args[0])
            if spec is None:
                self._refuse(node, "a whole-shape view of a tensor that parallelize_ did not shard", "call parallelize_ once, on the model that is compiled")
            return Sharded(spec.dim, spec.sections)
        inputs = _tensor_inputs(node)
        if node.op == "call_module":
            if any(self._sharded(x) for x in inputs):
                self._refuse(node, "a call to a submodule the graph did not inline", "")
            return None
        if not any(self._sharded(x) for x in inputs):
            return self._replicated_op(node)
        return self._sharded_op(node, inputs)

    def _sharded(self, node: fx.Node) -> bool:
        p = self.place.get(node)
        if isinstance(p, list):
            return any(q is not None for q in p)
        return p is not None

    def _replicated_op(self, node: fx.Node) -> Any:
        """No input is sharded. Multi-output ops get a placement per output."""
        val = node.meta.get("example_value")
        if isinstance(val, (tuple, list)):
            return [None] * len(val)
        # a parameter used whole by a row-parallel GEMM, or the like, is handled by its consumer
        return None

    def _sharded_op(self, node: fx.Node, inputs: list[fx.Node]) -> Any:
        t = node.target
        vocab_inputs = [x for x in inputs if x in self.vocab]
        if vocab_inputs and not self._keeps_vocab_sharding(node, vocab_inputs):
            return self._vocab_consumer(node, vocab_inputs)
        if node.op == "call_function" and t is operator.getitem:
            return self._getitem(node)
        if node.op == "call_function" and getattr(t, "__name__", "") == "tp_sentinel.default":
            return self.place[node.args[0]]
        if node.op == "call_function" and t in _LINEAR:
            return self._weight_gemm(node, node.args[0], node.args[1])
        if node.op == "call_function" and t is torch.addmm and self._weight_spec_node(node.args[2]) is not None:
            # addmm(bias, x, W): Hugging Face's Conv1D (GPT-2); a row-parallel bias is added after the sum
            return self._weight_gemm(node, node.args[1], node.args[2])
        if node.op == "call_function" and t in _MATMUL or (node.op == "call_method" and t == "bmm"):
            weight = self._weight_spec_node(node.args[1])
            if weight is not None:
                return self._weight_gemm(node, node.args[0], node.args[1])
            return self._matmul(node)
        if node.op == "call_function" and t in _SDPA:
            return self._sdpa(node)
        if node.op == "call_function" and t is F.embedding:
            return self._embedding(node)
        if node.op == "call_function" and t in (torch.rms_norm, F.rms_norm):
            return self._fused_rms_norm(node)
        if node.op == "call_function" and t in (F.layer_norm, torch.layer_norm, F.group_norm):
            return self._needs_whole(node, node.args[0], "layer_norm normalises over the last dim, which this plan shards",
                                     "btp shards the residual stream on d and supports RMSNorm there; use plan='megatron' (dense) or 'vanilla', or an RMSNorm model")
        if node.op == "call_function" and t in _SOFTMAX or (node.op == "call_method" and t in ("softmax", "log_softmax")):
            return self._reduce(node, keep=True)
        if _is_method_or_fn(node, _REDUCTIONS):
            return self._reduce(node, keep=False)
        if _is_method_or_fn(node, _VIEWS, (torch.reshape,)):
            return self._view(node)
        if _is_method_or_fn(node, {"flatten"}, (torch.flatten,)):
            return self._reshape_like(node, rewrite=False)
        if _is_method_or_fn(node, {"view_as_complex", "view_as_real"}, (torch.view_as_complex, torch.view_as_real)):
            return self._same_leading(node)
        if _is_method_or_fn(node, {"transpose", "swapaxes", "permute", "t", "movedim"}, (torch.transpose, torch.permute, torch.t, torch.swapaxes, torch.movedim)):
            return self._permute(node)
        if _is_method_or_fn(node, {"unsqueeze", "squeeze"}, (torch.unsqueeze, torch.squeeze)):
            return self._reshape_like(node, rewrite=False)
        if _is_method_or_fn(node, {"expand"}):
            return self._expand(node)
        if _is_method_or_fn(node, {"expand_as", "view_as", "reshape_as"}):
            return self._as_other(node)
        if _is_method_or_fn(node, _SPLITS, (torch.split, torch.chunk, torch.unbind, torch.tensor_split)):
            return self._split(node)
        if _is_method_or_fn(node, {"cat", "concat", "concatenate"}, (torch.cat, torch.concat)):
            return self._cat(node)
        if _is_method_or_fn(node, {"repeat_interleave"}, (torch.repeat_interleave,)):
            return self._repeat_interleave(node)
        if _is_method_or_fn(node, {"triu", "tril"}, (torch.triu, torch.tril)):
            return self._last_two_whole(node)
        if node.op == "call_function" and t in _LIKE_FACTORIES:
            return self.place[node.args[0]]
        if node.op == "call_function" and t in _ELEMENTWISE_FUNCTIONS or (node.op == "call_method" and t in _ELEMENTWISE_METHODS):
            return self._elementwise(node)
        self._refuse(node, f"{_fn_name(node)} has a sharded input and no sharding rule",
                     "report the op; until it has a rule, use plan='vanilla' or keep this part of the model replicated")

    # -- the vocabulary-parallel head --------------------------------------------------

    def _track_vocab(self, node: fx.Node) -> None:
        """The head's output is sharded on the vocabulary, and so is what the ops it passes keep sharded."""
        if self._sharded(node) and not _is_full_view(node) and any(
            x in self.vocab or self._head_weight(x) for x in node.all_input_nodes
        ):
            self.vocab.add(node)

    def _head_weight(self, node: fx.Node) -> bool:
        return _is_full_view(node) and self.specs[node.args[0]].head

    def _keeps_vocab_sharding(self, node: fx.Node, vocab_inputs: list[fx.Node]) -> bool:
        """Ops that logits pass through sharded: casts, views that keep the vocabulary dim whole,
        transposes, indexing of other dims, elementwise ops with scalars. Anything else (a softmax,
        a top-k, a user's own loss) gets them gathered first: slower, never different."""
        x = vocab_inputs[0]
        if isinstance(self.place[x], list):
            return False
        p = self.place[x]
        if node.op == "call_function" and node.target is operator.getitem:
            return len(vocab_inputs) == 1 and _index_keeps_dim(node.args[1], len(self.full[x]), p.dim)
        if _is_method_or_fn(node, {"transpose", "swapaxes", "permute", "t", "movedim"}, (torch.transpose, torch.permute, torch.t, torch.swapaxes, torch.movedim)):
            return True
        if _is_method_or_fn(node, _VIEWS | {"flatten", "unsqueeze", "squeeze"}, (torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze)):
            src, dst = self.full[x], self.full[node]
            o, _ = _view_target_dim(src, dst, p.dim, 1)
            return o is not None and _hint(dst[o]) == _hint(src[p.dim])
        if node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS or (node.op == "call_method" and node.target in _ELEMENTWISE_METHODS):
            others = _tensor_inputs(node)
            if node.op == "call_method" and node.target in _FIRST_ARG_ONLY:
                others = others[:1]
            nd = len(self.full[node] or ())
            od = p.dim + nd - len(self.full[x])
            for y in others:
                if self.full.get(y) is None:
                    continue
                yd = od - (nd - len(self.full[y]))
                if y in self.vocab or self._head_weight(y):  # logits plus the head's bias
                    if self.place[y].dim != yd:
                        return False
                elif self.place.get(y) is not None or (yd >= 0 and not _is_one(self.full[y][yd])):
                    return False
            return True
        return False

    def _vocab_consumer(self, node: fx.Node, vocab_inputs: list[fx.Node]) -> Placement:
        """A cross-entropy on vocabulary-sharded logits becomes the vocabulary-parallel one;
        any other consumer gets them whole."""
        if node.op == "call_function" and node.target is F.cross_entropy and self._vocab_cross_entropy(node):
            return None
        for x in vocab_inputs:
            self._gather_input(node, x, f"{_fn_name(node)} is not vocabulary-parallel")
        remaining = [y for y in _tensor_inputs(node) if self._sharded(y)]
        return self._sharded_op(node, remaining) if remaining else self._replicated_op(node)

    def _vocab_cross_entropy(self, node: fx.Node) -> bool:
        """``F.cross_entropy(logits [N, V] sharded on V, target [N])`` -> ``vocab_parallel_cross_entropy``.

        Only the plain form: no class weights, no label smoothing, no legacy reduction
        flags; the others keep the gathered logits (False).
        """
        try:
            bound = inspect.signature(F.cross_entropy).bind(*node.args, **node.kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        a = bound.arguments
        x, target = a["input"], a["target"]
        p = self.place.get(x)
        plain = (
            isinstance(p, Sharded) and len(self.full[x]) == 2 and p.dim == 1 and self.full.get(target) is not None
            and len(self.full[target]) == 1 and self.place.get(target) is None and a["weight"] is None
            and a["size_average"] is None and a["reduce"] is None and a["label_smoothing"] == 0.0
            and isinstance(a["ignore_index"], int) and a["reduction"] in ("mean", "sum", "none")
        )
        if not plain:
            return False
        vocab = _hint(self.full[x][1])
        node.target = vocab_parallel_cross_entropy
        node.args = (x, target, self.group, self.world, self.rank, vocab, a["ignore_index"], a["reduction"])
        node.kwargs = {}
        self.vocab_losses += 1
        self.repairs.append(f"vocab-parallel cross_entropy at {self._where(node)}: logits {self._shape_str(x)} stay "
                            f"sharded on the vocabulary ({local_size(vocab, self.world)} columns a rank); "
                            "all-reduces of [N] only")
        return True

    # -- rules ----------------------------------------------------------------------

    def _elementwise(self, node: fx.Node) -> Placement:
        """Broadcasting ops: the sharded inputs must agree; a replicated one is sliced to match."""
        inputs = _tensor_inputs(node)
        if node.op == "call_method" and node.target in _FIRST_ARG_ONLY:
            inputs = inputs[:1]
        out = self.full[node]
        if out is None:
            self._refuse(node, "an elementwise op with a sharded input and no tensor output", "")
        nd = len(out)
        dims = set()
        for x in inputs:
            p = self.place[x]
            if p is not None:
                dims.add((p.dim + nd - len(self.full[x]), p.sections))
        if not dims:  # only a dtype/shape donor is sharded: ``mask.type_as(h)``
            return None
        if len(dims) > 1:
            self._refuse(node, f"inputs sharded on different dims {sorted(d for d, _ in dims)}", "")
        ((od, sections),) = dims
        for x in inputs:
            if self.place[x] is not None:
                continue
            xd = od - (nd - len(self.full[x]))
            if xd >= 0 and not _is_one(self.full[x][xd]):
                self._scatter_input(node, x, xd)
        return Sharded(od, sections)

    def _scatter_input(self, node: fx.Node, x: fx.Node, dim: int) -> None:
        """``x`` is whole on every rank but ``node`` combines it with a sharded tensor: take this rank's slice."""
        if dim != len(self.full[x]) - 1:
            self._refuse(node, f"a replicated input {x.name} {self._shape_str(x)} would have to be sliced on dim {dim}, not the last", "")
        if x not in self.scattered:
            with self.graph.inserting_after(x):
                self.scattered[x] = self.graph.call_function(scatter_to_tp, (x, self.group, self.world, self.rank))
            self.place[self.scattered[x]] = Sharded(dim)
            self.scattered[x].meta[PLACEMENT_KEY] = Sharded(dim)
            self.full[self.scattered[x]] = self.full[x]  # the same whole tensor, now held in slices
            self.repairs.append(f"scatter {x.name} {self._shape_str(x)} -> this rank's slice of dim {dim} (replicated value entering a sharded op at {self._where(node)})")
        node.replace_input_with(x, self.scattered[x])

    def _gather_input(self, node: fx.Node, x: fx.Node, why: str = "") -> None:
        """``x`` is sharded but ``node`` needs it whole: all-gather it (and drop any padding)."""
        p = self.place[x]
        if p.sections:
            self._refuse(node, f"needs {x.name} whole, but it is a fused output cut part by part", "")
        if x not in self.gathered:
            whole = _hint(self.full[x][p.dim])
            size = whole if whole % self.world else -1
            with self.graph.inserting_after(x):
                self.gathered[x] = self.graph.call_function(gather_from_tp, (x, self.group, self.world, self.rank, p.dim, size))
            self.place[self.gathered[x]] = None
            self.gathered[x].meta[PLACEMENT_KEY] = None
            self.full[self.gathered[x]] = self.full[x]
            self.repairs.append(f"gather {x.name} {self._shape_str(x)} whole for {self._where(node)}" + (f" ({why})" if why else ""))
        node.replace_input_with(x, self.gathered[x])

    def _needs_whole(self, node: fx.Node, x: fx.Node, why: str, hint: str) -> Placement:
        if self.place.get(x) is not None:
            self._refuse(node, why, hint)
        return None

    def _weight_spec_node(self, w: Any) -> fx.Node | None:
        """The parameter behind a GEMM's weight argument (through ``.t()``), if it is one."""
        if not isinstance(w, fx.Node):
            return None
        if w.op == "call_method" and w.target == "t":  # the one spelling left by _canonical_weight_reads
            w = w.args[0]
        if _is_full_view(w):
            return w
        if w.op == "placeholder" and w in self.specs:
            return w
        return None

    def _weight_gemm(self, node: fx.Node, x: fx.Node, w: fx.Node) -> Placement:
        wnode = self._weight_spec_node(w)
        spec = self.specs.get(wnode.args[0] if _is_full_view(wnode) else wnode) if wnode is not None else None
        xp = self.place.get(x)
        last = len(self.full[node]) - 1
        if spec is None or spec.dim is None or spec.role == "replicate":
            if xp is not None and xp.dim == len(self.full[x]) - 1:
                self._gather_input(node, x)
                return None
            return xp if xp is None else Sharded(xp.dim, xp.sections)
        if spec.role == "row":
            if xp is None:
                self._scatter_input(node, x, len(self.full[x]) - 1)
            elif xp.dim != len(self.full[x]) - 1 or xp.sections:
                self._refuse(node, f"the input of row-parallel {self._param(spec, wnode)} is sharded on dim {xp.dim}, not on its last dim",
                             "the plan's roles do not fit this model's data flow")
            return None  # partial sums; tp_collectives all-reduces right after the GEMM
        if spec.role == "col":
            if xp is not None:
                self._refuse(node, f"the input of column-parallel {self._param(spec, wnode)} is already sharded (dim {xp.dim})",
                             "a column-parallel GEMM needs its whole input; the plan's roles do not fit this model's data flow")
            return Sharded(last, spec.sections)
        self._refuse(node, f"a GEMM against a parameter sharded as {spec.role!r}", "")

    def _param(self, spec: ShardSpec, node: fx.Node) -> str:
        return f"{node.args[0].name if _is_full_view(node) else node.name} ({spec.role})"

    def _matmul(self, node: fx.Node) -> Placement:
        """Activation x activation (attention scores): sharded batch dims pass through."""
        a, b = node.args[0], node.args[1]
        sa, sb = self.full[a], self.full[b]
        pa, pb = self.place.get(a), self.place.get(b)
        out_nd = len(self.full[node])
        if len(sa) < 2 or len(sb) < 2:
            self._refuse(node, "a matmul with a sharded vector operand", "")
        if pa is not None and pa.dim == len(sa) - 1 or pb is not None and pb.dim == len(sb) - 2:
            self._refuse(node, "a matmul that contracts over a sharded dim (each rank would hold a partial sum)", _WHOLE_HEADS)
        if pa is not None and pa.dim == len(sa) - 2:
            if pb is not None:
                self._refuse(node, "both operands of a matmul sharded on their outer dims", "")
            return Sharded(out_nd - 2)
        if pb is not None and pb.dim == len(sb) - 1:
            if pa is not None:
                self._refuse(node, "both operands of a matmul sharded on their outer dims", "")
            return Sharded(out_nd - 1)
        # batch dims, aligned from the right
        da = pa.dim + out_nd - len(sa) if pa is not None else None
        db = pb.dim + out_nd - len(sb) if pb is not None else None
        if da is not None and db is not None and da != db:
            self._refuse(node, f"matmul operands sharded on different batch dims ({da} vs {db})", "")
        od = da if da is not None else db
        for x, p, shape in ((a, pa, sa), (b, pb, sb)):
            if p is None:
                xd = od - (out_nd - len(shape))
                if xd >= 0 and not _is_one(shape[xd]):
                    self._refuse(node, f"a replicated operand {x.name} {self._shape_str(x)} against one sharded on batch dim {od}", "")
        return Sharded(od)

    def _sdpa(self, node: fx.Node) -> Placement:
        q, k, v = node.args[:3]
        heads = len(self.full[q]) - 3
        for x in (q, k, v):
            p = self.place.get(x)
            if p is None or p.dim != heads:
                self._refuse(node, f"attention needs q, k and v sharded on the heads dim ({heads}); {x.name} is {p}",
                             "shard q/k/v (or their up factors) so that each rank holds whole heads")
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if isinstance(mask, fx.Node) and self.place.get(mask) is None:
            mshape = self.full[mask]
            md = heads - (len(self.full[q]) - len(mshape))
            if md >= 0 and not _is_one(mshape[md]):
                self._refuse(node, "an attention mask with one entry per head, replicated", "")
        return Sharded(heads)

    def _embedding(self, node: fx.Node) -> Placement:
        idx, w = node.args[0], node.args[1]
        if self.place.get(idx) is not None:
            self._refuse(node, "embedding indices that are sharded", "")
        p = self.place.get(w)
        if p is None:
            return None
        if p.dim != 1:
            self._refuse(node, f"an embedding table sharded on dim {p.dim} (only its columns, dim 1, can be)", "")
        return Sharded(len(self.full[node]) - 1)

    def _decide_site(self, site: RMSNormSite) -> None:
        """An RMSNorm on a sharded input with a sharded weight stays sharded (tp_collectives
        sums its statistic); with a whole weight its input is gathered; a replicated input
        with a sharded weight is sliced."""
        x = site.input
        xp = self.place.get(x)
        wp = self._weight_placement(site.weight)
        last = len(self.full[x]) - 1 if self.full.get(x) is not None else None
        users = [n for n in site.nodes if x in n.all_input_nodes]
        if xp is not None and (wp is None and site.weight is not None):
            for n in users:
                self._gather_input(n, x)
            return
        if xp is None and wp is not None:
            for n in users:
                self._scatter_input(n, x, last)
            xp = Sharded(last)
        if xp is not None:
            if xp.dim != last or xp.sections:
                self._refuse(site.output, f"an RMSNorm over the last dim of an input sharded on dim {xp.dim}", "")
            self.exempt.update(n for n in site.nodes if _is_method_or_fn(n, _REDUCTIONS))
            self.sharded_norms.append(site.output)

    def _weight_placement(self, w: Any) -> Placement:
        """From the spec: a module reads its weight after the normalisation it scales (graph order)."""
        if not isinstance(w, fx.Node):
            return None
        if _is_full_view(w) and w.args[0] in self.specs:
            spec = self.specs[w.args[0]]
            return Sharded(spec.dim, spec.sections)
        return self.place.get(w)

    def _fused_rms_norm(self, node: fx.Node) -> Placement:
        x = node.args[0]
        xp = self.place.get(x)
        if xp is None:
            return None
        # _decide_site made the input and the weight agree; the normalised shape is the local one
        shape = node.args[1]
        if isinstance(shape, (list, tuple)) and shape and isinstance(shape[-1], int):
            local = (*shape[:-1], shape[-1] // self.world)
            self._set_arg(node, 1, type(shape)(local), f"normalized_shape {tuple(shape)} -> {tuple(local)}")
        return Sharded(xp.dim)

    def _reduce(self, node: fx.Node, keep: bool) -> Placement:
        x = node.args[0]
        p = self.place[x]
        nd = len(self.full[x])
        dims = _reduced_dims(node, nd)
        keepdim = keep or bool(node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 and not keep and isinstance(node.args[2], bool) else False))
        if p.dim in dims:
            if node in self.exempt:
                return None
            self._refuse(node, f"{_fn_name(node)} over dim {p.dim}, which is sharded",
                         "only an RMSNorm may reduce over the sharded dim (its statistic is summed over the group); "
                         "use plan='megatron' or 'vanilla' for this model")
        out = Sharded(p.dim, p.sections) if keepdim else Sharded(p.dim - sum(1 for d in dims if d < p.dim), p.sections)
        val = node.meta.get("example_value")
        return [out] * len(val) if isinstance(val, (tuple, list)) else out  # max(dim): values, indices

    def _view(self, node: fx.Node) -> Placement:
        return self._reshape_like(node, rewrite=True)

    def _reshape_like(self, node: fx.Node, rewrite: bool) -> Placement:
        x = node.args[0]
        p = self.place[x]
        src, dst = self.full[x], self.full[node]
        # a padded vocabulary dim passes only whole (checked by _keeps_vocab_sharding)
        padded = _hint(src[p.dim]) % self.world != 0
        o, why = _view_target_dim(src, dst, p.dim, 1 if padded else self.world)
        if p.sections and o is not None and src[p.dim] == dst[o]:
            # the fused dim passes through whole (GPT-2's [B*T, 3d] -> [B, T, 3d])
            if rewrite:
                self._rewrite_size(node, o, dst)
            return Sharded(o, p.sections)
        if p.sections:
            self._refuse(node, "a view that splits or merges a fused output before it is split into its parts",
                         "split the fused output first")
        if o is None:
            self._refuse(node, f"a {_fn_name(node)} of a sharded tensor that no rank's slice can follow: {why}",
                         "each rank must hold whole heads: a TP degree that divides the head counts, and heads as the outer dim of the view")
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
        self.repairs.append(f"repaired {_fn_name(node)}{before} -> {tuple(sizes)} at {self._where(node)}")

    def _set_arg(self, node: fx.Node, i: int, value: Any, what: str) -> None:
        args = list(node.args)
        args[i] = value
        node.args = tuple(args)
        self.repairs.append(f"repaired {_fn_name(node)} {what} at {self._where(node)}")

    def _same_leading(self, node: fx.Node) -> Placement:
        p = self.place[node.args[0]]
        if p.dim >= min(len(self.full[node.args[0]]), len(self.full[node])) - 1 and _fn_name(node) == "view_as_complex":
            self._refuse(node, "view_as_complex of the sharded last dim", _WHOLE_HEADS)
        return Sharded(p.dim, p.sections)

    def _permute(self, node: fx.Node) -> Placement:
        x = node.args[0]
        p = self.place[x]
        nd = len(self.full[x])
        name = _fn_name(node)
        if name == "t":
            order = list(range(nd))[::-1]
        elif name in ("transpose", "swapaxes"):
            a, b = (d % nd for d in _int_args(node, 1, 2, ("dim0", "dim1")))
            order = list(range(nd))
            order[a], order[b] = order[b], order[a]
        elif name == "permute":
            dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
            order = [d % nd for d in dims]
        else:  # movedim
            src, dst = _int_args(node, 1, 2, ("source", "destination"))
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
        if _fn_name(node) == "expand_as" and px is not None and po is not None:
            return Sharded(px.dim + len(self.full[other]) - len(self.full[x]))
        self._refuse(node, f"{_fn_name(node)} between a tensor sharded as {px} and one sharded as {po}", "")

    def _split(self, node: fx.Node) -> list[Placement]:
        x = node.args[0]
        p = self.place[x]
        nd = len(self.full[x])
        name = _fn_name(node)
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
        tensors = [t for t in node.args[0] if not (self.full.get(t) is not None and len(self.full[t]) == 1 and _is_zero(self.full[t][0]))]
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
                self._scatter_input(node, t, p.dim)
        return p

    def _repeat_interleave(self, node: fx.Node) -> Placement:
        """Each element repeated n times in place: a rank's contiguous heads stay contiguous (GQA)."""
        x = node.args[0]
        p = self.place[x]
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if not isinstance(repeats, int) or dim is None:
            self._refuse(node, "repeat_interleave of a sharded tensor with per-element repeats or no dim", "")
        return Sharded(p.dim, p.sections if dim % len(self.full[x]) != p.dim else None)

    def _last_two_whole(self, node: fx.Node) -> Placement:
        p = self.place[node.args[0]]
        if p.dim >= len(self.full[node]) - 2:
            self._refuse(node, f"{_fn_name(node)} of a matrix sharded on dim {p.dim}", "")
        return p

    def _output(self, node: fx.Node) -> None:
        """The caller gets whole tensors: a sharded output (a KV cache, hidden states) is gathered."""
        for x in _tensor_inputs(node):
            if self.place.get(x) is None:
                continue
            if x in self.vocab:  # logits the caller asked for
                self._gather_input(node, x, "returned to the caller")
                continue
            self._gather_input(node, x)
            self.report.skip(x.name, "a sharded tensor is returned, so it is all-gathered every step "
                             "(for training, ask the model for the loss alone, e.g. use_cache=False)")

    # -- after the walk ---------------------------------------------------------------

    def _remove_full_views(self) -> None:
        for node in list(self.graph.nodes):
            if _is_full_view(node) or any(_is_op(node, m) for m in ("tp_stream_in", "tp_stream_out", "tp_vocab_out")):
                node.replace_all_uses_with(node.args[0])
                self.graph.erase_node(node)

    def _propagate_and_check(self) -> int:
        """Shapes through the rank's graph; each must be the unsharded one with its sharded dim divided."""
        from torch._guards import TracingContext
        from torch._subclasses.fake_tensor import FakeTensorMode

        tc = TracingContext.try_get()
        mode = tc.fake_mode if tc is not None and tc.fake_mode is not None else FakeTensorMode()
        inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in self.ctx.example_inputs]
        checked = 0
        localizer = self

        class Propagate(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                try:
                    out = super().run_node(n)
                except Exception as exc:  # noqa: BLE001 - becomes a refusal that names the op
                    localizer._refuse(n, f"this rank's program fails here ({type(exc).__name__}: {str(exc).splitlines()[0]})", "")
                if n.op not in ("output",):
                    n.meta["example_value"] = out
                return out

        # a failing op becomes the refusal above; fake-tensor's own ERROR log of it would only repeat it
        fake_log = logging.getLogger("torch._subclasses.fake_tensor")
        level = fake_log.level
        fake_log.setLevel(logging.CRITICAL)
        try:
            with mode, torch.set_grad_enabled(self.ctx.grad_enabled):
                Propagate(self.gm).run(*inputs)
        finally:
            fake_log.setLevel(level)
        for node in self.graph.nodes:
            full = self.full.get(node)
            val = node.meta.get("example_value")
            if full is None or not isinstance(val, torch.Tensor):
                continue
            p = self.place.get(node)
            expected = list(full)
            if isinstance(p, Sharded):
                expected[p.dim] = local_size(full[p.dim], self.world)
            local = list(val.shape)
            checked += 1
            if len(local) != len(expected) or not all(_dims_equal(a, b) for a, b in zip(local, expected, strict=True)):
                self._refuse(node, f"this rank holds {tuple(local)} where the unsharded graph's {tuple(full)} "
                             f"{'sharded on dim ' + str(p.dim) if p else 'replicated'} gives {tuple(expected)}", "")
        return checked

    # -- messages ---------------------------------------------------------------------

    def _shape_str(self, node: fx.Node) -> str:
        shape = self.full.get(node)
        return str(list(shape)) if shape is not None else "?"

    def _where(self, node: fx.Node) -> str:
        module = _module_path(node)
        return f"{module}: {node.name}" if module else node.name

    def _refuse(self, node: fx.Node, why: str, hint: str) -> None:
        inputs = ", ".join(f"{x.name} {self._shape_str(x)} {_placement_str(self.place.get(x))}" for x in _tensor_inputs(node))
        lines = [
            f"{self._where(node)}: {why}.",
            f"  op: {node.format_node()}",
            f"  unsharded shapes: inputs {inputs or '-'}; output {self._shape_str(node)}",
        ]
        source = _source_line(node)
        if source:
            lines.append(f"  model source: {source}")
        lines.append(f"  how to proceed: {hint or _DEFAULT_HINT}")
        raise ParallelizeError("\n".join(lines))


# ----------------------------------------------------------------------------- helpers


def _shape_of(node: fx.Node) -> tuple | None:
    val = node.meta.get("example_value")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    out = []
    for n in node.all_input_nodes:
        if PLACEMENT_KEY in n.meta and n.target in (scatter_to_tp, gather_from_tp):
            out.append(n)  # inserted by this pass: no example value until shapes are propagated
            continue
        val = n.meta.get("example_value")
        if isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)):
            out.append(n)
    return out


def _index_keeps_dim(idx: Any, nd: int, d: int) -> bool:
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


def _is_zero(size: Any) -> bool:
    return isinstance(size, int) and size == 0


def _is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def _dims_equal(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def _hint(size: Any) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else int(size)


def _view_target_dim(src: Sequence[Any], dst: Sequence[Any], d: int, world: int) -> tuple[int | None, str]:
    """The output dim that carries input dim ``d``'s sharding through a reshape, or (None, why).

    Dims are grouped so that each group's sizes multiply to the same number on both
    sides. A rank's contiguous slice of ``d`` stays one contiguous slice of the output
    when ``d`` is the outermost non-1 dim of its group and the group's outermost
    non-1 output dim divides by ``world``.
    """
    for gi, gj in _view_groups([_hint(s) for s in src], [_hint(s) for s in dst]):
        if d not in gi:
            continue
        outer = [k for k in gi if _hint(src[k]) != 1]
        if not outer or outer[0] != d:
            return None, f"the sharded dim {d} is merged under dim {outer[0]}, so a rank's part is not contiguous"
        targets = [k for k in gj if _hint(dst[k]) != 1]
        if not targets:
            return None, f"the sharded dim {d} disappears"
        size = _hint(dst[targets[0]])
        if size % world:
            return None, (f"the sharded dim {d} becomes dim {targets[0]} of size {size} (the outermost of "
                          f"{[_hint(dst[k]) for k in gj]}), which the TP degree {world} does not divide")
        return targets[0], ""
    return None, "the view's sizes do not match its input's"


def _view_groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
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


def _reduced_dims(node: fx.Node, nd: int) -> set[int]:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return set(range(nd))
    if isinstance(dim, int):
        return {dim % nd}
    if isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim):
        return {d % nd for d in dim}
    return set(range(nd))


def _int_args(node: fx.Node, i: int, j: int, names: tuple[str, str]) -> tuple[int, int]:
    a = node.args[i] if len(node.args) > i else node.kwargs[names[0]]
    b = node.args[j] if len(node.args) > j else node.kwargs[names[1]]
    return int(a), int(b)


def _placement_str(p: Any) -> str:
    if p is None:
        return "(replicated)"
    if isinstance(p, list):
        return "(parts)"
    return f"(sharded on dim {p.dim})"


_MODULE_PART = re.compile(r"^L\['[^']+'\](\[\d+\])?\.?")


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = _MODULE_PART.sub("", str(path))
    return re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules", "").strip(".")


def _source_line(node: fx.Node) -> str:
    """``file:line  code`` of the model line that made the node (its innermost frame)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    file, line, fn, code = frames[-1]
    return f"{file}:{line} in {fn}: {code.strip()}"
