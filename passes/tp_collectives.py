"""Insert the tensor-parallel collectives of a model sharded by ``parallelize_``.

Reads the ``ShardSpec`` that ``parallelize_`` attached to each parameter (the
example inputs are the parameters themselves) and rewrites, on the Dynamo graph:

    y = linear(x, W_row)      ->  y = reduce_from_tp(linear(x, W_row)) [+ b]
    y = linear(x, W_col)      ->  y = linear(copy_to_tp(x), W_col)       (one copy per input)

``copy_to_tp`` (identity forward, all-reduce of the gradient in backward) is
placed as high as it can go: above the split and SiLU that separate a grouped
down factor's reduced output from its up factors, so backward, like forward,
sends one [T, r_q + r_k + r_v] all-reduce per group instead of one per factor.
It also climbs through elementwise work that combines latents (LaX's
``(h_i + h_{i-1}) @ B_i``, a scale, a gate) when every input of that work feeds
column-parallel GEMMs only: each input gets the copy instead, so the all-reduce
sits where all uses of a latent meet (h_i feeds B_i and, crossed, B_{i+1}) and
sums their partial gradients once. Every forward value there is whole on every
rank, so each vector-Jacobian product is the same linear map of the gradient on
every rank and summing before or after it gives the same result.

A weight that is ``cat`` of shards of one role (a group formed by
``group_linears``) keeps that role, so a grouped q/k/v down factor needs one
all-reduce of [T, r_q + r_k + r_v].

Online RMSNorm (btp): a norm whose input is a d-sharded slice of the residual
stream and whose output feeds row-parallel GEMMs only becomes

    s  = sum(x.float() ** 2, -1)                  # local statistic, fp32
    h  = linear(x * (offset + w), W_row)          # = rms(x) * (norm(x) @ W) locally
    H, S = split(reduce_from_tp(cat([h.float(), s], -1)))   # ONE collective
    y  = (H * rsqrt(S / d + eps)).to(x.dtype)

so the statistic travels in the all-reduce the GEMM needs anyway. The pair is
packed in fp32: for bf16 models the [T, r] part doubles in bytes. That wins
where collectives are latency-bound (small T); where they are bandwidth-bound
(NVLink at 7B shapes the packed pair costs about 1.9x, see
``benchmarks/bench_norm_packing.py``) ``tp.norm_statistic="separate"`` sends the
[T, r] part in the model's dtype and the statistic in its own fp32 all-reduce. A norm on a
sharded input that feeds anything else gets its own all-reduce of the statistic
(correct, one extra small collective), reported as such.

Online LayerNorm (btp) folds the same way, with two statistics: each rank centres
its slice on its own mean m_l (c_l = x_l - m_l), and the GEMM's all-reduce carries,
in fp32, the tokens' [T, r] part (c_l g_l) @ A_l, their sum of squares about m_l and
m_l itself in the rank's own column, plus the rows g_l @ A_l (one per rank) and
b_l @ A_l (summed):

    y = (H + (m - mean) @ G) * rsqrt(var + eps) + B
    var = (sum_l M2_l + d_l * sum_l (m_l - mean)^2) / d

Every m_l arrives exactly (it is summed with zeros), so the variance is combined
from centred sums (Chan's parallel formula), not E[x^2] - mean^2, which loses the
variance's digits when the mean is large against the spread. A norm without a
weight or bias is found by what it computes and folded alike (g = 1, b = 0).

The ``tp_sentinel`` that guards the model's input is removed here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from boost_compile.analysis import LayerNormSite, RMSNormSite, remove_dead_code, unused_nodes
from boost_compile.analysis.fx_utils import LATENT_OP_METHODS, LATENT_OP_TARGETS, LINEAR_TARGETS
from boost_compile.distributed.collectives import copy_to_tp, reduce_from_tp
from boost_compile.distributed.shard import ParallelizeError, ShardSpec
from boost_compile.pass_manager import PassContext, PassReport
from boost_compile.passes.tp_localize import SHARDED_NORMS_KEY, TPPass, shard_specs

_MATMUL = {operator.matmul, torch.matmul, torch.mm}


class TPCollectivesPass(TPPass):
    name = "tp_collectives"
    completes_rank_program = True  # verify checks the rank's program after this pass

    def run(self, ctx: PassContext) -> PassReport:
        unused = unused_nodes(ctx.gm.graph)  # what the captured graph leaves unused stays
        report = PassReport(self.name)
        graph = ctx.gm.graph
        specs = shard_specs(ctx)
        sentinels = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.boost.tp_sentinel.default]
        if not specs and not sentinels:
            report.not_applicable = "the model was not parallelized with parallelize_"
            return report
        for s in sentinels:
            s.replace_all_uses_with(s.args[0])
            graph.erase_node(s)
        view = ctx.view
        gemms = [(n, sp) for n in graph.nodes if (sp := _gemm_spec(n, specs)) is not None]
        row = {n: sp for n, sp in gemms if sp.role == "row"}
        done: set[fx.Node] = set()
        collectives = 0

        # the norms whose input tp_localize left sharded on the last dim (btp's stream)
        sharded_norms = set(ctx.gm.meta.get(SHARDED_NORMS_KEY, ()))  # by node name
        fixed: set[str] = set()
        replaced: dict[fx.Node, fx.Node] = {}  # a norm's old output -> its rewrite (a norm may read one)
        for site in view.norms:
            if site.output.name not in sharded_norms:
                continue
            if site.input in replaced:  # modded-nanogpt: the first block's norm reads the embedding's norm
                site = dataclasses.replace(site, input=replaced[site.input])
            fixed.add(site.output.name)
            users = list(site.output.users)
            kind = "layernorm" if isinstance(site, LayerNormSite) else "rmsnorm"
            report.found.append(f"{kind} {site.name}")
            if users and all(u in row and u.args[0] is site.output for u in users):
                separate = self.config.tp.norm_statistic == "separate"
                online = _online_layernorm if kind == "layernorm" else _online_rmsnorm
                for u in users:
                    with _provenance(graph, site.output):
                        online(graph, site, u, row[u], separate)
                    done.add(u)
                    collectives += 2 if separate else 1
                report.rewritten.append(f"{kind} {site.name} (online, in the GEMM's all-reduce)")
            else:
                own = _stat_all_reduce_layernorm if kind == "layernorm" else _stat_all_reduce_rmsnorm
                with _provenance(graph, site.output):
                    replaced[site.output] = own(graph, site, _spec_of_site(site, specs, row))
                collectives += 1
                report.rewritten.append(f"{kind} {site.name} (own statistic all-reduce)")

        if missed := sharded_norms - fixed:
            raise ParallelizeError(
                f"norm site(s) {sorted(missed)} normalise a sharded input but were not "
                "found again after the earlier passes; their statistic would be this rank's alone"
            )
        for node, sp in gemms:
            if node in done:
                continue
            report.found.append(node.name)
            if sp.role == "row":
                _reduce_after(graph, node, sp)
                collectives += 1
            report.rewritten.append(f"{node.name} ({sp.role})")

        # after the reductions exist, so that hoisting sees the final graph
        col = {n for n, sp in gemms if sp.role == "col"}
        copies: dict[fx.Node, fx.Node] = {}
        feeders = _col_feeders(graph, col)
        # every target first: inserting a copy changes the uses that hoisting reads
        targets = [(node, sp, top) for node, sp in gemms if sp.role == "col"
                   for top in _hoist_targets(_input_arg(node), feeders)]
        for node, sp, top in targets:
            x = _input_arg(node)
            if top not in copies:
                with graph.inserting_after(top):
                    copies[top] = graph.call_function(copy_to_tp, (top, sp.group_name))
                copies[top].meta.update(top.meta)
                collectives += 1
                if top is not x or x in feeders:
                    top.replace_all_uses_with(copies[top], delete_user_cb=lambda u, c=copies[top]: u is not c)
            if top is x:
                node.replace_input_with(x, copies[top])
        report.details = {"plan": next(iter(specs.values())).plan if specs else None, "collectives": collectives}
        remove_dead_code(graph, unused)
        return report


_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack")


@contextlib.contextmanager
def _provenance(graph: fx.Graph, origin: fx.Node) -> Iterator[None]:
    """Nodes created inside take ``origin``'s module and source line (explain's "from" column)."""
    before = set(graph.nodes)
    meta = {k: origin.meta[k] for k in _PROVENANCE if k in origin.meta}
    yield
    for node in graph.nodes:
        if node not in before:
            for k, v in meta.items():
                node.meta.setdefault(k, v)


#: ops with one tensor input that every rank computes alike on a replicated
#: input: the backward all-reduce of a column-parallel GEMM's input gradient can
#: move above them (their vector-Jacobian products are linear in the gradient)
_HOISTABLE_FUNCTIONS = {
    operator.getitem, torch.split, torch.chunk, torch.nn.functional.silu, torch.nn.functional.relu,
    torch.nn.functional.gelu, torch.sigmoid, torch.tanh,
}
_HOISTABLE_METHODS = {"view", "reshape", "contiguous", "split", "chunk", "float", "silu", "relu", "sigmoid", "tanh"}
#: elementwise ops of several tensor inputs the copy climbs through when every input feeds
#: column-parallel GEMMs only (each then gets a copy of its own)
_COMBINING = LATENT_OP_TARGETS


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Inputs that may be tensors: all but those known to be sizes (SymInts)."""
    return [n for n in node.all_input_nodes if not isinstance(n.meta.get("example_value"), int | torch.SymInt)]


def _hoistable(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _HOISTABLE_FUNCTIONS:
        return len(_tensor_inputs(node)) == 1
    if node.op == "call_method" and node.target in _HOISTABLE_METHODS:
        return len(_tensor_inputs(node)) == 1
    return _combining(node)


def _combining(node: fx.Node) -> bool:
    """An elementwise op of several tensors (``h_i + h_{i-1}``) with no keyword arguments."""
    is_op = (node.op == "call_function" and node.target in _COMBINING) or (
        node.op == "call_method" and node.target in LATENT_OP_METHODS)
    return is_op and not node.kwargs and len(_tensor_inputs(node)) >= 1


def _col_feeders(graph: fx.Graph, col: set[fx.Node]) -> set[fx.Node]:
    """The nodes whose every use ends, through hoistable ops only, as the input of a
    column-parallel GEMM; through elementwise work that combines several tensors only
    when all of them are such nodes (each will carry its own copy).

    The largest set that is consistent with itself: start from every node with uses and
    drop, until nothing changes, those with a use that does not qualify (the co-inputs
    of combining ops make the question circular, so it is not answered by recursion).
    """
    feeders = {n for n in graph.nodes if n.users and n.op != "placeholder"}  # a parameter keeps its gradient

    def qualifies(node: fx.Node, use: fx.Node) -> bool:
        if use in col:
            return _input_arg(use) is node and sum(a is node for a in use.args) == 1
        if not _hoistable(use) or use not in feeders:
            return False
        return not _combining(use) or all(p in feeders for p in _tensor_inputs(use))

    changed = True
    while changed:
        dropped = {n for n in feeders if not all(qualifies(n, u) for u in n.users)}
        feeders -= dropped
        changed = bool(dropped)
    return feeders


def _hoist_targets(x: fx.Node, feeders: set[fx.Node]) -> list[fx.Node]:
    """Where ``copy_to_tp`` can serve ``x``: the highest ancestors, through hoistable ops,
    whose every use feeds column-parallel GEMMs (:func:`_col_feeders`): one for a unary
    chain, one per input where elementwise work combines several.

    A grouped q/k/v down factor's reduced output is split, passed through SiLU
    and consumed by three up factors: one backward all-reduce of [T, 3r] at the
    reduction replaces three of [T, r] at the up factors' inputs. Summing there is
    exact because each rank's gradient is a partial sum of the column slices and
    everything in between is replicated and linear in the gradient.
    """
    inputs = _tensor_inputs(x) if _hoistable(x) else []
    if not inputs or not all(p in feeders for p in inputs):
        return [x]
    tops: list[fx.Node] = []
    for parent in inputs:
        tops += [t for t in _hoist_targets(parent, feeders) if t not in tops]
    return tops


def _input_arg(node: fx.Node) -> Any:
    """The activation a GEMM multiplies: ``addmm(bias, x, W)`` takes it second."""
    return node.args[1] if node.target is torch.addmm else node.args[0]


def _weight_arg(node: fx.Node) -> Any:
    if node.target is torch.addmm:
        return node.args[2]
    return node.args[1] if len(node.args) > 1 else None


def _gemm_spec(node: fx.Node, specs: dict[fx.Node, ShardSpec]) -> ShardSpec | None:
    if node.op != "call_function" or node.target not in LINEAR_TARGETS | _MATMUL | {torch.addmm}:
        return None
    w = _weight_arg(node)
    if isinstance(w, fx.Node) and w.op == "call_method" and w.target == "t":
        w = w.args[0]
    return _spec_through_cat(w, specs)


def _spec_through_cat(w: Any, specs: dict[fx.Node, ShardSpec]) -> ShardSpec | None:
    if not isinstance(w, fx.Node):
        return None
    if w in specs:
        spec = specs[w]
        return spec if spec.role in ("row", "col") else None
    if w.op == "call_function" and w.target is torch.cat:
        parts = [_spec_through_cat(p, specs) for p in w.args[0]]
        if parts and all(p is not None for p in parts) and len({p.role for p in parts}) == 1:
            return parts[0]
    return None


def _spec_of_site(site: RMSNormSite | LayerNormSite, specs: dict[fx.Node, ShardSpec], row: dict[fx.Node, ShardSpec]) -> ShardSpec:
    for p in (site.weight, getattr(site, "bias", None)):
        if p is not None and p in specs:
            return specs[p]
    return next(iter(specs.values()) if specs else iter(row.values()))


def _reduce_after(graph: fx.Graph, node: fx.Node, spec: ShardSpec) -> None:
    """``reduce_from_tp`` on a row-parallel GEMM's output; a bias is added after the sum."""
    bias = None
    if node.target in LINEAR_TARGETS and len(node.args) > 2 and node.args[2] is not None:
        bias = node.args[2]
        node.args = (node.args[0], node.args[1], None)
    elif node.target is torch.addmm:
        bias = node.args[0]
        node.target = torch.mm
        node.args = (node.args[1], node.args[2])
    with graph.inserting_after(node):
        reduced = graph.call_function(reduce_from_tp, (node, spec.group_name))
    out = reduced
    if bias is not None:
        with graph.inserting_after(reduced):
            out = graph.call_function(operator.add, (reduced, bias))
    node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not reduced)
    reduced.meta.update(node.meta)
    out.meta.update(node.meta)


def _scale_factor(graph: fx.Graph, site: RMSNormSite) -> Any:
    """``offset + w`` (or None when the norm has no weight)."""
    if site.weight is None:
        return None
    if site.weight_offset:
        return graph.call_function(operator.add, (site.weight, site.weight_offset))
    return site.weight


def _eps(site: RMSNormSite, x: fx.Node) -> float:
    if site.eps is not None:
        return float(site.eps)
    val = x.meta.get("example_value", x.meta.get("val"))
    return float(torch.finfo(val.dtype).eps)


def _stat_dtype(x: fx.Node) -> torch.dtype:
    """The dtype a norm's statistics and packed all-reduce run in: fp32, or the input's own where
    wider (a float64 model stays float64; ``.float()`` would round it to fp32)."""
    val = x.meta.get("example_value", x.meta.get("val"))
    dtype = getattr(val, "dtype", torch.float32)
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def _wide(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    """``node`` in ``dtype`` (:func:`_stat_dtype`): ``.float()`` for fp32, as before."""
    return graph.call_method("float", (node,)) if dtype == torch.float32 else graph.call_method("to", (node, dtype))


def _local_sumsq(graph: fx.Graph, x: fx.Node) -> fx.Node:
    xf = _wide(graph, x, _stat_dtype(x))
    sq = graph.call_function(operator.mul, (xf, xf))
    return graph.call_method("sum", (sq, -1), {"keepdim": True})


def _online_rmsnorm(graph: fx.Graph, site: RMSNormSite, gemm: fx.Node, spec: ShardSpec, separate: bool = False) -> None:
    """Rewrite norm -> row-parallel GEMM; ``separate``: two all-reduces, the GEMM's in its own dtype."""
    x = site.input
    d_local = x.meta["example_value"].shape[-1]
    d_full = int(d_local) * spec.world
    eps = _eps(site, x)
    with graph.inserting_before(gemm):
        s_local = _local_sumsq(graph, x)
        scale = _scale_factor(graph, site)
        xg = graph.call_function(operator.mul, (x, scale)) if scale is not None else x
        xg = graph.call_method("type_as", (xg, x))
        h_local = graph.call_function(gemm.target, (xg, *gemm.args[1:]), dict(gemm.kwargs))
        if separate:
            h = graph.call_function(reduce_from_tp, (h_local, spec.group_name))
            s = graph.call_function(reduce_from_tp, (s_local, spec.group_name))
        else:
            packed = graph.call_function(torch.cat, ([_wide(graph, h_local, _stat_dtype(x)), s_local], -1))
            summed = graph.call_function(reduce_from_tp, (packed, spec.group_name))
            r = _out_width(gemm)
            h = graph.call_function(operator.getitem, (summed, (Ellipsis, slice(0, r))))
            s = graph.call_function(operator.getitem, (summed, (Ellipsis, slice(r, r + 1))))
        rstd = graph.call_function(torch.rsqrt,
                                   (graph.call_function(operator.add, (graph.call_function(operator.truediv, (s, d_full)), eps)),))
        out = graph.call_method("type_as", (graph.call_function(operator.mul, (h, rstd)), x))
    out.meta.update(gemm.meta)
    gemm.replace_all_uses_with(out)
    graph.erase_node(gemm)


def _out_width(gemm: fx.Node) -> int:
    """Output width of a GEMM: from its metadata, or (a group's new GEMM) its split sizes."""
    val = gemm.meta.get("example_value", gemm.meta.get("val"))
    if val is not None:
        return int(val.shape[-1])
    split = next(iter(gemm.users))
    if split.op == "call_function" and split.target is torch.split:
        return int(sum(split.args[1]))
    raise RuntimeError(f"cannot tell the output width of {gemm.name}")


def _statistic_sum(graph: fx.Graph, local: fx.Node, spec: ShardSpec) -> fx.Node:
    """A statistic summed over the group for a norm whose output stays sharded: each rank's
    slice of the output depends on it differently, so its gradient is summed too (forward and
    backward all-reduce: ``copy_to_tp(reduce_from_tp(.))``). Online norms need no backward sum:
    their output, the row-parallel GEMM's reduced result, is the same on every rank."""
    return graph.call_function(copy_to_tp, (graph.call_function(reduce_from_tp, (local, spec.group_name)), spec.group_name))


def _stat_all_reduce_rmsnorm(graph: fx.Graph, site: RMSNormSite, spec: ShardSpec) -> fx.Node:
    x = site.input
    d_full = int(x.meta["example_value"].shape[-1]) * spec.world
    eps = _eps(site, x)
    with graph.inserting_before(site.output):
        s = _statistic_sum(graph, _local_sumsq(graph, x), spec)
        rstd = graph.call_function(torch.rsqrt,
                                   (graph.call_function(operator.add, (graph.call_function(operator.truediv, (s, d_full)), eps)),))
        normed = graph.call_function(operator.mul, (_wide(graph, x, _stat_dtype(x)), rstd))
        scale = _scale_factor(graph, site)
        if scale is not None:
            normed = graph.call_function(operator.mul, (normed, scale))
        out = graph.call_method("type_as", (normed, x))
    out.meta.update(site.output.meta)
    site.output.replace_all_uses_with(out)
    return out


# ----------------------------------------------------------------------------- online LayerNorm


def _local_moments(graph: fx.Graph, x: fx.Node, spec: ShardSpec) -> tuple[fx.Node, fx.Node]:
    """This rank's centred slice ``c = x - m_l`` (fp32) and its statistics [..., 1 + p]:
    ``M2_l = sum(c^2)`` and the local mean ``m_l`` in column ``1 + rank`` (zeros elsewhere)."""
    xf = _wide(graph, x, _stat_dtype(x))
    m = graph.call_method("mean", (xf, -1), {"keepdim": True})
    c = graph.call_function(operator.sub, (xf, m))
    m2 = graph.call_method("sum", (graph.call_function(operator.mul, (c, c)), -1), {"keepdim": True})
    slots = graph.call_function(torch.nn.functional.pad, (m, (spec.rank, spec.world - 1 - spec.rank)))
    return c, graph.call_function(torch.cat, ([m2, slots], -1))


def _whole_moments(graph: fx.Graph, stats: fx.Node, d_local: int, spec: ShardSpec, eps: float) -> tuple[fx.Node, fx.Node]:
    """From the summed statistics: every rank's mean minus the whole mean ([..., p]) and rstd ([..., 1]).

    var = (sum_l M2_l + d_l sum_l (m_l - mean)^2) / d, with every m_l known exactly (each
    travelled alone in its column): no E[x^2] - mean^2, which loses the digits of the
    variance when the mean is large against the spread."""
    p = spec.world
    m2 = graph.call_function(operator.getitem, (stats, (Ellipsis, slice(0, 1))))
    means = graph.call_function(operator.getitem, (stats, (Ellipsis, slice(1, 1 + p))))
    mean = graph.call_method("mean", (means, -1), {"keepdim": True})
    dev = graph.call_function(operator.sub, (means, mean))
    between = graph.call_method("sum", (graph.call_function(operator.mul, (dev, dev)), -1), {"keepdim": True})
    var = graph.call_function(operator.truediv, (graph.call_function(operator.add, (m2, graph.call_function(
        operator.mul, (between, d_local)))), d_local * p))
    rstd = graph.call_function(torch.rsqrt, (graph.call_function(operator.add, (var, eps)),))
    return dev, rstd


def _online_layernorm(graph: fx.Graph, site: LayerNormSite, gemm: fx.Node, spec: ShardSpec, separate: bool = False) -> None:
    """LayerNorm -> row-parallel GEMM, its statistics in the GEMM's all-reduce:

        LN(x) @ A = (sum_l (c_l g_l) @ A_l + sum_l (m_l - mean) (g_l @ A_l)) * rstd + sum_l b_l @ A_l

    with ``c_l = x_l - m_l`` centred on this rank's own mean (no large terms cancel). Packed as
    rows of one fp32 all-reduce: the tokens' [N, r | M2 | means] and, below them, each rank's
    ``g_l @ A_l`` in its own row and the summed ``b_l @ A_l``. ``separate``: the GEMM rows in
    the model's dtype, the statistics in their own fp32 all-reduce."""
    call, method = graph.call_function, graph.call_method
    pad, get = torch.nn.functional.pad, operator.getitem
    x = site.input
    shape = tuple(int(n) for n in x.meta["example_value"].shape)
    lead, d_local = shape[:-1], shape[-1]
    n_tok = 1
    for n in lead:
        n_tok *= n
    p, r, rank = spec.world, _out_width(gemm), spec.rank
    wide = _stat_dtype(x)
    if gemm.kwargs.get("bias") is not None or (len(gemm.args) > 2 and gemm.args[2] is not None):
        raise ParallelizeError(f"{gemm.name}: a row-parallel GEMM with a bias after a LayerNorm (the bias is not summed)")

    def gemm_of(a: fx.Node) -> fx.Node:  # the row-parallel GEMM on another input
        return call(gemm.target, (method("type_as", (a, x)), *gemm.args[1:]), dict(gemm.kwargs))

    with graph.inserting_before(gemm):
        c, stats = _local_moments(graph, x, spec)
        g = site.weight if site.weight is not None else method("new_ones", (x, (d_local,)))
        h_local = gemm_of(call(operator.mul, (c, g)) if site.weight is not None else c)
        rows = [
            method("reshape", (h_local, n_tok, r)),
            call(pad, (gemm_of(method("view", (g, 1, d_local))), (0, 0, rank, p - 1 - rank))),  # g_l @ A_l in row rank
        ]
        if site.bias is not None:
            rows.append(gemm_of(method("view", (site.bias, 1, d_local))))
        if separate:
            summed = _wide(graph, call(reduce_from_tp, (call(torch.cat, (rows, 0)), spec.group_name)), wide)
            stats = call(reduce_from_tp, (stats, spec.group_name))
        else:
            width = r + 1 + p
            tokens = call(torch.cat, ([_wide(graph, rows[0], wide), method("reshape", (stats, n_tok, 1 + p))], -1))
            extra = [call(pad, (_wide(graph, row, wide), (0, width - r))) for row in rows[1:]]
            summed = call(reduce_from_tp, (call(torch.cat, ([tokens, *extra], 0)), spec.group_name))
            stats = method("reshape", (call(get, (summed, (slice(0, n_tok), slice(r, width)))), *lead, 1 + p))
        h = method("reshape", (call(get, (summed, (slice(0, n_tok), slice(0, r)))), *lead, r))
        g_all = call(get, (summed, (slice(n_tok, n_tok + p), slice(0, r))))  # [p, r]: every rank's g_l @ A_l
        dev, rstd = _whole_moments(graph, stats, d_local, spec, float(site.eps))
        y = call(operator.mul, (call(operator.add, (h, call(torch.matmul, (dev, g_all)))), rstd))
        if site.bias is not None:
            y = call(operator.add, (y, call(get, (summed, (slice(n_tok + p, n_tok + p + 1), slice(0, r))))))
        out = method("type_as", (y, x))
    out.meta.update(gemm.meta)
    gemm.replace_all_uses_with(out)
    graph.erase_node(gemm)


def _stat_all_reduce_layernorm(graph: fx.Graph, site: LayerNormSite, spec: ShardSpec) -> fx.Node:
    """A LayerNorm on a sharded input that feeds more than row-parallel GEMMs: its statistics in an
    all-reduce of their own, then this rank's slice normalised: ``(c_l + m_l - mean) * rstd * g_l + b_l``."""
    x = site.input
    d_local = int(x.meta["example_value"].shape[-1])
    with graph.inserting_before(site.output):
        c, stats = _local_moments(graph, x, spec)
        stats = _statistic_sum(graph, stats, spec)
        dev, rstd = _whole_moments(graph, stats, d_local, spec, float(site.eps))
        own = graph.call_function(operator.getitem, (dev, (Ellipsis, slice(spec.rank, spec.rank + 1))))
        normed = graph.call_function(operator.mul, (graph.call_function(operator.add, (c, own)), rstd))
        if site.weight is not None:
            normed = graph.call_function(operator.mul, (normed, site.weight))
        if site.bias is not None:
            normed = graph.call_function(operator.add, (normed, site.bias))
        out = graph.call_method("type_as", (normed, x))
    out.meta.update(site.output.meta)
    site.output.replace_all_uses_with(out)
    return out
