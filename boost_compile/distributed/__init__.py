"""Tensor parallelism: ``parallelize_`` shards a model, the backend inserts collectives; expert
parallelism: ``expert_parallel_`` shards a mixture of experts by expert."""

from boost_compile.distributed.expert_parallel import ExpertParallelError, ExpertParallelReport, expert_parallel_
from boost_compile.distributed.parallelize import PLANS, TPReport, parallelize_
from boost_compile.distributed.shard import (
    ParallelizeError,
    ShardSpec,
    full_tensor,
    gather_full_grads,
    gather_full_state_dict,
)

__all__ = [
    "PLANS",
    "ExpertParallelError",
    "ExpertParallelReport",
    "ParallelizeError",
    "ShardSpec",
    "TPReport",
    "expert_parallel_",
    "full_tensor",
    "gather_full_grads",
    "gather_full_state_dict",
    "parallelize_",
]
