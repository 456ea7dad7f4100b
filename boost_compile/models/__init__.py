"""Reference models: a Llama-style decoder with dense, low-rank or CoLA projections."""

from boost_compile.models.llama import (
    MLP,
    PROJECTIONS,
    Attention,
    Block,
    Llama,
    LlamaConfig,
)
from boost_compile.models.lowrank import ACTIVATIONS, LowRankLinear, break_even_rank

__all__ = [
    "ACTIVATIONS",
    "Attention",
    "Block",
    "Llama",
    "LlamaConfig",
    "LowRankLinear",
    "MLP",
    "PROJECTIONS",
    "break_even_rank",
]
