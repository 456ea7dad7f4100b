"""What the trainer integrations share: compile a module in place with the boost backend, whole,
also under DDP.

In place (``nn.Module.compile``), the parameter names and state-dict keys stay the module's (no
``_orig_mod.``), which the trainers' checkpoints and DDP wrapping expect. With ``checkpoint``
``lowrank`` or ``full`` the compiled forward runs with Dynamo's DDP optimizer off: inside DDP's
forward (the Trainer, accelerate, Lightning with strategy="ddp") Dynamo otherwise cuts the graph
at every gradient bucket, through blocks whose structure the checkpoint pass then cannot see;
uncut, the gradients are all-reduced after the whole backward, as boost-train does
(``train/parallel.py`` ``ddp_compile_settings``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from boost_compile import _torch_compat as compat
from boost_compile.backend import compile_graph
from boost_compile.config import BoostConfig

#: checkpoint modes whose blocks must reach the checkpoint pass whole
WHOLE_BLOCK_CHECKPOINTS = ("lowrank", "full")


def compile_in_place(module: nn.Module, config: BoostConfig, **compile_kwargs: Any) -> nn.Module:
    """``module.compile(backend=boost with config)``, uncut under DDP for the whole-block checkpoints."""
    module.compile(backend=functools.partial(compile_graph, config=config), **compile_kwargs)
    if config.checkpoint in WHOLE_BLOCK_CHECKPOINTS:
        compat.wrap_compiled_call(module, uncut_under_ddp)
    return module


def uncut_under_ddp(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` run with Dynamo's DDP optimizer off (see the module's docstring)."""

    @functools.wraps(call)
    def uncut(*args: Any, **kwargs: Any) -> Any:
        with compat.compile_settings(dynamo={"optimize_ddp": False}):
            return call(*args, **kwargs)

    return uncut
