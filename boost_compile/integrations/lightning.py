"""Lightning (``lightning.Trainer`` and ``lightning.Fabric``) with ``backend="boost"``.

    from boost_compile.integrations.lightning import compile_module

    class LitLlama(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Llama(LlamaConfig.preset("tiny"))

        def configure_model(self):
            compile_module(self, {"inner": "aot_eager"})   # compiles self.model, in place
        ...

    trainer.fit(LitLlama(), loader)                        # strategy="ddp" as well

With Fabric, compile the model before ``fabric.setup``: ``compile_module(model, options)``.

Why the inner model and not the LightningModule: ``trainer.fit(torch.compile(lit_module))``
makes Lightning compile ``training_step`` itself, and Dynamo fails inside ``self.log``
(``InternalTorchDynamoError`` from ``inspect.signature``, with any backend, Lightning 2.6 and
torch 2.13). The model alone is one graph, which is what the boost passes want.

Why in place (``nn.Module.compile``) rather than ``self.model = torch.compile(self.model)``:
the model keeps its class and its ``state_dict`` keys (no ``_orig_mod.`` prefix), so Lightning
checkpoints load into an uncompiled module; DDP, which both Trainer and Fabric put around the
LightningModule on several processes, sees a plain module whose forward happens to be compiled.
Inside DDP's forward Dynamo's DDP optimizer cuts that module's graph at the gradient buckets and
boost compiles each piece; with ``checkpoint="lowrank"`` or ``"full"``, whose pass needs whole
blocks, compile_module turns the cut off for the module (``optimize_ddp=False``, as boost-train).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from boost_compile import _torch_compat as compat
from boost_compile.blocks import tensor_parallel
from boost_compile.config import BoostConfig
from boost_compile.integrations.in_place import compile_in_place

INSTALL = "pip install 'boost-compile[lightning]'"
#: the attribute that records the config a module was compiled with (``configure_model`` runs once per stage)
_CONFIG_ATTR = "_boost_lightning_config"


def lightning_module_types() -> tuple[type, ...]:
    """``lightning.pytorch.LightningModule`` (and ``pytorch_lightning``'s, when that is imported);
    a one-line ImportError naming the extra when Lightning is not installed."""
    try:
        from lightning.pytorch import LightningModule
    except ImportError as exc:
        raise ImportError(f"boost_compile.integrations.lightning needs Lightning, which is not installed: {INSTALL}") from exc
    types: tuple[type, ...] = (LightningModule,)
    standalone = sys.modules.get("pytorch_lightning")
    if standalone is not None and hasattr(standalone, "LightningModule"):
        types += (standalone.LightningModule,)
    return types


def model_of(module: nn.Module, submodule: str | None = None) -> nn.Module:
    """The module ``compile_module`` compiles: ``submodule`` of ``module`` when named; else, for a
    LightningModule, its one child that holds parameters; else ``module`` itself."""
    if submodule is not None:
        try:
            return module.get_submodule(submodule)
        except AttributeError as exc:
            raise ValueError(f"submodule={submodule!r}: {type(module).__name__} has no such submodule") from exc
    if not isinstance(module, lightning_module_types()):
        return module
    children = [name for name, child in module.named_children() if next(child.parameters(), None) is not None]
    if len(children) != 1:
        found = f"has {len(children)} ({children})" if children else "has none"
        raise ValueError(
            f"compile_module compiles the one child of {type(module).__name__} that holds parameters, and it "
            f"{found}; build the model before (in __init__ or configure_model) or name it: submodule='...'"
        )
    return module.get_submodule(children[0])


def compile_module(
    module: nn.Module,
    options: BoostConfig | dict[str, Any] | None = None,
    *,
    submodule: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
) -> nn.Module:
    """Compile the model of ``module`` in place with ``backend="boost"``; returns the compiled module.

    ``module``: a LightningModule (its model is its one child with parameters, or ``submodule``)
    or the plain ``nn.Module`` given to ``fabric.setup`` (compiled itself). ``options``: the
    backend's ``options=``, checked now, not at the first training step. Call it in
    ``configure_model`` or before ``trainer.fit`` / ``fabric.setup``; calling it again with the same
    options does nothing (Lightning runs ``configure_model`` once per stage). With
    ``checkpoint="lowrank"`` or ``"full"`` the module stays one graph under DDP
    (:mod:`boost_compile.integrations.in_place`). Refuses, each with a one-line ValueError: a module compiled before by
    other means or with other options, a ``torch.compile`` wrapper, compile-time ``factorize``
    (training needs ``factorize_``) and a tensor-parallel model (``parallelize_``: Lightning's
    DDP would average different shards).
    """
    lightning_module_types()
    config = BoostConfig.from_options(options)
    if config.factorize is not None and config.factorize.enabled:
        raise ValueError(
            "options['factorize'] factorizes a frozen graph at compile time and cannot train; call "
            "boost_compile.factorize_(model, FactorizeConfig(...)) before compile_module and leave it out of options"
        )
    if compat.is_torch_compile_wrapper(module):
        raise ValueError(
            f"compile_module got a torch.compile wrapper around {type(compat.original_module(module)).__name__}; "
            "pass the module itself (compile_module compiles in place)"
        )
    target = model_of(module, submodule)
    if tensor_parallel(target):
        raise ValueError(
            "compile_module cannot prepare a tensor-parallel model (parallelize_) for Lightning: its DDP would "
            "average different shards; train it with boost-train"
        )
    done = getattr(target, _CONFIG_ATTR, None)
    if done is not None:
        if done == config:
            return target
        raise ValueError(f"{type(target).__name__} was compiled by compile_module with other options ({done}); "
                         "compile it once")
    if compat.is_compiled_module(target):
        raise ValueError(f"{type(target).__name__} is compiled already (module.compile or torch.compile); "
                         "compile it once, with compile_module alone")
    compile_in_place(target, config, fullgraph=fullgraph, dynamic=dynamic)
    setattr(target, _CONFIG_ATTR, config)
    return target


__all__ = ["INSTALL", "compile_module", "lightning_module_types", "model_of"]
