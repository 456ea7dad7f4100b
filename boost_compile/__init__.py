"""boost_compile: a torch.compile backend for low-rank (bottleneck) LLMs.

    import torch, boost_compile as bc
    model = bc.models.Llama(bc.models.LlamaConfig.preset("cola-60m"))
    step = torch.compile(model, backend="boost")
    print(bc.explain(model, tokens))
"""

from boost_compile import models
from boost_compile.backend import boost_backend, compile
from boost_compile.blocks import BlockCompileError, compile_blocks
from boost_compile.config import (
    AnalysisConfig,
    BoostConfig,
    ConfigError,
    FactorizeConfig,
)
from boost_compile.distributed import (
    ExpertParallelError,
    ParallelizeError,
    expert_parallel_,
    gather_full_grads,
    gather_full_state_dict,
    parallelize_,
)
from boost_compile.explain import Explanation, explain
from boost_compile.factorize import FactorizeReport, factorize_
from boost_compile.pass_manager import PassReport, StrictPassError

__version__ = "0.1.0"

__all__ = [
    "AnalysisConfig",
    "BlockCompileError",
    "BoostConfig",
    "ConfigError",
    "ExpertParallelError",
    "Explanation",
    "FactorizeConfig",
    "FactorizeReport",
    "ParallelizeError",
    "PassReport",
    "StrictPassError",
    "boost_backend",
    "compile",
    "compile_blocks",
    "expert_parallel_",
    "explain",
    "factorize_",
    "gather_full_grads",
    "gather_full_state_dict",
    "models",
    "parallelize_",
]
