"""Graph role analysis for tensor parallelism: what the captured graph says each
parameter is (embedding, block norm, bottleneck down/up factor, dense row/column
linear, output head), where the residual stream runs, and how fused outputs split.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from boost_compile.analysis import GraphView, capture_views
from boost_compile.analysis.repeated import repeat_names
from boost_compile.distributed.shard import ParallelizeError


@dataclass
class Roles:
    """What the graph says each parameter is."""

    view: GraphView
    embedding: str | None  # the module whose input carries the eager-mode guard
    shardable_embeddings: list[str]  # weights of embeddings that feed the stream and nothing else
    block_norms: list[str]  # weights and biases of the norms inside the blocks (cut on d under btp)
    chains: list[tuple[str, str, str, str]]  # (down weight, down layout, up weight, up layout)
    # (weight, layout, "row"|"col"|"replicate"); "replicate": a down projection whose output reaches
    # another projection (MLA's q_a_proj, kv_a_proj_with_mqa), which megatron keeps whole
    dense: list[tuple[str, str, str]]
    biases: dict[str, str]  # weight -> bias
    sections: dict[str, tuple[int, ...]]  # column-parallel weight -> whole sizes of its output's split
    heads: list[tuple[str, str, str | None]]  # untied output heads: (weight, layout, bias)
    # the parameters (weight, bias) of a norm over a block linear's whole output -> that linear's weight:
    # OLMo 2's q_norm over all heads of q_proj. Cut like the linear's output when it is column-parallel
    projection_norms: dict[str, str] = dataclasses.field(default_factory=dict)


def analyse(model: nn.Module, example_inputs: Sequence[Any]) -> Roles:
    views = capture_views(model, *example_inputs)
    if len(views) != 1:
        raise ParallelizeError(f"the model must capture as one graph (found {len(views)}; fix the graph breaks)")
    view = views[0]
    stream = view.residual_stream
    if not stream:
        raise ParallelizeError("no residual stream found: parallelize_ understands pre-norm residual blocks")
    names = view.param_names
    # embeddings that reach the stream's start: token and learned position embeddings,
    # through scaling (Gemma), dropout or their sum; one whose weight is used anywhere
    # else (a head tied to it) stays whole
    lookups = [n for n in ({stream[0]} | view.ancestors(stream[0])) if _is_embedding(n) and n.args[1] in names]
    lookups.sort(key=lambda n: list(view.graph.nodes).index(n))
    embedding = names[lookups[0].args[1]] if lookups else None
    shardable = [names[n.args[1]] for n in lookups if len(n.args[1].users) == 1]
    stream_set = set(stream)
    # the parameters (weight, LayerNorm bias) of the norms that read the stream inside the blocks
    block_norms = [
        name for s in view.norms if s.input in stream_set and s.input is not stream[-1]
        for name in (s.param_name, getattr(s, "bias_name", None)) if name
    ]
    in_chain = set()
    chains = []
    sections: dict[str, tuple[int, ...]] = {}
    for c in view.bottlenecks:
        if not view.in_block(c.down):
            continue
        chains.append((c.down.param_name, c.down.layout, c.up.param_name, c.up.layout))
        in_chain |= {c.down.node, c.up.node}
        if (parts := _split_sections(c.up.node)) is not None:
            sections[c.up.param_name] = parts
    dense = []
    sites = [s for s in view.block_linears if s.node not in in_chain]
    rows = {s.node for s in sites if _feeds_stream(s.node, stream_set, view)}
    others = {s.node for s in sites} - rows  # the block linears that are not row-parallel
    for site in sites:
        if site.node in rows:
            role = "row"
        elif _linears_reached(site.node, stream_set, view) & others:
            # a down projection into another projection that is not the block's output (MLA's
            # q_a_proj -> q_a_layernorm -> q_b_proj): cut, its output would reach a column-parallel
            # GEMM already sharded; Megatron-LM keeps it (and the latent norm after it) whole
            role = "replicate"
        else:
            role = "col"
        dense.append((site.param_name, site.layout, role))
        if role == "col" and (parts := _split_sections(site.node)) is not None:
            sections[site.param_name] = parts
    biases = {s.param_name: names[s.bias] for s in view.linears if s.bias is not None and s.bias in names}
    after = view.descendants(stream[-1])
    heads = [
        (s.param_name, s.layout, biases.get(s.param_name))
        for s in view.linears
        if s.param_name and s.node in after and not view.in_block(s) and _read_only_by(s.weight, s.node, names)
    ]
    projection_norms = {
        name: site.param_name
        for s in view.norms if s.input in view.linear_by_node and s.input not in stream_set
        and (site := view.linear_by_node[s.input]).param_name and view.in_block(site)
        for name in (s.param_name, getattr(s, "bias_name", None)) if name
    }
    return Roles(view, embedding, shardable, block_norms, chains, dense, biases, sections, heads, projection_norms)


def repeat_roles(roles: Roles, container: str, source: int, count: int) -> Roles:
    """``roles`` read from a capture of the first blocks, extended to ``count`` blocks: block
    ``source``'s parameters stand for every later block's (``analysis.repeated.first_blocks``)."""
    def names(values: list[str]) -> list[str]:
        return repeat_names(values, container, source, count)

    def each(name: str) -> list[str]:
        return repeat_names([name], container, source, count)

    chains = [(down, c[1], up, c[3]) for c in roles.chains for down, up in zip(each(c[0]), each(c[2]), strict=True)]
    dense = [(w, layout, role) for weight, layout, role in roles.dense for w in each(weight)]
    biases = {w: b for weight, bias in roles.biases.items() for w, b in zip(each(weight), each(bias), strict=True)}
    sections = {w: parts for weight, parts in roles.sections.items() for w in each(weight)}
    projection_norms = {n: w for norm, weight in roles.projection_norms.items()
                        for n, w in zip(each(norm), each(weight), strict=True)}
    return Roles(roles.view, roles.embedding, roles.shardable_embeddings, names(roles.block_norms), chains, dense,
                 biases, sections, roles.heads, projection_norms)


def _read_only_by(weight: fx.Node, gemm: fx.Node, names: dict[fx.Node, str]) -> bool:
    """Whether the parameter behind ``weight`` (possibly through ``.t()``) feeds ``gemm`` alone:
    a head tied to the embedding does not."""
    param = weight
    while param not in names:
        if len(param.all_input_nodes) != 1:
            return False
        param = param.all_input_nodes[0]
    node = param
    while node is not gemm:
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
    return True


def _last_dim_slice(node: fx.Node) -> slice | None:
    """``x[..., a:b]`` -> slice(a, b)."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], tuple):
        return None
    idx = node.args[1]
    if len(idx) == 2 and idx[0] is Ellipsis and isinstance(idx[1], slice) and idx[1].step in (None, 1):
        return idx[1]
    return None


def _slice_sections(node: fx.Node, width: int) -> tuple[int, ...] | None:
    """Sizes of the parts when the users' last-dim slices tile [0, width) exactly (Phi-3's qkv)."""
    spans = sorted(((s.start or 0), width if s.stop is None else s.stop) for s in map(_last_dim_slice, node.users))
    if len(spans) < 2 or spans[0][0] != 0 or spans[-1][1] != width:
        return None
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:], strict=False)):
        return None
    return tuple(b - a for a, b in spans)


def _is_reshape(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in ("view", "reshape")) or (
        node.op == "call_function" and node.target is torch.reshape
    )


def _is_embedding(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.nn.functional.embedding


def _split_sections(node: fx.Node) -> tuple[int, ...] | None:
    """Whole sizes of the parts a GEMM's output is split into on its last dim (fused q/k/v)."""
    out = node.meta.get("example_value")
    if out is None:
        return None
    if len(node.users) > 1 and all(_last_dim_slice(u) is not None for u in node.users):
        return _slice_sections(node, int(out.shape[-1]))
    users = list(node.users)
    if len(users) != 1:
        return None
    split = users[0]
    reshaped = split.meta.get("example_value")
    if (  # a reshape that keeps the last dim whole first (GPT-2's Conv1D: [B*T, 3d] -> [B, T, 3d])
        _is_reshape(split) and reshaped is not None
        and reshaped.shape[-1] == out.shape[-1] and len(split.users) == 1
    ):
        node, split = split, next(iter(split.users))
    is_split = (split.op == "call_method" and split.target in ("split", "chunk")) or (
        split.op == "call_function" and split.target in (torch.split, torch.chunk)
    )
    if not is_split or split.args[0] is not node:
        return None
    out = node.meta.get("example_value")
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if out is None or dim not in (-1, out.dim() - 1):
        return None
    width = int(out.shape[-1])
    size = split.args[1] if len(split.args) > 1 else split.kwargs.get("split_size_or_sections", split.kwargs.get("chunks"))
    if split.target in ("chunk", torch.chunk):
        if not isinstance(size, int) or width % size:
            return None
        return (width // size,) * size
    if isinstance(size, int):
        return (size,) * (width // size) + ((width % size,) if width % size else ())
    if isinstance(size, (list, tuple)) and all(isinstance(v, int) for v in size):
        return tuple(size)
    return None


def _feeds_stream(node: fx.Node, stream: set[fx.Node], view: GraphView) -> bool:
    """Whether the output reaches a residual add without passing another linear."""
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stream:
            return True
        if n in view.linear_by_node:
            continue
        todo.extend(n.users)
    return False


def _linears_reached(node: fx.Node, stream: set[fx.Node], view: GraphView) -> set[fx.Node]:
    """The linears the output reaches without passing another linear or the residual stream."""
    seen, todo, found = set(), list(node.users), set()
    while todo:
        n = todo.pop()
        if n in seen or n in stream:
            continue
        seen.add(n)
        if n in view.linear_by_node:
            found.add(n)
            continue
        todo.extend(n.users)
    return found


def gemm_dim(layout: str, role: str) -> int:
    """Dim to cut: out_in weights are [d_out, d_in], in_out weights [d_in, d_out]."""
    if layout == "out_in":
        return 1 if role == "row" else 0
    return 0 if role == "row" else 1
