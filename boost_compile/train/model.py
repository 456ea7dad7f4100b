"""The model every rank starts from: a reference preset or a Hugging Face causal LM.

:func:`build_model` seeds, builds and (when ``factorize`` is on) factorizes the
model; parallelizing and compiling it is :mod:`boost_compile.train.parallel`'s job.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from boost_compile.train.config import ModelShape, TrainConfig, factorize_config

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


def build_model(tc: TrainConfig, shape: ModelShape, device: torch.device) -> nn.Module:
    """The model every rank starts from (same seed, same weights), factorized if asked."""
    torch.manual_seed(tc.trainer.seed)
    if shape.kind == "preset":
        from boost_compile.models import Llama

        model: nn.Module = Llama(shape.llama_config, device=device)
    else:
        import transformers

        config = shape.hf_config
        config.use_cache = False
        if tc.model.pretrained:
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                tc.model.hf_path, config=config, local_files_only=True
            )
        else:
            hf = transformers.AutoModelForCausalLM.from_config(config)
        model = HFCausalLM(hf.float()).to(device)
    factorize = factorize_config(tc.factorize)
    if factorize is not None:
        from boost_compile.factorize import factorize_

        example = (torch.arange(16, device=device).view(1, 16) % shape.vocab_size,)
        report = factorize_(model, factorize, example_inputs=example)
        log.info("factorized %d layers: %s -> %s parameters", len(report.layers), f"{report.params_before:,}", f"{report.params_after:,}")
    return model
