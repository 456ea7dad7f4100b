"""Compile a model block by block: each repeated block its own graph, one artifact for identical blocks.

    model.layers[i](h)      ->  model.layers[i] compiled in place (``nn.Module.compile``)
    embedding, norm, head   ->  left eager; F.cross_entropy on the head's logits compiled (Inductor)

Why per block (torchtitan's way) rather than the whole model as one graph:

- **compile time does not grow with depth**: Dynamo traces the block's code once, and every
  block of the same class and shapes reuses that compiled artifact (its guards check types
  and shapes, not which block), so 32 layers compile like 2;
- **data-parallel overlap**: each block's backward is its own autograd node, so DDP's hooks
  see a block's gradients as soon as its backward ends and all-reduce them while the blocks
  below run theirs. Dynamo's DDP optimizer is not needed (``optimize_ddp=False``), so no
  graph is cut at a gradient bucket through the middle of a block;
- every pass still sees a whole block: grouping, the RMSNorm rewrite, low-rank checkpointing.

Compiling in place keeps parameter names (no ``_orig_mod.``), so optimizers, checkpoints and
DDP see the same model. When the blocks' code is compiled with Inductor, the loss on the output
head's logits is too (``loss_logits.py``): eager, ``F.cross_entropy`` makes four passes over the
step's largest tensor where the whole-model graph makes two. A tensor-parallel model compiles block by block too: under btp and
megatron each block's graph becomes this rank's program with its collectives, and the code around
the blocks runs eagerly on the shards with hooks where the whole program would gather or slice
(``distributed/tp_blocks.py``); under vanilla the blocks' DTensors carry their own collectives.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from boost_compile.analysis.repeated import repeated_blocks

log = logging.getLogger(__name__)


class BlockCompileError(ValueError):
    """The model's blocks cannot be found or compiled one by one; the message says why."""


def find_blocks(model: nn.Module) -> list[str]:
    """Names of the model's repeated blocks: the children of its largest ``nn.ModuleList``,
    ``nn.ModuleDict`` or ``nn.Sequential`` whose children are all of one class (a decoder's
    ``layers``), by parameter count.

    Raises BlockCompileError when the model has none (name them with ``blocks=``).
    """
    found = repeated_blocks(model)
    if found is None:
        raise BlockCompileError(
            f"{type(model).__name__} has no nn.ModuleList, nn.ModuleDict or nn.Sequential of blocks of one class; "
            "name the blocks to compile with blocks=[...] or compile the whole model"
        )
    return found[1]


def tensor_parallel(model: nn.Module) -> bool:
    """Parallelized by ``parallelize_`` (shards with a spec) or holding DTensor parameters."""
    from torch.distributed.tensor import DTensor

    return getattr(model, "_boost_tp_plan", None) is not None or any(
        getattr(p, "_boost_tp", None) is not None or isinstance(p, DTensor) for p in model.parameters()
    )


def compile_blocks(
    model: nn.Module,
    options: dict[str, Any] | None = None,
    *,
    backend: str | Callable[..., Any] = "boost",
    blocks: Sequence[str] | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
) -> list[str]:
    """Compile each repeated block of ``model`` in place with ``backend``; returns their names.

    ``options``: the backend's ``options=`` (for "boost", checked by ``BoostConfig.from_options``);
    ``blocks``: the blocks' names (default: :func:`find_blocks`). The rest of the model runs
    eagerly. Raises BlockCompileError for a tensor-parallel model whose code around the blocks
    cannot run eagerly on its shards (the message names the construct; compile it whole with
    ``torch.compile(model, backend="boost")``), or one parallelized with btp or megatron and a
    backend other than boost (only boost's passes make a block's graph this rank's program).
    """
    if backend == "boost" and options is not None:
        from boost_compile.config import BoostConfig

        BoostConfig.from_options(dict(options))  # a bad option fails here, not at the first step
    names = list(blocks) if blocks is not None else find_blocks(model)
    if not names:
        raise BlockCompileError("blocks=[] names no block to compile")
    _warn_kv_cache(model, len(names))
    if tensor_parallel(model):
        _prepare_tensor_parallel(model, names, backend, options)
    elif _blocks_inner(backend, options) == "inductor":
        _compile_head_loss(model, names)
    backend, options = _block_graph_backend(backend, options)
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if options is not None:
        kwargs["options"] = dict(options)
    for name in names:
        try:
            block = model.get_submodule(name)
        except AttributeError as exc:
            raise BlockCompileError(f"blocks: {type(model).__name__} has no submodule {name!r}") from exc
        block.compile(**kwargs)
    if tensor_parallel(model) and getattr(model, "_boost_block_layout", None) is not None:
        from boost_compile.distributed.tp_blocks import enter_sliced

        enter_sliced(model, names)
    log.info("compiled %d block%s one by one (%s ... %s) with backend %s", len(names), "" if len(names) == 1 else "s",
             names[0], names[-1],
             backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__))
    return names


def _warn_kv_cache(model: nn.Module, blocks: int) -> None:
    """Log why a Hugging Face model that builds its KV cache compiles once per block, not once."""
    if blocks > 1 and getattr(getattr(model, "config", None), "use_cache", None) is True:
        from boost_compile import _torch_compat as compat

        log.warning(
            "%s: config.use_cache is True, so every forward builds a KV cache and each block's call guards on "
            "its own layer index: every block compiles a graph of its own, and past Dynamo's recompile limit "
            "(%d) the remaining blocks run eagerly, without the passes. Set model.config.use_cache = False "
            "to train with one graph per kind of block", type(model).__name__, compat.dynamo_recompile_limit_value())


def _prepare_tensor_parallel(model: nn.Module, names: list[str], backend: Any, options: dict[str, Any] | None) -> None:
    """btp and megatron: mark the blocks and hook the code around them (vanilla needs nothing)."""
    from torch.distributed.tensor import DTensor

    plan = getattr(model, "_boost_tp_plan", None)
    if plan is None or any(isinstance(p, DTensor) for p in model.parameters()):
        return  # vanilla: DTensor parameters, the collectives come with them
    from boost_compile.distributed.shard import ParallelizeError
    from boost_compile.distributed.tp_blocks import prepare_blocks

    if not (backend == "boost" or getattr(_unwrapped(backend), "func", None) is _compile_graph()):
        raise BlockCompileError(f"a model parallelized with {plan!r} compiles only with the boost backend, which "
                                "makes each block's graph this rank's program")
    try:
        prepare_blocks(model, names, _blocks_inner(backend, options) or "eager")
    except ParallelizeError as exc:
        raise BlockCompileError(str(exc)) from None


def _blocks_inner(backend: Any, options: dict[str, Any] | None) -> str | None:
    """The compiler the blocks' code ends in: "inductor" for backend="inductor", boost's inner
    compiler for boost (by name or a ``compile_graph`` partial, maybe wrapped), None for anything else."""
    if backend == "inductor":
        return "inductor"
    from boost_compile.config import BoostConfig

    if backend == "boost":
        return BoostConfig.from_options(dict(options or {})).inner
    backend = _unwrapped(backend)
    if getattr(backend, "func", None) is _compile_graph():
        given = backend.keywords.get("config")
        return (given if isinstance(given, BoostConfig) else BoostConfig.from_options(given)).inner
    return None


def find_head(model: nn.Module, blocks: Sequence[str]) -> str | None:
    """The name of ``model``'s output head: Hugging Face's ``get_output_embeddings()``, else the one
    ``nn.Linear`` outside the blocks whose ``out_features`` is the size of an ``nn.Embedding``'s
    vocabulary there. None when there is no such module or more than one."""
    names = {id(m): n for n, m in model.named_modules()}
    get = getattr(model, "get_output_embeddings", None)
    if callable(get) and isinstance(out := get(), nn.Linear) and id(out) in names:
        return names[id(out)]

    def outside(name: str) -> bool:
        return not any(name == b or name.startswith(b + ".") for b in blocks)

    vocab = {m.num_embeddings for n, m in model.named_modules() if isinstance(m, nn.Embedding) and outside(n)}
    heads = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and outside(n) and m.out_features in vocab]
    return heads[0] if len(heads) == 1 else None


def _compile_head_loss(model: nn.Module, blocks: Sequence[str]) -> None:
    """Make the head's logits :class:`LossLogits`, whose ``F.cross_entropy`` is compiled with Inductor."""
    import torch

    from boost_compile.loss_logits import LossLogits, compiled_cross_entropy

    name = find_head(model, blocks)
    if name is None:
        log.info("no output head found (an nn.Linear to the embedding's vocabulary outside the blocks): "
                 "the loss runs eagerly")
        return
    head = model.get_submodule(name)
    if getattr(head, "_boost_loss_hook", None) is not None:
        return  # compiled block by block before: hooked already
    loss = compiled_cross_entropy()
    head._boost_loss_hook = head.register_forward_hook(
        lambda _m, _a, out: LossLogits.wrap(out, loss) if type(out) is torch.Tensor else out)
    log.info("F.cross_entropy on the logits of %s runs compiled with Inductor", name)


def _block_graph_backend(backend: Any, options: dict[str, Any] | None) -> tuple[Any, dict[str, Any] | None]:
    """The boost backend told that each graph is one block (``BoostConfig.block_graph``: full
    checkpointing keeps the block's input only), by name or as a ``compile_graph`` partial. Other
    backends, and a wrapped partial (its maker sets the flag), are returned as they are."""
    if backend == "boost":
        return backend, {**(options or {}), "block_graph": True}
    if getattr(backend, "func", None) is _compile_graph():
        from boost_compile.config import BoostConfig

        config = BoostConfig.from_options(backend.keywords.get("config"))
        return functools.partial(backend.func, *backend.args, **{**backend.keywords, "config": config.replace(block_graph=True)}), options
    return backend, options


def _unwrapped(backend: Any) -> Any:
    """The backend a wrapper made with ``functools.wraps`` calls (``trainer.memory_report``'s, which
    turns the caches off and counts the calls): the blocks compile as they would without it."""
    while getattr(backend, "__wrapped__", None) is not None:
        backend = backend.__wrapped__
    return backend


def _compile_graph() -> Any:
    from boost_compile.backend import compile_graph

    return compile_graph


def compiled_blocks(model: nn.Module) -> list[str]:
    """Names of ``model``'s submodules compiled in place (``nn.Module.compile``)."""
    from boost_compile import _torch_compat as compat

    return [name for name, m in model.named_modules() if name and compat.is_compiled_module(m)]


__all__ = ["BlockCompileError", "compile_blocks", "compiled_blocks", "find_blocks", "tensor_parallel"]
