"""Hugging Face ``transformers.Trainer`` and ``accelerate`` with ``backend="boost"``.

    from boost_compile.integrations.hf import BoostTrainer
    trainer = BoostTrainer(model=model, args=args, train_dataset=data, boost_options={"checkpoint": "lowrank"})
    trainer.train()

or, with any Trainer subclass, or with accelerate and no Trainer:

    compile_for_trainer(model, {"checkpoint": "lowrank"})   # model.compile(backend=boost), in place
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Why not ``TrainingArguments(torch_compile=True, torch_compile_backend="boost")``: the Trainer
hands the name to accelerate's ``TorchDynamoPlugin``, whose ``__post_init__`` converts it with
``DynamoBackend(name.upper())``, a closed enum of the backends accelerate knows, so the Trainer
fails while it builds its ``Accelerator`` (``ValueError: 'BOOST' is not a valid DynamoBackend``)
before torch ever looks the name up; the same happens to ``Accelerator(dynamo_backend="boost")``
and to ``ACCELERATE_DYNAMO_BACKEND=boost``, which the plugin reads when no backend is given.
``check_training_args`` (run by ``BoostTrainer``) turns that into a message naming the call that
works. It refuses the other backends too: accelerate would put a second ``torch.compile`` around
the model, one that never gets a graph (the model's in-place compiled forward takes them).

Compiling in place (``nn.Module.compile``) keeps the model what it was: its class, its
``state_dict`` keys (no ``_orig_mod.`` prefix), ``save_pretrained`` and the Trainer's
checkpoints; DDP, which the Trainer and ``accelerator.prepare`` put around it on several
processes, sees a plain module whose forward happens to be compiled.
"""

from __future__ import annotations

import os
from typing import Any

import torch.nn as nn

from boost_compile.blocks import tensor_parallel
from boost_compile.config import BoostConfig
from boost_compile.integrations.in_place import compile_in_place

#: what installs this module's dependencies
INSTALL = "pip install 'boost-compile[hf]'"
try:
    import transformers
except ImportError as exc:  # one line naming the extra, not a traceback into a missing package
    raise ImportError(f"boost_compile.integrations.hf needs transformers and accelerate, which are not installed: {INSTALL}") from exc

#: the environment variable accelerate's ``TorchDynamoPlugin`` reads when given no backend
ACCELERATE_BACKEND_ENV = "ACCELERATE_DYNAMO_BACKEND"

_COMPILE_FIRST = (
    "compile the model first: boost_compile.integrations.hf.compile_for_trainer(model, options) "
    "or BoostTrainer(..., boost_options=options)"
)


def compile_for_trainer(model: nn.Module, options: BoostConfig | dict[str, Any] | None = None) -> nn.Module:
    """Compile ``model`` in place with the boost backend and return it.

    ``options`` are the ``torch.compile(..., options=)`` of ``backend="boost"``, checked now
    (``BoostConfig.from_options``: an unknown key or a bad value fails here, not at the first
    step). Hand the model to ``transformers.Trainer`` or ``accelerator.prepare`` afterwards, with
    ``torch_compile`` left off.

    With ``checkpoint="lowrank"`` or ``"full"`` the forward compiles with Dynamo's DDP optimizer
    off (:mod:`boost_compile.integrations.in_place`), as boost-train does.
    """
    config = BoostConfig.from_options(options)
    return compile_in_place(model, config)


def check_training_args(args: transformers.TrainingArguments | None) -> None:
    """Raise a one-line ``ValueError`` where the Trainer would ask accelerate to compile the model.

    The backend accelerate gets is ``args.torch_compile_backend`` when ``args.torch_compile``,
    else ``$ACCELERATE_DYNAMO_BACKEND`` (accelerate reads it when the Trainer passes none;
    ``args=None`` checks it alone, for ``Accelerator()``). "boost" fails in accelerate's enum;
    any other backend puts a second ``torch.compile`` around the boost-compiled model: it gets no
    graph (the model's own compiled forward takes them all) and only misleads about which
    compiler runs; boost's inner compiler is chosen with ``options={"inner": ...}``. Only "no"
    (or no setting) passes.
    """
    if args is not None and args.torch_compile:
        backend = args.torch_compile_backend or "inductor"
        where, fix = f"TrainingArguments(torch_compile_backend={backend!r})", "leave torch_compile off"
    else:
        backend = os.environ.get(ACCELERATE_BACKEND_ENV) or "no"
        where, fix = f"{ACCELERATE_BACKEND_ENV}={backend}", "unset it"
    if backend.lower() == "no":
        return
    if backend.lower() == "boost":
        raise ValueError(f"{where} fails inside accelerate, whose DynamoBackend enum has no 'boost'; "
                         f"{fix} and {_COMPILE_FIRST}")
    raise ValueError(f"{where} makes accelerate put a second torch.compile around the boost-compiled model, "
                     f"one that compiles nothing; {fix} and choose boost's inner compiler with options={{'inner': ...}}")


class BoostTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose model is compiled in place with ``backend="boost"``.

    Takes the Trainer's arguments plus ``boost_options`` (the backend's ``options=``, checked
    now). Refuses, each with a one-line message: ``torch_compile`` on or ``ACCELERATE_DYNAMO_BACKEND``
    set (``check_training_args``), ``model_init`` without ``model`` (compile in your ``model_init``
    with ``compile_for_trainer`` instead), and a tensor-parallel model (``parallelize_``): the
    Trainer would put DDP over its shards.
    """

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None,
                 *more: Any, boost_options: BoostConfig | dict[str, Any] | None = None, **kwargs: Any) -> None:
        check_training_args(args)
        if model is None:
            raise ValueError(
                "BoostTrainer compiles model=, which is missing; with model_init, return "
                "compile_for_trainer(model, options) from it and use transformers.Trainer"
            )
        if tensor_parallel(model):
            raise ValueError(
                "BoostTrainer cannot train a tensor-parallel model (parallelize_): the Trainer wraps it in "
                "DDP over every rank, which overwrites and averages different shards; train it with boost-train"
            )
        compile_for_trainer(model, boost_options)
        super().__init__(model, args, *more, **kwargs)
