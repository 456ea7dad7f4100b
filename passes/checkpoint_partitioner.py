"""The partitioner the boost backend hands to the inner compiler.

``CheckpointPartitioner`` is the partitioner the backend hands to the inner
compiler (aot_eager: ``partition_fn``; Inductor: ``custom_partitioner_fn``,
whose ``uuid`` keys the AOT-autograd and FX caches, so a tagged graph never
reuses an untagged compile). In every mode, checkpoint="none" included, the
values computed from the parameters alone (a grouped GEMM's concatenated
weights) are recomputed in backward rather than saved
(``recompute_weight_copies``). Under checkpointing, on the joint graph it
first forces every collective to MUST_SAVE (a tag inherited from a recomputed
op, e.g. a DTensor linear that all-gathers, would otherwise win over the
partitioner's own ``force_save_collectives``), keeps random ops when the graph
has an opaque input (DTensor's DeviceMesh: see
``keep_random_ops_beside_opaque_inputs``), patches the activation budget for
"budget", and runs min-cut. With a ``sink`` (explain, the benchmark) it also records what
was saved: the backward graph's placeholders other than tangents are exactly
the saved values (they share the forward node's meta), equal to the forward
graph's outputs after the user outputs; ``saved_tensors_report`` turns them
into a ``PassReport``. A recomputed op is a backward node that has a forward
node of the same name (both graphs are cut from one joint graph).

Attention is recomputed from the kept tensors. On CPU, SDPA is tagged
nondeterministic-seeded, so the partitioner also keeps the generator state for
its recompute (``rng_state_output_*``, a few KB), as it would for dropout.

Its ``uuid()`` hashes this module and the collective predicate it calls (what
shapes the partition), not the tagging pass or the report.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from boost_compile import _torch_compat as compat
from boost_compile.analysis import fx_utils
from boost_compile.analysis.fx_utils import is_collective, weight_only_nodes
from boost_compile.config import BoostConfig
from boost_compile.pass_manager import PassReport
from boost_compile.passes.activation_checkpoint import META_KEY, RECOMPUTE, SAVE
from boost_compile.passes.saved_tensors import saved_tensors_report


def force_save_collectives(joint: fx.GraphModule) -> int:
    """Every functional collective of the joint graph is MUST_SAVE; returns how many were retagged."""
    changed = 0
    for node in joint.graph.nodes:
        if is_collective(node, bodies=False):
            if node.meta.get("recompute") != SAVE:
                node.meta["recompute"] = SAVE
                changed += 1
            info = (node.meta.get("custom") or {}).get(META_KEY)
            if info is not None and info.get("role") != "collective":  # for the report
                node.meta["custom"] = {**node.meta["custom"], META_KEY: {**info, "role": "collective"}}
    return changed


def _returned_from_parameters(joint: fx.GraphModule, static: set[str], num_fwd_outputs: int | None) -> set[str]:
    """The parameters and buffers behind a forward output computed from them alone.

    Such an output is, in a training graph, usually the new value of an input the forward mutates
    (Gemma 3n clamps a weight in place: ``weight.data.clamp_``), which AOT autograd copies into the
    input after the forward: recomputed in backward from that input, it would read the new value
    (autograd refuses the saved input, whose version moved: tests/unit/test_zoo.py's gemma3n_text
    raised so before this exclusion)."""
    if num_fwd_outputs is None:
        return set(static)  # unknown: recompute nothing
    (output,) = joint.graph.find_nodes(op="output")
    returned = [n for n in compat.tree_leaves(output.args)[:num_fwd_outputs] if isinstance(n, fx.Node)]
    weight_only = weight_only_nodes(joint.graph, static)
    found: set[str] = set()
    stack = [n for n in returned if n in weight_only or n.name in static]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.add(node.name)
        stack.extend(node.all_input_nodes)
    return found


def recompute_weight_copies(joint: fx.GraphModule, static: set[str], num_fwd_outputs: int | None = None) -> int:
    """Values computed from the parameters alone are recomputed in backward, not saved; returns how many were tagged.

    ``group_linears`` concatenates a group's weights in the graph each step; left to the partitioner,
    the backward keeps the concatenation (its input gradient reads it) and with it a second copy of
    the group's weights until the backward reaches them. Under FSDP2 that copy is unsharded: it
    outlives the all-gathered parameters FSDP2 frees after the forward (about a layer's q/k/v and
    gate/up weights per layer, the whole model's in one rank for a dense Llama). Recomputing it from
    the parameters costs one copy of the group's weights in backward. Random ops, collectives and
    effectful nodes are never tagged (nor what they feed), nor a node already MUST_SAVE, nor anything
    computed from a parameter the forward returns a value of (``_returned_from_parameters``).
    """
    static = static - _returned_from_parameters(joint, static, num_fwd_outputs)
    weight_only = weight_only_nodes(joint.graph, static)
    replayable: set[fx.Node] = set()
    for node in joint.graph.nodes:  # topological: a node comes after what it reads
        unsafe = (is_collective(node, bodies=False) or node.is_impure()
                  or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()))
        inputs_ok = all(a in replayable or a.op == "placeholder" for a in node.all_input_nodes)
        if node in weight_only and not unsafe and inputs_ok:
            replayable.add(node)
    changed = 0
    for node in replayable:
        if node.meta.get("recompute") not in (SAVE, RECOMPUTE):
            node.meta["recompute"] = RECOMPUTE
            changed += 1
    return changed


def keep_random_ops_beside_opaque_inputs(joint: fx.GraphModule) -> int:
    """With an opaque graph input (DTensor's DeviceMesh), random ops are kept, not recomputed.

    Recomputing a random op makes the partitioner thread the generator state
    through forward and backward (``functionalize_rng_ops``); in torch 2.13 that
    shifts the saved values past an opaque one, and AOT autograd then finds the
    DeviceMesh among the saved tensors. On CPU the random op is SDPA, so under
    DTensor (the "vanilla" TP plan) attention's outputs are kept instead of
    recomputed. Returns how many nodes were retagged.
    """
    if not any(compat.is_opaque_node(p) for p in joint.graph.find_nodes(op="placeholder")):
        return 0
    changed = 0
    for node in joint.graph.nodes:
        random = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        if random and node.meta.get("recompute") in (RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
            # a multi-output op is kept through its getitems (a tuple cannot be saved)
            for kept in (node, *(u for u in node.users if u.target is operator.getitem)):
                kept.meta["recompute"] = SAVE
                info = (kept.meta.get("custom") or {}).get(META_KEY)
                if info is not None:  # for the report
                    role = {**info, "role": "random op kept (opaque graph input)"}
                    kept.meta["custom"] = {**kept.meta["custom"], META_KEY: role}
                changed += 1
    return changed


class CheckpointPartitioner(compat.CustomPartitionerFn):
    """Splits the joint graph for the inner compiler (aot_eager or Inductor).

    ``base``: "min_cut" (checkpointing, and Inductor's own default) or "default"
    (aot_autograd's default partitioner, used for checkpoint="none" on aot_eager
    when only recording). ``sink``: receives one ``saved_tensors`` report per
    joint graph.
    """

    def __init__(self, config: BoostConfig, base: str = "min_cut", sink: list[PassReport] | None = None) -> None:
        self.mode = config.checkpoint
        self.budget = config.checkpoint_budget
        self.base = base
        self.sink = sink

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        num_fwd_outputs = kwargs.get("num_fwd_outputs")
        primals = [n.name for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
        indices = kwargs.get("static_lifetime_input_indices") or []
        static = {primals[i] for i in indices if i < len(primals)}
        if self.mode != "none":
            force_save_collectives(gm)
            keep_random_ops_beside_opaque_inputs(gm)
        recompute_weight_copies(gm, static, num_fwd_outputs)
        if self.base == "default":
            kwargs.pop("compiler", None)
            fw, bw = compat.default_partition(gm, joint_inputs, **kwargs)
        else:
            patch = {"activation_memory_budget": self.budget} if self.mode == "budget" else {}
            with compat.functorch_config_patch(patch):
                fw, bw = compat.min_cut_partition(gm, joint_inputs, **kwargs)
        if self.sink is not None:
            report = saved_tensors_report(
                fw, bw, num_fwd_outputs=num_fwd_outputs, static_inputs=static, mode=self.mode
            )
            self.sink.append(report)
        return fw, bw

    # Inductor deep-copies (and may pickle) its config, this object included: the
    # copy shares the sink, so the reports still reach the caller; a pickle drops it.
    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointPartitioner:
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "sink": None}

    def uuid(self) -> str:
        src = inspect.getsource(inspect.getmodule(type(self)))
        src += "".join(inspect.getsource(f) for f in (fx_utils.is_collective, fx_utils.collective_kind, fx_utils.forward_bodies,
                                                 fx_utils.weight_only_nodes))
        # a recording compile is keyed apart: a cache hit would skip the partitioner, and the report with it
        key = json.dumps({"mode": self.mode, "budget": self.budget, "base": self.base, "records": self.sink is not None})
        return hashlib.sha256((src + key).encode()).hexdigest()


def checkpoint_partitioner(config: BoostConfig, sink: list[PassReport] | None = None) -> CheckpointPartitioner:
    """The partitioner for ``config``.

    checkpoint="none" wraps the inner compiler's own partitioner (aot_eager's is
    ``default_partition``, Inductor's is min-cut): it tags no activation, only the
    values computed from the parameters alone (``recompute_weight_copies``).
    """
    base = "default" if config.checkpoint == "none" and config.inner == "aot_eager" else "min_cut"
    return CheckpointPartitioner(config, base=base, sink=sink)
