"""Reference models: a Llama-style decoder with dense, low-rank, CoLA or LaX projections."""

from boost_compile.models.llama import (
    MLP,
    PROJECTIONS,
    Attention,
    Block,
    Llama,
    LlamaConfig,
)
from boost_compile.models.lowrank import ACTIVATIONS, LaxLinear, LowRankLinear, break_even_rank

__all__ = [
    "ACTIVATIONS",
    "Attention",
    "Block",
    "LaxLinear",
    "Llama",
    "LlamaConfig",
    "LowRankLinear",
    "MLP",
    "PROJECTIONS",
    "break_even_rank",
]
