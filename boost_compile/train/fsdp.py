"""FSDP2 (``parallel.dp_shard > 1``): the weights, gradients and optimizer state sharded over
the data-parallel ranks with ``torch.distributed.fsdp.fully_shard``, torchtitan's way.

The order is torchtitan's: the blocks are compiled one by one first (boost's passes make each
block's graph), then each block becomes an FSDP unit of its own, so that only one block's
weights are gathered at a time; the input embedding and the output head (with the final norm,
which feeds only it) are units of their own; the root takes what is left. A unit's weights are
all-gathered before its forward (issued as the unit before it starts computing: ``prefetch``)
and, with ``reshard_after_forward``, freed after it and gathered again for its backward (issued
as the unit after it starts its backward), except a plain embedding's, which its backward does not
read; its gradients are reduce-scattered as its backward ends.

    embeddings -> block 0 -> ... -> block n-1 -> [norm, head] -> root (the rest)

A weight tied between the embedding and the head (one parameter in two modules) must be in one
unit: both then stay in the root. Blocks that hold one parameter between them (Zamba 2 reaches one
shared transformer from several layers) form one unit, gathered for each of them. Under
``trainer.precision=bf16-mixed`` the gathered weights are
bf16 and the gradients are reduced in fp32 (FSDP2's ``MixedPrecisionPolicy``); the sharded
weights the optimizer steps stay fp32. With ``parallel.dp > 1`` the mesh is 2-D (HSDP): each of
``dp`` replicas holds the model sharded over its ``dp_shard`` ranks, and gradients are
reduce-scattered within a replica, then all-reduced across replicas. On host memory (gloo) the
all-gathers and reduce-scatters are ``distributed.host_comms``'s, which allocate no second buffer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from boost_compile.blocks import find_blocks, find_head
from boost_compile.distributed.expert_parallel import is_expert_parameter
from boost_compile.distributed.host_comms import use_in_place_host_comms

log = logging.getLogger("boost_compile.train")


def fsdp_units(model: nn.Module) -> list[list[str]]:
    """The modules that become FSDP units, in order, each a list of names (the root not included):
    the embeddings outside the blocks, every block, the final norm and the head."""
    blocks = find_blocks(model)

    def outside(name: str) -> bool:
        return not any(name == b or name.startswith(b + ".") for b in blocks)

    head = find_head(model, blocks)
    tied = _tied_names(model)
    units: list[list[str]] = []
    embeddings = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding) and outside(n) and n not in tied]
    units += [[n] for n in embeddings]
    units += _blocks_sharing_parameters(model, blocks)
    if head is not None and head not in tied:
        norm = _final_norm(model, blocks, head)
        units.append([norm, head] if norm is not None and norm not in tied else [head])
    return units


def _blocks_sharing_parameters(model: nn.Module, blocks: list[str]) -> list[list[str]]:
    """The blocks as units, in order: each alone, except blocks that hold one parameter between
    them (Zamba 2's shared transformer, reached from several layers), which form one unit at
    the first one's place (FSDP2 shards a parameter in one unit only)."""
    first: dict[int, int] = {}  # a parameter's id -> the first block that holds it
    group = list(range(len(blocks)))  # each block's unit: the first block it shares with

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    for i, name in enumerate(blocks):
        for p in model.get_submodule(name).parameters():
            j = first.setdefault(id(p), i)
            a, b = root(i), root(j)
            if a != b:
                group[max(a, b)] = min(a, b)
    units: dict[int, list[str]] = {}
    for i, name in enumerate(blocks):
        units.setdefault(root(i), []).append(name)
    shared = [u for u in units.values() if len(u) > 1]
    if shared:
        log.info("FSDP2: blocks sharing parameters form one unit each: %s", "; ".join("+".join(u) for u in shared))
    return list(units.values())


def _tied_names(model: nn.Module) -> set[str]:
    """Modules that hold a parameter another module holds too (a tied embedding and head)."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    return {name for names in owners.values() if len(names) > 1 for name in names}


def _final_norm(model: nn.Module, blocks: list[str], head: str) -> str | None:
    """The module registered just before the head, outside the blocks, when it is a norm (no
    parameter but a weight and maybe a bias): the final norm, which only the head reads."""
    before = None
    for name, module in model.named_children():
        if name == head:
            break
        if name not in blocks and not any(b.startswith(name + ".") for b in blocks):
            before = (name, module)
    if before is None:
        return None
    name, module = before
    params = {n for n, _ in module.named_parameters()}
    return name if params and params <= {"weight", "bias"} and "norm" in type(module).__name__.lower() else None


def shard_model(model: nn.Module, mesh: Any, precision: str, reshard_after_forward: bool,
                experts_mesh: Any = None) -> list[list[str]]:
    """``fully_shard`` every unit of :func:`fsdp_units`, then the root, over ``mesh`` (1-D: FSDP;
    2-D ``(dp_replicate, dp_shard)``: HSDP). Returns the units.

    Expert parallelism's experts (each rank's own already): with ``experts_mesh`` (the ranks that
    hold the same experts, when there are several) each experts module is sharded over it first,
    FSDP2 reduce-scattering their gradients over those replicas (their mean); without, the experts
    are left out (``ignored_params``) and the step averages them. Their marks (``_boost_ep``) stay
    on the sharded parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16-mixed" else MixedPrecisionPolicy()
    units = fsdp_units(model)
    specs = tp_specs_by_name(model)
    marks = {name: p._boost_ep for name, p in model.named_parameters() if is_expert_parameter(p)}
    experts = None
    if marks and experts_mesh is not None:
        owners = {name.rpartition(".")[0] for name in marks}
        for owner in sorted(owners):
            fully_shard(model.get_submodule(owner), mesh=experts_mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward)
    elif marks:  # already this rank's own, their gradients averaged by the step
        experts = {p for p in model.parameters() if is_expert_parameter(p)}
    head = units[-1] if units and units[-1][-1] == find_head(model, find_blocks(model)) else None
    for unit in units:
        modules = [model.get_submodule(n) for n in unit]
        # the head's weights are the backward's first need: gathering them again at once would buy nothing
        # (torchtitan keeps them too); and a vocabulary-parallel head's eager logits (VocabShardedLogits)
        # are not a tensor FSDP2 hooks its re-gather for the backward on
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and unit is not head, ignored_params=experts)
        if reshard_after_forward and all(_backward_reads_no_weight(m) for m in modules):
            modules[0].set_unshard_in_backward(False)
            log.info("FSDP2: %s is not gathered again for its backward (a plain embedding reads no weight there)",
                     "+".join(unit))
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False,  # the backward needs it first
                ignored_params=experts)
    prefetch(model, units)
    if use_in_place_host_comms([model, *(model.get_submodule(unit[0]) for unit in units)], mesh):
        log.info("FSDP2 on host memory: all-gathers and reduce-scatters in place, one call per rank (gloo's own "
                 "would allocate up to 2x a unit's weights again)")
    if specs:
        keep_tp_specs(model, [n for unit in units for n in unit], specs)
    for name, p in model.named_parameters():  # fully_shard made new parameters of the experts'
        if name in marks:
            p._boost_ep = marks[name]
    log.info("FSDP2 over %s: %d units (%s ... %s) and the root", "x".join(map(str, mesh.shape)), len(units),
             "+".join(units[0]), "+".join(units[-1]))
    return units


def _backward_reads_no_weight(module: nn.Module) -> bool:
    """A plain ``nn.Embedding`` (its own forward, no ``max_norm``): its weight's gradient is a
    scatter of the output's by token, so its backward reads the token ids, never the weight.
    FSDP2 then skips gathering it again for the backward: a vocabulary-sized unit (125 MiB for a
    32k x 1024 table, twice that while the gather is copied out) that the backward's end, where the
    gradients peak, would otherwise hold."""
    return type(module).forward is nn.Embedding.forward and getattr(module, "max_norm", None) is None


def prefetch(model: nn.Module, units: list[list[str]]) -> None:
    """Each unit's forward issues the all-gather of the next unit's weights before it computes, and
    each unit's backward that of the unit before it: the gather of block i+1 runs while block i
    computes. FSDP2 prefetches one unit in the backward by itself; the forward needs to be told."""
    modules = [model.get_submodule(unit[0]) for unit in units]
    for here, after in zip(modules, modules[1:], strict=False):
        here.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([here])


def tp_specs_by_name(model: nn.Module) -> dict[str, Any]:
    """Each TP-sharded parameter's ``ShardSpec`` (``parallelize_``'s ``_boost_tp``), by name."""
    return {n: p._boost_tp for n, p in model.named_parameters(remove_duplicate=False)
            if getattr(p, "_boost_tp", None) is not None}


def keep_tp_specs(model: nn.Module, units: list[str], specs: dict[str, Any]) -> None:
    """Put each TP shard's spec back on the parameters FSDP2 made of it.

    ``fully_shard`` replaces every parameter by a DTensor of its dp_shard slices, and before each
    forward sets the module's parameter to the gathered tensor, again a new object: both lose the
    ``_boost_tp`` the boost backend's TP passes (and the clipping, the checkpoints) read. A forward
    pre-hook on each unit, after FSDP2's gather, puts it on the gathered parameters (the same
    objects from step to step: FSDP2 frees and refills their storage); the DTensor shards get it now.
    """
    def tag(module: nn.Module, prefix: str) -> None:
        for name, p in module.named_parameters(remove_duplicate=False):
            spec = specs.get(prefix + name)
            if spec is not None and getattr(p, "_boost_tp", None) is not spec:
                p._boost_tp = spec

    def hook_for(prefix: str):
        @torch.compiler.disable
        def hook(module: nn.Module, _args: Any) -> None:
            tag(module, prefix)
        return hook

    tag(model, "")
    for name in ["", *units]:
        module = model.get_submodule(name) if name else model
        module.register_forward_pre_hook(hook_for(f"{name}." if name else ""))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backwards that keep their gradients unreduced (the micro-steps of gradient accumulation
    before the last): one reduce-scatter per step, not per micro-step."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t
