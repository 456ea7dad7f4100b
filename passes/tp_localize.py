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
tensor meets a sharded one on the sharded dim (a tied embedding's output entering the
d-sharded stream, gpt-oss's per-head sinks next to this rank's heads) it inserts
``scatter_to_tp``; where a sharded tensor meets a consumer that needs it whole (the
final norm, a replicated head, the graph's output) ``gather_from_tp``. A replicated
tensor read whole by an op with a sharded output (Qwen3's q_norm weight scaling this
rank's heads) gets a partial gradient on each rank: it enters through ``copy_to_tp``,
which sums that gradient over the group. Reductions over the sharded dim are allowed only inside an
RMSNorm or LayerNorm site, whose statistics ``tp_collectives`` then sums over the
group; a norm with no weight stays sharded when only row-parallel GEMMs read it, and
is gathered before anything else (the final norm of modded-nanogpt).

The output head cut on the vocabulary makes the logits sharded on their last
dim; they pass casts, views that keep that dim whole and indexing of other dims
sharded, a plain ``F.cross_entropy`` on them becomes
``vocab_parallel_cross_entropy`` (all-reduces of [N] only), and any other
consumer, like the graph's output, gets them gathered (padding dropped).

Then shapes are propagated again through the rank's graph, and every node must
have the unsharded node's shape with exactly its sharded dim divided by the TP
degree (rounded up for a padded vocabulary). What cannot be placed (a softmax or a hand-written norm over the sharded dim, a view
that no contiguous slice can hold, a parameter read other than through its
module attribute, ...) is refused with a ``ParallelizeError`` that names the op,
the shapes and the model's source line, before the first step runs.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from boost_compile import _torch_compat as compat
from boost_compile.analysis import GraphView, LayerNormSite, RMSNormSite
from boost_compile.analysis.fx_utils import LINEAR_TARGETS, is_custom_op, is_full_view, module_path
from boost_compile.distributed import tp_random
from boost_compile.distributed.collectives import (
    copy_to_tp,
    gather_from_tp,
    local_size,
    scatter_to_tp,
    vocab_parallel_cross_entropy,
)
from boost_compile.distributed.shard import ParallelizeError, ShardSpec
from boost_compile.pass_manager import GraphPass, PassContext, PassReport
from boost_compile.passes.tp_op_rules import (
    ELEMENTWISE_FUNCTIONS,
    ELEMENTWISE_METHODS,
    FIRST_ARG_ONLY,
    LIKE_FACTORIES,
    MATMUL,
    NEW_TENSORS,
    REDUCTIONS,
    SDPA,
    SOFTMAX,
    SPLITS,
    VIEWS,
    WHOLE_HEADS,
    Placement,
    ShapeRules,
    Sharded,
    dims_equal,
    fn_name,
    hint,
    index_keeps_dim,
    is_method_or_fn,
    is_one,
    placement_str,
    reduced_dims,
    source_line,
    view_target_dim,
)
from boost_compile.passes.tp_partial_grads import PLACEMENT_KEY, PartialGradients
from boost_compile.passes.tp_partial_grads import tensor_inputs as _tensor_inputs

SHARDED_NORMS_KEY = "boost_tp_sharded_norms"



_DEFAULT_HINT = ("shard this model with another plan (megatron keeps the stream whole; vanilla uses DTensor's "
                 "own rules), or change the model so that this op sees whole tensors or only its rank's heads")


# ----------------------------------------------------------------------------- the pass


class TPPass(GraphPass):
    """A pass on a model sharded by ``parallelize_``: enabled and configured by ``tp``."""

    droppable = False  # without it there is no rank's program

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


class _Localizer(ShapeRules, PartialGradients):
    """One walk over the graph in topological order: place, rewrite, then check."""

    def __init__(self, ctx: PassContext, specs: dict[fx.Node, ShardSpec], report: PassReport) -> None:
        self.ctx, self.gm, self.graph = ctx, ctx.gm, ctx.gm.graph
        self.specs, self.report = specs, report
        first = next(iter(specs.values()))
        self.group, self.world, self.rank = first.group_name, first.world, first.rank
        self.place: dict[fx.Node, Any] = {}
        self.full = {n: _shape_of(n) for n in self.graph.nodes}
        self.scattered: dict[tuple[fx.Node, int], fx.Node] = {}  # (whole tensor, dim) -> this rank's slice
        self.narrowed: dict[tuple[fx.Node, int], fx.Node] = {}  # a replicated expand, expanded to this rank's part
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.repairs: list[str] = []
        self.exempt: set[fx.Node] = set()  # reductions inside an RMSNorm site on a sharded input
        self.vocab: set[fx.Node] = set()  # sharded on the vocabulary: the head's output and what follows it
        self.vocab_losses = 0
        self.sharded_norms: list[fx.Node] = []
        self.col_inputs: set[fx.Node] = set()  # column-parallel GEMMs: tp_collectives sums their input's gradient
        self.partial_sums: dict[fx.Node, fx.Node] = {}  # a replicated tensor -> its copy_to_tp for sharded consumers
        view = GraphView(self.gm, ctx.example_inputs, ctx.config.analysis)
        self.site_of: dict[fx.Node, RMSNormSite | LayerNormSite] = {}
        for site in view.norms:
            for n in site.nodes:
                self.site_of.setdefault(n, site)
        self.decided: set[int] = set()

    # -- driver ---------------------------------------------------------------------

    def _canonical_weight_reads(self) -> None:
        """One spelling per weight GEMM, the one ``tp_collectives`` matches: ``x.matmul(W)`` and
        ``x.mm(W)`` become ``x @ W``; ``torch.t(W)`` and ``W.T`` become ``W.t()``."""
        weights = {n for n in self.graph.nodes if is_full_view(n) or (n.op == "placeholder" and n in self.specs)}
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
        self._rank_local_dropout()
        self._sum_partial_gradients()
        self._remove_full_views()
        # by name: a graph put back by verify is a copy, whose nodes are new objects of the same names
        self.gm.meta[SHARDED_NORMS_KEY] = [n.name for n in self.sharded_norms]
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
                bad = [u for u in node.users if not is_full_view(u)]
                if bad:
                    self._refuse(bad[0], f"the model reads the shard of a sharded parameter directly ({node.name}), "
                                 "not through its module attribute",
                                 "read parameters as module attributes (self.weight), not through _parameters or "
                                 "named_parameters(), inside forward")
            return None
        if node.op == "get_attr":
            return None
        if is_custom_op(node, "tp_stream_in"):  # a pipeline stage's input: this rank's d-slice of the stream
            return Sharded(len(self.full[node]) - 1)
        if is_custom_op(node, "tp_stream_out"):  # a pipeline stage's output: this rank's d-slice, not gathered
            x = node.args[0]
            last = len(self.full[x]) - 1
            if self.place.get(x) is None:
                self._scatter_input(node, x, last)
            elif self.place[x] != Sharded(last):
                self._refuse(node, f"the stage returns a stream sharded as {self.place[x]}, not on its last dim", "")
            return None  # the local slice itself: what the next stage receives
        if is_custom_op(node, "tp_vocab_out"):  # a last stage's logits: this rank's vocabulary slice, not gathered
            x = node.args[0]
            if x not in self.vocab or self.place.get(x) != Sharded(len(self.full[x]) - 1):
                self._refuse(node, "the stage returns logits marked as vocabulary-sharded (shard_logits) that are not "
                             "the vocabulary-parallel head's output, sharded on their last dim",
                             "use shard_logits only on a stage whose last op is the untied output head")
            return None
        if is_full_view(node):
            spec = self.specs.get(node.args[0])
            if spec is None:
                self._refuse(node, "a whole-shape view of a tensor that parallelize_ did not shard",
                             "call parallelize_ once, on the model that is compiled")
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
        if node.op == "call_function" and t in LINEAR_TARGETS:
            return self._weight_gemm(node, node.args[0], node.args[1])
        if node.op == "call_function" and t is torch.addmm and self._weight_spec_node(node.args[2]) is not None:
            # addmm(bias, x, W): Hugging Face's Conv1D (GPT-2); a row-parallel bias is added after the sum
            return self._weight_gemm(node, node.args[1], node.args[2])
        if node.op == "call_function" and t in MATMUL or (node.op == "call_method" and t == "bmm"):
            weight = self._weight_spec_node(node.args[1])
            if weight is not None:
                return self._weight_gemm(node, node.args[0], node.args[1])
            return self._matmul(node)
        if node.op == "call_function" and t in SDPA:
            return self._sdpa(node)
        if node.op == "call_function" and t is F.embedding:
            return self._embedding(node)
        if node.op == "call_function" and t in (torch.rms_norm, F.rms_norm, F.layer_norm, torch.layer_norm):
            return self._fused_norm(node)
        if node.op == "call_function" and t is F.group_norm:
            return self._needs_whole(node, node.args[0], "group_norm normalises over the channels, which this plan shards",
                                     "btp shards the residual stream on d and supports RMSNorm and LayerNorm there; "
                                     "use plan='megatron' (dense) or 'vanilla'")
        if node.op == "call_function" and t in SOFTMAX or (node.op == "call_method" and t in ("softmax", "log_softmax")):
            return self._reduce(node, keep=True)
        if is_method_or_fn(node, {"min", "max"}) and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
            return self._elementwise(node)  # min(x, other): elementwise, not a reduction (xIELU's activation)
        if is_method_or_fn(node, REDUCTIONS):
            return self._reduce(node, keep=False)
        if is_method_or_fn(node, VIEWS, (torch.reshape,)):
            return self._view(node)
        if is_method_or_fn(node, {"flatten"}, (torch.flatten,)):
            return self._reshape_like(node, rewrite=False)
        if is_method_or_fn(node, {"view_as_complex", "view_as_real"}, (torch.view_as_complex, torch.view_as_real)):
            return self._same_leading(node)
        if is_method_or_fn(node, {"transpose", "swapaxes", "permute", "t", "movedim"},
                           (torch.transpose, torch.permute, torch.t, torch.swapaxes, torch.movedim)):
            return self._permute(node)
        if is_method_or_fn(node, {"unsqueeze", "squeeze"}, (torch.unsqueeze, torch.squeeze)):
            return self._reshape_like(node, rewrite=False)
        if is_method_or_fn(node, {"expand"}):
            return self._expand(node)
        if is_method_or_fn(node, {"expand_as", "view_as", "reshape_as"}):
            return self._as_other(node)
        if is_method_or_fn(node, SPLITS, (torch.split, torch.chunk, torch.unbind, torch.tensor_split)):
            return self._split(node)
        if is_method_or_fn(node, {"cat", "concat", "concatenate"}, (torch.cat, torch.concat)):
            return self._cat(node)
        if is_method_or_fn(node, {"stack"}, (torch.stack,)):
            return self._stack(node)
        if is_method_or_fn(node, {"repeat_interleave"}, (torch.repeat_interleave,)):
            return self._repeat_interleave(node)
        if is_method_or_fn(node, {"triu", "tril"}, (torch.triu, torch.tril)):
            return self._last_two_whole(node)
        if node.op == "call_function" and t in (torch.rand_like, torch.randn_like) or is_method_or_fn(
                node, {"bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_"}, (torch.bernoulli,)):
            self._refuse(node, f"{fn_name(node)} draws random values shaped like a tensor cut across the TP ranks: "
                         "every rank (seeded alike) would draw the same values on its slice",
                         "use F.dropout or nn.Dropout there, which tp_localize gives each rank its own stream")
        if node.op == "call_function" and t in LIKE_FACTORIES:
            return self.place[node.args[0]]
        if node.op == "call_method" and t in NEW_TENSORS:
            return self._new_tensor(node)
        if node.op == "call_method" and t == "copy_":
            return self._copy_into(node)
        if node.op == "call_function" and t in ELEMENTWISE_FUNCTIONS or (node.op == "call_method" and t in ELEMENTWISE_METHODS):
            return self._elementwise(node)
        self._refuse(node, f"{fn_name(node)} has a sharded input and no sharding rule",
                     "report the op; until it has a rule, use plan='vanilla' or keep this part of the model replicated")

    # -- the vocabulary-parallel head --------------------------------------------------

    def _track_vocab(self, node: fx.Node) -> None:
        """The head's output is sharded on the vocabulary, and so is what the ops it passes keep sharded."""
        if self._sharded(node) and not is_full_view(node) and any(
            x in self.vocab or self._head_weight(x) for x in node.all_input_nodes
        ):
            self.vocab.add(node)

    def _head_weight(self, node: fx.Node) -> bool:
        return is_full_view(node) and self.specs[node.args[0]].head

    def _keeps_vocab_sharding(self, node: fx.Node, vocab_inputs: list[fx.Node]) -> bool:
        """Ops that logits pass through sharded: casts, views that keep the vocabulary dim whole,
        transposes, indexing of other dims, elementwise ops with scalars. Anything else (a softmax,
        a top-k, a user's own loss) gets them gathered first: slower, never different."""
        x = vocab_inputs[0]
        if isinstance(self.place[x], list):
            return False
        p = self.place[x]
        if node.op == "call_function" and node.target is operator.getitem:
            return len(vocab_inputs) == 1 and index_keeps_dim(node.args[1], len(self.full[x]), p.dim)
        if is_method_or_fn(node, {"transpose", "swapaxes", "permute", "t", "movedim"},
                           (torch.transpose, torch.permute, torch.t, torch.swapaxes, torch.movedim)):
            return True
        if is_method_or_fn(node, VIEWS | {"flatten", "unsqueeze", "squeeze"},
                           (torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze)):
            src, dst = self.full[x], self.full[node]
            o, _ = view_target_dim(src, dst, p.dim, 1)
            return o is not None and hint(dst[o]) == hint(src[p.dim])
        if (node.op == "call_function" and node.target in ELEMENTWISE_FUNCTIONS
                or (node.op == "call_method" and node.target in ELEMENTWISE_METHODS)):
            others = _tensor_inputs(node)
            if node.op == "call_method" and node.target in FIRST_ARG_ONLY:
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
                elif self.place.get(y) is not None or (yd >= 0 and not is_one(self.full[y][yd])):
                    return False
            return True
        return False

    def _vocab_consumer(self, node: fx.Node, vocab_inputs: list[fx.Node]) -> Placement:
        """A cross-entropy on vocabulary-sharded logits becomes the vocabulary-parallel one;
        any other consumer gets them whole."""
        if node.op == "call_function" and node.target is F.cross_entropy and self._vocab_cross_entropy(node):
            return None
        for x in vocab_inputs:
            self._gather_input(node, x, f"{fn_name(node)} is not vocabulary-parallel")
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
        vocab = hint(self.full[x][1])
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
        if node.op == "call_method" and node.target in FIRST_ARG_ONLY:
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
            if xd >= 0 and not is_one(self.full[x][xd]):
                if sections:
                    self._refuse(node, f"a replicated input {x.name} {self._shape_str(x)} meets a fused output cut part "
                                 f"by part (parts {list(sections)}); its slice would not match", "split the fused output first")
                self._scatter_input(node, x, xd)
        return Sharded(od, sections)

    def _copy_into(self, node: fx.Node) -> Placement:
        """``dst.copy_(src)``, an in-place write into a buffer or a view of one (DeepSeek's
        ``key_states[..., :nope].copy_(k_nope)``): ``src`` must be cut as ``dst`` is. A replicated
        ``src`` is sliced to ``dst``'s part (where it is not broadcast); a sharded ``src`` copied into
        a buffer every rank holds whole is gathered; cut on another dim, refused."""
        dst, src = node.args[0], node.args[1]
        if not isinstance(src, fx.Node) or self.full.get(src) is None or self.full.get(dst) is None:
            self._refuse(node, "copy_ with a sharded tensor and something that is not a tensor", "")
        pd, ps = self.place.get(dst), self.place.get(src)
        if pd is None:
            self._gather_input(node, src, "copied into a tensor every rank holds whole")
            return None
        sd = pd.dim - (len(self.full[dst]) - len(self.full[src]))  # src's dim under dst's cut
        if ps is None:
            if sd >= 0 and not is_one(self.full[src][sd]):
                self._scatter_input(node, src, sd)
            return pd
        if ps.dim != sd or ps.sections != pd.sections:
            self._refuse(node, f"copy_ of a tensor sharded on dim {ps.dim} into one sharded on dim {pd.dim}",
                         "the buffer and what is written into it must be cut alike (whole heads on each rank)")
        return pd

    def _expand_to_local(self, node: fx.Node, x: fx.Node, dim: int) -> bool:
        """``x = t.expand(...)`` replicated, broadcasting a size-1 dim of ``t`` to ``dim``, meets a tensor
        cut on ``dim`` (the rope key all heads of multi-head latent attention share, next to this
        rank's heads): ``t`` is expanded to this rank's part of ``dim`` instead. Its gradient there is
        the sum over this rank's part alone, so ``t`` enters through ``copy_to_tp`` (identity forward,
        all-reduce of the gradient in backward). False when ``x`` is not such an expand."""
        if not (x.op == "call_method" and x.target == "expand") or not isinstance(x.args[0], fx.Node):
            return False
        t = x.args[0]
        whole, tshape = self.full[x], self.full.get(t)
        if self.place.get(t) is not None or tshape is None or hint(whole[dim]) % self.world:
            return False
        td = dim - (len(whole) - len(tshape))
        if td >= 0 and not is_one(tshape[td]):
            return False
        key = (x, dim)
        if key not in self.narrowed:
            with self.graph.inserting_after(x):
                summed = self.graph.call_function(copy_to_tp, (t, self.group))
            with self.graph.inserting_after(summed):
                local = self.graph.call_method("expand", (summed, *x.args[1:]), dict(x.kwargs))
            summed.meta, local.meta = dict(t.meta), dict(x.meta)
            self.place[summed], self.full[summed] = None, tshape
            self.place[local], self.full[local] = Sharded(dim), whole
            summed.meta[PLACEMENT_KEY], local.meta[PLACEMENT_KEY] = None, Sharded(dim)
            self._rewrite_size(local, dim, whole)
            self.narrowed[key] = local
            self.repairs.append(f"expand {x.name} {self._shape_str(x)} to this rank's part of dim {dim}, for "
                                f"{self._where(node)} (a replicated tensor broadcast over a sharded dim); "
                                f"its input's gradient summed over the group")
        node.replace_input_with(x, self.narrowed[key])
        return True

    def _scatter_input(self, node: fx.Node, x: fx.Node, dim: int) -> None:
        """``x`` is whole on every rank but ``node`` combines it with a sharded tensor: take this rank's slice."""
        last = len(self.full[x]) - 1
        if dim != last and self._expand_to_local(node, x, dim):
            return
        if hint(self.full[x][dim]) % self.world:
            self._refuse(node, f"a replicated input {x.name} {self._shape_str(x)} would have to be sliced on dim {dim}, "
                         f"which the TP degree {self.world} does not divide", WHOLE_HEADS)
        key = (x, dim)
        if key not in self.scattered:
            args = (x, self.group, self.world, self.rank) + (() if dim == last else (dim,))
            with self.graph.inserting_after(x):
                self.scattered[key] = self.graph.call_function(scatter_to_tp, args)
            self.place[self.scattered[key]] = Sharded(dim)
            self.scattered[key].meta[PLACEMENT_KEY] = Sharded(dim)
            self.full[self.scattered[key]] = self.full[x]  # the same whole tensor, now held in slices
            self.repairs.append(f"scatter {x.name} {self._shape_str(x)} -> this rank's slice of dim {dim} "
                                f"(replicated value entering a sharded op at {self._where(node)})")
        node.replace_input_with(x, self.scattered[key])

    def _gather_input(self, node: fx.Node, x: fx.Node, why: str = "") -> None:
        """``x`` is sharded but ``node`` needs it whole: all-gather it (and drop any padding)."""
        p = self.place[x]
        if p.sections:
            self._refuse(node, f"needs {x.name} whole, but it is a fused output cut part by part", "")
        if x not in self.gathered:
            whole = hint(self.full[x][p.dim])
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
        if is_full_view(w):
            return w
        if w.op == "placeholder" and w in self.specs:
            return w
        return None

    def _weight_gemm(self, node: fx.Node, x: fx.Node, w: fx.Node) -> Placement:
        wnode = self._weight_spec_node(w)
        spec = self.specs.get(wnode.args[0] if is_full_view(wnode) else wnode) if wnode is not None else None
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
            self.col_inputs.add(node)
            return Sharded(last, spec.sections)
        self._refuse(node, f"a GEMM against a parameter sharded as {spec.role!r}", "")

    def _param(self, spec: ShardSpec, node: fx.Node) -> str:
        return f"{node.args[0].name if is_full_view(node) else node.name} ({spec.role})"

    def _matmul(self, node: fx.Node) -> Placement:
        """Activation x activation (attention scores): sharded batch dims pass through."""
        a, b = node.args[0], node.args[1]
        sa, sb = self.full[a], self.full[b]
        pa, pb = self.place.get(a), self.place.get(b)
        out_nd = len(self.full[node])
        if len(sa) < 2 or len(sb) < 2:
            self._refuse(node, "a matmul with a sharded vector operand", "")
        if pa is not None and pa.dim == len(sa) - 1 or pb is not None and pb.dim == len(sb) - 2:
            self._refuse(node, "a matmul that contracts over a sharded dim (each rank would hold a partial sum)", WHOLE_HEADS)
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
                if xd >= 0 and not is_one(shape[xd]):
                    self._refuse(node, f"a replicated operand {x.name} {self._shape_str(x)} against one sharded on batch dim {od}", "")
        return Sharded(od)

    def _rank_local_dropout(self) -> None:
        """Each dropout on a sharded tensor, and each attention with ``dropout_p`` on sharded heads,
        draws from this rank's own stream (:mod:`boost_compile.distributed.tp_random`): a seed
        drawn once per call from the shared generator, mixed with the rank and the site's number."""
        sites: list[tuple[fx.Node, str, float]] = []
        for node in self.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in (F.dropout, torch.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
                               torch.nn.functional.dropout3d, F.alpha_dropout, F.feature_alpha_dropout):
                x = node.args[0]
                if not isinstance(x, fx.Node) or self.place.get(x) is None:
                    continue  # replicated: the shared generator keeps every rank's copy equal
                p, training, inplace = _dropout_args(node)
                if not training or p == 0:
                    continue
                if node.target not in (F.dropout, torch.dropout):
                    self._refuse(node, f"{fn_name(node)} on a tensor cut across the TP ranks would draw the same "
                                 "mask on every rank", "use F.dropout / nn.Dropout there")
                if inplace:
                    self._refuse(node, "an in-place dropout on a tensor cut across the TP ranks",
                                 "use nn.Dropout(p) without inplace=True")
                sites.append((node, "dropout", p))
            elif node.target in SDPA:
                p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
                if isinstance(p, (int, float)) and p > 0 and self.place.get(node) is not None:
                    sites.append((node, "attention", float(p)))
        if not sites:
            return
        with self.graph.inserting_before(sites[0][0]):
            seed = self.graph.call_function(tp_random.draw_seed, ())
        self.place[seed] = None
        for site, (node, kind, p) in enumerate(sites):
            if kind == "dropout":
                node.target, node.args, node.kwargs = tp_random.tp_dropout, (node.args[0], p, seed, self.rank, site), {}
            else:
                names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
                defaults = (None, 0.0, False, None, False)
                extra = [node.kwargs.get(n, node.args[3 + i] if len(node.args) > 3 + i else d)
                         for i, (n, d) in enumerate(zip(names, defaults, strict=True))]
                node.target = tp_random.tp_attention_dropout
                node.args, node.kwargs = (*node.args[:3], *extra, seed, self.rank, site), {}
            self.repairs.append(f"rank-local dropout ({kind}, p={p}) at {node.name}: this rank's own stream, site {site}")

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
            if md >= 0 and not is_one(mshape[md]):
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

    def _decide_site(self, site: RMSNormSite | LayerNormSite) -> None:
        """A norm over the last dim of an input sharded on that dim stays sharded (tp_collectives
        sums its statistics) when its parameters are sharded too, or, without parameters, unless
        a GEMM that needs a whole input reads it (the head); otherwise its input is gathered. A
        replicated input with sharded parameters is sliced. A norm over a dim that is not the
        sharded one (a q/k norm over the head dim of local heads) is this rank's own."""
        x = site.input
        xp = self.place.get(x)
        last = len(self.full[x]) - 1 if self.full.get(x) is not None else None
        if xp is not None and xp.dim != last and not xp.sections:
            return  # normalises within each rank's slice
        params = [p for p in (site.weight, getattr(site, "bias", None)) if p is not None]
        placements = {self._weight_placement(p) for p in params}
        if len(placements) > 1:
            self._refuse(site.output, f"a norm whose weight and bias are cut differently ({placements})", "")
        wp = placements.pop() if placements else None
        users = [n for n in site.nodes if x in n.all_input_nodes]
        whole = wp is None and (params or self._feeds_a_whole_input_gemm(site.output))
        if xp is not None and whole:
            for n in users:
                self._gather_input(n, x)
            return
        if xp is None and wp is not None:
            for n in users:
                self._scatter_input(n, x, last)
            xp = Sharded(last)
        if xp is not None:
            if xp.dim != last or xp.sections:
                self._refuse(site.output, f"a norm over the last dim of an input sharded on dim {xp.dim}", "")
            self.exempt.update(n for n in site.nodes if is_method_or_fn(n, REDUCTIONS))
            self.sharded_norms.append(site.output)

    def _feeds_a_whole_input_gemm(self, out: fx.Node) -> bool:
        """A weightless norm's output read by a GEMM whose weight is not row-parallel (a head, a
        replicated weight): that GEMM needs the whole input, so the norm runs on the whole stream.
        Otherwise the norm stays sharded: online in row-parallel GEMMs, or with its own statistic."""
        def whole_input_gemm(u: fx.Node) -> bool:
            if not (u.op == "call_function" and (u.target in LINEAR_TARGETS or u.target in MATMUL)) or u.args[0] is not out:
                return False
            w = self._weight_spec_node(u.args[1])
            spec = self.specs.get(w.args[0] if w is not None and is_full_view(w) else w)
            return spec is None or spec.role != "row"

        return any(whole_input_gemm(u) for u in out.users)

    def _weight_placement(self, w: Any) -> Placement:
        """From the spec: a module reads its weight after the normalisation it scales (graph order)."""
        if not isinstance(w, fx.Node):
            return None
        if is_full_view(w) and w.args[0] in self.specs:
            spec = self.specs[w.args[0]]
            return Sharded(spec.dim, spec.sections)
        return self.place.get(w)

    def _fused_norm(self, node: fx.Node) -> Placement:
        """``rms_norm`` / ``layer_norm``: on the sharded last dim only as a site ``_decide_site`` kept
        sharded (tp_collectives gives it the whole statistics); on another dim, this rank's own."""
        x = node.args[0]
        xp = self.place.get(x)
        if xp is None:
            return None
        last = len(self.full[x]) - 1
        if xp.dim != last:
            return Sharded(xp.dim, xp.sections)
        if node not in self.sharded_norms:
            self._refuse(node, f"{fn_name(node)} normalises over the sharded last dim, and is not a norm this plan can "
                         "give the whole statistics (over more than the last dim, or its parameters not cut alike)",
                         "normalise over the last dim alone, with parameters of the model's width")
        # _decide_site made the input and the parameters agree; the normalised shape is the local one
        shape = node.args[1]
        if isinstance(shape, (list, tuple)) and shape and isinstance(shape[-1], int):
            local = (*shape[:-1], shape[-1] // self.world)
            self._set_arg(node, 1, type(shape)(local), f"normalized_shape {tuple(shape)} -> {tuple(local)}")
        return Sharded(xp.dim)

    def _reduce(self, node: fx.Node, keep: bool) -> Placement:
        x = node.args[0]
        p = self.place[x]
        nd = len(self.full[x])
        dims = reduced_dims(node, nd)
        keepdim = keep or bool(node.kwargs.get(
            "keepdim", node.args[2] if len(node.args) > 2 and not keep and isinstance(node.args[2], bool) else False))
        if p.dim in dims:
            if node in self.exempt:
                return None
            self._refuse(node, f"{fn_name(node)} over dim {p.dim}, which is sharded",
                         "only an RMSNorm may reduce over the sharded dim (its statistic is summed over the group); "
                         "use plan='megatron' or 'vanilla' for this model")
        out = Sharded(p.dim, p.sections) if keepdim else Sharded(p.dim - sum(1 for d in dims if d < p.dim), p.sections)
        val = node.meta.get("example_value")
        return [out] * len(val) if isinstance(val, (tuple, list)) else out  # max(dim): values, indices

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
            if is_full_view(node) or any(is_custom_op(node, m) for m in ("tp_stream_in", "tp_stream_out", "tp_vocab_out")):
                node.replace_all_uses_with(node.args[0])
                self.graph.erase_node(node)

    def _propagate_and_check(self) -> int:
        """Shapes through the rank's graph; each must be the unsharded one with its sharded dim divided."""
        mode = compat.current_fake_mode()
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
        with compat.quiet_fake_tensor_log(), mode, torch.set_grad_enabled(self.ctx.grad_enabled):
            Propagate(self.gm).run(*inputs)
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
            if len(local) != len(expected) or not all(dims_equal(a, b) for a, b in zip(local, expected, strict=True)):
                self._refuse(node, f"this rank holds {tuple(local)} where the unsharded graph's {tuple(full)} "
                             f"{'sharded on dim ' + str(p.dim) if p else 'replicated'} gives {tuple(expected)}", "")
        return checked

    # -- messages ---------------------------------------------------------------------

    def _shape_str(self, node: fx.Node) -> str:
        shape = self.full.get(node)
        return str(list(shape)) if shape is not None else "?"

    def _where(self, node: fx.Node) -> str:
        module = module_path(node)
        return f"{module}: {node.name}" if module else node.name

    def _refuse(self, node: fx.Node, why: str, hint: str) -> None:
        inputs = ", ".join(f"{x.name} {self._shape_str(x)} {placement_str(self.place.get(x))}" for x in _tensor_inputs(node))
        lines = [
            f"{self._where(node)}: {why}.",
            f"  op: {node.format_node()}",
            f"  unsharded shapes: inputs {inputs or '-'}; output {self._shape_str(node)}",
        ]
        source = source_line(node)
        if source:
            lines.append(f"  model source: {source}")
        lines.append(f"  how to proceed: {hint or _DEFAULT_HINT}")
        raise ParallelizeError("\n".join(lines))


# ----------------------------------------------------------------------------- helpers


def _dropout_args(node: fx.Node) -> tuple[float, bool, bool]:
    """(p, training, inplace) of ``F.dropout(x, p, training, inplace)`` or ``torch.dropout(x, p, train)``."""
    if node.target is torch.dropout:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        return float(p), bool(node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True)), False
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    inplace = node.kwargs.get("inplace", node.args[3] if len(node.args) > 3 else False)
    return float(p), bool(training), bool(inplace)


def _shape_of(node: fx.Node) -> tuple | None:
    val = node.meta.get("example_value")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
