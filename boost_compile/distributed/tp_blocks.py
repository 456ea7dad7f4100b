"""Tensor parallelism block by block: each block compiled on its own, the code around them eager.

Compiled whole, ``tp_localize`` and ``tp_collectives`` turn the whole model's graph into this
rank's program. Compiled per block (``compile_blocks``), each block's graph gets that treatment on
its own, and the code around the blocks runs eagerly on the shards, with what the whole program
would insert there done by module hooks and by the blocks' compiled calls:

    btp       embedding (cut on d)          -> its output gathered: the code before the first
                                               block sees the whole stream (a width it reads, a
                                               dropout it draws are the one-process ones)
              first block's call            -> the whole stream cut to this rank's d-slice
              each block                    -> compiled; its stream input and output marked as
                                               this rank's d-slice (tp_stream_in / tp_stream_out)
              last block's call             -> its output gathered (a pipeline stage that
                                               returns its slice keeps it)
    megatron  the stream is replicated: the code around the blocks runs whole; each block's
              stream input is guarded (tp_sentinel), so an eager call fails in one line
    both      a vocabulary-parallel head    -> its input's gradient summed (copy_to_tp); its logits
                                               this rank's slice (VocabShardedLogits): F.cross_entropy
                                               on them is the vocabulary-parallel loss, any other op
                                               gathers them first

Code between two blocks would see a d-slice under btp and is refused, naming the op and its
line. Where the hooks go comes from the capture ``parallelize_`` already makes
(:func:`block_layout`); :func:`prepare_blocks` and :func:`enter_sliced` apply it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from boost_compile import _torch_compat as compat
from boost_compile.analysis.fx_utils import module_block, module_path
from boost_compile.distributed.collectives import (
    copy_to_tp,
    gather_from_tp,
    scatter_to_tp,
    tp_sentinel,
    tp_stream_in,
    tp_stream_out,
    vocab_parallel_cross_entropy,
)
from boost_compile.distributed.shard import ParallelizeError, VocabShard
from boost_compile.distributed.vocab_logits import VocabShardedLogits


@dataclass(frozen=True)
class BlockLayout:
    """Where the eager code around the blocks needs a hook, read from the whole model's capture."""

    plan: str
    group_name: str
    world: int
    rank: int
    #: the stream's whole width d (btp)
    width: int = 0
    #: embeddings cut on d: their output is gathered, the code before the first block sees it whole (btp)
    sharded_embeddings: tuple[str, ...] = ()
    #: the last block's stream output is gathered, the code after it sees it whole (btp; a pipeline
    #: stage that returns its d-slice does not)
    gather_last: bool = True
    #: vocabulary-parallel heads: (module, whole vocabulary)
    heads: tuple[tuple[str, int], ...] = ()
    #: why the model cannot run block by block under this plan (None: it can)
    refusal: str | None = None


def _target_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _source(node: fx.Node) -> str:
    """`` (file.py:12: the code)`` from the node's stack trace, '' when it has none."""
    lines = [line.strip() for line in node.meta.get("stack_trace", "").strip().splitlines()]
    files = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not files:
        return ""
    where = lines[files[-1]].split('"')
    code = lines[files[-1] + 1] if files[-1] + 1 < len(lines) else ""
    line_no = where[2].split(",")[1].strip().removeprefix("line ") if len(where) > 2 else "?"
    return f" ({where[1].rsplit('/', 1)[-1] if len(where) > 1 else '?'}:{line_no}: {code})"


def _between_blocks(graph: fx.Graph) -> list[fx.Node]:
    """Calls outside the blocks that both read something a block made and feed a block."""
    nodes = list(graph.nodes)
    inside = {n for n in nodes if module_block(n) is not None}
    after: set[fx.Node] = set()
    for n in nodes:  # topological: made from a block's output
        if n not in inside and any(a in inside or a in after for a in n.all_input_nodes):
            after.add(n)
    before: set[fx.Node] = set()
    for n in reversed(nodes):  # feeds a block
        if n not in inside and any(u in inside or u in before for u in n.users):
            before.add(n)
    return [n for n in nodes if n in after and n in before and n.op in ("call_function", "call_method", "call_module")]


def block_layout(roles: Any, specs: dict[str, Any], plan: str, group_name: str, world: int, rank: int,
                 model: nn.Module, returns_stream: bool = False) -> BlockLayout:
    """The hooks the eager code around the blocks needs under ``plan`` (see the module docstring).

    ``roles``: ``parallelize_``'s analysis of the unsharded capture; ``specs``: the parameters'
    ShardSpecs; ``returns_stream``: a pipeline stage that returns its d-slice of the stream.
    A construct the hooks cannot place becomes ``refusal``.
    """
    view = roles.view
    base = {"plan": plan, "group_name": group_name, "world": world, "rank": rank}
    stream = view.residual_stream
    modules = dict(model.named_modules())
    heads = []
    for weight, _layout, _bias in roles.heads:
        spec = specs.get(weight)
        if spec is None or not spec.head:
            continue
        site = next(s for s in view.linears if s.param_name == weight)
        owner = module_path(site.node)
        if owner not in modules or not owner:
            return BlockLayout(**base, refusal=f"the output head {weight} is applied outside a module{_source(site.node)}")
        vocab = spec.size if spec.size is not None else dict(model.named_parameters())[weight].shape[spec.dim] * world
        heads.append((owner, vocab))
    if plan != "btp":
        return BlockLayout(**base, heads=tuple(heads))

    # the embeddings cut on d: their output gathered, so the eager code before the first block
    # sees the whole stream (it may read its width: GPT-2's output_shape) and draws whole masks
    lookups = [n for n in ({stream[0]} | view.ancestors(stream[0]))
               if n.op == "call_function" and n.target is torch.nn.functional.embedding]
    sharded = []
    for lookup in lookups:
        if view.param_names.get(lookup.args[1]) in roles.shardable_embeddings:
            owner = module_path(lookup)
            if not owner or owner not in modules:
                return BlockLayout(**base, refusal=f"an embedding cut on d is read outside a module{_source(lookup)}")
            sharded.append(owner)
    # between the blocks the stream is this rank's d-slice: no eager code may touch it there
    for node in _between_blocks(view.graph):
        return BlockLayout(**base, refusal=f"{_target_name(node)} between two blocks{_source(node)} would run "
                                           "eagerly on this rank's d-slice of the stream; compile the model whole")
    width = int(stream[0].meta["example_value"].shape[-1])
    return BlockLayout(**base, width=width, sharded_embeddings=tuple(sharded), gather_last=not returns_stream,
                       heads=tuple(heads))


# ----------------------------------------------------------------------------- applying it


class _MarkedBlock:
    """Mixed into a block's class: its stream input and output marked for the boost backend."""

    _boost_block_world: int = 1
    _boost_block_plan: str = "btp"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        world, plan = self._boost_block_world, self._boost_block_plan
        if not args or not isinstance(args[0], torch.Tensor):
            raise ParallelizeError(f"{type(self).__name__}: a block compiled on its own under {plan} takes the "
                                   "residual stream as its first positional argument")
        x = args[0]
        args = ((tp_stream_in(x, world, plan) if plan == "btp" else tp_sentinel(x, plan)), *args[1:])
        out = super().forward(*args, **kwargs)  # type: ignore[misc]
        if plan != "btp":
            return out
        if isinstance(out, torch.Tensor):
            return tp_stream_out(out, world, plan)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):  # (h, ...): LaX's latents, HF's tuples
            return (tp_stream_out(out[0], world, plan), *out[1:])
        raise ParallelizeError(f"{type(self).__name__} returns {type(out).__name__}: a block compiled on its own under "
                               "btp must return its stream (or a tuple that starts with it)")


def _marked_class(cls: type, world: int, plan: str) -> type:
    """One marked subclass per (class, world, plan), so identical blocks keep one class (one artifact)."""
    cache = cls.__dict__.get("_boost_marked_classes")
    if cache is None:
        cache = {}
        cls._boost_marked_classes = cache
    key = (world, plan)
    if key not in cache:
        cache[key] = type(cls.__name__, (_MarkedBlock, cls), {
            "__module__": cls.__module__, "_boost_block_world": world, "_boost_block_plan": plan})
    return cache[key]


class _SlicedCall:
    """A btp block's compiled call, in eager code: the whole stream the eager code hands the first
    block is cut to this rank's d-slice (``scatter_to_tp``) before the compiled graph, which takes
    slices, runs; the last block's output is gathered (``gather_from_tp``) for the code after it."""

    def __init__(self, inner: Any, layout: BlockLayout, last: bool) -> None:
        self.inner, self.layout, self.last = inner, layout, last

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lay = self.layout
        if args and isinstance(args[0], torch.Tensor) and args[0].shape[-1] == lay.width:
            args = (scatter_to_tp(args[0], lay.group_name, lay.world, lay.rank), *args[1:])
        out = self.inner(*args, **kwargs)
        if not self.last:
            return out
        if isinstance(out, torch.Tensor):
            return gather_from_tp(out, lay.group_name, lay.world, lay.rank)
        return (gather_from_tp(out[0], lay.group_name, lay.world, lay.rank), *out[1:])


def enter_sliced(model: nn.Module, blocks: list[str]) -> None:
    """After ``compile_blocks`` compiled them: under btp each block is called through :class:`_SlicedCall`
    (the last one, in the order given, gathers its output unless the model is a pipeline stage
    that returns its slice)."""
    layout: BlockLayout = model._boost_block_layout
    if layout.plan != "btp":
        return
    for i, name in enumerate(blocks):
        last = layout.gather_last and i == len(blocks) - 1
        compat.wrap_compiled_call(model.get_submodule(name), lambda inner, last=last: (
            inner if isinstance(inner, _SlicedCall) else _SlicedCall(inner, layout, last)))


def prepare_blocks(model: nn.Module, blocks: list[str], inner: str = "eager") -> BlockLayout:
    """Make a model parallelized with btp or megatron run block by block (see the module docstring).

    ``inner``: the blocks' inner compiler; with "inductor" the eager vocabulary-parallel loss is
    compiled by Inductor too (fused, it reads this rank's logit slice once forward and once backward).

    Raises ParallelizeError when ``parallelize_`` found a construct the eager code cannot
    run on the shards (``BlockLayout.refusal``) or the model has no layout (parallelized by
    an older call). Idempotent on the same blocks.
    """
    layout: BlockLayout | None = getattr(model, "_boost_block_layout", None)
    if layout is None:
        raise ParallelizeError("this tensor-parallel model has no block layout (parallelize it with parallelize_)")
    if layout.refusal is not None:
        raise ParallelizeError(f"cannot compile block by block under {layout.plan}: {layout.refusal}")
    if getattr(model, "_boost_blocks_prepared", None) == tuple(blocks):
        return layout
    for name in blocks:
        block = model.get_submodule(name)
        if not isinstance(block, _MarkedBlock):
            block.__class__ = _marked_class(type(block), layout.world, layout.plan)
    g, world, rank = layout.group_name, layout.world, layout.rank
    for name in layout.sharded_embeddings:
        model.get_submodule(name).register_forward_hook(lambda _m, _a, out: gather_from_tp(out, g, world, rank))
    sliced_logits = getattr(model, "_boost_vocab_shard", None) is not None  # a last stage returns its slice
    loss = torch.compile(vocab_parallel_cross_entropy, backend="inductor") if inner == "inductor" else None
    for name, vocab in layout.heads:
        head = model.get_submodule(name)
        head.register_forward_pre_hook(lambda _m, args: (copy_to_tp(args[0], g), *args[1:]))
        if not sliced_logits:  # the eager loss takes the slice (vocabulary-parallel), anything else gathers it
            shard = VocabShard(g, world, rank, vocab)
            head.register_forward_hook(lambda _m, _a, out, shard=shard: VocabShardedLogits.wrap(out, shard, loss))
    sentinel = getattr(model, "_boost_sentinel_handle", None)
    if sentinel is not None:  # the eager code now runs on the shards, correctly
        sentinel.remove()
        model._boost_sentinel_handle = None
    if hasattr(model, "set_input_guard"):  # a pipeline stage's guard, inside its forward
        model.set_input_guard(None)
    model._boost_blocks_prepared = tuple(blocks)
    return layout


__all__ = ["BlockLayout", "block_layout", "enter_sliced", "prepare_blocks"]
