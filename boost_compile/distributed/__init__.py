"""Tensor parallelism: ``parallelize_`` shards a model, the backend inserts collectives."""

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
    "ParallelizeError",
    "ShardSpec",
    "TPReport",
    "full_tensor",
    "gather_full_grads",
    "gather_full_state_dict",
    "parallelize_",
]
