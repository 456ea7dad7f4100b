"""The reference of one tensor-parallel rank's program: the whole model, built from its shards.

A model sharded by ``parallelize_`` (btp, megatron) is captured with the *whole* model's
shapes: each sharded parameter reads as ``tp_full_view(shard)``, the model's input passes a
``tp_sentinel``, and a block compiled on its own under btp takes and returns this rank's
slice of the residual stream (``tp_stream_in`` / ``tp_stream_out``). With those markers made
identities and the shards gathered, the captured graph is the unsharded model, and it runs
on one process with no collective:

    captured   w = tp_full_view(w_shard); y = linear(x, w)      (held [32, 16], seen [64, 16])
    reference  y = linear(x, w_whole)                            (w_whole: the ranks' shards gathered)
    rank       y = linear(copy_to_tp(x), w_shard)                (after tp_localize, tp_collectives)

The rank's program, run by every rank of the group at once, must give the reference's
outputs and, for each sharded input, this rank's slice of the reference's gradient:
``RankView.local`` cuts the reference's values the way ``parallelize_`` cut the parameters.
Every decision is taken by the whole group (``agree``): a rank that dropped a rewrite its
peer kept would run a different program, and their collectives would no longer pair up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from boost_compile import _torch_compat as compat
from boost_compile.analysis.fx_utils import is_custom_op
from boost_compile.distributed.shard import ShardSpec, full_tensor, shard_tensor

#: markers the reference reads as identities (their input is already whole there)
_WHOLE_MARKERS = ("tp_full_view", "tp_sentinel")
#: a btp block's input and output: this rank's slice of the stream's last dim
_STREAM_IN, _STREAM_OUT, _VOCAB_OUT = "tp_stream_in", "tp_stream_out", "tp_vocab_out"
#: ops a rank's program draws per-rank random numbers with (tp_random.py): not comparable by design
_PER_RANK_RANDOM = ("tp_dropout", "tp_attention_dropout")


@dataclass(frozen=True)
class Cut:
    """How this rank's tensor is cut from the whole one (``ShardSpec``'s terms)."""

    dim: int
    world: int
    rank: int
    sections: tuple[int, ...] | None = None
    #: the whole size of a padded dim (a vocabulary the TP degree does not divide)
    size: int | None = None

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        return shard_tensor(whole, self.dim, self.world, self.rank, self.sections, pad=self.size is not None)

    def whole_shape(self, local: Sequence[int]) -> list[int]:
        shape = list(local)
        shape[self.dim] = self.size if self.size is not None else shape[self.dim] * self.world
        return shape


def tp_specs(example_inputs: Sequence[Any]) -> list[ShardSpec | None]:
    return [getattr(x, "_boost_tp", None) for x in example_inputs]


def is_rank_program(example_inputs: Sequence[Any]) -> bool:
    """Whether the inputs are a ``parallelize_``d model's shards (btp, megatron)."""
    return any(s is not None for s in tp_specs(example_inputs))


def per_rank_random(gm: fx.GraphModule) -> str | None:
    """Why ``gm``'s random draws differ from one process's by design (None: they do not)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") in _PER_RANK_RANDOM:
            return (f"{node.name}: dropout on a sharded tensor draws each rank's own mask by design "
                    "(tp_random), which no one-process run draws")
    return None


class RankView:
    """The captured graph of a rank's program as the whole model, and the cut of each of its tensors."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], names: Sequence[str]) -> None:
        specs = tp_specs(example_inputs)
        first = next(s for s in specs if s is not None)
        self.group_name, self.world, self.rank = first.group_name, first.world, first.rank
        self.unsupported: str | None = None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        stream_in = {n.args[0] for n in gm.graph.nodes if is_custom_op(n, _STREAM_IN)}
        #: the placeholders' cuts, by input name (the names of ``verify.Inputs``)
        self.input_cuts: dict[str, Cut] = {}
        self.gather: list[ShardSpec | None] = []
        for node, name, spec in zip(placeholders, names, specs, strict=False):
            if spec is not None and spec.dim is not None:
                self.input_cuts[name] = Cut(spec.dim, spec.world, spec.rank, spec.sections, spec.size)
                self.gather.append(spec)
            elif node in stream_in:
                self.input_cuts[name] = Cut(-1, self.world, self.rank)
                self.gather.append(ShardSpec("shard", -1, self.group_name, self.world, self.rank, first.plan))
            else:
                self.gather.append(None)
        if any(is_custom_op(n, _STREAM_IN) and n.args[0] not in placeholders for n in gm.graph.nodes):
            self.unsupported = "a stream slice that is not an input of the graph"
        self.output_cuts = self._output_cuts(gm)

    def _output_cuts(self, gm: fx.GraphModule) -> dict[str, Cut]:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        cuts = {}
        for i, leaf in enumerate(compat.tree_leaves(output.args[0])):
            if is_custom_op(leaf, _STREAM_OUT):
                cuts[f"output[{i}]"] = Cut(-1, self.world, self.rank)
            elif is_custom_op(leaf, _VOCAB_OUT):
                vocab = leaf.args[0].meta["example_value"].shape[-1]
                cuts[f"output[{i}]"] = Cut(-1, self.world, self.rank, size=int(vocab))
        for node in gm.graph.nodes:
            if (is_custom_op(node, _STREAM_OUT) or is_custom_op(node, _VOCAB_OUT)) and any(
                    u.op != "output" for u in node.users):
                self.unsupported = f"{node.name}: a stream slice read inside the graph"
        return cuts

    def whole_inputs(self, example_inputs: Sequence[Any]) -> list[Any]:
        """The inputs of the whole model: each sharded one gathered from the group (a collective)."""
        out = []
        for x, spec in zip(example_inputs, self.gather, strict=False):
            if spec is None or not isinstance(x, torch.Tensor):
                out.append(x)
                continue
            whole = full_tensor(x.detach(), replace(spec, dim=spec.dim % x.dim()))
            out.append(whole.requires_grad_(x.requires_grad))
        return out

    def whole_bytes(self, example_inputs: Sequence[Any]) -> int:
        """The bytes of ``whole_inputs`` (before gathering them)."""
        return sum(x.numel() * x.element_size() * (self.world if spec is not None else 1)
                   for x, spec in zip(example_inputs, self.gather, strict=False) if isinstance(x, torch.Tensor))

    def local(self, values: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """The reference's values as this rank holds them: cut outputs and gradients of cut inputs sliced."""
        out = {}
        for name, value in values.items():
            cut = self.output_cuts.get(name) or self.input_cuts.get(name.removeprefix("grad:"))
            out[name] = cut.local(value) if cut is not None and value is not None else value
        return out

    def agree(self, ok: bool, device: torch.device) -> bool:
        """Whether every rank of the group says ``ok`` (one all-reduce: a verdict the group shares)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=compat.resolve_process_group(self.group_name))
        return bool(flag.item())


def shapes_differ(tested: Mapping[str, torch.Tensor | None], reference: Mapping[str, torch.Tensor | None]) -> str | None:
    """A tensor the rank holds in a shape other than the reference's cut (a cut verify does not know)."""
    for name, ref in reference.items():
        t = tested.get(name)
        if ref is not None and t is not None and tuple(t.shape) != tuple(ref.shape):
            return f"{name} is {tuple(t.shape)} on this rank, {tuple(ref.shape)} in the reference's cut"
    return None


def read_markers_as_identities(whole: fx.GraphModule) -> fx.GraphModule:
    """``whole`` (a copy of the captured graph) with every TP marker read as the identity: its
    input is whole in the reference. Edits ``whole`` in place and returns it."""
    for node in list(whole.graph.nodes):
        if any(is_custom_op(node, m) for m in (*_WHOLE_MARKERS, _STREAM_IN, _STREAM_OUT, _VOCAB_OUT)):
            node.replace_all_uses_with(node.args[0])
            whole.graph.erase_node(node)
    whole.recompile()
    return whole
