"""The model every rank starts from: a reference preset or a Hugging Face causal LM.

:func:`build_model` seeds, builds and (when ``factorize`` is on) factorizes the
model; parallelizing and compiling it is :mod:`boost_compile.train.parallel`'s job.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from boost_compile.train.config import ModelConfig, TrainConfig
from boost_compile.train.validate import ModelShape, factorize_config

if TYPE_CHECKING:
    from boost_compile.weight_sources import WeightSource

log = logging.getLogger("boost_compile.train")


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind the reference models' ``forward(tokens, targets)``."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.hf(input_ids=tokens, use_cache=False).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def fit_vocab(shape: ModelShape, model: ModelConfig, tokenizer_size: int) -> ModelShape:
    """``shape`` with the vocabulary following the tokenizer: ``padded_vocab(tokenizer_size)``.

    The ids past ``tokenizer_size`` are padding for the GEMMs: the tokenizer never
    produces them, so they are never targets (generation masks them). A vocabulary
    that is fixed (pretrained Hugging Face weights, ``model.overrides.vocab_size``)
    is kept when it holds the tokenizer's ids; ConfigError when it does not.
    """
    import copy
    import dataclasses

    from boost_compile.config import ConfigError
    from boost_compile.train.tokenizer import padded_vocab

    fixed = model.pretrained or (shape.kind == "preset" and "vocab_size" in model.overrides)
    if fixed:
        if shape.vocab_size < tokenizer_size:
            raise ConfigError(
                f"the tokenizer has {tokenizer_size} tokens but the model's vocab_size is {shape.vocab_size}"
            )
        return shape
    vocab = padded_vocab(tokenizer_size)
    if vocab == shape.vocab_size:
        return shape
    log.info("vocab: %s tokens, padded to %s (the model's vocab_size, was %s)", f"{tokenizer_size:,}", f"{vocab:,}",
             f"{shape.vocab_size:,}")
    if shape.kind == "preset":
        config = dataclasses.replace(shape.llama_config, vocab_size=vocab)
        return dataclasses.replace(shape, vocab_size=vocab, llama_config=config)
    hf_config = copy.deepcopy(shape.hf_config)
    hf_config.vocab_size = vocab
    return dataclasses.replace(shape, vocab_size=vocab, hf_config=hf_config)


def defers_init(tc: TrainConfig) -> bool:
    """Whether the model is built on the meta device, each rank materialising its part
    (``model.init=per_parameter``: random weights drawn per parameter, or pretrained weights read
    slice by slice from their safetensors, factorized one layer at a time). A pretrained folder
    without safetensors (``pytorch_model.bin``) is loaded whole instead (logged at the build)."""
    if tc.model.init != "per_parameter":
        return False
    return not (tc.model.pretrained and tc.model.hf_path and not has_safetensors(tc.model.hf_path))


def has_safetensors(folder: str) -> bool:
    """Whether ``folder`` holds ``model.safetensors`` or a ``model.safetensors.index.json``."""
    from pathlib import Path

    path = Path(folder).expanduser()
    return (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()


def build_on_meta(tc: TrainConfig, shape: ModelShape, device: torch.device | None = None) -> tuple[nn.Module, WeightSource]:
    """The model with every parameter on the meta device (buffers real, on the host), factorized
    there if asked, and the source of the values each rank materialises of it
    (``boost_compile/weight_sources.py``): the recipe of its own init, or the pretrained folder's
    safetensors. ConfigError, naming the parameter, for a model whose init the recipe cannot replay
    or whose checkpoint lacks a parameter."""
    from boost_compile.config import ConfigError
    from boost_compile.meta_init import MetaInitError, deferred_init

    try:
        with deferred_init(tc.trainer.seed) as recording:
            model = construct(tc, shape)
        source = _pretrained_source(tc, model) if tc.model.pretrained else recording.recipe(model)
        source = factorize_model(model, tc, shape, device or torch.device("cpu"), source)
    except MetaInitError as exc:
        raise ConfigError(f"model.init=per_parameter: {exc}") from exc
    except (RuntimeError, NotImplementedError) as exc:  # model code that computes with a meta parameter
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.init=per_parameter: building the model on the meta device fails ({first}); "
                          "model.init=global_rng builds the whole model on every rank instead") from exc
    return model, source


def _pretrained_source(tc: TrainConfig, model: nn.Module) -> WeightSource:
    """The pretrained folder's safetensors, slice by slice, each parameter checked against the model:
    one the folder lacks is refused, as a pretrained start must not silently hold random weights."""
    from boost_compile.config import ConfigError
    from boost_compile.weight_sources import SafetensorsFolder

    hf = getattr(model, "hf", None)
    try:
        folder = SafetensorsFolder(tc.model.hf_path, prefix="hf." if hf is not None else "",
                                   base_prefix=getattr(hf, "base_model_prefix", ""))
    except FileNotFoundError as exc:
        raise ConfigError(f"model.init=per_parameter reads pretrained weights from safetensors: {exc}; "
                          "model.init=global_rng loads the folder whole with from_pretrained") from exc
    missing = [n for n, _ in model.named_parameters() if not folder.has(n)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"model.pretrained: {', '.join(missing[:3])}{more} not in {tc.model.hf_path}'s safetensors")
    for name, p in model.named_parameters():
        if folder.shape(name) != p.shape:
            raise ConfigError(f"model.pretrained: {name} is {tuple(folder.shape(name))} in {tc.model.hf_path} "
                              f"and {tuple(p.shape)} in the model its config.json builds")
    return folder


def construct(tc: TrainConfig, shape: ModelShape) -> nn.Module:
    """The model from its config, its weights initialised by its own code (on the host, or on meta
    under :func:`build_on_meta`), with a boost-export folder's bottlenecks."""
    from boost_compile.models.llama import apply_lowrank_layout

    if shape.kind == "preset":
        from boost_compile.models import Llama

        model = Llama(shape.llama_config)
        apply_lowrank_layout(model, shape.lowrank_layers)
        return model
    import transformers

    config = shape.hf_config
    config.use_cache = False
    hf = transformers.AutoModelForCausalLM.from_config(config).float()
    fp64_experts(tc, hf)
    apply_lowrank_layout(hf, shape.lowrank_layers)
    return HFCausalLM(hf)


def fp64_experts(tc: TrainConfig, hf: nn.Module) -> None:
    """``trainer.precision=fp64``: a mixture of experts on transformers' eager experts loop, as its
    default grouped GEMM (``torch._grouped_mm``) has no float64 (logged)."""
    import contextlib

    from boost_compile.distributed.expert_parallel import find_experts

    if tc.trainer.precision != "fp64" or not hasattr(hf, "set_experts_implementation"):
        return
    with contextlib.suppress(ValueError):
        if not find_experts(hf):
            return
    if getattr(hf.config, "_experts_implementation", None) in (None, "grouped_mm"):
        log.info("trainer.precision=fp64: the experts run transformers' eager implementation (grouped_mm has no float64)")
        with contextlib.suppress(Exception):  # a model without the choice keeps its own experts
            hf.set_experts_implementation("eager")


def materialize_part(model: nn.Module, source: WeightSource, device: torch.device, what: str,
                     names: dict[str, str] | None = None) -> None:
    """:func:`boost_compile.meta_init.materialize_` of the part of the model this rank holds, logged
    with its size (``what``: the part, "the whole model", "its FSDP2 shards", ...)."""
    from boost_compile.meta_init import materialize_

    begin = time.perf_counter()
    materialize_(model, source, device, names)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    log.info("model.init=per_parameter: built on meta, this rank materialised %s (%s parameters) in %.1fs",
             what, f"{local:,}", time.perf_counter() - begin)


def build_model(tc: TrainConfig, shape: ModelShape, device: torch.device) -> nn.Module:
    """The whole model on this rank (every rank the same weights), factorized if asked."""
    if defers_init(tc):
        model, source = build_on_meta(tc, shape, device)
        materialize_part(model, source, device, "the whole model")
        return model
    model = _build_whole(tc, shape, device)
    factorize_model(model, tc, shape, device)
    return model


def _build_whole(tc: TrainConfig, shape: ModelShape, device: torch.device) -> nn.Module:
    """``model.init=global_rng`` or pretrained weights: built whole, torch's RNG seeded."""
    torch.manual_seed(tc.trainer.seed)
    if shape.kind == "preset":
        from boost_compile.models import Llama

        if tc.model.pretrained:  # a boost-export folder of a reference model
            model = Llama.from_pretrained(tc.model.hf_path, device=device).float()
            model.reset_rope()  # recomputed in fp32, as a model built here holds them
            return model
        return Llama(shape.llama_config, device=device)
    import transformers

    config = shape.hf_config
    config.use_cache = False
    if tc.model.pretrained:
        if tc.model.init == "per_parameter":
            log.info("model.init=per_parameter: %s holds no safetensors; every rank loads it whole with "
                     "from_pretrained", tc.model.hf_path)
        if shape.lowrank_layers:  # a boost-export folder of a factorized Hugging Face model
            from boost_compile.models.llama import apply_lowrank_layout
            from boost_compile.safetensors_writer import load_folder_into

            hf = transformers.AutoModelForCausalLM.from_config(config).float()
            apply_lowrank_layout(hf, shape.lowrank_layers)
            load_folder_into(hf, Path(tc.model.hf_path).expanduser())
        else:
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                tc.model.hf_path, config=config, local_files_only=True
            )
    else:
        hf = transformers.AutoModelForCausalLM.from_config(config)
    fp64_experts(tc, hf)
    return HFCausalLM(hf.float()).to(device)


def factorize_model(model: nn.Module, tc: TrainConfig, shape: ModelShape, device: torch.device,
                    source: WeightSource | None = None) -> WeightSource | None:
    """``model`` with its dense block linears made bottlenecks when ``factorize`` is on; on the meta
    device, ``source`` extended with the factors' values (returned: ``source`` itself when off)."""
    factorize = factorize_config(tc.factorize)
    if factorize is None:
        return source
    from boost_compile.factorize import factorize_

    example = (torch.arange(16, device=device).view(1, 16) % shape.vocab_size,)
    report = factorize_(model, factorize, example_inputs=example, seed=tc.trainer.seed)
    log.info("factorized %d layers: %s -> %s parameters", len(report.layers), f"{report.params_before:,}", f"{report.params_after:,}")
    return report.source(source) if source is not None else None
